"""What recording interprocess events costs the stream that records them (server side of a retrieve).

The server records each slice's per-layer events, opened from the engine's CUDA
IPC handles, on its copy stream right after the slice, then waits for the
stream at the end of the transfer. This measures, in a child process that opened
the parent's handles (as the server does), the host time from enqueuing a 64 MiB
host-to-GPU copy to ``synchronize()`` returning, minus the copy's GPU time, with:

* ``none``: no events;
* ``plain32``: 32 ordinary events recorded after the copy;
* ``ipc1`` / ``ipc32``: 1 or 32 of the engine's interprocess events after the copy;
* ``ipc32_side``: the 32 interprocess events recorded on a second stream that
  waits for the copy stream, while the host waits only for the copy stream;
* ``ipc1_engine_waits`` / ``ipc32_engine_waits``: as ``ipc1`` / ``ipc32``, and the
  parent (the engine) makes its own stream wait for those events while the copy
  runs, as an engine released early does;
* ``ipc32_engine_waits_query``: as ``ipc32_engine_waits``, the host polling an
  ordinary event recorded last (``query()``) instead of synchronizing the stream.

    python benchmarks/event_record_cost.py --out benchmarks/results/event-record-cost-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp


def child(handles: list[bytes], reps: int, queue: Any, conn: Any) -> None:
    dev = torch.device("cuda", 0)
    ipc = [torch.cuda.Event.from_ipc_handle(0, h) for h in handles]
    plain = [torch.cuda.Event() for _ in range(32)]
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    stream, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    mark = torch.cuda.Event()

    def record(variant: str) -> torch.cuda.Stream | None:
        if variant == "plain32":
            for e in plain:
                e.record(stream)
        elif variant == "ipc1":
            ipc[0].record(stream)
        elif variant in ("ipc32", "ipc32_engine_waits", "ipc32_engine_waits_query"):
            for e in ipc:
                e.record(stream)
        elif variant == "ipc1_engine_waits":
            ipc[0].record(stream)
        if variant.endswith("_engine_waits"):
            conn.send(32 if variant.startswith("ipc32") else 1)
        elif variant == "ipc32_side":
            mark.record(stream)
            side.wait_event(mark)
            for e in ipc:
                e.record(side)
        return None

    out: dict[str, Any] = {}
    variants = ["none", "plain32", "ipc1", "ipc32", "ipc32_side", "ipc1_engine_waits", "ipc32_engine_waits",
                "ipc32_engine_waits_query"]
    rows: dict[str, list[float]] = {v: [] for v in variants}
    gpu: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(reps + 2):
        for v in variants:
            torch.cuda.synchronize()
            time.sleep(0.005)  # let the host idle as between transfers
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record(stream)
            with torch.cuda.stream(stream):
                buf.copy_(host, non_blocking=True)
            end.record(stream)
            record(v)
            if v.endswith("_query"):
                last = torch.cuda.Event()
                last.record(stream)
                while not last.query():
                    pass
            else:
                stream.synchronize()
            t1 = time.perf_counter()
            side.synchronize()
            if rep >= 2:
                g = start.elapsed_time(end)
                gpu[v].append(g)
                rows[v].append((t1 - t0) * 1e3 - g)
    for v in variants:
        out[v] = {"host_minus_gpu_ms": round(statistics.median(rows[v]), 4),
                  "gpu_copy_ms": round(statistics.median(gpu[v]), 4)}
    conn.send(None)
    queue.put(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    events = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True) for _ in range(32)]
    handles = [bytes(e.ipc_handle()) for e in events]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=child, args=(handles, args.reps, q, there))
    proc.start()
    stream = torch.cuda.Stream()
    while True:  # the engine: wait on the GPU for the events the child just recorded, as wait_for_layer does
        n = here.recv()
        if n is None:
            break
        for e in events[:n]:
            stream.wait_event(e)
    result = {"benchmark": "event_record_cost", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "reps": args.reps, "variants": q.get(timeout=300)}
    proc.join(60)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
