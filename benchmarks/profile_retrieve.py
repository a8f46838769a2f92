"""Where a GPU retrieve's time goes: one timeline across the engine process and the server process.

``time.perf_counter`` is CLOCK_MONOTONIC on Linux, so timestamps taken in the
server child and in this process share one clock. The child runs the real
``kvstrata serve`` with wrappers around the steps of a retrieve (request
decoded, handler entered, objects located, executor built, per-transfer table,
each slice enqueued and published, finish, reply sent) and CUDA timing events
on its copy stream, so each slice's GPU completion is placed on the same clock.

    python benchmarks/profile_retrieve.py --tokens 8192 --widths 0,1,32 --reps 3

Prints, per width, the median offset of every step from the engine's submit.

``--device cpu`` profiles the same request path without a GPU: the reference
engine's shared-memory cache with the GPU run's counts (32 layers, 256-token
chunks, 16-token blocks) but a one-head, two-byte model, so the copies are small
and what shows is the host work around them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from typing import Any


def install_tracing(path: str) -> None:
    """Wrap the server's retrieve steps so each writes (time, name) to ``path`` (server child only)."""
    import torch

    from kvstrata.core.arrival import board
    from kvstrata.core.transfer import planner
    from kvstrata.core.wire import transport
    from kvstrata.core.wire.protocol import DECLARATIONS
    from kvstrata.core.server import cache_server as server_mod
    from kvstrata.core.transfer import torch_executor

    out = open(path, "a")
    lock = threading.Lock()
    pending: list[tuple[float, Any, list[Any]]] = []
    held: list[tuple[float, str, float | None]] = []

    def mark(name: str, t: float | None = None) -> None:
        # In memory: a write per mark would release the GIL and wake other threads,
        # perturbing exactly what is measured. Written out after each reply (flush).
        # With the thread's CPU time: where wall time outruns it, the thread waited.
        held.append((time.perf_counter() if t is None else t, name, time.thread_time() if t is None else None))

    def flush() -> None:
        with lock:
            rows, held[:] = list(held), []
            out.write("".join(json.dumps({"t": t, "name": n, "cpu": c}) + "\n" for t, n, c in rows))
            out.flush()

    def wrap(owner: Any, attr: str, enter: str | None, leave: str | None) -> None:
        orig = getattr(owner, attr, None)
        if orig is None:  # a renamed step must not take the whole profile down
            print(f"profile_retrieve: {getattr(owner, '__name__', owner)}.{attr} not found; not traced", file=sys.stderr)
            return

        @functools.wraps(orig)
        def wrapper(*a: Any, **k: Any) -> Any:
            if enter:
                mark(enter)
            try:
                return orig(*a, **k)
            finally:
                if leave:
                    mark(leave)

        setattr(owner, attr, wrapper)

    wrap(transport.Server, "_decode", "recv", None)
    wrap(server_mod.CacheServer, "retrieve", "handler_in", "handler_out")
    wrap(server_mod.CacheServer, "_locked_objects", "locate_in", "objects_located")
    wrap(server_mod.CacheServer, "_acquire", None, "instance")
    wrap(server_mod.CacheServer, "_retrieve_into_cache", "into_cache", None)
    wrap(server_mod.CacheServer, "store_kv", "store_in", "store_out")
    wrap(board.ArrivalBoard, "publish", None, "publish")
    wrap(planner, "run_transfer", "transfer_in", "all_enqueued")
    answering = threading.local()  # set while a thread answers a transfer

    def answering_transfer(attr: str) -> None:
        orig = getattr(transport.Server, attr)

        @functools.wraps(orig)
        def wrapper(self: Any, *a: Any) -> Any:
            answering.on = True
            try:
                return orig(self, *a)
            finally:
                answering.on = False

        setattr(transport.Server, attr, wrapper)

    answering_transfer("_run_blocking")
    orig_send = transport.Server._send

    def send(self: Any, *a: Any) -> None:
        try:
            orig_send(self, *a)
        finally:
            if getattr(answering, "on", False):
                mark("reply_sent")
                flush()

    transport.Server._send = send  # type: ignore[method-assign]
    orig_run = transport.Server._run

    def run_request(self: Any, request: Any, *a: Any) -> bytes:
        try:
            return orig_run(self, request, *a)
        finally:
            if not DECLARATIONS[request.request_type].blocking:
                held.clear()  # a PING's or LOOKUP's marks are not part of any transfer's timeline

    transport.Server._run = run_request  # type: ignore[method-assign]
    if not torch.cuda.is_available():
        wrap(torch_executor.TorchExecutor, "scatter", "scatter_in", "scatter_out")
        wrap(torch_executor.TorchExecutor, "gather", "gather_in", "gather_out")
        return
    from kvstrata.native import cuda_executor, cuda_target

    wrap(cuda_target.CudaIpcTarget, "open_layer_events", None, "events_opened")
    wrap(cuda_target.CudaIpcTarget, "executor", "executor_in", "executor_out")
    wrap(cuda_executor.CudaExecutor, "_table", "table_in", "table_out")
    wrap(cuda_executor.CudaExecutor, "gather", "gather_in", "gather_out")

    orig_scatter = cuda_executor.CudaExecutor.scatter

    def scatter(self: Any, job: Any, layer_start: int, layer_count: int) -> None:
        stream = self.engine.stream
        if not getattr(self, "_trace", None):
            ev0 = torch.cuda.Event(enable_timing=True)
            ev0.record(stream)
            self._trace = (time.perf_counter(), ev0, [])
            pending.append(self._trace)
        mark("scatter_in")
        orig_scatter(self, job, layer_start, layer_count)
        mark("scatter_out")
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        self._trace[2].append(ev)

    cuda_executor.CudaExecutor.scatter = scatter

    idle_events: dict[int, dict[str, Any]] = {}
    orig_completion = cuda_target.CudaIpcTarget.completion

    def completion(self: Any, *args: Any, **kwargs: Any) -> Any:
        # when each stream goes idle after everything the transfer enqueued, its event records included
        # (recorded before the completion's own event, so that event's wait covers them)
        idle = {name: torch.cuda.Event(enable_timing=True) for name in ("kernel", "copy")}
        idle["kernel"].record(self.engine.stream)
        if self.engine.copy_stream is not None:
            idle["copy"].record(self.engine.copy_stream)
        done = orig_completion(self, *args, **kwargs)
        idle_events[id(done)] = {"idle": idle, "copy_stream": self.engine.copy_stream is not None}
        return done

    cuda_target.CudaIpcTarget.completion = completion  # type: ignore[method-assign]
    orig_wait = cuda_target.DeviceCompletion.wait

    def wait(self: Any) -> None:
        mark("finish_in")
        orig_wait(self)
        mark("finish_out")
        entry = idle_events.pop(id(self), None)
        if entry is None:
            return
        idle = entry["idle"]
        while pending:
            t0, ev0, evs = pending.pop()
            for i, ev in enumerate(evs):
                if i in (0, len(evs) - 1):
                    mark(f"gpu_slice{'0' if i == 0 else '_last'}_done", t0 + ev0.elapsed_time(ev) / 1e3)
            mark("gpu_kernel_stream_idle", t0 + ev0.elapsed_time(idle["kernel"]) / 1e3)
            if entry["copy_stream"]:
                mark("gpu_copy_stream_idle", t0 + ev0.elapsed_time(idle["copy"]) / 1e3)

    cuda_target.DeviceCompletion.wait = wait  # type: ignore[method-assign]


def serve_traced(argv: list[str]) -> int:
    path = os.environ["KVSTRATA_TRACE_FILE"]
    install_tracing(path)
    from kvstrata.cli import main

    return main(argv)


def trace_engine_side() -> dict[str, float]:
    """Marks in this (engine) process: the request leaving, the reply thread waking, the future resolving.

    Each mark keeps its first time after ``clear()``, so a retrieve's own send
    and reply are what is seen.
    """
    from kvstrata.core.wire import transport

    marks: dict[str, float] = {}
    send, wait, resolve = transport.SharedSocket.send, transport.SharedSocket.wait, transport.Client._resolve
    def traced_send(self: Any, frames: list[Any], *args: Any) -> None:
        marks.setdefault("engine_send_in", time.perf_counter())
        send(self, frames, *args)
        marks.setdefault("engine_sent", time.perf_counter())

    def traced_wait(self: Any, *args: Any) -> None:
        wait(self, *args)
        if self.inbox and "engine_sent" in marks:
            marks.setdefault("engine_io_drained", time.perf_counter())

    def traced_resolve(self: Any, frame: bytes) -> None:
        if "engine_sent" in marks:
            marks.setdefault("engine_resolve_in", time.perf_counter())
        resolve(self, frame)

    transport.SharedSocket.send = traced_send  # type: ignore[method-assign]
    transport.SharedSocket.wait = traced_wait  # type: ignore[method-assign]
    transport.Client._resolve = traced_resolve  # type: ignore[method-assign]
    return marks


CPU_MARKS = ("recv", "handler_in", "locate_in", "executor_in", "transfer_in", "scatter_in", "table_in", "table_out",
             "scatter_out", "publish", "all_enqueued", "handler_out")
"""Marks the dispatching thread takes from the request's decode to its reply, reported also as that thread's
CPU time (``name@cpu``, from ``recv``): wall time beyond CPU time is time the thread waited."""


def read_trace(path: str, since: float, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The server's marks for the transfer started at ``since``; it writes them just after sending the reply
    (so the previous transfer's may land after the file was emptied: they are older and skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        with open(path) as f:
            rows = [r for r in map(json.loads, f) if r["t"] >= since]
        if any(r["name"] == "reply_sent" for r in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.001)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch

    from kvstrata.core.wire.client import CacheClient
    from kvstrata.core.store.keys import CacheKey
    from kvstrata.server_process import ServerProcess
    from kvstrata.core.engine.server_placement import ServerPlacement
    from transfer import spin_until_settled, wait_for_transfer_end  # the engine's poll, as the transfer benchmark models it

    gpu = args.device == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    trace = tempfile.mktemp(prefix="kvstrata-trace-", suffix=".jsonl")
    os.environ["KVSTRATA_TRACE_FILE"] = trace
    nb = args.tokens // 16
    if gpu:
        from kvstrata.native.cuda_events import CudaEventBackend
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from kvstrata_testing.gpu_caches import GpuKVCache  # engine-format GPU caches: test support, not shipped

        cache = GpuKVCache("vllm-LBNHC", num_layers=32, num_heads=8, head_size=128, dtype="bfloat16",
                           num_blocks=2 * nb + 2, block_size=16)
        cache.write(cache.random_kv(args.tokens, seed=1), list(range(nb)))
        backend = CudaEventBackend("cuda:0")
        store_event = backend.store_event_handle
    else:
        from kvstrata.core.arrival.events import HostEventBackend
        from kvstrata.adapters.reference.engine import ModelShape, ReferenceEngine

        cache = ReferenceEngine(ModelShape(32, 2, 1, 1, "bfloat16"), num_blocks=2 * nb + 2, block_size=16)
        backend = HostEventBackend()
        store_event = lambda: None  # noqa: E731
    nbytes = 2 * cache.layout.object_bytes(args.tokens)  # the retrieved prompt plus one stored at a time
    src, dst = list(range(nb)), list(range(nb, 2 * nb))
    prompt = torch.randint(0, 32000, (args.tokens,)).tolist()
    if not gpu:
        cache.prefill(prompt, src)
    sync()
    srv = ServerProcess(l1_bytes=nbytes + (64 << 20), chunk_size=args.chunk, log_level="WARNING",
                        extra_args=["--cuda-mode", args.mode] if args.mode else None)
    srv.args = [sys.executable, os.path.abspath(__file__), "--serve-traced", *srv.args[3:]]
    results: dict[str, Any] = {"device": args.device}
    engine_marks = trace_engine_side()
    with srv:
        client = CacheClient(srv.address, timeout=120.0)
        worker = ServerPlacement(client, 0, cache.layout, event_backend=backend)
        try:
            worker.register()
            client.store(CacheKey.for_tokens("s", prompt, model="m"), 0, [src], event_handle=store_event())
            widths = [int(w) for w in args.widths.split(",")]
            for width in widths:
                rows: dict[str, list[float]] = {}
                for rep in range(args.reps + 1):
                    rid = f"w{width}-{rep}"
                    key = CacheKey.for_tokens(rid, prompt, model="m")
                    client.lookup(key)
                    sync()
                    open(trace, "w").close()
                    engine_marks.clear()
                    worker.submit_retrieve(rid, key, [dst], layers_per_slice=width)
                    while rid not in worker.get_finished():
                        time.sleep(2e-5)
                    for layer in range(32):
                        worker.wait_for_layer(layer)
                    spin_until_settled(worker, rid)
                    wait_for_transfer_end(worker.records[rid])
                    worker.wait_all()
                    rec = worker.records.pop(rid)
                    if rec.failure:
                        raise RuntimeError(f"retrieve {rid} failed: {rec.failure}")
                    if rep == 0:
                        continue
                    t0 = rec.submitted_at
                    seen: dict[str, float] = {}
                    cpu0 = None
                    for e in read_trace(trace, t0):
                        key_name = e["name"] if e["name"] not in seen else e["name"] + "_last"
                        seen[key_name] = (e["t"] - t0) * 1e3
                        if e.get("cpu") is not None and key_name in CPU_MARKS:
                            # the dispatching thread's CPU time since it decoded the request
                            cpu0 = e["cpu"] if cpu0 is None else cpu0
                            seen[key_name + "@cpu"] = (e["cpu"] - cpu0) * 1e3
                    seen["engine_released"] = (rec.released_at - t0) * 1e3
                    seen["engine_reply"] = (rec.transfer_ended_at - t0) * 1e3
                    seen["engine_settled"] = (rec.completed_at - t0) * 1e3
                    seen.update({k: (v - t0) * 1e3 for k, v in engine_marks.items()})
                    for k, v in seen.items():
                        rows.setdefault(k, []).append(v)
                results[str(width)] = {k: round(statistics.median(v), 3) for k, v in
                                       sorted(rows.items(), key=lambda kv: statistics.median(kv[1]))}
            rows = {}
            for rep in range(args.reps + 1):
                p = torch.randint(0, 32000, (args.tokens,)).tolist()
                key = CacheKey.for_tokens(f"st{rep}", p, model="m")
                open(trace, "w").close()
                engine_marks.clear()
                t0 = time.perf_counter()
                client.store(key, 0, [src], event_handle=store_event())
                t1 = time.perf_counter()
                if rep == 0:
                    continue
                seen = {}
                for e in read_trace(trace, t0):
                    name = e["name"] if e["name"] not in seen else e["name"] + "_last"
                    seen[name] = (e["t"] - t0) * 1e3
                seen["engine_reply"] = (t1 - t0) * 1e3
                seen.update({k: (v - t0) * 1e3 for k, v in engine_marks.items()})
                for k, v in seen.items():
                    rows.setdefault(k, []).append(v)
            results["store"] = {k: round(statistics.median(v), 3) for k, v in
                                sorted(rows.items(), key=lambda kv: statistics.median(kv[1]))}
        finally:
            worker.close()
            client.close()
            if not gpu:
                cache.close()
    os.unlink(trace)
    return results


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-traced":
        return serve_traced(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--widths", default="0,1,32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--mode", default=None, choices=("staged", "kernel", "torch"),
                   help="server copy mode (kvstrata serve --cuda-mode); default: the server's")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    results = run(args)
    for width, steps in results.items():
        if not isinstance(steps, dict):
            continue
        print(f"{'width ' + width if width != 'store' else 'store'}: " + ", ".join(f"{k} {v}" for k, v in steps.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
