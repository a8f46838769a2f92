"""The per-run table of a ``benchmarks/tree_ab.sh`` run of ``ttft.py``: each one-request arm's first-token time and
release (medians), and each concurrency cell's mean and p90 first-token time, one line per run and cell, so the base
and head runs of one call read side by side.

    python benchmarks/ab_table.py DIR     (DIR holds NAME-{0-base,1-head,2-head,3-base}.json)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Any, Iterator


def arm_label(arm: str) -> str:
    return arm.split("/")[-1]  # "engine/w4" -> "w4"


def lines(name: str, run: dict[str, Any]) -> Iterator[str]:
    head = f"{name:28s} {run['commit']}"
    for fmt in run["formats"].values():
        for arms in fmt.get("concurrency_1", {}).values():
            cells = []
            for arm, a in arms.items():
                cell = f"{arm_label(arm)} {a['ttft_ms']['median']:.1f}"
                if "release_ms" in a:
                    cell += f" (rel {a['release_ms']['median']:.2f})"
                cells.append(cell)
            yield f"{head} 1 req, TTFT ms: " + ", ".join(cells)
        for requests, arms in fmt.get("concurrency", {}).items():
            cells = [f"{arm_label(arm)} {a['ttft_ms']['mean']:.1f}/{a['ttft_ms']['p90']:.1f}"
                     for arm, a in arms.items() if isinstance(a, dict) and "ttft_ms" in a]
            yield f"{head} {requests} req, mean/p90 TTFT ms: " + ", ".join(cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    args = p.parse_args(argv)
    for path in sorted(glob.glob(os.path.join(args.directory, "*-[0-3]-*.json"))):
        with open(path) as f:
            run = json.load(f)
        for line in lines(os.path.basename(path)[:-5], run):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
