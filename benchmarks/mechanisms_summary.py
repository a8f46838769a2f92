"""Summarize ``benchmarks/mechanisms_ab.sh``: first-token time with a server mechanism and without it.

    python benchmarks/mechanisms_summary.py OUT_DIR [--json OUT_DIR/summary.json]

For each arm (placement and slice width), the median first-token time at one request and the mean at four
concurrent requests, with the mechanism (the server's defaults) and without it, in each half of the runs. The
spread is what the same settings measured twice differ by (the two runs with the defaults). A mechanism pays only
if removing it is slower by more than the spread in both halves.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FORMAT = "vllm-LBNHC"
ARMS_OF = {"server": ("server/chunk", "server/w1"), "engine": ("engine/chunk", "engine/w1")}


def figures(result: dict[str, Any], arm: str) -> tuple[float, float]:
    """(median TTFT at one request, mean TTFT at four requests) of ``arm``, in ms."""
    fres = result["formats"][FORMAT]
    one = next(iter(fres["concurrency_1"].values()))[arm]["ttft_ms"]["median"]
    four = fres["concurrency"]["4"][arm]["ttft_ms"]["mean"]
    return one, four


def load(out: Path) -> dict[str, dict[str, Any]]:
    runs = {}
    for path in sorted(out.glob("*.json")):
        if path.name == "summary.json":
            continue
        data = json.loads(path.read_text())
        if FORMAT in data.get("formats", {}):
            runs[path.stem] = data
        else:
            print(f"{path.name}: no {FORMAT} result ({data.get('errors')})", file=sys.stderr)
    return runs


def compare(rows: list[dict[str, Any]], mechanism: str, order: str, with_run: dict, with_arm: str,
            without_run: dict, without_arm: str) -> None:
    w1, w4 = figures(with_run, with_arm)
    o1, o4 = figures(without_run, without_arm)
    rows.append({"mechanism": mechanism, "order": order, "arm": with_arm,
                 "with_ms": [w1, w4], "without_ms": [o1, o4],
                 "without_vs_with": [round(o1 / w1 - 1, 4), round(o4 / w4 - 1, 4)]})


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    flag_runs = {name: run for name, run in runs.items() if name.startswith("flags-")}
    defaults = [run for name, run in sorted(flag_runs.items()) if name.endswith("-defaults")]
    for name, run in sorted(flag_runs.items()):
        if name.endswith("-defaults"):
            continue
        flag = name.split("-", 2)[2]
        position = int(name.split("-")[1])
        half = position < len(flag_runs) // 2
        base = defaults[0] if half or len(defaults) < 2 else defaults[1]
        for arm in ARMS_OF["server"] + ARMS_OF["engine"]:
            compare(rows, f"{flag} (with = the default)", "first half" if half else "second half",
                    base, arm, run, arm)
    spread = []
    if len(defaults) == 2:
        for arm in ARMS_OF["server"] + ARMS_OF["engine"]:
            a, b = figures(defaults[0], arm), figures(defaults[1], arm)
            spread.append({"arm": arm, "same_settings_ms": [a, b],
                           "difference": [round(abs(b[i] / a[i] - 1), 4) for i in range(2)]})
    return {"rows": rows, "spread": spread,
            "note": "figures are [median TTFT at 1 request, mean TTFT at 4 requests] in ms; without_vs_with > 0 "
                    "means the arm without the mechanism was slower"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    summary = summarize(load(args.out))
    for r in summary["rows"]:
        print(f"{r['mechanism']:<52} {r['order']:<12} {r['arm']:<18} with {r['with_ms']} without {r['without_ms']} "
              f"-> {[f'{x:+.1%}' for x in r['without_vs_with']]}")
    for s in summary["spread"]:
        print(f"spread {s['arm']:<34} {s['same_settings_ms']} -> {[f'{x:.1%}' for x in s['difference']]}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
