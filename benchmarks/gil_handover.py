"""Does handing Python work to another thread of the engine's process let an engine that polls release sooner?

A load's first slice lands a few tens of microseconds after it is handed over; planning the load's other slices
is Python work (``--work-us``, 0.9 ms for a 70B shard's 79 slices on the H200). This times, in one process and with
no GPU, when a poller that sleeps ``--sleep-us`` between looks first sees a "landed" time ``--land-us`` after a
submit, when the submitting thread did that work itself before polling (``inline``) and when it handed it to a
second thread (``handed``). Pure Python holds the GIL: the poller, awake again, waits for it until the other
thread lets go. Not a test; a question answered on the machine it runs on (JSON with that machine).

    python benchmarks/gil_handover.py --out benchmarks/results/gil-handover-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time


def hold_gil_for(us: float) -> None:
    """Run pure Python (never letting go of the GIL) for ``us`` microseconds."""
    end = time.perf_counter() + us * 1e-6
    n = 0
    while time.perf_counter() < end:
        n += 1


def release_ms(handed: bool, work_us: float, land_us: float, sleep_us: float) -> float:
    """One submit: ms until the poller sees the landed time."""
    start_work = threading.Event()
    worker = threading.Thread(target=lambda: (start_work.wait(), hold_gil_for(work_us)))
    worker.start()
    time.sleep(0.002)  # the worker is parked on the event, not starting
    t0 = time.perf_counter()
    landed_at = t0 + land_us * 1e-6
    if handed:
        start_work.set()
    else:
        hold_gil_for(work_us)
    while True:
        now = time.perf_counter()
        if now >= landed_at:
            break
        time.sleep(sleep_us * 1e-6)
    start_work.set()
    worker.join()
    return (now - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-us", type=float, default=900.0)
    p.add_argument("--land-us", type=float, default=50.0)
    p.add_argument("--sleep-us", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", default="benchmarks/results/gil-handover-cpu.json")
    args = p.parse_args(argv)
    from provenance import measured_commit

    result: dict = {"benchmark": "gil_handover", "commit": measured_commit(), "config": vars(args).copy(),
                    "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                "platform": platform.platform(), "switch_interval_s": sys.getswitchinterval()}}
    for name, handed in (("inline", False), ("handed", True)):
        times = sorted(release_ms(handed, args.work_us, args.land_us, args.sleep_us) for _ in range(args.reps))
        result[name] = {"median_ms": round(statistics.median(times), 3),
                        "p90_ms": round(times[int(0.9 * len(times))], 3), "n": len(times)}
        print(f"{name:7s} released after {result[name]['median_ms']:.3f} ms (median), p90 {result[name]['p90_ms']:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
