"""The worker runtime's engine-side numbers, per interval and as Prometheus totals, from a real server."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.adapters.reference import conformance as reference
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.stats import RuntimeStats, RuntimeStatsCollector

from helpers import random_prompt

LAYERS = 4


def test_the_runtime_counts_loads_releases_and_layer_waits(server) -> None:
    driver = reference.ReferenceConformanceDriver(HarnessSpec(num_layers=LAYERS, num_blocks=32))
    try:
        driver.start(RuntimeSettings(server.address, layers_per_slice=1, instance_id=40))
        prompt = random_prompt(128, seed=21)
        blocks = driver.allocate(128)
        driver.prefill(prompt, blocks)
        driver.store("stats-store", prompt, blocks)
        first = driver.runtime.take_stats()
        assert first.stores == 1 and first.loads_started == 0
        dst = driver.allocate(128)
        assert driver.load("stats-load", prompt, dst) == 128
        deadline = time.monotonic() + 30
        while "stats-load" not in driver.poll().released:
            assert time.monotonic() < deadline
        for layer in range(LAYERS):
            driver.wait_for_layer(layer)
        interval = driver.runtime.take_stats()
        assert (interval.loads_started, interval.loads_released, interval.layer_waits, interval.loads_failed) == \
            (1, 1, LAYERS, 0)
        assert interval.release_seconds > 0 and interval.layer_wait_seconds >= 0
        assert driver.runtime.take_stats().is_empty()  # an interval is handed out once
        summary = interval.summary()
        assert summary["mean_release_ms"] == 1e3 * interval.release_seconds
        # the running totals, under Prometheus names, for an engine without a stats mechanism of its own
        registry = CollectorRegistry()
        registry.register(RuntimeStatsCollector(driver.runtime.stats, {"rank": "0"}))
        assert registry.get_sample_value("kvstrata_engine_loads_started_total", {"rank": "0"}) == 1
        assert registry.get_sample_value("kvstrata_engine_stores_total", {"rank": "0"}) == 1
        assert registry.get_sample_value("kvstrata_engine_layer_waits_total", {"rank": "0"}) == LAYERS
        assert b"kvstrata_engine_release_seconds_total" in generate_latest(registry)
    finally:
        driver.close()


def test_stats_add_and_round_trip_through_a_dict() -> None:
    a = RuntimeStats(loads_started=2, loads_released=2, release_seconds=0.004)
    b = RuntimeStats.from_dict(RuntimeStats(loads_started=1, loads_failed=1).as_dict())
    total = a.add(b)
    assert (total.loads_started, total.loads_failed, total.release_seconds) == (3, 1, 0.004)
    assert total.summary()["mean_release_ms"] == 2.0
    assert RuntimeStats().is_empty() and not total.is_empty()
