"""An engine's instance id: derived per engine unless configured, and a registration the server refuses is
logged with the server's reason (not as a server that cannot be reached)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from kvstrata.adapters.reference import conformance as reference
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.engine.settings import (ENGINE_INSTANCE_BASE, ENGINE_INSTANCE_STRIDE, RuntimeSettings,
                                           engine_instance_id)
from kvstrata.core.engine.worker_runtime import WorkerRuntime


def test_an_engine_key_gives_every_process_of_one_engine_one_id_and_other_engines_others() -> None:
    keys = [f"engine-{i}" for i in range(100)] + ["", "0", "a" * 300, "\udcff"]
    ids = [engine_instance_id(k) for k in keys]
    assert ids == [engine_instance_id(k) for k in keys]  # the same in every process: no per-process seed
    for i in ids:
        assert ENGINE_INSTANCE_BASE <= i and i + ENGINE_INSTANCE_STRIDE - 1 < 2 ** 31  # ranks fit above it
        assert i % ENGINE_INSTANCE_STRIDE == 0  # no engine's ranks reach into another's
    assert len(set(ids)) == len(ids)


def test_a_configured_instance_id_is_kept_and_an_unset_one_comes_from_the_engine_key() -> None:
    assert RuntimeSettings.from_mapping({"instance_id": 7}, engine_key="e").instance_id == 7
    assert RuntimeSettings.from_mapping({"instance_id": 0}, engine_key="e").instance_id == 0
    assert RuntimeSettings.from_mapping({}, engine_key="e").instance_id == engine_instance_id("e")
    assert RuntimeSettings.from_mapping({}, engine_key="e").instance_id != \
        RuntimeSettings.from_mapping({}, engine_key="f").instance_id
    assert RuntimeSettings.from_mapping({}).instance_id == 0  # an engine that knows no key of its own
    with pytest.raises(ValueError, match=r"where\.instance_id: must be >= 0"):
        RuntimeSettings.from_mapping({"instance_id": -1}, where="where")


def test_a_taken_instance_id_is_logged_as_the_servers_refusal_and_registers_once_free(
        server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvstrata")
    caches = [reference.ReferenceCache(HarnessSpec(num_layers=2, num_blocks=8, block_size=16)) for _ in range(2)]
    first = WorkerRuntime(load_adapter("reference"), RuntimeSettings(server.address, instance_id=660), model="ids")
    record = tmp_path / "second.jsonl"
    second = WorkerRuntime(load_adapter("reference"),
                           RuntimeSettings(server.address, instance_id=660, record_path=str(record)), model="ids")
    try:
        first.register(caches[0].kv_caches)
        assert first.connected
        caplog.clear()
        second.register(caches[1].kv_caches)
        assert not second.connected
        text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("kvstrata.core.engine"))
        assert "not reachable" not in text, text
        assert "refused to register this cache as instance 660" in text, text
        assert "instance 660 is registered by another connection, which is still connected" in text, text
        refused = [json.loads(line) for line in record.read_text().splitlines()]
        assert [(e["event"], e["instance_id"]) for e in refused] == [("register_refused", 660)]
        assert "instance 660 is registered by another connection" in refused[0]["reason"]

        first.close()  # the id is free again: the second engine's next try registers
        first = None
        second._next_connect = 0.0  # its retry is due (RECONNECT_INTERVAL), without waiting for it
        assert second.connect()
    finally:
        if first is not None:
            first.close()
        second.close()
        for cache in caches:
            cache.close()
