"""The keep-warm rehearsal's scratch layout: the engine's strides over one block, checked without a GPU."""

from __future__ import annotations

import pytest

from kvstrata.core.layouts import Region, sglang_layout, trtllm_pool_layout, vllm_layout
from kvstrata.native.warm_path import scratch_layout


def _layouts():
    big = Region("cuda_ipc", 1 << 40)
    yield vllm_layout(num_layers=32, num_blocks=5000, block_size=16, num_heads=8, head_size=128, dtype="bfloat16",
                      region=big, physical="LBNHC")
    yield vllm_layout(num_layers=32, num_blocks=5000, block_size=16, num_heads=8, head_size=128, dtype="float16",
                      region=big, physical="LBHNC")
    yield sglang_layout(num_layers=4, num_slots=4096, page_size=1, num_heads=2, head_size=64, dtype="float32",
                        k_regions=[big] * 4, v_regions=[big] * 4)
    yield trtllm_pool_layout(num_layers=8, num_blocks=100, block_size=32, num_heads=4, head_size=64,
                             dtype="float8_e4m3fn", region=big)


@pytest.mark.parametrize("layout", list(_layouts()), ids=lambda l: f"{l.format}-{l.dtype}")
def test_scratch_layout_keeps_the_strides_over_one_block(layout):
    scratch = scratch_layout(layout)  # validates like any registration
    assert scratch.num_blocks == 1 and len(scratch.regions) == 1
    for name in ("format", "num_layers", "kv_size", "block_size", "num_heads", "head_bytes", "dtype",
                 "block_stride", "token_stride", "head_stride", "layer_groups"):
        assert getattr(scratch, name) == getattr(layout, name), name
    assert scratch.shape_signature() == layout.shape_signature()
    span = ((layout.block_size - 1) * layout.token_stride + (layout.num_heads - 1) * layout.head_stride
            + layout.head_bytes)
    assert scratch.regions[0].size == span  # one block, every plane aliased: small whatever the cache
    assert span < 4 << 20
