"""``benchmarks/ttft.py``'s arm names: each parses into the settings it names, and a misspelt one is refused
(it would otherwise run the default settings under a name that says otherwise)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))

import ttft  # noqa: E402  (the benchmark script, imported for its arm parser)


@pytest.mark.parametrize("name,expected", [
    ("server", ttft.ArmSettings("server")),
    ("engine", ttft.ArmSettings("engine")),
    ("engine-bufs4", ttft.ArmSettings("engine", buffers=4)),
    ("engine-ctas33", ttft.ArmSettings("engine", ctas=33)),
    ("engine-priohigh", ttft.ArmSettings("engine", priority=-1)),
    ("engine-prio0", ttft.ArmSettings("engine", priority=0)),
    ("engine-bufs3-ctas66-priohigh-retrieve", ttft.ArmSettings("engine", -1, 66, 3)),
    ("engine-paced", ttft.ArmSettings("engine", paced=True)),
    ("engine-paced-bufs4-retrieve", ttft.ArmSettings("engine", buffers=4, paced=True)),
])
def test_an_arm_name_parses_into_the_settings_it_names(name: str, expected: ttft.ArmSettings) -> None:
    assert ttft.arm_settings(name) == expected
    assert ttft.locates_by_lookup(name) == (name != "server" and not name.startswith("server-")
                                            and not name.endswith("-retrieve"))


@pytest.mark.parametrize("name", ["engine-priohigh-bufs4", "wroker", "server-norings", "engine-rr", "engine-bufs", "server-bufs4",
                                  "server-retrieve", "engine-prio1", "engine-handover1", "engine-ahead0",
                                  "server-paced", "engine-bufs4-paced"])
def test_a_name_that_leaves_anything_unparsed_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ttft.arm_settings(name)


def test_chunk_major_is_served_one_request_after_another_at_concurrency_and_a_layer_major_width_only_if_asked() -> None:
    arms = ttft.concurrency_arms(["engine"], [0, 4, ttft.AUTO], [4])
    served = {ttft.arm_name(pl, w, serial): ttft.served_one_after_another(w, serial) for pl, w, serial in arms}
    assert served == {"resident": False, "engine/chunk": True, "engine/w4": False, "engine/auto": False,
                      "engine/w4-serial": True}


def test_chunk_major_together_is_its_own_arm_submitted_at_once_and_judged_beside_the_serial_baseline() -> None:
    arms = ttft.concurrency_arms(["engine"], [0, 4], [], chunk_major_together=True)
    served = {ttft.arm_name(pl, w, serial): ttft.served_one_after_another(w, serial) for pl, w, serial in arms}
    assert served == {"resident": False, "engine/chunk": True, "engine/w4": False, "engine/chunk-together": False}
    arms_measured = {"resident": {"ttft_ms": {"mean": 130.0, "p90": 150.0}},
                     "engine/chunk": {"ttft_ms": {"mean": 100.0, "p90": 120.0}},
                     "engine/chunk-together": {"ttft_ms": {"mean": 125.0, "p90": 140.0}},
                     "engine/w4": {"ttft_ms": {"mean": 110.0, "p90": 150.0}}}
    result = {"formats": {"vllm-LBNHC": {"concurrency": {"4": arms_measured}}}}
    row = ttft.evaluate(result, ["engine"], [0, 4])["vllm-LBNHC/engine"]["concurrency"]["4"]
    assert row["never_worse"] is False and row["mean_change"] == pytest.approx(0.10)
    assert row["together_mean_change"] == pytest.approx(0.25)
    assert row["best_vs_together_mean_change"] == pytest.approx(-0.12)
    assert row["never_worse_than_together"] is False  # its p90 (150) is above the together arm's (140)


def test_a_timeline_splits_into_layer_0_the_layers_compute_and_the_waits_between_them() -> None:
    import ttft_sweep_table

    # layer 0 usable at 2.0, computed 2.0-3.0; layer 1 waits 0.5 ms, computed 3.5-5.0
    assert ttft_sweep_table.timeline_parts({"usable": [2.0, 3.5], "computed": [3.0, 5.0]}) == (2.0, 2.5, 0.5)


def test_the_engine_threads_timeline_splits_into_layer_0_its_waits_and_its_launches() -> None:
    import ttft_sweep_table

    # waits 1.0-1.5 (layer 0), launches to 2.5, waits 2.5-2.6, launches to the last wait's end (not counted)
    marks = {"cpu_wait_from": [1.0, 2.5], "cpu_usable": [1.5, 2.6]}
    assert ttft_sweep_table.engine_thread_parts(marks) == pytest.approx((1.5, 0.6, 1.0))


def test_a_cells_time_beyond_perfect_overlap_is_its_best_width_over_the_longer_of_compute_and_transfer() -> None:
    import ttft_sweep_table

    run = {"config": {"shape": "s", "prefix_tokens": 4096, "engine_loop": "sleep"},
           "targets": {"vllm-LBNHC/engine": {"concurrency_1": {"128": {
               "compute_ms": 10.0, "transfer_ms": 4.0, "best_width": 1, "best_ttft_ms": 12.5}}}},
           "formats": {"vllm-LBNHC": {"concurrency_1": {"128": {"engine/w1": {
               "release_ms": {"median": 1.25}, "transfer_ms": {"median": 4.5}}}}}}}
    header, rule, row = ttft_sweep_table.overlap_rows([run])
    assert row == "| s | 4096 | sleep | vllm-LBNHC | 128 | 10.0 | 4.0 | w1 | 12.5 | +2.50 | 1.25 | 4.5 |"


def test_the_targets_are_counted_over_one_request_runs_by_prefix_and_over_each_concurrency_cell() -> None:
    import ttft_sweep_table

    def one_request(prefix: int, loop: str, share: float, auto: float, transfer: float,
                    fmt: str = "vllm-LBNHC") -> dict:
        return {"config": {"shape": "s", "prefix_tokens": prefix, "engine_loop": loop, "concurrency": []},
                "commit": "c",
                "targets": {f"{fmt}/engine": {"concurrency_1": {"128": {
                    "fraction_of_ceiling": share, "met_85pct": share >= 0.85, "auto_vs_best_fixed": auto}},
                    "concurrency": {}}},
                "formats": {fmt: {"concurrency_1": {"128": {"engine/w1": {
                    "transfer_ms": {"median": transfer}}}}}}}

    concurrency = {"config": {"shape": "s", "prefix_tokens": 30720, "engine_loop": "sleep", "concurrency": [2, 4]},
                   "targets": {"vllm-LBNHC/engine": {
                       # its own one-request cell (fewer widths) is not counted with the one-request runs
                       "concurrency_1": {"128": {"fraction_of_ceiling": 0.1, "auto_vs_best_fixed": 0.5}},
                       "concurrency": {"2": {"mean_change": -0.3, "never_worse": True},
                                       "4": {"mean_change": 0.05, "never_worse": False,
                                             "best_vs_together_mean_change": -0.02,
                                             "never_worse_than_together": True}}},
                               # another placement's cells are counted apart, in rows named after it
                               "vllm-LBNHC/engine-paced": {
                       "concurrency_1": {"128": {"fraction_of_ceiling": 0.2, "auto_vs_best_fixed": 0.6}},
                       "concurrency": {"2": {"mean_change": -0.1, "never_worse": True},
                                       "4": {"mean_change": -0.25, "never_worse": True}}}},
                   "formats": {}}
    runs = [one_request(30720, "sleep", 0.90, 0.01, 10.0), one_request(30720, "spin", 0.80, 0.04, 11.5),
            one_request(4096, "sleep", 0.75, -0.02, 4.0), concurrency,
            # another format's run of the same cell, sleeping only: the spin comparison still pairs vLLM's runs
            one_request(30720, "sleep", 0.95, 0.0, 9.0, fmt="sglang")]
    rows = ttft_sweep_table.target_rows(runs)[2:]
    assert rows == [
        "| one request, 16k tokens or more: 85% of the ceiling | 3 | 2 | 80% to 95% |",
        "| one request, shorter: 70% of the ceiling | 1 | 1 | 75% to 75% |",
        "| auto within 3% of the best fixed width | 4 | 3 | -2.0% to +4.0% |",
        "| 2-16 requests: best fixed width never worse than chunk-major served one after another (mean change) | 2 | 1 "
        "| -30.0% to +5.0% |",
        "| the same, against chunk-major submitted together (where measured) | 1 | 1 | -2.0% to -2.0% |",
        "| 4 requests, 16k tokens or more: 20% lower mean | 1 | 0 | +5.0% to +5.0% |",
        "| a spinning engine thread moves a load's completion by at most 10% | 1 | 0 | +15.0% to +15.0% |",
        "| engine-paced: 2-16 requests: best fixed width never worse than chunk-major served one after another (mean "
        "change) | 2 | 2 | -25.0% to -10.0% |",
        "| engine-paced: 4 requests, 16k tokens or more: 20% lower mean | 1 | 1 | -25.0% to -25.0% |"]
