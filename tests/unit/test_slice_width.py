"""``layers_per_slice: auto``: the width follows the bytes of one layer of the load and the measured copy rate."""

from __future__ import annotations

import pytest

from kvstrata.core.engine.slice_width import AUTO, SLICE_COST_S, SliceWidthModel, describe


def _model(num_layers: int, kv_heads: int) -> SliceWidthModel:
    return SliceWidthModel(num_layers, 2 * kv_heads * 128 * 2, "cuda:0")  # K and V, heads of 128 bf16


def test_a_long_prefix_of_a_few_thick_layers_runs_one_layer_per_slice():
    model = _model(32, 8)  # Llama-3.1-8B: 8 KV heads of 128 bf16
    assert model.choose(15104) == 1


def test_thin_layers_run_wider_slices_and_a_tiny_load_runs_chunk_major():
    model = _model(80, 1)  # one GPU's shard of a 70B model at TP 8: one KV head
    w_long, w_short = model.choose(30720), model.choose(4096)
    assert 1 <= w_long < w_short < 80
    # the slice's fixed cost stays under its share of the slice's copy time
    layer_s = 4096 * model.layer_bytes_per_token / model.copy_rate
    assert SLICE_COST_S["cuda"] <= 0.05 * w_short * layer_s < SLICE_COST_S["cuda"] + 0.05 * layer_s
    assert model.choose(16) == 0 and model.choose(0) == 0


def test_a_measured_copy_rate_moves_the_width():
    model = _model(80, 1)
    before = model.choose(8192)
    model.observe(10 << 30, 1.0)  # a slower copy engine than assumed: each layer copies longer
    assert model.measured_loads == 1 and model.copy_rate == pytest.approx((10 << 30) / 1.0)
    assert model.choose(8192) < before
    model.observe(0, 1.0)
    model.observe(1 << 30, 0.0)
    assert model.measured_loads == 1  # nothing measurable: ignored


def test_auto_is_named_in_log_lines():
    assert describe(AUTO) == "auto" and describe(4) == "4" and describe(0) == "0"
