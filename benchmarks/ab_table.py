"""The per-run table of a ``benchmarks/tree_ab.sh`` run, one line per run and cell, so the base and head runs of one
call read side by side: for ``ttft.py`` each one-request arm's first-token time and release (medians) and each
concurrency cell's mean and p90 first-token time; for ``transfer.py`` the engine placement's loads per width
(complete, released, layer 0 usable on the engine's stream; medians) and its stores against the raw copies.

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
    if run.get("benchmark") == "transfer":
        yield from transfer_lines(head, run)
        return
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


def transfer_lines(head: str, run: dict[str, Any]) -> Iterator[str]:
    raw, placed = run["raw"], run["engine_placement"]
    for width, r in placed["retrieve"].items():
        yield (f"{head} width {width:>2}, ms: complete {r['complete_ms']['median']:.2f}, released "
               f"{r['release_ms']['median']:.3f}, layer 0 usable {r['gpu_first_layer_ms']['median']:.3f} "
               f"(p10 {r['gpu_first_layer_ms']['p10']:.3f}, p90 {r['gpu_first_layer_ms']['p90']:.3f})"
               + (f", its wait returned {r['first_layer_waited_ms']['median']:.3f}" if "first_layer_waited_ms" in r
                  else "")
               + (f", first layer handed over {r['first_layer_handed_ms']['median']:.3f}"
                  if "first_layer_handed_ms" in r else "")
               + (f", submit stamped {r['submit_stamped_ms']['median']:.3f} after the call"
                  if "submit_stamped_ms" in r else ""))
    h2d, d2h = raw["h2d_pinned_ms"]["median"], raw["d2h_pinned_ms"]["median"]
    chunk_major = placed["retrieve"]["0"]["complete_ms"]["median"]
    cells = [f"chunk-major / raw H2D {chunk_major / h2d:.3f}x"]
    for key, label in (("store_ms", "store at store time"), ("store_reserved_ahead_ms", "reserved ahead")):
        if key in placed:
            cells.append(f"{label} / raw D2H {placed[key]['median'] / d2h:.3f}x")
    yield f"{head} raw H2D {h2d:.2f} ms, D2H {d2h:.2f} ms; " + ", ".join(cells)


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
