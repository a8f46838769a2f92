"""The SGLang adapter's layout descriptors, checked against SGLang's own tensor shapes (no SGLang needed).

Every host layout kvstrata's HiCache backend registers (``layer_first``, ``page_first``,
``page_first_direct``, shapes as SGLang 0.5.23's ``MHATokenToKVPoolHost.init_kv_buffer``) and the device
pool's per-layer ``[slots, heads, dim]`` buffers must address exactly the element SGLang's own indexing
does: the strided view kvstrata copies through is compared with SGLang-style indexing of the same tensor.
These run without SGLang; the CPU engine tests (tests/sglang_engine) run all three layouts end to end.
Also: SGLang token slots to block ids, and what is refused.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.adapters.sglang.kv_layout import (
    SglangHostPool,
    SglangKVBuffers,
    blocks_of_slots,
    describe_buffers,
    describe_host_pool,
)
from kvstrata.core.transfer.layouts import LayoutError
from kvstrata.core.transfer.torch_executor import plane_view

L, SLOTS, H, D, PS = 3, 64, 2, 8, 16


def host_tensors(layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    shape = {"layer_first": (2, L, SLOTS, H, D), "page_first": (2, SLOTS, L, H, D),
             "page_first_direct": (2, SLOTS // PS, L, PS, H, D)}[layout]
    kv = torch.randn(shape)
    return kv[0], kv[1]


def sglang_index(t: torch.Tensor, layout: str, layer: int, slot: int) -> torch.Tensor:
    """What SGLang's host pool holds for (layer, token slot): [heads, dim]."""
    if layout == "layer_first":
        return t[layer, slot]
    if layout == "page_first":
        return t[slot, layer]
    return t[slot // PS, layer, slot % PS]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_each_host_layout_descriptor_addresses_what_sglang_indexes(layout: str) -> None:
    k, v = host_tensors(layout)
    desc, regions = describe_host_pool(SglangHostPool(k, v, layout, PS))
    assert desc.format == f"sglang-host-{layout}" and desc.num_blocks == SLOTS // PS
    for plane, t in enumerate((k, v)):
        for layer in range(L):
            view = plane_view(regions, desc, layer, plane)  # [blocks, page, heads, head bytes]
            for slot in (0, 5, PS, 37, SLOTS - 1):
                got = view[slot // PS, slot % PS].contiguous().view(torch.float32)
                assert torch.equal(got, sglang_index(t, layout, layer, slot)), (layout, plane, layer, slot)


def test_the_device_pool_descriptor_addresses_sglangs_k_and_v_buffers() -> None:
    k = tuple(torch.randn(SLOTS + PS, H, D) for _ in range(L))
    v = tuple(torch.randn(SLOTS + PS, H, D) for _ in range(L))
    desc, regions = describe_buffers(SglangKVBuffers(k, v, PS))
    for plane, planes in enumerate((k, v)):
        for layer in range(L):
            view = plane_view(regions, desc, layer, plane)
            assert torch.equal(view[2, 3].contiguous().view(torch.float32), planes[layer][2 * PS + 3])
    mla = tuple(torch.randn(SLOTS + PS, 1, 24) for _ in range(L))
    desc, _ = describe_buffers(SglangKVBuffers(mla, None, PS))
    assert desc.kv_size == 1 and desc.num_heads == 1


def test_token_slots_become_block_ids_and_anything_else_is_refused_by_name() -> None:
    assert blocks_of_slots(torch.arange(3 * PS, 5 * PS), PS) == [3, 4]
    assert blocks_of_slots(torch.cat([torch.arange(7 * PS, 8 * PS), torch.arange(2 * PS, 3 * PS)]), PS) == [7, 2]
    with pytest.raises(LayoutError, match="not a whole number of 16-token pages"):
        blocks_of_slots(torch.arange(PS + 1), PS)
    with pytest.raises(LayoutError, match="not whole, page-aligned pages"):
        blocks_of_slots(torch.arange(1, PS + 1), PS)
    k = tuple(torch.zeros(SLOTS, H, D) for _ in range(L))
    with pytest.raises(LayoutError, match="every layer must be a contiguous"):
        describe_buffers(SglangKVBuffers(k, (*k[:2], torch.zeros(SLOTS, H, D + 1)), PS))
    with pytest.raises(LayoutError, match="must be contiguous tensors of one shape"):
        describe_host_pool(SglangHostPool(torch.zeros(L, SLOTS, H, D), torch.zeros(L, SLOTS, H, D + 2),
                                          "layer_first", PS))
