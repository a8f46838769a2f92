"""The tables of a ``benchmarks/ttft_sweep.sh`` run: the issue's targets counted over its cells, every cell's share
of the overlap ceiling, how far its best width is from perfect overlap, concurrency against chunk-major, what a
spinning engine thread does to a load's completion, and where a load's time goes.

    python benchmarks/ttft_sweep_table.py DIR [--out DIR/table.md]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Any, Iterator


def load(directory: str) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(glob.glob(os.path.join(directory, "ttft-*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def cells(runs: list[dict[str, Any]], section: str) -> Iterator[tuple[dict[str, Any], str, str, dict[str, Any],
                                                                      dict[str, Any]]]:
    """(run config, format, row key, row, arms) of every format's ``section`` of the targets (``concurrency_1``: rows
    by new tokens; ``concurrency``: by requests), in order. A placement other than ``engine`` is named with the
    format (``vllm-LBNHC/engine-priohigh``). ``arms``: that placement's measured arms of the row, by width
    (``w4``, ``chunk``)."""
    for r in runs:
        for cell, t in sorted(r.get("targets", {}).items()):
            fmt, _, placement = cell.partition("/")
            name = fmt if placement == "engine" else cell
            measured = r["formats"].get(fmt, {}).get(section, {})
            for key, row in sorted(t[section].items(), key=lambda kv: int(kv[0])):
                arms = {arm.partition("/")[2]: stats for arm, stats in measured.get(key, {}).items()
                        if arm.partition("/")[0] == placement}
                yield r["config"], name, key, row, arms


def ceiling_rows(runs: list[dict[str, Any]]) -> list[str]:
    out = ["| shape | prefix | loop | format | new | chunk-major ms | best fixed | ms | % of ceiling | auto (widths) ms "
           "| auto % of ceiling | auto vs best |", "|" + " --- |" * 12]
    for c, fmt, new, row, _ in cells(runs, "concurrency_1"):
        auto = "" if "auto_ttft_ms" not in row else f"{row['auto_ttft_ms']:.1f} ({row.get('auto_widths')})"
        auto_share = row.get("auto_fraction_of_ceiling")
        auto_share_text = "" if auto_share is None else f"{100 * auto_share:.0f}%"
        out.append(f"| {c['shape']} | {c['prefix_tokens']} | {c['engine_loop']} | {fmt} | {new} | "
                   f"{row['chunk_major_ttft_ms']:.1f} | w{row['best_width']} | {row['best_ttft_ms']:.1f} | "
                   f"{100 * row['fraction_of_ceiling']:.0f}% | {auto} | {auto_share_text} | "
                   f"{pct(row.get('auto_vs_best_fixed'))} |")
    return out


def overlap_rows(runs: list[dict[str, Any]]) -> list[str]:
    """Each one-request cell's best fixed width against perfect overlap: its first-token time beyond the longer of
    compute alone and chunk-major's transfer (what no width can beat), next to when its request was released
    after submit and when its own transfer completed (medians). A cell short of the ceiling is short by its
    "beyond overlap" column; the release says how much of that passed before the engine could start."""
    out = ["| shape | prefix | loop | format | new | compute alone ms | chunk-major transfer ms | best fixed | ms "
           "| beyond overlap ms | released after submit ms | its transfer ms |", "|" + " --- |" * 12]
    for c, fmt, new, row, arms in cells(runs, "concurrency_1"):
        arm = arms.get(f"w{row['best_width']}", {})
        if "release_ms" not in arm:
            continue
        limit = max(row["compute_ms"], row["transfer_ms"])
        out.append(f"| {c['shape']} | {c['prefix_tokens']} | {c['engine_loop']} | {fmt} | {new} | "
                   f"{row['compute_ms']:.1f} | {row['transfer_ms']:.1f} | w{row['best_width']} | "
                   f"{row['best_ttft_ms']:.1f} | {row['best_ttft_ms'] - limit:+.2f} | "
                   f"{arm['release_ms']['median']:.2f} | {arm['transfer_ms']['median']:.1f} |")
    return out


def concurrency_rows(runs: list[dict[str, Any]]) -> list[str]:
    out = ["| shape | prefix | loop | format | requests | chunk-major mean / p90 ms | best fixed: mean change "
           "| never worse | auto: mean change | auto never worse | no transfer at all: mean change "
           "| layer-major served one after another: mean change "
           "| chunk-major submitted together: mean change | best fixed against it | never worse than it |",
           "|" + " --- |" * 15]
    for c, fmt, conc, row, _ in cells(runs, "concurrency"):
        out.append(f"| {c['shape']} | {c['prefix_tokens']} | {c['engine_loop']} | {fmt} | {conc} | "
                   f"{row['chunk_major_mean_ms']:.1f} / {row['chunk_major_p90_ms']:.1f} | "
                   f"{pct(row['mean_change'])} (w{row['best_width']}) | {row['never_worse']} | "
                   f"{pct(row.get('auto_mean_change'))} | {row.get('auto_never_worse', '')} | "
                   f"{pct(row.get('resident_mean_change'))} | "
                   + (f"{pct(row['serial_mean_change'])} ({row['serial_best']}) |" if "serial_mean_change" in row
                      else " |")
                   + (f" {pct(row['together_mean_change'])} | {pct(row['best_vs_together_mean_change'])} | "
                      f"{row['never_worse_than_together']} |" if "together_mean_change" in row else " | | |"))
    return out


def one_request_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of one request only: a concurrency run's own one-request cell has fewer widths and repetitions."""
    return [r for r in runs if not r["config"].get("concurrency")]


def spin_changes(runs: list[dict[str, Any]]) -> Iterator[tuple[str, int, str, str, str, float, float]]:
    """(shape, prefix, format, new tokens, arm, median transfer ms sleeping, spinning) of every engine arm measured
    with both engine loops in one-request runs of one commit."""
    by_cell: dict[tuple, dict[str, tuple[str | None, dict[str, Any]]]] = {}
    for r in one_request_runs(runs):  # by format: one cell's formats may come from several runs
        c = r["config"]
        for fmt, fres in r["formats"].items():
            by_cell.setdefault((c["shape"], c["prefix_tokens"], fmt), {})[c["engine_loop"]] = (r.get("commit"), fres)
    for (shape, prefix, fmt), loops in sorted(by_cell.items()):
        if not {"sleep", "spin"} <= set(loops) or loops["sleep"][0] != loops["spin"][0]:
            continue  # a comparison within one commit's code only
        fres, spun = loops["sleep"][1], loops["spin"][1]
        for new, arms in sorted(fres.get("concurrency_1", {}).items(), key=lambda kv: int(kv[0])):
            for arm, stats in sorted(arms.items()):
                other = spun.get("concurrency_1", {}).get(new, {}).get(arm)
                if "transfer_ms" not in stats or not other:
                    continue
                yield shape, prefix, fmt, new, arm, stats["transfer_ms"]["median"], other["transfer_ms"]["median"]


def spin_rows(runs: list[dict[str, Any]]) -> list[str]:
    """Median transfer time of each engine arm with the engine's thread spinning against sleeping."""
    out = ["| shape | prefix | format | new | arm | transfer ms, sleep | spin | change |", "|" + " --- |" * 8]
    for shape, prefix, fmt, new, arm, a, b in spin_changes(runs):
        out.append(f"| {shape} | {prefix} | {fmt} | {new} | {arm} | {a:.2f} | {b:.2f} | {pct(b / a - 1)} |")
    return out


LONG_PREFIX = 16384
"""The issue's "16k tokens or more"."""


def target_row(target: str, values: list[float], met: list[bool], fmt: str) -> str:
    """One row of :func:`target_rows`: the target, how many cells, how many met it, the range of the figure."""
    if not values:
        return f"| {target} | 0 | | |"
    return f"| {target} | {len(values)} | {sum(met)} | {fmt.format(min(values))} to {fmt.format(max(values))} |"


def concurrency_cells(runs: list[dict[str, Any]], placement: str = "") -> list[tuple[int, str, dict[str, Any]]]:
    """(prefix, requests, target row) of every concurrency cell of the engine placement named ``placement``
    ("": the engine placement as it is by default)."""
    return [(c["prefix_tokens"], requests, r) for c, name, requests, r, _ in cells(runs, "concurrency")
            if name.partition("/")[2] == placement]


def concurrency_target_rows(conc: list[tuple[int, str, dict[str, Any]]], label: str = "") -> tuple[str, str]:
    """The rows of :func:`target_rows` that every placement's concurrency cells ``conc`` get: never worse than
    chunk-major served one after another, and 20% lower at 4 requests of 16k tokens or more."""
    every = [r for _, _, r in conc]
    four_long = [r for prefix, requests, r in conc if prefix >= LONG_PREFIX and requests == "4"]
    return (target_row(f"{label}2-16 requests: best fixed width never worse than chunk-major served one after "
                       "another (mean change)", [r["mean_change"] for r in every], [r["never_worse"] for r in every],
                       "{:+.1%}"),
            target_row(f"{label}4 requests, 16k tokens or more: 20% lower mean", [r["mean_change"] for r in four_long],
                       [r["mean_change"] <= -0.20 for r in four_long], "{:+.1%}"))


def target_rows(runs: list[dict[str, Any]]) -> list[str]:
    """The issue's targets counted over this sweep's cells: how many cells meet each, and the range of the figure.
    One-request targets count the one-request runs only; every target counts the engine placement as it is by
    default, and the concurrency targets are counted again for each other placement a run measured
    (``engine-paced``)."""
    one = [(c["prefix_tokens"], r) for c, name, _, r, _ in cells(one_request_runs(runs), "concurrency_1")
           if "/" not in name]
    conc = concurrency_cells(runs)
    others = sorted({name.partition("/")[2] for _, name, *_ in cells(runs, "concurrency") if "/" in name})
    spins = [b / a - 1 for *_, a, b in spin_changes(runs)]
    long_one = [r for prefix, r in one if prefix >= LONG_PREFIX]
    short_one = [r for prefix, r in one if prefix < LONG_PREFIX]
    autos = [r for _, r in one if "auto_vs_best_fixed" in r]
    together = [r for _, _, r in conc if "never_worse_than_together" in r]
    never_worse, four_lower = concurrency_target_rows(conc)
    return ["| target | cells | met | figure, lowest to highest |", "|" + " --- |" * 4,
            target_row("one request, 16k tokens or more: 85% of the ceiling",
                       [r["fraction_of_ceiling"] for r in long_one], [r["met_85pct"] for r in long_one], "{:.0%}"),
            target_row("one request, shorter: 70% of the ceiling", [r["fraction_of_ceiling"] for r in short_one],
                       [r["fraction_of_ceiling"] >= 0.70 for r in short_one], "{:.0%}"),
            target_row("auto within 3% of the best fixed width", [r["auto_vs_best_fixed"] for r in autos],
                       [r["auto_vs_best_fixed"] <= 0.03 for r in autos], "{:+.1%}"),
            never_worse,
            target_row("the same, against chunk-major submitted together (where measured)",
                       [r["best_vs_together_mean_change"] for r in together],
                       [r["never_worse_than_together"] for r in together], "{:+.1%}"),
            four_lower,
            target_row("a spinning engine thread moves a load's completion by at most 10%", spins,
                       [abs(x) <= 0.10 for x in spins], "{:+.1%}")] + [
            line for placement in others
            for line in concurrency_target_rows(concurrency_cells(runs, placement), f"{placement}: ")]


def timeline_cells(runs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Each run's and format's width-1 timeline: (its row's first cells: shape, prefix, loop, format, new tokens;
    the engine placement's timeline run; the resident one), where the run recorded both."""
    for r in runs:
        c = r["config"]
        for fmt, fres in sorted(r["formats"].items()):
            lines = fres.get("timeline", {})
            if "engine" in lines and "resident" in lines:
                yield (f"| {c['shape']} | {c['prefix_tokens']} | {c['engine_loop']} | {fmt} | "
                       f"{c.get('timeline_new_tokens', 1024)} |"), lines["engine"], lines["resident"]


def time_rows(runs: list[dict[str, Any]]) -> list[str]:
    """Where a width-1 load's first-token time goes beyond compute alone, from each run's timeline (one request,
    the GPU's per-layer marks of the engine's stream, engine placement against resident, same run): until layer 0
    may be read, the layers' compute running longer while the copies run, the stream waiting between layers."""
    out = ["| shape | prefix | loop | format | new | resident ms | width 1 ms | to layer 0 | layers computed slower "
           "| waits between layers | rest |", "|" + " --- |" * 11]
    for cells, eng, res in timeline_cells(runs):
        parts = [timeline_parts(x["timeline"]) for x in (eng, res)]
        total = eng["ttft_ms"][0] - res["ttft_ms"][0]
        first, slower, waits = (a - b for a, b in zip(*parts))
        out.append(f"{cells} {res['ttft_ms'][0]:.2f} | {eng['ttft_ms'][0]:.2f} | {first:+.2f} | {slower:+.2f} | "
                   f"{waits:+.2f} | {total - first - slower - waits:+.2f} |")
    return out


def engine_thread_rows(runs: list[dict[str, Any]]) -> list[str]:
    """The same timeline from the engine's thread (its own clock before and after each layer wait, where the run
    recorded it): time to its first layer, in its layer waits, and launching the layers. Where the engine is
    launch-bound (its thread, not the GPU, paces the layers), this is where its first-token time goes."""
    out = ["| shape | prefix | loop | format | new | to layer 0 | in layer waits | launching layers |",
           "|" + " --- |" * 8]
    for cells, eng, res in timeline_cells(runs):
        if "cpu_usable" not in eng["timeline"]:
            continue
        first, waits, launches = (a - b for a, b in zip(engine_thread_parts(eng["timeline"]),
                                                        engine_thread_parts(res["timeline"])))
        out.append(f"{cells} {first:+.2f} | {waits:+.2f} | {launches:+.2f} |")
    return out


def engine_thread_parts(marks: dict[str, list[float]]) -> tuple[float, float, float]:
    """(the engine's thread reaching layer 0, its layer waits summed, its time from one layer's wait to the next
    one's: the layer's launches) in ms, from a timeline's ``cpu_wait_from`` and ``cpu_usable`` marks."""
    wait_from, usable = marks["cpu_wait_from"], marks["cpu_usable"]
    waits = sum(u - w for w, u in zip(wait_from, usable))
    launches = sum(w - u for u, w in zip(usable, wait_from[1:]))
    return usable[0], waits, launches


def timeline_parts(marks: dict[str, list[float]]) -> tuple[float, float, float]:
    """(layer 0 usable, the layers' compute summed, the gaps between one layer's end and the next one's start) in ms,
    from a timeline's ``usable`` and ``computed`` marks."""
    usable, computed = marks["usable"], marks["computed"]
    compute = sum(c - u for u, c in zip(usable, computed))
    gaps = sum(u - c for u, c in zip(usable[1:], computed))
    return usable[0], compute, gaps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("directory")
    p.add_argument("--out")
    args = p.parse_args()
    runs = load(args.directory)
    commits = sorted({f"{r['config']['shape']} {r['config']['prefix_tokens']} {r['config']['engine_loop']}: "
                      f"{r.get('commit')} on {r.get('device', {}).get('gpu', '?')}" for r in runs})
    text = "\n".join(["Each cell's run (shape, prefix, engine loop: commit on GPU):", "",
                      *(f"- {c}" for c in commits), "",
                      "## The targets, counted over these cells", "", *target_rows(runs), "",
                      "## One request: % of the overlap ceiling", "", *ceiling_rows(runs), "",
                      "## One request, best fixed width: first-token time beyond perfect overlap (medians)", "",
                      *overlap_rows(runs), "",
                      "## Requests arriving together (256 new tokens each): mean first-token time against chunk-major",
                      "", *concurrency_rows(runs), "",
                      "## A spinning engine thread: load completion (engine placement, one request)", "",
                      *spin_rows(runs), "",
                      "## One request, width 1: where the time beyond compute alone goes (ms, the timeline run)", "",
                      *time_rows(runs), "",
                      "## The same from the engine's thread, against resident (ms, where the run recorded it)", "",
                      *engine_thread_rows(runs), ""])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
