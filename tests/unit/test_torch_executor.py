"""The pure-torch executor against per-token indexing, on the layouts it takes both paths for.

Dense layouts (the reference engine's, vLLM-on-CPU's pages) take the fast path
that copies a run of slots for every layer of a slice at once; strided ones
(vLLM's LBHNC, TensorRT-LLM's block-major pool) take the per-layer, per-block
path. Both are checked against the slowest, most obvious reading: one token of
one layer of one plane at a time through ``plane_view``.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.transfer import layouts
from kvstrata.core.transfer.layouts import Region
from kvstrata.core.transfer.torch_executor import gather_staged, layer_span_view, plane_view, scatter_staged

L, H, D, BS, NB = 4, 2, 8, 4, 12


def make(kind: str):
    if kind == "blocks":
        size = layouts.blocks_layout_bytes(num_layers=L, kv_size=2, num_blocks=NB, block_size=BS, num_heads=H,
                                           head_size=D, dtype="bfloat16")
        lay = layouts.blocks_layout(num_layers=L, kv_size=2, num_blocks=NB, block_size=BS, num_heads=H,
                                    head_size=D, dtype="bfloat16", region=Region("local", size))
    elif kind == "vllm-LBHNC":  # K and V interleaved per head, heads outside tokens
        size = L * NB * BS * H * 2 * (2 * D)
        lay = layouts.vllm_layout(num_layers=L, num_blocks=NB, block_size=BS, num_heads=H, head_size=D,
                                  dtype="bfloat16", region=Region("local", size), physical="LBHNC")
    else:
        size = NB * L * 2 * H * BS * 2 * D
        lay = layouts.trtllm_pool_layout(num_layers=L, num_blocks=NB, block_size=BS, num_heads=H, head_size=D,
                                         dtype="bfloat16", region=Region("local", size))
    return lay, [torch.zeros(size, dtype=torch.uint8)]


def slots_of(blocks: list[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + n)
    return torch.tensor(blocks)[pos // BS], pos % BS


@pytest.mark.parametrize("kind,fast", [("blocks", True), ("vllm-LBHNC", False), ("trtllm", False)])
@pytest.mark.parametrize("first,count", [(0, 0), (1, 2), (3, 1)])
def test_scatter_and_gather_match_per_token_indexing(kind: str, fast: bool, first: int, count: int) -> None:
    lay, regions = make(kind)
    assert (layer_span_view(regions, lay, 0, L, 0) is not None) == fast
    blocks = [7, 2, 3, 9, 10]  # runs across consecutive blocks (2,3 and 9,10) and breaks between them
    start, n = 3, 15  # starts mid-block
    b, o = slots_of(blocks, start, n)
    layers = count or L
    staged = torch.randint(0, 256, (lay.kv_size, layers, n, H, lay.head_bytes), dtype=torch.uint8)
    scatter_staged(staged, regions, lay, [b], [o], layer_offset=first if count else 0, staged_layers=count)
    for slot in range(layers):
        layer = (first if count else 0) + slot
        for k in range(lay.kv_size):
            view = plane_view(regions, lay, layer, k)
            for t in range(n):
                assert torch.equal(view[b[t], o[t]], staged[k, slot, t]), (layer, k, t)
    untouched = [l for l in range(L) if not (first if count else 0) <= l < (first if count else 0) + layers]
    for layer in untouched:
        assert not plane_view(regions, lay, layer, 0).any()
    if not count:
        out = torch.zeros_like(staged)
        gather_staged(out, regions, lay, [b], [o])
        assert torch.equal(out, staged)


@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("width", [0, 1, 3])
def test_executor_one_copy_per_slice_when_objects_and_slots_line_up(consecutive: bool, width: int) -> None:
    """Objects back to back in one pool into consecutive slots take one copy per plane and slice;
    anything else takes the per-copy path. Both must write exactly the objects' bytes."""
    from kvstrata.core.transfer import planner
    from kvstrata.core.transfer.torch_executor import TorchExecutor

    lay, regions = make("blocks")
    T, n_obj = BS * 2, 3  # chunks of two blocks
    pool = torch.randint(0, 256, (n_obj * lay.object_bytes(T) + 64,), dtype=torch.uint8)
    objects = [pool[i * lay.object_bytes(T):(i + 1) * lay.object_bytes(T)].view(2, L, T, H, lay.head_bytes)
               for i in range(n_obj)]
    blocks = [3, 4, 5, 6, 7, 8] if consecutive else [3, 4, 9, 6, 7, 8]
    job = planner.TransferJob(lay, [blocks], planner.plan_copies([T] * n_obj, T, 0, 0))
    ex = TorchExecutor(regions, objects)
    planner.run_transfer(ex, job, width)
    assert (ex._back_to_back(job) is not None) == consecutive
    for layer in range(L):
        for k in range(2):
            view = plane_view(regions, lay, layer, k)
            for t in range(n_obj * T):
                b, o = blocks[t // BS], t % BS
                assert torch.equal(view[b, o], objects[t // T][k, layer, t % T]), (layer, k, t)
