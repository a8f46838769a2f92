"""Host time of a retrieve's first slice, by function: where the CPU goes before the first copy is enqueued.

In one process on one GPU (no server), for the transfer benchmark's shapes:
builds a fresh executor over the L1 objects the way the server does
(``pool_executor``), enqueues the first layer slice, and repeats; cProfile
then lists the functions by their own time. A complement to
``profile_retrieve.py``, which places steps on one timeline but cannot say what
inside a step costs.

    python benchmarks/profile_host.py --reps 200
    python benchmarks/profile_host.py --submit --reps 100   # the engine side: Placement.submit_retrieve
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--submit", action="store_true", help="profile the engine's submit against a real server")
    ap.add_argument("--table-steps", action="store_true",
                    help="time each host step of the per-transfer token table, back to back and after 20 ms of "
                         "spinning with a driver query (as the server's busy poll)")
    ap.add_argument("--idle-study", action="store_true",
                    help="time the first slice (unprofiled) back to back, after 20 ms asleep and after 20 ms of "
                         "spinning: does the host run slower after idling, as a server between transfers does?")
    args = ap.parse_args()
    if args.submit:
        return profile_submit(args)
    from kvstrata.core.transfer import planner
    from kvstrata.core.store.l1_store import L1Store
    from kvstrata.native.cuda_executor import CudaTransferEngine
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from kvstrata_testing.gpu_caches import GpuKVCache  # engine-format GPU caches: test support, not shipped

    nb = args.tokens // 16
    cache = GpuKVCache("vllm-LBNHC", num_layers=32, num_heads=8, head_size=128, dtype="bfloat16",
                       num_blocks=2 * nb + 2, block_size=16)
    layout = cache.layout
    store = L1Store(layout.object_bytes(args.tokens) + (8 << 20))
    objs = []
    for i in range(args.tokens // args.chunk):
        o = store.reserve(i.to_bytes(16, "little"), args.chunk, layout.object_bytes(args.chunk),
                          layout.shape_signature())
        store.commit(o)
        objs.append(o)
    engine = CudaTransferEngine(layout, cache.region_tensors(), store.pool, 0)
    dst = list(range(nb, 2 * nb))

    def first_slice() -> None:
        copies = planner.plan_copies([o.num_tokens for o in objs], args.chunk, 0, 0)
        job = planner.TransferJob(layout, [dst], copies)
        ex = engine.pool_executor([(o.offset, o.num_tokens) for o in objs])
        ex.scatter(job, 0, args.width)
        ex.close()

    for _ in range(10):
        first_slice()
        engine.synchronize()
    if args.table_steps:
        table_steps(engine, objs, layout, dst, args)
        engine.close()
        store.close()
        return 0
    if args.idle_study:
        gaps = ("back_to_back", "sleep_20ms", "spin_20ms", "spin_20ms_stream_query", "sleep_20ms_then_query")
        times: dict[str, list[tuple[float, float]]] = {gap: [] for gap in gaps}
        for _ in range(args.reps):  # the gaps interleaved, so that a drift of the machine hits them all alike
            for gap in gaps:
                idle(gap, engine.stream)
                t, c = time.perf_counter(), time.thread_time()
                first_slice()
                times[gap].append(((time.perf_counter() - t) * 1e6, (time.thread_time() - c) * 1e6))
                engine.synchronize()
        for gap in gaps:
            wall, cpu = sorted(w for w, _ in times[gap]), sorted(c for _, c in times[gap])
            print(f"idle study, {gap}: first slice (width {args.width}) wall median {wall[len(wall) // 2]:.1f} us, "
                  f"p90 {wall[len(wall) * 9 // 10]:.1f} us, thread CPU median {cpu[len(cpu) // 2]:.1f} us")
        engine.close()
        store.close()
        return 0
    times = []
    prof = cProfile.Profile()
    for i in range(args.reps):
        t = time.perf_counter()
        if i % 2:
            prof.enable()
        first_slice()
        if i % 2:
            prof.disable()
        else:
            times.append((time.perf_counter() - t) * 1e6)
        engine.synchronize()
    report(prof, times, f"first slice (width {args.width})", args.top)
    engine.close()
    store.close()
    return 0


def idle(gap: str, probe: torch.cuda.Stream) -> None:
    """Spend what a server spends between transfers, as ``gap`` names it (``back_to_back``: nothing).

    ``sleep_20ms`` sleeps; ``spin_20ms`` spins in Python; ``..._stream_query`` queries
    ``probe`` while spinning (keeps the CUDA driver's path warm, as a polling server
    can); ``..._then_query`` makes one query after sleeping (is a single touch enough?).
    """
    if gap.startswith("sleep_20ms"):
        time.sleep(0.02)
        if gap.endswith("then_query"):
            probe.query()
    elif gap.startswith("spin_20ms"):
        end = time.perf_counter() + 0.02
        query = gap.endswith("stream_query")
        while time.perf_counter() < end:
            if query:
                probe.query()
    elif gap != "back_to_back":
        raise ValueError(f"unknown idle gap {gap!r}")


def table_steps(engine: Any, objs: list[Any], layout: Any, dst: list[int], args: argparse.Namespace) -> None:
    """The token table's host steps as first written (numpy conversions, a device allocation, torch's event
    wrappers), each timed, beside the current ``CudaTransferEngine.build_table`` (one struct pack into a
    leased slot and one extension call) timed as a whole under the same conditions."""
    import numpy as np

    from kvstrata.core.transfer import planner

    copies = planner.plan_copies([o.num_tokens for o in objs], args.chunk, 0, 0)
    job = planner.TransferJob(layout, [dst], copies)
    ex = engine.pool_executor([(o.offset, o.num_tokens) for o in objs])
    ex._bind(job)
    row = engine.row_bytes
    n_tok = sum(c.num_tokens for c in copies)
    slot = torch.empty(1 << 15, dtype=torch.int64, pin_memory=True)
    done = torch.cuda.Event()
    done.record(engine.stream)

    def descriptors() -> list[tuple[int, int, int, int, int]]:
        # as CudaExecutor._table builds them for a staging buffer of one slot per copy
        return [(2 * 1 * row * ex._first[i], c.num_tokens * row, c.dst_position, c.num_tokens, ex._first[i])
                for i, c in enumerate(job.copies)]

    def steps() -> dict[str, float]:
        marks = [("start", time.perf_counter())]
        desc = descriptors()
        marks.append(("descriptors", time.perf_counter()))
        done.query()
        marks.append(("event_query", time.perf_counter()))
        n_desc, blocks = 5 * len(desc), job.block_ids[0]
        need = n_desc + len(blocks)
        host = slot.numpy()
        host[:n_desc] = np.asarray(desc, dtype=np.int64).reshape(-1)
        marks.append(("descriptors_to_pinned", time.perf_counter()))
        host[n_desc:need] = blocks
        marks.append(("blocks_to_pinned", time.perf_counter()))
        buf = torch.empty(need + 3 * n_tok, dtype=torch.int64, device=engine.device)
        marks.append(("torch_empty", time.perf_counter()))
        buf.record_stream(engine.stream)
        marks.append(("record_stream", time.perf_counter()))
        run = np.asarray([[buf.data_ptr(), slot.data_ptr(), 8 * need]], dtype=np.int64)
        engine.ext.memcpy_runs(run.ctypes.data, 1, engine.index, engine.stream.cuda_stream)
        marks.append(("memcpy", time.perf_counter()))
        done.record(engine.stream)
        marks.append(("event_record", time.perf_counter()))
        lay = engine.layout
        base = buf.data_ptr()
        engine.ext.build_table(base, len(desc), base + 8 * n_desc, row, lay.block_size, lay.block_stride,
                               lay.token_stride, n_tok, base + 8 * need, engine.index, engine.stream.cuda_stream)
        marks.append(("build_kernel", time.perf_counter()))
        return {b[0]: (b[1] - a[1]) * 1e6 for a, b in zip(marks, marks[1:])}

    def current() -> dict[str, float]:
        t = time.perf_counter()
        _, leased = engine.build_table(descriptors(), job.block_ids[0], n_tok)
        out = {"current_build_table": (time.perf_counter() - t) * 1e6}
        engine.release_table(leased)
        return out

    for gap in ("back_to_back", "spin_20ms_stream_query", "sleep_20ms"):
        rows: list[dict[str, float]] = []
        for _ in range(args.reps):
            idle(gap, engine.stream)
            rows.append(steps())
            engine.synchronize()
            idle(gap, engine.stream)
            rows[-1].update(current())
            engine.synchronize()
        med = {k: round(sorted(r[k] for r in rows)[len(rows) // 2], 1) for k in rows[0]}
        first = sum(v for k, v in med.items() if k != "current_build_table")
        print(f"table steps, {gap} (us, medians): {med}; first version's total {first:.1f}, "
              f"current {med['current_build_table']:.1f}")


def report(prof: cProfile.Profile, times: list[float], what: str, top: int) -> None:
    times.sort()
    print(f"{what} host time, unprofiled: median {times[len(times) // 2]:.1f} us, p10 {times[len(times) // 10]:.1f} us")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    print(s.getvalue())


def profile_submit(args: argparse.Namespace) -> int:
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.core.store.keys import CacheKey
    from kvstrata.server_process import ServerProcess
    from kvstrata.core.engine.server_placement import ServerPlacement
    from kvstrata.native.cuda_events import CudaEventBackend
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from kvstrata_testing.gpu_caches import GpuKVCache  # engine-format GPU caches: test support, not shipped

    nb = args.tokens // 16
    cache = GpuKVCache("vllm-LBNHC", num_layers=32, num_heads=8, head_size=128, dtype="bfloat16",
                       num_blocks=2 * nb + 2, block_size=16)
    with ServerProcess(l1_bytes=cache.layout.object_bytes(args.tokens) + (64 << 20), chunk_size=args.chunk,
                       log_level="WARNING") as srv:
        backend = CudaEventBackend("cuda:0")
        client = CacheClient(srv.address, timeout=60)
        worker = ServerPlacement(client, 0, cache.layout, event_backend=backend)
        worker.register()
        prompt = torch.randint(0, 32000, (args.tokens,)).tolist()
        client.store(CacheKey.for_tokens("s", prompt, model="m"), 0, [list(range(nb))],
                     event_handle=backend.store_event_handle())
        dst = list(range(nb, 2 * nb))
        prof = cProfile.Profile()
        times = []
        for i in range(args.reps):
            key = CacheKey.for_tokens(f"r{i}", prompt, model="m")
            client.lookup(key)
            t = time.perf_counter()
            if i % 2:
                prof.enable()
            worker.submit_retrieve(f"r{i}", key, [dst], layers_per_slice=args.width)
            if i % 2:
                prof.disable()
            else:
                times.append((time.perf_counter() - t) * 1e6)
            while f"r{i}" not in worker.get_finished():
                time.sleep(2e-5)
            worker.wait_all()
        report(prof, times, "submit_retrieve", args.top)
        worker.close()
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
