import logging

import pytest

from kvstrata.core.engine.settings import RuntimeSettings, resolve_layers_per_slice


@pytest.mark.parametrize("value, width", [
    (0, 0), (1, 1), (8, 8), (True, 1), (False, 0), (None, 0),
    ("8", 8), (" 2 ", 2), ("0", 0), ("true", 1), ("False", 0), ("", 0), ("auto", -1), (" Auto ", -1),
])
def test_accepts_what_a_deployer_writes(value, width):
    assert resolve_layers_per_slice(value) == width


@pytest.mark.parametrize("value", [-1, 2.5, "eight", "-3", [1], {"n": 1}, 10**9])
def test_anything_else_warns_and_reads_as_off(value, caplog):
    caplog.set_level(logging.WARNING)
    assert resolve_layers_per_slice(value, setting="layerwise_overlap") == 0
    assert any("layerwise_overlap" in r.message and "stays off" in r.message for r in caplog.records)


@pytest.mark.parametrize("old", ["layers_per_stage", "layerwise_overlap"])
def test_old_slice_width_names_still_work_with_a_deprecation_warning(old, caplog):
    from kvstrata.core.engine.settings import RuntimeSettings

    caplog.set_level(logging.WARNING)
    settings = RuntimeSettings.from_mapping({"server_address": "ipc:///tmp/x", old: 4}, where="cfg")
    assert settings.layers_per_slice == 4
    assert any(f"cfg.{old} is deprecated" in r.message and "layers_per_slice" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="not both"):
        RuntimeSettings.from_mapping({"server_address": "ipc:///tmp/x", old: 4, "layers_per_slice": 2})


def test_the_old_placement_name_worker_still_works_with_a_deprecation_warning(caplog):
    from kvstrata.core.engine.settings import RuntimeSettings

    caplog.set_level(logging.WARNING)
    settings = RuntimeSettings.from_mapping({"server_address": "ipc:///tmp/x", "placement": "worker"}, where="cfg")
    assert settings.placement == "engine"
    assert any("cfg.placement='worker' is deprecated" in r.message for r in caplog.records)


def test_pace_loads_is_off_unless_set_and_must_be_a_bool():
    assert RuntimeSettings.from_mapping({"server_address": "ipc:///tmp/x"}).pace_loads is False
    assert RuntimeSettings.from_mapping({"server_address": "ipc:///tmp/x", "pace_loads": True}).pace_loads is True
    with pytest.raises(ValueError, match=r"cfg\.pace_loads must be true or false, got 'yes'"):
        RuntimeSettings.from_mapping({"server_address": "ipc:///tmp/x", "pace_loads": "yes"}, where="cfg")
