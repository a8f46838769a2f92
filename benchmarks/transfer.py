"""Transfer benchmark: a 1 GiB retrieve of 32 layers through a real server, against the raw copy limit.

In one run on one GPU (by default Llama-3.1-8B shapes: 32 layers, 8 KV heads of 128, bf16; 8192 tokens = 1 GiB;
``--shape`` takes another of ``shapes.py``'s, e.g. one GPU's shard of Llama-3.1-70B; chunk 256; vLLM's LBNHC cache
with 16-token blocks):

1. raw limits: one pinned host-to-GPU cudaMemcpy of the same bytes (the limit a
   retrieve is held to), and GPU-to-host for the store path; also from the
   server's kind of memory (a cudaHostRegister-ed shared-memory pool), and as
   32 pieces;
2. in-process executor times (no server, GPU events only), per copy mode and
   width, plus a thread-block sweep of the kernel: what the GPU itself spends;
3. end to end against a ``kvstrata serve`` child process, per copy mode:
   chunk-major retrieve time, and for widths 1, 2, 4, 8, 32 the time until the
   request is released and until the transfer completes: when the engine side
   (the worker, polled every 20 us as an engine polls between steps) learns that
   every layer landed, from the arrival board or the reply, whichever comes
   first; also when the reply itself resolved (``reply_ms``), and the GPU-side
   view (when the engine's stream saw the first and the last layer land); the
   store path against the raw GPU-to-host copy;
4. SGLang's offload path through the SGLang adapter's loader, after a forward
   stand-in still computing when the offload is called (``sglang_offload``).

Each phase runs in a process of its own (``--phase``), as an engine process holds one copier: in one process, a
copier's host-to-staging rate under later copiers depended on the order of the copiers' first transfers (see
``CudaLocalCopier``), which made a phase's figures depend on which phases ran before it.

Writes a JSON result (``--out``) with the GPU name, versions and date, and
evaluates the transfer targets on the primary mode. Run it as the README in
this directory says.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

from shapes import KV_SHAPES, SHAPES, Shapes

SHAPE: Shapes = SHAPES["llama-3.1-8b"]
"""The model shape whose KV the run moves (``--shape``; set once, before any phase)."""

TARGETS = {
    "chunk_major_vs_raw": 1.05,
    "store_vs_raw": 1.10,
    "width1_release_ms": 0.9,
    "width1_overhead_ms": 0.5,
    "wide_overhead_ms": 0.3,
}


def stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {}
    return {"median": statistics.median(v), "min": v[0], "max": v[-1],
            "p10": v[max(0, int(0.1 * (len(v) - 1)))], "p90": v[min(len(v) - 1, round(0.9 * (len(v) - 1)))],
            "n": len(v)}


def gpu_time(fn: Callable[[], None], stream: torch.cuda.Stream, reps: int, warmup: int = 2) -> list[float]:
    """Milliseconds per call of ``fn`` between events on ``stream``."""
    out = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            out.append(start.elapsed_time(end))
    return out


def device_info() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    info = {"gpu": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "cpu_count": os.cpu_count()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# --- 1. raw limits -------------------------------------------------------------------

def measure_raw_zmq(reps: int, request_bytes: int = 70_000) -> dict[str, Any]:
    """The transport's floor on this machine: bare pyzmq request/reply with another process over IPC.

    A RETRIEVE-sized request (tokens, block ids, event handles: about 70 KB) and
    a small reply, against ``transport_latency.py``'s bare echo; both sides block
    in recv, as kvstrata's do.
    """
    import tempfile

    from transport_latency import ECHO, bare_legs, running

    address = f"ipc://{tempfile.mkdtemp(prefix='kvstrata-rtt-')}/echo"
    with running(ECHO, address):
        there, back = bare_legs(address, reps, warm=50, payload_bytes=request_bytes)
    return {"request_bytes": request_bytes, "request_leg_ms": stats([t * 1e3 for t in there]),
            "reply_leg_ms": stats([b * 1e3 for b in back]),
            "round_trip_ms": stats([(t + b) * 1e3 for t, b in zip(there, back)])}


def copier_engine(worker: Any) -> Any:
    """An engine-placement worker's ``CudaTransferEngine`` (None for a server-placement one, which copies in the
    server's process)."""
    copier = getattr(worker, "_copier", None)
    return None if copier is None else copier.engine


def wait_pool_registered(worker: Any, timeout: float = 600.0) -> float | None:
    """An engine-placement worker registers the server's pool for DMA in the background once registered itself:
    wait for that, so that what is timed next copies from registered memory; how long it took (None for a worker
    that copies nothing itself)."""
    pinning = getattr(copier_engine(worker), "pinning", None)
    if pinning is None:
        return None
    if not pinning.wait(timeout) or pinning.error is not None:
        raise RuntimeError(f"the L1 pool's registration for DMA did not finish: {pinning.error or 'timed out'}")
    return round(pinning.finished_at - pinning.started_at, 3)


def measure_raw(nbytes: int, reps: int) -> dict[str, Any]:
    from kvstrata.core.store.l1_store import L1Store
    from kvstrata.native import cuda_ext
    from kvstrata.native.host_pinning import PoolPinning

    ext = cuda_ext.load()
    stream = torch.cuda.Stream()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda"))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev.cpu())
    out: dict[str, Any] = {"bytes": nbytes}
    with torch.cuda.stream(stream):
        out["h2d_pinned_ms"] = stats(gpu_time(lambda: dev.copy_(host, non_blocking=True), stream, reps))
        out["d2h_pinned_ms"] = stats(gpu_time(lambda: host.copy_(dev, non_blocking=True), stream, reps))
    store = L1Store(nbytes + (1 << 20))
    try:
        pool = store.pool[:nbytes]
        pool.copy_(host)
        pinning = PoolPinning(store.pool, 0, ext)
        try:
            one = torch.tensor([[dev.data_ptr(), pool.data_ptr(), nbytes]], dtype=torch.int64)
            piece = nbytes // 32
            many = torch.tensor([[dev.data_ptr() + i * piece, pool.data_ptr() + i * piece, piece] for i in range(32)],
                                dtype=torch.int64)
            back = torch.tensor([[pool.data_ptr(), dev.data_ptr(), nbytes]], dtype=torch.int64)
            s = stream.cuda_stream
            out["h2d_registered_shm_ms"] = stats(gpu_time(lambda: ext.memcpy_runs(one.data_ptr(), 1, 0, s), stream, reps))
            out["h2d_registered_shm_32_pieces_ms"] = stats(
                gpu_time(lambda: ext.memcpy_runs(many.data_ptr(), 32, 0, s), stream, reps))
            out["d2h_registered_shm_ms"] = stats(gpu_time(lambda: ext.memcpy_runs(back.data_ptr(), 1, 0, s), stream, reps))
        finally:
            pinning.close()
            del pool
    finally:
        store.close()
    for k in ("h2d_pinned_ms", "d2h_pinned_ms", "h2d_registered_shm_ms"):
        out[k.replace("_ms", "_gbps")] = round(nbytes / out[k]["median"] / 1e6, 2)
    dev = host = None  # the copies hold 2 GiB: freed before empty_cache hands it back
    torch.cuda.empty_cache()
    return out


# --- shared set-up -------------------------------------------------------------------


def engine_cache(tokens: int, block_size: int):
    """vLLM's cache of :data:`SHAPE`, room for two loads of ``tokens``."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from kvstrata_testing.gpu_caches import GpuKVCache  # engine-format GPU caches: test support, not shipped

    nb = tokens // block_size
    return GpuKVCache("vllm-LBNHC", num_layers=SHAPE.layers, num_heads=SHAPE.kv_heads, head_size=SHAPE.head,
                      dtype="bfloat16", num_blocks=2 * nb + 2, block_size=block_size)


# --- 2. in-process executor times ------------------------------------------------------


def measure_inprocess(tokens: int, chunk: int, block_size: int, reps: int, modes: list[str], widths: list[int],
                      cta_sweep: list[int]) -> dict[str, Any]:
    from kvstrata.core.transfer import planner
    from kvstrata.core.store.l1_store import L1Store
    from kvstrata.native.cuda_executor import CudaTransferConfig, CudaTransferEngine

    cache = engine_cache(tokens, block_size)
    nb = tokens // block_size
    truth = cache.random_kv(tokens, seed=1)
    nbytes = cache.layout.object_bytes(tokens)
    store = L1Store(nbytes + (8 << 20))
    out: dict[str, Any] = {}
    objects: list[torch.Tensor] = []
    try:
        host = truth.cpu()
        for i, start in enumerate(range(0, tokens, chunk)):
            obj = store.reserve(i.to_bytes(16, "little"), chunk, cache.layout.object_bytes(chunk),
                                cache.layout.shape_signature())
            view = store.object_view(obj)
            view.copy_(host[:, :, start:start + chunk])
            store.commit(obj)
            objects.append(view)
        del host
        src = list(range(nb))
        dst = list(range(nb, 2 * nb))
        copies = planner.plan_copies([chunk] * len(objects), chunk, 0, 0)
        for mode in modes:
            engine = CudaTransferEngine(cache.layout, cache.region_tensors(), store.pool, 0,
                                        CudaTransferConfig(mode=mode))
            res: dict[str, Any] = {"max_ctas": engine.max_ctas}
            try:
                for width in widths:
                    gpu_ms, first_ms, host_ms = [], [], []
                    for i in range(2 + reps):
                        ex = engine.executor(objects)  # fresh executor: the per-transfer table build is included
                        job = planner.TransferJob(cache.layout, [dst], copies)
                        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                        marks: list[int] = []

                        def on_batch(s: int, c: int) -> None:
                            if not marks:
                                ev[1].record(engine.stream)
                                marks.append(s)

                        ev[0].record(engine.stream)
                        t0 = time.perf_counter()
                        planner.run_transfer(ex, job, width, on_batch)
                        t1 = time.perf_counter()
                        ev[2].record(engine.stream)
                        ev[2].synchronize()
                        if i >= 2:
                            host_ms.append((t1 - t0) * 1e3)
                            gpu_ms.append(ev[0].elapsed_time(ev[2]))
                            first_ms.append(ev[0].elapsed_time(ev[1]))
                    res[f"retrieve_w{width}"] = {"gpu_ms": stats(gpu_ms), "gpu_first_slice_ms": stats(first_ms),
                                                 "host_enqueue_ms": stats(host_ms)}
                cache.poison(dst)
                planner.run_transfer(engine.executor(objects), planner.TransferJob(cache.layout, [dst], copies), 1)
                engine.synchronize()
                res["verified"] = bool(cache.read(dst, 0, tokens).equal(truth))
                cache.write(truth, src)
                torch.cuda.synchronize()

                def gather_all() -> None:
                    for i, start in enumerate(range(0, tokens, chunk)):
                        job = planner.TransferJob(cache.layout, [src], [planner.ChunkCopy(0, 0, chunk, start)])
                        engine.executor([objects[i]]).gather(job)

                res["store_gather_gpu_ms"] = stats(gpu_time(gather_all, engine.stream, reps))
                if mode == "kernel":
                    sweep = {}
                    default = engine.max_ctas
                    for ctas in cta_sweep:
                        engine.max_ctas = ctas
                        ex = engine.executor(objects)
                        job = planner.TransferJob(cache.layout, [dst], copies)
                        r = gpu_time(lambda: ex.scatter(job, 0, 0), engine.stream, max(3, reps // 2))
                        g = gpu_time(gather_all, engine.stream, max(3, reps // 2))
                        sweep[str(ctas)] = {"retrieve_chunk_major_gpu_ms": statistics.median(r),
                                            "store_gather_gpu_ms": statistics.median(g)}
                    engine.max_ctas = default
                    res["cta_sweep"] = sweep
            finally:
                engine.close()
            out[mode] = res
    finally:
        objects.clear()  # drop the views so the pool unmaps
        store.close()
        cache = truth = None  # before empty_cache, so their GPU memory goes back
        torch.cuda.empty_cache()
    return out


# --- 3. end to end through a server ----------------------------------------------------


def _spin_until_released(worker, rid: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while rid not in worker.get_finished():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid} never released")
        time.sleep(2e-5)  # an engine polls between steps; a hot spin would hold the GIL the transport needs


def spin_until_settled(worker, rid: str, timeout: float = 30.0) -> None:
    """Poll as an engine does between steps until the worker has seen the transfer complete."""
    rec = worker.records[rid]
    deadline = time.monotonic() + timeout
    while rec.completed_at is None and rec.failure is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid} never completed")
        worker.get_finished()
        time.sleep(2e-5)


def wait_for_transfer_end(rec, timeout: float = 30.0) -> None:
    """Until the load's transfer has ended as well (server placement: its reply, which may come after the board
    let the engine settle it)."""
    deadline = time.monotonic() + timeout
    while rec.transfer_ended_at is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rec.request_id}'s transfer never ended")
        time.sleep(2e-5)


def measure_server(mode: str, tokens: int, chunk: int, block_size: int, reps: int,
                   widths: list[int], server_args: list[str] | None = None,
                   placement: str = "server", locate: str = "lookup") -> dict[str, Any]:
    """``server_args``: more ``kvstrata serve`` options. ``placement``: ``server`` (the server copies into the
    cache over CUDA IPC) or ``engine`` (engine placement: this process maps the pool and copies with its own
    streams; the prompt is stored through a second, server-placement instance). ``locate`` (engine placement):
    ``lookup`` starts each load from where its LOOKUP found the chunks, as the engine runtime does;
    ``retrieve`` asks RETRIEVE first (the A/B)."""
    from kvstrata.core.engine.requests import ChunkLocations
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.core.store.keys import CacheKey
    from kvstrata.server_process import ServerProcess
    from kvstrata.core.engine.engine_placement import EnginePlacement
    from kvstrata.core.engine.server_placement import ServerPlacement
    from kvstrata.native.cuda_events import CudaEventBackend

    cache = engine_cache(tokens, block_size)
    nb = tokens // block_size
    nbytes = cache.layout.object_bytes(tokens)
    src, dst = list(range(nb)), list(range(nb, 2 * nb))
    truth = cache.random_kv(tokens, seed=2)
    cache.write(truth, src)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"mode": mode, "server_args": server_args or []}
    if placement == "engine":
        out["locate"] = locate
    with ServerProcess(l1_bytes=2 * nbytes + (64 << 20), chunk_size=chunk, log_level="WARNING",
                       extra_args=["--cuda-mode", mode, *(server_args or [])]) as srv:
        backend = CudaEventBackend("cuda:0")
        client = CacheClient(srv.address, timeout=120.0)
        storer = ServerPlacement(client, 0, cache.layout, event_backend=backend)
        worker = storer
        area = None
        try:
            t = time.perf_counter()
            storer.register()
            out["register_s"] = round(time.perf_counter() - t, 3)
            out["placement"] = placement
            if placement == "engine":
                from kvstrata.core.engine.registration_area import RegistrationArea

                area = RegistrationArea(cache.layout, chunk_size=chunk)
                worker_client = CacheClient(srv.address, timeout=120.0)  # a connection of its own, as an engine's
                worker = EnginePlacement(worker_client, 1, cache.layout, event_backend=backend,
                                         local_regions=cache.region_tensors(), registration_layout=area.layout,
                                         pool_writable=True)
                t = time.perf_counter()
                worker.register()  # maps the pool (writable: it stores too) and registers it for DMA
                out["worker_register_s"] = round(time.perf_counter() - t, 3)
                out["pool_dma_register_s"] = round(worker._copier.register_s, 3)
                out["pool_dma_background_s"] = wait_pool_registered(worker)
                out["pool_bytes"] = worker._copier.engine.pool.numel()
            gen = torch.Generator().manual_seed(5)

            def prompt() -> list[int]:
                return torch.randint(0, 32000, (tokens,), generator=gen).tolist()

            store_steps: list[dict[str, float]] = []

            def store(p: list[int], rid: str, ahead: bool = False) -> float:
                # the key is built before the clock starts, as for a retrieve: the engine
                # has its prompt's key before it asks for any transfer
                key = CacheKey.for_tokens(rid, p, model="llama")
                reservation = None
                if ahead:  # reserved before the forward (vLLM, TensorRT-LLM): answered by the time it ends
                    reservation = worker.reserve_store(key)
                    worker.client.transport.wait(reservation)
                t0 = time.perf_counter()
                if placement == "engine":  # engine-placement: RESERVE_STORE, this process's copies, the commit
                    r = worker.store(key, [src], reservation=reservation)
                    st = worker.last_store
                    store_steps.append({"reserve_ms": (st.reserved_at - st.started_at) * 1e3,
                                        "enqueue_ms": (st.enqueued_at - st.reserved_at) * 1e3,
                                        "copy_ms": (st.copied_at - st.reserved_at) * 1e3,
                                        "commit_ms": (st.committed_at - st.copied_at) * 1e3})
                else:
                    r = client.store(key, 0, [src], event_handle=backend.store_event_handle())
                ms = (time.perf_counter() - t0) * 1e3
                assert r["stored_tokens"] == tokens, r
                return ms

            retrieve_prompt = prompt()
            out["first_store_ms"] = store(retrieve_prompt, "warm")
            runs: dict[int, list[dict[str, float]]] = {w: [] for w in widths}
            verified = {}
            stream = torch.cuda.current_stream()
            for rnd in range(reps + 1):
                order = widths[rnd % len(widths):] + widths[:rnd % len(widths)]
                for width in order:
                    # the lock owner names the loading worker's instance: the worker may use the locks this
                    # (scheduler's) connection took
                    rid = f"r{rnd}-w{width}@i{worker.instance_id}"
                    key = CacheKey.for_tokens(rid, retrieve_prompt, model="llama")
                    looked_up = client.transport.wait(client.lookup_async(key))  # before the clock, as an engine
                    assert looked_up["hit_tokens"] == tokens
                    located = ChunkLocations.from_lookup_reply(looked_up) if locate == "lookup" else None
                    if rnd == 0:
                        cache.poison(dst)
                    torch.cuda.synchronize()
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    ev[0].record(stream)
                    called = time.perf_counter()
                    worker.submit_retrieve(rid, key, [dst], layers_per_slice=width, located=located)
                    _spin_until_released(worker, rid)
                    for layer in range(cache.num_layers):
                        worker.wait_for_layer(layer)
                        if layer == 0:
                            first_waited = time.perf_counter()
                            ev[1].record(stream)
                    ev[2].record(stream)
                    spin_until_settled(worker, rid)
                    wait_for_transfer_end(worker.records[rid])
                    worker.wait_all()
                    torch.cuda.synchronize()
                    rec = worker.records.pop(rid)
                    if rec.failure or rec.fallback:
                        raise RuntimeError(f"retrieve {rid} failed or fell back: {rec}")
                    if placement == "engine" and rec.located_by != locate:
                        raise RuntimeError(f"retrieve {rid} was located by {rec.located_by}, not {locate}")
                    if rnd == 0:
                        verified[width] = bool(cache.read(dst, 0, tokens).equal(truth))
                        continue
                    runs[width].append({
                        "release_ms": (rec.released_at - rec.submitted_at) * 1e3,
                        "complete_ms": (rec.completed_at - rec.submitted_at) * 1e3,
                        "reply_ms": (rec.transfer_ended_at - rec.submitted_at) * 1e3,
                        "gpu_first_layer_ms": ev[0].elapsed_time(ev[1]),
                        "first_layer_waited_ms": (first_waited - rec.submitted_at) * 1e3,
                        "submit_stamped_ms": (rec.submitted_at - called) * 1e3,
                        "gpu_complete_ms": ev[0].elapsed_time(ev[2]),
                        "released_in_flight": bool(rec.released_before_complete),
                        "first_layer_ahead": bool(getattr(rec, "first_layer_ahead", False)),
                        **({"replied_ms": (rec.replied_at - rec.submitted_at) * 1e3,
                            "located_ms": (rec.located_at - rec.submitted_at) * 1e3,
                            "planned_ms": (rec.planned_at - rec.submitted_at) * 1e3,
                            "first_slice_enqueued_ms": (rec.first_slice_at - rec.submitted_at) * 1e3}
                           if rec.located_at is not None else {}),
                        **({"first_layer_handed_ms": (rec.first_layer_handed_at - rec.submitted_at) * 1e3}
                           if getattr(rec, "first_layer_handed_at", None) is not None else {}),
                    })
            out["verified"] = verified
            res = {}
            for width in widths:
                rows = runs[width]
                res[str(width)] = {k: stats([r[k] for r in rows]) for k in
                                   ("release_ms", "complete_ms", "reply_ms", "gpu_first_layer_ms",
                                    "gpu_complete_ms", "first_layer_waited_ms", "submit_stamped_ms", "replied_ms",
                                    "located_ms", "planned_ms", "first_layer_handed_ms", "first_slice_enqueued_ms")
                                   if all(k in r for r in rows)}
                res[str(width)]["released_in_flight"] = sum(r["released_in_flight"] for r in rows)
                res[str(width)]["first_layer_ahead"] = sum(r["first_layer_ahead"] for r in rows)
                if width != 0:  # paired with the chunk-major retrieve of the same round
                    res[str(width)]["overhead_vs_chunk_major_ms"] = stats(
                        [r["complete_ms"] - c["complete_ms"] for r, c in zip(rows, runs[0])])
                    res[str(width)]["gpu_overhead_vs_chunk_major_ms"] = stats(
                        [r["gpu_complete_ms"] - c["gpu_complete_ms"] for r, c in zip(rows, runs[0])])
            out["retrieve"] = res
            store_steps.clear()
            store_ms = [store(prompt(), f"s{i}") for i in range(reps + 1)][1:]
            out["store_ms"] = stats(store_ms)
            if store_steps:  # engine-placement: where the store's time went (the first, warm-up store left out)
                out["store_steps_ms"] = {k: stats([s[k] for s in store_steps[1:]]) for k in store_steps[0]}
                store_steps.clear()
                out["store_reserved_ahead_ms"] = stats([store(prompt(), f"a{i}", ahead=True) for i in range(reps)])
                out["store_reserved_ahead_steps_ms"] = {k: stats([s[k] for s in store_steps]) for k in store_steps[0]}
        finally:
            if worker is not storer:
                worker.close()
                worker.client.close()
            storer.close()
            if area is not None:
                area.close()
            client.close()
    return out


SGLANG_PAGE = 64
"""The SGLang offload phase's page size (SGLang's ``--page-size``; kvstrata's linker needs whole pages)."""


class _OffloadOnlyCounter:
    """SGLang's layer counter for a loader that only offloads: a load reaching it is a benchmark bug."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def reset(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the offload benchmark queues no load, yet the loader called the counter's {name}")


def measure_sglang_offload(tokens: int, chunk: int, reps: int, forward_ms: list[float]) -> dict[str, Any]:
    """SGLang's offload path, through the SGLang adapter's own loader (SGLang does not install here): per-layer
    K/V buffers shaped as SGLang's, a forward stand-in on its own stream that computes for about ``forward_ms``
    (matmuls) and then writes every page, SGLang's two offload-ready events (``record_offload_ready``: the
    current stream, the forward stream), then ``LayerLoader.offload`` with them, as SGLang's write-through does
    while the forward may still run. The store's time runs from the moment the loader's wait for those events
    returned to the commit (the store marks written; COMMIT_STORE's reply before them), as
    ``store_reserved_ahead_ms`` does; ``reserve_wait_ms`` is how long the store still waited for its RESERVE_STORE
    (sent before the wait) then."""
    import hashlib

    from kvstrata.adapters.sglang import hooks as sglang_hooks
    from kvstrata.adapters.sglang.kv_layout import SglangKVBuffers
    from kvstrata.adapters.sglang.loader import LayerLoader, synchronize_events
    from kvstrata.core.adapter_api.plugins import load_adapter
    from kvstrata.core.engine.settings import RuntimeSettings
    from kvstrata.core.engine.worker_runtime import WorkerRuntime
    from kvstrata.server_process import ServerProcess

    layers, heads, dim = SHAPE.layers, SHAPE.kv_heads, SHAPE.head

    def planes() -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(layers))

    kv = SglangKVBuffers(planes(), planes(), SGLANG_PAGE)
    nbytes = 2 * layers * tokens * heads * dim * 2
    slots = torch.arange(tokens, device="cuda")
    fill = torch.randn(tokens, heads, dim, device="cuda").to(torch.bfloat16)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        mm_ms = statistics.median(gpu_time(lambda: torch.mm(a, a, out=b), forward, 10))
    out: dict[str, Any] = {"engine_format": "sglang per-layer k_buffer/v_buffer", "page_size": SGLANG_PAGE,
                           "bytes": nbytes, "matmul_ms": round(mm_ms, 4), "by_forward_ms": {}}
    with ServerProcess(l1_bytes=2 * nbytes + (64 << 20), chunk_size=chunk, log_level="WARNING") as srv:
        settings = RuntimeSettings.from_mapping({"server_address": srv.address, "placement": "engine",
                                                 "instance_id": 90}, where="benchmarks/transfer.py")
        runtime = WorkerRuntime(load_adapter(sglang_hooks, check_engine=False), settings, model="sglang-offload")
        runtime.register(kv)
        loader = LayerLoader(runtime, _OffloadOnlyCounter(layers), page_size=SGLANG_PAGE,
                             wait_for_offload_inputs=synchronize_events)
        n = 0
        try:
            for fms in [forward_ms[0], *forward_ms]:  # the first pass warms up and is dropped
                rows = []
                for _ in range(reps):
                    n += 1
                    hashes = [hashlib.sha256(f"offload-{n}-{i}".encode()).hexdigest()
                              for i in range(tokens // SGLANG_PAGE)]
                    with torch.cuda.stream(forward):
                        for _ in range(round(fms / mm_ms)):
                            torch.mm(a, a, out=b)
                        for t in kv.planes():  # the forward writes the pages last
                            t.copy_(fill)
                    indices_ready = torch.cuda.Event()
                    indices_ready.record()
                    kv_written = torch.cuda.Event()
                    kv_written.record(forward)
                    t0 = time.perf_counter()
                    loader.offload(hashes, slots, [indices_ready, kv_written])
                    deadline = time.monotonic() + 60
                    while loader.num_completed_offloads() == 0:
                        if time.monotonic() > deadline:
                            raise TimeoutError("an offload did not complete within 60 s")
                        time.sleep(0.0002)
                    if not loader.pop_completed_offload():
                        raise RuntimeError("an offload failed (see the log)")
                    st = runtime.transfers.last_store
                    if not st.reserved_ahead:
                        raise RuntimeError("the offload's store did not use the reservation made before its wait")
                    rows.append({"store_ms": (st.committed_at - st.started_at) * 1e3,
                                 "reserve_wait_ms": (st.reserved_at - st.started_at) * 1e3,
                                 "copy_ms": (st.copied_at - st.reserved_at) * 1e3,
                                 "commit_ms": (st.committed_at - st.copied_at) * 1e3,
                                 "offload_call_to_commit_ms": (st.committed_at - t0) * 1e3})
                out["by_forward_ms"][str(fms)] = {k: stats([r[k] for r in rows]) for k in rows[0]}
        finally:
            loader.close()
    return out


def evaluate(raw: dict[str, Any], e2e: dict[str, Any]) -> dict[str, Any]:
    h2d = raw["h2d_pinned_ms"]["median"]
    d2h = raw["d2h_pinned_ms"]["median"]
    r = e2e["retrieve"]
    cm = r["0"]["complete_ms"]["median"]
    out = {
        "chunk_major_vs_raw": {"value": cm / h2d, "limit": TARGETS["chunk_major_vs_raw"],
                               "detail": f"chunk-major {cm:.2f} ms vs raw {h2d:.2f} ms"},
        "store_vs_raw": {"value": e2e["store_ms"]["median"] / d2h, "limit": TARGETS["store_vs_raw"],
                         "detail": f"store {e2e['store_ms']['median']:.2f} ms vs raw {d2h:.2f} ms"},
    }
    if "1" in r:
        out["width1_release_ms"] = {"value": r["1"]["release_ms"]["median"], "limit": TARGETS["width1_release_ms"]}
        out["width1_overhead_ms"] = {"value": r["1"]["overhead_vs_chunk_major_ms"]["median"],
                                     "limit": TARGETS["width1_overhead_ms"]}
    wide = {w: r[w]["overhead_vs_chunk_major_ms"]["median"] for w in r if w not in ("0", "1")}
    if wide:
        worst = max(wide, key=wide.get)
        out["wide_overhead_ms"] = {"value": wide[worst], "limit": TARGETS["wide_overhead_ms"],
                                   "detail": {f"w{w}": round(v, 3) for w, v in wide.items()}}
    for t in out.values():
        t["met"] = bool(t["value"] <= t["limit"]) if not isinstance(t["value"], str) else False
        t["value"] = round(t["value"], 4)
    return out


ENGINE_EXECUTED_TARGETS = {"chunk_major_vs_raw": 1.05, "width1_first_layer_usable_ms": 1.5, "store_vs_raw": 1.10}
"""The transfer targets for the engine placement (loads from the pool, and stores by
RESERVE_STORE, this process's copies, the commit: the store marks, or COMMIT_STORE before them)."""


def evaluate_engine_placement(raw: dict[str, Any], ee: dict[str, Any], server: dict[str, Any] | None) -> dict:
    h2d = raw["h2d_pinned_ms"]["median"]
    r = ee["retrieve"]
    cm = r["0"]["complete_ms"]["median"]
    out = {"chunk_major_vs_raw": {"value": cm / h2d, "limit": ENGINE_EXECUTED_TARGETS["chunk_major_vs_raw"],
                                  "detail": f"chunk-major {cm:.2f} ms vs raw {h2d:.2f} ms"}}
    if "1" in r:
        first = r["1"]["gpu_first_layer_ms"]["median"]
        detail = f"layer 0 usable on the engine's stream {first:.3f} ms after submit"
        if server and "1" in server["retrieve"]:
            detail += f" (server placement: {server['retrieve']['1']['gpu_first_layer_ms']['median']:.3f} ms)"
        out["width1_first_layer_usable_ms"] = {"value": first, "limit": ENGINE_EXECUTED_TARGETS[
            "width1_first_layer_usable_ms"], "detail": detail}
    if "store_ms" in ee:
        st, d2h = ee["store_ms"]["median"], raw["d2h_pinned_ms"]["median"]
        out["store_vs_raw"] = {"value": st / d2h, "limit": ENGINE_EXECUTED_TARGETS["store_vs_raw"],
                               "detail": f"RESERVE_STORE + copies + commit {st:.2f} ms vs raw D2H {d2h:.2f} ms"}
    if "store_reserved_ahead_ms" in ee:
        st, d2h = ee["store_reserved_ahead_ms"]["median"], raw["d2h_pinned_ms"]["median"]
        out["store_reserved_ahead_vs_raw"] = {
            "value": st / d2h, "limit": ENGINE_EXECUTED_TARGETS["store_vs_raw"],
            "detail": f"copies + commit, RESERVE_STORE answered during the forward (vLLM's and TensorRT-LLM's "
                      f"path), {st:.2f} ms vs raw D2H {d2h:.2f} ms"}
    for t in out.values():
        t["met"] = bool(t["value"] <= t["limit"])
        t["value"] = round(t["value"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="retrieve length; 8192 at Llama-3.1-8B shapes = 1 GiB")
    p.add_argument("--shape", default="llama-3.1-8b", choices=KV_SHAPES,
                   help="the model shape whose KV is moved (shapes.py)")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--modes", default="staged", help="the server's copy modes (kvstrata serve --cuda-mode), the "
                   "first is primary (targets)")
    p.add_argument("--widths", default="0,1,2,4,8,32", help="0 = chunk-major")
    p.add_argument("--cta-sweep", default="8,16,33,66,132,264,528")
    p.add_argument("--skip", default="",
                   help="comma list of phases to skip: raw, rawzmq, inprocess, server, engine (every engine-placement "
                        "phase), locate_ab (only the engine-placement loads that ask RETRIEVE where the chunks are), sglang_offload "
                        "(SGLang's offload path)")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval for this (engine) process in seconds; 0 keeps Python's default, "
                        "as an engine would")
    p.add_argument("--ab", action="append", default=[], metavar="NAME=SETTING",
                   help="also run the primary mode's server phase as variant NAME, right after it on the same "
                        "machine: SETTING is kvstrata serve options, space separated; e.g. "
                        "--ab 'poll_5=--busy-poll-ms 5' (repeatable)")
    p.add_argument("--offload-forward-ms", default="0,5",
                   help="sglang_offload phase: the forward stand-in's compute before it writes the pages, per arm "
                        "(0: the pages' write alone, so little of the reservation is hidden)")
    p.add_argument("--out", default="benchmarks/results/transfer-h200.json")
    p.add_argument("--phase", default="", help="run only this phase, in this process, and write its result alone "
                   "(how the run starts each phase in a process of its own)")
    args = p.parse_args(argv)
    global SHAPE
    SHAPE = SHAPES[args.shape]
    variants = [parse_ab(spec) for spec in args.ab]
    if not torch.cuda.is_available():
        print("benchmarks/transfer.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.switch_interval > 0:
        sys.setswitchinterval(args.switch_interval)
    modes = [m for m in args.modes.split(",") if m]
    widths = [int(w) for w in args.widths.split(",")]
    skip = set(args.skip.split(","))
    from provenance import measured_commit

    result: dict[str, Any] = {"benchmark": "transfer", "commit": measured_commit(), "device": device_info(),
                              "config": {"tokens": args.tokens, "chunk": args.chunk, "block_size": args.block_size,
                                         "reps": args.reps, "modes": modes, "widths": widths,
                                         "shape": args.shape, "model": SHAPE.describe(),
                                         "engine_format": "vllm-LBNHC",
                                         "switch_interval_s": sys.getswitchinterval()},
                              "errors": {}}
    from kvstrata.native import cuda_ext

    t = time.perf_counter()
    cuda_ext.load()
    result["extension_load_s"] = round(time.perf_counter() - t, 2)
    nbytes = cache_bytes(args.tokens)
    phases = [("raw", lambda: measure_raw(nbytes, args.reps)),
              ("rawzmq", lambda: measure_raw_zmq(200)),
              ("inprocess", lambda: measure_inprocess(args.tokens, args.chunk, args.block_size, args.reps, modes,
                                                      widths, [int(c) for c in args.cta_sweep.split(",") if c]))]
    for mode in modes:
        phases.append((f"server_{mode}", lambda m=mode: measure_server(m, args.tokens, args.chunk, args.block_size,
                                                                       args.reps, widths)))
        if mode == modes[0]:
            for name, cli in variants:
                phases.append((f"server_{mode}_{name}", lambda m=mode, c=cli: measure_server(
                    m, args.tokens, args.chunk, args.block_size, args.reps, widths, c)))
    phases.append(("engine_placement", lambda: measure_server(modes[0], args.tokens, args.chunk, args.block_size,
                                                               args.reps, widths, placement="engine")))
    if "locate_ab" not in skip:  # the same engine-placement loads, each asking RETRIEVE where its chunks are
        phases.append(("engine_placement_retrieve", lambda: measure_server(
            modes[0], args.tokens, args.chunk, args.block_size, args.reps, widths, placement="engine",
            locate="retrieve")))
    if "sglang_offload" not in skip:  # SGLang's write-through: the reservation sent before the forward ends
        phases.append(("sglang_offload", lambda: measure_sglang_offload(
            args.tokens, args.chunk, args.reps, [float(x) for x in args.offload_forward_ms.split(",")])))
    if args.phase:
        if args.phase not in dict(phases):
            raise SystemExit(f"--phase {args.phase!r}: not one of {', '.join(name for name, _ in phases)}")
        try:
            out = {"result": dict(phases)[args.phase]()}
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        with open(args.out, "w") as f:
            json.dump(out, f)
        return 0
    for name, _ in phases:
        if name.split("_")[0] in skip or name in skip:
            continue
        t = time.perf_counter()
        try:
            result[name] = run_phase(name, argv if argv is not None else sys.argv[1:])
        except Exception as exc:
            result["errors"][name] = str(exc)
            print(f"[{name}] FAILED: {exc}", file=sys.stderr)
        print(f"[{name}] {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    primary = f"server_{modes[0]}"
    if "raw" in result and primary in result:
        result["targets"] = evaluate(result["raw"], result[primary])
    if "raw" in result and "engine_placement" in result:
        result["engine_placement_targets"] = evaluate_engine_placement(result["raw"], result["engine_placement"],
                                                                     result.get(primary))
        if "sglang_offload" in result:
            d2h = result["raw"]["d2h_pinned_ms"]["median"]
            for fms, row in result["sglang_offload"]["by_forward_ms"].items():
                st = row["store_ms"]["median"]
                result["engine_placement_targets"][f"store_sglang_offload_forward{fms}ms_vs_raw"] = {
                    "value": round(st / d2h, 4), "limit": ENGINE_EXECUTED_TARGETS["store_vs_raw"],
                    "met": bool(st / d2h <= ENGINE_EXECUTED_TARGETS["store_vs_raw"]),
                    "detail": f"SGLang's offload after a {fms} ms forward stand-in: from its wait's end to "
                              f"the commit {st:.2f} ms (still waiting for RESERVE_STORE "
                              f"{row['reserve_wait_ms']['median']:.3f} ms) vs raw D2H {d2h:.2f} ms"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=False)
    print_summary(result, modes)
    return 0 if not result["errors"] else 1


def run_phase(name: str, argv: list[str]) -> dict[str, Any]:
    """Phase ``name`` in a child process of its own (this script with ``--phase``), with this run's options;
    its result, or an error naming what the child said."""
    with tempfile.TemporaryDirectory(prefix="kvstrata-transfer-") as tmp:
        out = os.path.join(tmp, f"{name}.json")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--phase", name, "--out", out])
        if not os.path.exists(out):
            raise RuntimeError(f"phase {name}: its process exited {proc.returncode} without a result")
        with open(out) as f:
            got = json.load(f)
    if "error" in got:
        raise RuntimeError(got["error"])
    return got["result"]


def parse_ab(spec: str) -> tuple[str, list[str]]:
    """``NAME=SETTING`` (see ``--ab``) -> (name, kvstrata serve options)."""
    name, _, setting = spec.partition("=")
    cli = []
    for word in setting.split():
        if "=" in word and not word.startswith("--") and word.split("=")[0].isupper():
            raise SystemExit(f"--ab {spec!r}: {word} looks like an environment setting; the A/B switches are "
                             "kvstrata serve options (e.g. --busy-poll-ms)")
        cli.append(word)
    return name, cli


def cache_bytes(tokens: int) -> int:
    """The bytes of ``tokens`` tokens of :data:`SHAPE`'s KV (bf16, K and V)."""
    return tokens * SHAPE.layers * 2 * SHAPE.kv_heads * SHAPE.head * 2


def print_summary(result: dict[str, Any], modes: list[str]) -> None:
    raw = result.get("raw", {})
    if raw:
        print(f"raw H2D {raw['h2d_pinned_ms']['median']:.3f} ms ({raw['h2d_pinned_gbps']} GB/s), "
              f"registered shm {raw['h2d_registered_shm_ms']['median']:.3f} ms, "
              f"32 pieces {raw['h2d_registered_shm_32_pieces_ms']['median']:.3f} ms; "
              f"raw D2H {raw['d2h_pinned_ms']['median']:.3f} ms")
    rz = result.get("rawzmq")
    if rz:
        print(f"raw pyzmq between two processes: request leg {rz['request_leg_ms']['median']:.3f} ms, reply leg "
              f"{rz['reply_leg_ms']['median']:.3f} ms, round trip {rz['round_trip_ms']['median']:.3f} ms")
    for mode in modes:
        ip = result.get("inprocess", {}).get(mode)
        if ip:
            cells = ", ".join(f"w{k[len('retrieve_w'):]} {v['gpu_ms']['median']:.3f}" for k, v in ip.items()
                              if k.startswith("retrieve_w"))
            print(f"[in-process {mode}] GPU ms: {cells}; gather {ip['store_gather_gpu_ms']['median']:.3f}; "
                  f"verified {ip.get('verified')}")
            if "cta_sweep" in ip:
                print("  CTA sweep (retrieve/gather GPU ms): " + ", ".join(
                    f"{c}: {v['retrieve_chunk_major_gpu_ms']:.2f}/{v['store_gather_gpu_ms']:.2f}"
                    for c, v in ip["cta_sweep"].items()))
    for name, sv in result.items():
        if name.startswith("server_") or name.startswith("engine_placement") and "retrieve" in sv:
            steps = sv.get("store_steps_ms")
            print(f"[{name}] store {sv['store_ms']['median']:.3f} ms"
                  + (" (RESERVE_STORE {:.3f}, copies {:.3f} of which enqueued in {:.3f}, commit {:.3f})".format(
                      *(steps[k]["median"] for k in ("reserve_ms", "copy_ms", "enqueue_ms", "commit_ms")))
                     if steps else "")
                  + (f"; reserved ahead {sv['store_reserved_ahead_ms']['median']:.3f} ms"
                     if "store_reserved_ahead_ms" in sv else "")
                  + f"; verified {sv.get('verified')}")
            print("  width  release_ms  complete_ms  overhead_ms  gpu_first_ms  gpu_complete_ms")
            for w, r in sv["retrieve"].items():
                ov = r.get("overhead_vs_chunk_major_ms", {}).get("median", 0.0)
                print(f"  {w:>5}  {r['release_ms']['median']:10.3f}  {r['complete_ms']['median']:11.3f}  "
                      f"{ov:11.3f}  {r['gpu_first_layer_ms']['median']:12.3f}  {r['gpu_complete_ms']['median']:15.3f}"
                      + (f"  replied {r['replied_ms']['median']:.3f} located {r['located_ms']['median']:.3f}"
                         f" planned {r['planned_ms']['median']:.3f}"
                         f" first enqueued "
                         f"{r['first_slice_enqueued_ms']['median']:.3f}"
                         f" first layer ahead {r.get('first_layer_ahead', 0)}/{r['release_ms']['n']}"
                         if "located_ms" in r else "")
                      + (f" first layer handed over {r['first_layer_handed_ms']['median']:.3f}"
                         if "first_layer_handed_ms" in r else "")
                      + (f" layer 0 waited {r['first_layer_waited_ms']['median']:.3f}"
                         if "first_layer_waited_ms" in r else "")
                      + (f" (submit stamped {r['submit_stamped_ms']['median']:.3f} after the call)"
                         if "submit_stamped_ms" in r else ""))
    for name, t in result.get("targets", {}).items():
        print(f"target {name}: {t['value']} (limit {t['limit']}) {'MET' if t['met'] else 'MISSED'}")
    ee = result.get("engine_placement")
    if ee:
        print(f"[engine_placement] pool of {ee['pool_bytes'] >> 20} MiB registered for DMA in "
              f"{ee['pool_dma_register_s']} s (worker registration {ee['worker_register_s']} s)")
    for name, t in result.get("engine_placement_targets", {}).items():
        print(f"engine-placement target {name}: {t['value']} (limit {t['limit']}) {'MET' if t['met'] else 'MISSED'}"
              f"{' - ' + t['detail'] if 'detail' in t else ''}")
    so = result.get("sglang_offload")
    if so:
        for fms, row in so["by_forward_ms"].items():
            print(f"[sglang_offload] forward {fms} ms: store {row['store_ms']['median']:.3f} ms after the wait "
                  f"(RESERVE_STORE still awaited {row['reserve_wait_ms']['median']:.3f}, copies "
                  f"{row['copy_ms']['median']:.3f}, commit {row['commit_ms']['median']:.3f}); offload call "
                  f"to commit {row['offload_call_to_commit_ms']['median']:.3f} ms")
    for name, err in result.get("errors", {}).items():
        print(f"error in {name}: {err.splitlines()[0]}")


if __name__ == "__main__":
    sys.exit(main())
