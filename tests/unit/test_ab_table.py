"""``benchmarks/ab_table.py`` on a ``transfer.py`` run: the engine placement's loads per width and the raw-copy ratios,
read from a run kept in ``benchmarks/results``."""

from __future__ import annotations

import json
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, BENCHMARKS)

import ab_table  # noqa: E402  (the benchmark script, imported for its table lines)

RUN = os.path.join(BENCHMARKS, "results", "issue-now-ab-h100", "second-call", "transfer-0-base.json")


def test_a_transfer_run_gives_a_line_per_width_and_one_of_its_ratios_to_the_raw_copies() -> None:
    with open(RUN) as f:
        run = json.load(f)
    lines = list(ab_table.lines("transfer-0-base", run))
    retrieve = run["engine_placement"]["retrieve"]
    assert len(lines) == len(retrieve) + 1
    width_1 = next(line for line in lines if "width  1," in line)
    assert f"layer 0 usable {retrieve['1']['gpu_first_layer_ms']['median']:.3f}" in width_1
    assert f"released {retrieve['1']['release_ms']['median']:.3f}" in width_1
    ratio = retrieve["0"]["complete_ms"]["median"] / run["raw"]["h2d_pinned_ms"]["median"]
    assert f"chunk-major / raw H2D {ratio:.3f}x" in lines[-1] and "reserved ahead / raw D2H" in lines[-1]
    assert all(line.startswith(f"transfer-0-base{' ' * 13} {run['commit']}") for line in lines)
