import logging

import pytest

from kvstrata.core.engine.settings import resolve_layers_per_stage


@pytest.mark.parametrize("value, width", [
    (0, 0), (1, 1), (8, 8), (True, 1), (False, 0), (None, 0),
    ("8", 8), (" 2 ", 2), ("0", 0), ("true", 1), ("False", 0), ("", 0),
])
def test_accepts_what_a_deployer_writes(value, width):
    assert resolve_layers_per_stage(value) == width


@pytest.mark.parametrize("value", [-1, 2.5, "eight", "-3", [1], {"n": 1}, 10**9])
def test_anything_else_warns_and_reads_as_off(value, caplog):
    caplog.set_level(logging.WARNING)
    assert resolve_layers_per_stage(value, setting="layerwise_overlap") == 0
    assert any("layerwise_overlap" in r.message and "stays off" in r.message for r in caplog.records)
