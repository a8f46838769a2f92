"""Every engine format reduces to the strided layout: checked against the engine's own tensor indexing."""

import pytest
import torch

from kvstrata.core.transfer import planner
from kvstrata.core.transfer.layouts import (
    LayoutError, PagedKVLayout, Region, blocks_layout, sglang_layout, trtllm_pool_layout, vllm_layout,
)
from kvstrata.core.transfer.torch_executor import TorchExecutor

L, NB, BS, H, HD = 3, 6, 4, 2, 8


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _scatter(layout, regions, tokens=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    obj = torch.randint(0, 255, layout.object_shape(tokens), dtype=torch.uint8, generator=g)
    block_ids = [[4, 1, 5]]
    job = planner.TransferJob(layout, block_ids, planner.plan_copies([tokens], 16, 0, 0))
    TorchExecutor(regions, [obj]).scatter(job, 0, 0)
    # compare as int16, not bf16: random bytes include NaNs, which never compare equal
    typed = obj.view(layout.kv_size, layout.num_layers, tokens, H, HD * 2).view(torch.int16)
    return typed, block_ids[0]


def _slots(blocks, tokens):
    return [(blocks[t // BS], t % BS) for t in range(tokens)]


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC"])
def test_vllm_per_layer_views(physical):
    shape = (L, NB, BS, H, 2 * HD) if physical == "LBNHC" else (L, NB, H, BS, 2 * HD)
    cache = torch.zeros(shape, dtype=torch.int16)
    layout = vllm_layout(num_layers=L, num_blocks=NB, block_size=BS, num_heads=H, head_size=HD, dtype="bfloat16",
                         region=Region("local", cache.numel() * 2), physical=physical)
    typed, blocks = _scatter(layout, [_bytes(cache)])
    for t, (b, o) in enumerate(_slots(blocks, 10)):
        for l in range(L):
            row = cache[l, b, o] if physical == "LBNHC" else cache[l, b, :, o]  # [H, 2*HD]
            assert torch.equal(row[:, :HD], typed[0, l, t]) and torch.equal(row[:, HD:], typed[1, l, t])


def test_sglang_token_slot_buffers_and_mla():
    k = [torch.zeros(NB * BS, H, HD, dtype=torch.int16) for _ in range(L)]
    v = [torch.zeros(NB * BS, H, HD, dtype=torch.int16) for _ in range(L)]
    regions = [_bytes(t) for t in k + v]
    layout = sglang_layout(num_layers=L, num_slots=NB * BS, page_size=BS, num_heads=H, head_size=HD,
                           dtype="bfloat16", k_regions=[Region("local", t.numel() * 2) for t in k],
                           v_regions=[Region("local", t.numel() * 2) for t in v])
    typed, blocks = _scatter(layout, regions)
    for t, (b, o) in enumerate(_slots(blocks, 10)):
        for l in range(L):
            assert torch.equal(k[l][b * BS + o], typed[0, l, t]) and torch.equal(v[l][b * BS + o], typed[1, l, t])
    mla = sglang_layout(num_layers=L, num_slots=NB * BS, page_size=BS, num_heads=H, head_size=HD,
                        dtype="bfloat16", k_regions=[Region("local", t.numel() * 2) for t in k], v_regions=None)
    assert mla.kv_size == 1 and mla.object_shape(4)[0] == 1


def test_trtllm_block_major_pool():
    pool = torch.zeros(NB, L, 2, H, BS, HD, dtype=torch.int16)  # HND inside a block
    layout = trtllm_pool_layout(num_layers=L, num_blocks=NB, block_size=BS, num_heads=H, head_size=HD,
                                dtype="bfloat16", region=Region("local", pool.numel() * 2))
    typed, blocks = _scatter(layout, [_bytes(pool)])
    for t, (b, o) in enumerate(_slots(blocks, 10)):
        for l in range(L):
            assert torch.equal(pool[b, l, 0, :, o], typed[0, l, t]) and torch.equal(pool[b, l, 1, :, o], typed[1, l, t])


def test_blocks_layout_round_trips_through_the_wire():
    layout = blocks_layout(num_layers=L, kv_size=2, num_blocks=NB, block_size=BS, num_heads=H, head_size=HD,
                           dtype="bfloat16", region=Region("shm", L * 2 * NB * BS * H * HD * 2, "seg"))
    assert PagedKVLayout.from_wire(layout.to_wire("server")) == layout


def test_inconsistent_descriptors_are_rejected_with_the_reason():
    good = blocks_layout(num_layers=L, kv_size=2, num_blocks=NB, block_size=BS, num_heads=H, head_size=HD,
                         dtype="bfloat16", region=Region("shm", L * 2 * NB * BS * H * HD * 2, "seg")).to_wire("server")
    with pytest.raises(LayoutError, match="past region 0"):
        PagedKVLayout.from_wire({**good, "regions": [{"kind": "shm", "size": 100, "name": "seg"}]})
    with pytest.raises(LayoutError, match="dtype 'float64'"):
        PagedKVLayout.from_wire({**good, "dtype": "float64"})
    with pytest.raises(LayoutError, match="kv_size must be 1 .MLA. or 2"):
        PagedKVLayout.from_wire({**good, "kv_size": 3})
    with pytest.raises(LayoutError, match="malformed KV cache descriptor"):
        PagedKVLayout.from_wire({k: v for k, v in good.items() if k != "block_stride"})
    with pytest.raises(LayoutError, match="unknown vLLM physical layout"):
        vllm_layout(num_layers=1, num_blocks=1, block_size=1, num_heads=1, head_size=1, dtype="float32",
                    region=Region("local", 8), physical="NHD")


def test_regions_that_are_views_into_a_larger_buffer():
    """vLLM hands per-layer views of one shared buffer: offsets count from the view, not the storage."""
    from kvstrata.adapters.vllm.kv_layout import cpu_page_layout

    buf = torch.arange(L * NB * H * BS * 4, dtype=torch.int32)
    kv = {f"model.layers.{l}.self_attn.attn": buf.view(L, NB, H, BS, 4)[l] for l in range(L)}
    layout, regions = cpu_page_layout(kv)
    obj = torch.empty(layout.object_shape(2 * BS), dtype=torch.uint8)
    job = planner.TransferJob(layout, [[3, 1]], planner.plan_copies([2 * BS], 2 * BS, 0, 0))
    TorchExecutor(regions, [obj]).gather(job)
    pages = buf.view(L, NB, -1)
    for l in range(L):
        got = obj[0, l].reshape(2, -1).view(torch.int32)
        assert torch.equal(got[0], pages[l, 3]) and torch.equal(got[1], pages[l, 1]), l


def test_a_layout_moving_an_engines_pages_is_keyed_by_its_format_a_per_token_one_by_its_dtype():
    import dataclasses

    from kvstrata.adapters.vllm.kv_layout import cpu_page_layout

    buf = torch.zeros(L * NB * H * BS * 4, dtype=torch.int32)
    kv = {f"model.layers.{l}.self_attn.attn": buf.view(L, NB, H, BS, 4)[l] for l in range(L)}
    pages, _ = cpu_page_layout(kv, "vec")
    assert pages.moves_pages and pages.object_form() == "vllm-cpu-vec-int32-pages"
    registration = dataclasses.replace(pages, format=pages.format + "+registration")  # engine placement's area
    assert registration.object_form() == "vllm-cpu-vec-int32-pages"
    per_token = vllm_layout(num_layers=1, num_blocks=1, block_size=1, num_heads=1, head_size=4, dtype="bfloat16",
                            region=Region("local", 16), physical="LBNHC")
    assert not per_token.moves_pages and per_token.object_form() == "bfloat16"


def test_planes_addressed_apart_are_bounded_and_cross_the_wire():
    """``plane_strides``: per plane (token stride, element stride); the bounds check covers a plane whose
    elements lie apart, and the descriptor survives the wire."""
    import dataclasses

    from kvstrata.core.transfer.layouts import PagedKVLayout

    es, hd, bs, heads, blocks = 4, 8, 4, 2, 3
    page = heads * bs * 2 * hd * es
    layout = PagedKVLayout(format="k-transposed", num_layers=1, kv_size=2, num_blocks=blocks, block_size=bs,
                           num_heads=heads, head_bytes=hd * es, dtype="float32",
                           offsets=(((0, 0), (0, bs * hd * es)),), block_stride=page, token_stride=hd * es,
                           head_stride=bs * 2 * hd * es, regions=(Region("local", blocks * page),),
                           plane_strides=((es, bs * es), (hd * es, es)))
    assert PagedKVLayout.from_wire(layout.to_wire("engine")) == layout
    assert layout.plane_addressing(0) == (es, bs * es) and layout.object_form() == "float32"
    with pytest.raises(LayoutError, match="spans bytes"):
        dataclasses.replace(layout, regions=(Region("local", blocks * page - 1),))
    with pytest.raises(LayoutError, match="plane_strides lists 1 planes"):
        dataclasses.replace(layout, plane_strides=((es, es),))
