#!/usr/bin/env python3
"""Per run of a base/head A/B of ttft.py (tree_ab.sh): each one-request arm's TTFT and release medians, and each concurrency
cell's mean and p90 TTFT.
  python benchmarks/ab_table.py DIR   (DIR holds NAME-{0-base,1-head,2-head,3-base}.json)"""
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*-[0-3]-*.json")):
    d = json.load(open(f))
    name = os.path.basename(f)[:-5]
    for fmt, fd in d["formats"].items():
        for new, arms in fd.get("concurrency_1", {}).items():
            cells = []
            for arm, a in arms.items():
                cell = f"{arm.split('/')[-1]} {a['ttft_ms']['median']:.1f}"
                if "release_ms" in a:
                    cell += f" (rel {a['release_ms']['median']:.2f})"
                cells.append(cell)
            print(f"{name:28s} {d['commit']} 1 req, TTFT ms: " + ", ".join(cells))
        for c, cd in fd.get("concurrency", {}).items():
            cells = [f"{arm.split('/')[-1]} {a['ttft_ms']['mean']:.1f}/{a['ttft_ms']['p90']:.1f}"
                     for arm, a in cd.items() if isinstance(a, dict) and "ttft_ms" in a]
            print(f"{name:28s} {d['commit']} {c} req, mean/p90 TTFT ms: " + ", ".join(cells))
