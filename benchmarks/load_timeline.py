"""Where an engine-placement load's time to layer 0 goes, on the GPU's own clock: a CUPTI timeline.

Runs ``transfer.py``'s engine-placement loads (1 GiB at Llama-3.1-8B shapes by default, or ``--shape``; chunk-major
and width 1, or ``--widths``)
under ``torch.profiler`` with CPU and CUDA activities, so every driver call of the process (the engine's thread,
the copier's native issuing thread) and every copy and kernel on the GPU land on one timeline. The load's planning
steps are annotated (``kv::submit``, ``kv::first_layer_ahead``, ``kv::locate``, ``kv::enqueue_programs``,
``kv::scatter``, ``kv::hand_over``, ``kv::issuer_submit``, ``kv::table``, ``kv::mark_slice``, ``kv::scatter_slices``, and the benchmark's
``kv::wait_release`` and ``kv::wait_layer``). Writes, for the last width-1 loads, every annotation, driver call,
copy and kernel from submit until layer 0's wait returned, in milliseconds after submit, with the thread (or
stream) it ran on:

    python benchmarks/load_timeline.py --out benchmarks/results/NAME/timeline.txt [--reps 6] [--trace FILE.json.gz]
        [--shape llama-3.1-70b-tp8 --tokens 4096 --widths 0,4]

The profiler adds microseconds to every annotated step and driver call: read the order and the gaps, not the
absolute times (``transfer.py`` times the same loads unprofiled).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shapes import KV_SHAPES, SHAPES  # noqa: E402  (a sibling module)

WINDOW_US = 5000
"""How far after a submit the timeline looks for its layer-0 wait (a width-1 load of 1 GiB lands layer 0 in ~1 ms; the
profiler stretches that)."""


def annotate() -> None:
    """Wrap the load's planning steps and the benchmark's waits in profiler ranges."""
    import transfer
    from torch.profiler import record_function

    from kvstrata.core.engine import engine_placement, placement, transfer_queue
    from kvstrata.native import cuda_executor, load_issuer

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        setattr(owner, name, wrapped)

    for owner, name, label in [
            (engine_placement.EnginePlacement, "submit_retrieve", "kv::submit"),
            (cuda_executor.CudaLocalCopier, "stage_first_layer", "kv::first_layer_ahead"),
            (placement.Placement, "wait_for_layer", "kv::wait_layer"),
            (transfer, "_spin_until_released", "kv::wait_release"),
            (transfer_queue.TransferQueue, "_locate", "kv::locate"),
            (transfer_queue.TransferQueue, "_enqueue_in_programs", "kv::enqueue_programs"),
            (cuda_executor.CudaExecutor, "_table", "kv::table"),
            (cuda_executor.CudaExecutor, "scatter", "kv::scatter"),
            (cuda_executor.CudaExecutor, "scatter_slices", "kv::scatter_slices"),
            (load_issuer.LoadIssuer, "hand_over", "kv::hand_over"),
            (load_issuer.LoadIssuer, "_submit", "kv::issuer_submit"),
            (cuda_executor.CudaLocalCopier, "mark_slice", "kv::mark_slice")]:
        wrap(owner, name, label)


def timelines(events: list[dict[str, Any]], loads: int) -> list[str]:
    """The last ``loads`` submits' events up to their first layer wait, one line each."""
    spans = [e for e in events if e.get("ph") == "X"]
    submits = sorted((e for e in spans if e["name"] == "kv::submit"), key=lambda e: e["ts"])
    lines: list[str] = []
    for submit in submits[-loads:]:
        t0 = submit["ts"]
        near = sorted((e for e in spans if t0 - 50 <= e["ts"] <= t0 + WINDOW_US), key=lambda e: e["ts"])
        waits = [e for e in near if e["name"] == "kv::wait_layer"]
        if not waits:  # a chunk-major load: layer 0 comes with the whole load
            continue
        end = waits[0]["ts"] + waits[0]["dur"]
        lines.append(f"--- load submitted at {t0:.0f} us")
        for e in near:
            if e["ts"] > end:
                break
            category = e.get("cat", "")
            if category in ("cpu_op", "python_function") and not e["name"].startswith("kv::"):
                continue
            stream = e.get("args", {}).get("stream", "")
            lines.append(f"{(e['ts'] - t0) / 1e3:8.3f} +{e['dur'] / 1e3:7.3f} ms  thread {str(e.get('tid'))[-6:]:>6} "
                         f"{category[:12]:12} {e['name'][:70]}{f'  stream {stream}' if stream != '' else ''}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--shape", default="llama-3.1-8b", choices=KV_SHAPES,
                   help="the model shape whose KV is moved (shapes.py)")
    p.add_argument("--widths", default="0,1", help="the widths loaded, 0 = chunk-major (timelines: the others)")
    p.add_argument("--reps", type=int, default=6, help="loads per width (after one unmeasured round)")
    p.add_argument("--out", required=True, help="the timeline (text)")
    p.add_argument("--trace", default="", help="also keep the whole chrome trace here (gzipped)")
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import transfer

    transfer.SHAPE = SHAPES[args.shape]
    widths = [int(w) for w in args.widths.split(",") if w]
    if not torch.cuda.is_available():
        print("benchmarks/load_timeline.py needs a CUDA device", file=sys.stderr)
        return 2
    annotate()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = transfer.measure_server("staged", args.tokens, 256, 16, args.reps, widths, placement="engine",
                                         locate="lookup")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            raw = f.read()
    if args.trace:
        with gzip.open(args.trace, "wb") as g:
            g.write(raw)
    summary = {width: {k: round(v["median"], 3) for k, v in r.items() if isinstance(v, dict)}
               for width, r in result["retrieve"].items()}
    lines = [f"profiled medians (ms after submit): {json.dumps(summary)}"]
    lines += timelines(json.loads(raw)["traceEvents"], len(widths) * args.reps)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:80]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
