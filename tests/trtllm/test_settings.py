"""kvstrata's settings for TensorRT-LLM come from KVSTRATA_TRTLLM_CONFIG (inline JSON or a file it names)."""

from __future__ import annotations

import json

import pytest
from kvstrata.adapters.trtllm import settings


def test_inline_json() -> None:
    s, o = settings.load({settings.ENV_VAR: '{"server_address": "ipc:///tmp/x.sock", "layers_per_slice": 2, '
                                            '"async_load": true}'})
    assert (s.server_address, s.layers_per_slice, o.async_load) == ("ipc:///tmp/x.sock", 2, True)


def test_unset_is_every_default() -> None:
    s, o = settings.load({})
    assert (s.layers_per_slice, s.placement, o.async_load) == (0, "auto", False)


def test_json_and_yaml_files(tmp_path) -> None:
    j = tmp_path / "kv.json"
    j.write_text(json.dumps({"placement": "engine", "instance_id": 3}))
    s, _ = settings.load({settings.ENV_VAR: str(j)})
    assert (s.placement, s.instance_id) == ("engine", 3)
    y = tmp_path / "kv.yaml"
    y.write_text("layers_per_slice: 4\nasync_load: false\n")
    s, o = settings.load({settings.ENV_VAR: str(y)})
    assert (s.layers_per_slice, o.async_load) == (4, False)


def test_unknown_key_named_with_the_variable_and_file(tmp_path) -> None:
    f = tmp_path / "kv.json"
    f.write_text(json.dumps({"layers_per_stag": 1}))
    with pytest.raises(ValueError, match=r"KVSTRATA_TRTLLM_CONFIG file .*kv\.json.*layers_per_stag"):
        settings.load({settings.ENV_VAR: str(f)})


@pytest.mark.parametrize("value, message", [
    ('{"async_load": "yes"}', "async_load must be true or false"),
    ('{"server_address": ', "not valid JSON"),
    ("/nonexistent/kvstrata.json", "neither a JSON object nor a readable file"),
    ('{"placement": "gpu"}', "placement must be"),
])
def test_bad_values_are_refused_by_name(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings.load({settings.ENV_VAR: value})


def test_kv_heads_is_a_whole_number_of_heads_per_rank() -> None:
    from kvstrata.adapters.trtllm.settings import parse

    assert parse({"kv_heads": 4}, "X")[1].kv_heads == 4
    assert parse({}, "X")[1].kv_heads == 0
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="X.kv_heads must be a whole number of KV heads per rank"):
            parse({"kv_heads": bad}, "X")
