"""Planner arithmetic and the chunk-major / layer-major equivalence on the torch reference."""

import logging

import pytest
import torch

from kvstrata.core.transfer import planner
from kvstrata.core.transfer.layouts import Region, blocks_layout
from kvstrata.core.transfer.torch_executor import TorchExecutor


def test_plan_copies_skips_tokens_the_engine_has():
    copies = planner.plan_copies([64, 64, 30], 64, 0, 80)
    assert copies == [planner.ChunkCopy(1, 16, 48, 80), planner.ChunkCopy(2, 0, 30, 128)]
    assert planner.plan_copies([64], 64, 0, 64) == []
    with pytest.raises(ValueError, match="holds 65 tokens, chunk size is 64"):
        planner.plan_copies([65], 64, 0, 0)


def test_layer_slices_cover_every_layer_once_last_may_be_short():
    assert planner.layer_slices(32, 0) == [(0, 32)]
    assert planner.layer_slices(32, 3)[-1] == (30, 2)
    for w in (1, 2, 3, 8, 32, 40):
        covered = [l for s, c in planner.layer_slices(32, w) for l in range(s, s + c)]
        assert covered == list(range(32))


def _setup(layers=6, kv=2, blocks=8, bs=4, heads=2, head=4):
    region = torch.zeros(layers * kv * blocks * bs * heads * head * 2, dtype=torch.uint8)
    layout = blocks_layout(num_layers=layers, kv_size=kv, num_blocks=blocks, block_size=bs, num_heads=heads,
                           head_size=head, dtype="bfloat16", region=Region("local", region.numel()))
    objs = [torch.randint(0, 255, layout.object_shape(8), dtype=torch.uint8) for _ in range(2)]
    return layout, region, objs


def test_layer_major_writes_exactly_what_chunk_major_writes_and_calls_back_per_slice():
    layout, region, objs = _setup()
    copies = planner.plan_copies([8, 8], 8, 0, 3)
    results = {}
    for width in (0, 1, 4, 6):
        region.zero_()
        job = planner.TransferJob(layout, [[7, 2, 5, 0]], copies)
        seen = []
        planner.run_transfer(TorchExecutor([region], objs), job, width, lambda s, c: seen.append((s, c)))
        results[width] = region.clone()
        assert seen == planner.layer_slices(6, width)
    for width in (1, 4, 6):
        assert torch.equal(results[width], results[0])
    assert results[0].any()


def test_gather_inverts_scatter():
    layout, region, objs = _setup()
    job = planner.TransferJob(layout, [[3, 1, 6, 4]], planner.plan_copies([8, 8], 8, 0, 0))
    TorchExecutor([region], objs).scatter(job, 0, 0)
    back = [torch.zeros_like(o) for o in objs]
    TorchExecutor([region], back).gather(job)
    assert all(torch.equal(a, b) for a, b in zip(objs, back))


def test_fallback_reasons_and_log_once(caplog):
    layout, _, _ = _setup()
    assert planner.layer_major_fallback_reason(layout) is None
    assert "cannot be sliced" in planner.layer_major_fallback_reason(layout, sliceable=False)
    assert "native transfer extension" in planner.layer_major_fallback_reason(layout, native_available=False)
    hybrid = blocks_layout(num_layers=4, kv_size=2, num_blocks=2, block_size=2, num_heads=1, head_size=2,
                           dtype="float32", region=Region("local", 4 * 2 * 2 * 2 * 1 * 2 * 4))
    hybrid = type(hybrid)(**{**hybrid.__dict__, "layer_groups": ((0, 1), (2, 3))})
    assert "hybrid" in planner.layer_major_fallback_reason(hybrid)
    caplog.set_level(logging.WARNING)
    reason = "test reason %d" % id(caplog)
    planner.log_fallback_once(reason)
    planner.log_fallback_once(reason)
    assert sum(reason in r.message for r in caplog.records) == 1
