"""Print ``copy_streams_ab.sh``'s results: per format, size and first-use order, each arm's chunk-major transfer
(nothing computing), and at width 1 its load under compute and first-token time, each the mean of its reps (ms).

    python benchmarks/copy_streams_summary.py DIR/ab-*.json
"""

from __future__ import annotations

import json
import sys


def mean(arm: dict, key: str) -> float | None:
    return arm.get(key, {}).get("mean")


def main(paths: list[str]) -> None:
    for path in paths:
        r = json.load(open(path))
        order = r["config"].get("first_use", "placements")
        for fmt, fr in r["formats"].items():
            for new, arms in fr.get("concurrency_1", {}).items():
                print(f"{fmt} new={new} first-use={order}: resident {mean(arms['resident'], 'ttft_ms')}")
                for name in r["config"]["placements"]:
                    chunk, w1 = arms.get(f"{name}/chunk", {}), arms.get(f"{name}/w1", {})
                    print(f"  {name:34s} chunk transfer {mean(chunk, 'transfer_ms')}  w1 load under compute "
                          f"{mean(w1, 'transfer_ms')}  w1 first token {mean(w1, 'ttft_ms')}")
        if r.get("errors"):
            print("  errors:", r["errors"])


if __name__ == "__main__":
    main(sys.argv[1:])
