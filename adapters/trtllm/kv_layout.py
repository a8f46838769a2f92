"""Describe TensorRT-LLM's KV pool as a kvstrata PagedKVLayout.

TensorRT-LLM hands ``register_kv_caches`` one contiguous tensor, the KV cache manager's
``get_unique_primary_pool()``: ``[num_blocks, num_layers, kv_factor, block_size_elems]`` (kv_factor 2,
or 1 for K-only/MLA caches), HND inside a block plane: element ``head*tokens_per_block*dim + token*dim +
channel``. Block ids (``get_cache_indices``) index dim 0.

The tensor does not say how ``block_size_elems`` splits into heads and head size, and kvstrata only ever
moves whole blocks of this pool (loads and stores are block-aligned), so each (block, layer, plane) is
described as ``tokens_per_block`` opaque ``uint8`` rows of ``block_size_elems / tokens_per_block``
elements' bytes (format ``trtllm-pages``), the way the vLLM adapter moves CPU pages. A block's bytes
round-trip exactly; the L1 object's row order is this pool's own, and the format is part of every chunk's
key, so no other engine's format reads it. Told the KV heads per rank (``kv_heads``), the pool is addressed
per token instead (``trtllm_pool_layout``'s HND): kvstrata's own per-token objects, shared with every engine
of the same model and dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from kvstrata.core.transfer.layouts import (
    LayoutError,
    PagedKVLayout,
    Region,
    trtllm_pool_layout,
)

FORMAT = "trtllm-pages"
"""Whole (block, layer, plane) pages as opaque ``uint8`` rows (the convention for formats moved as pages)."""

TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.uint8: "uint8",
                torch.int8: "int8"}


@dataclass(frozen=True)
class TrtllmKvPool:
    """What the worker registers: TensorRT-LLM's pool tensor and the block size from its ``KvCacheConfig``."""

    tensor: torch.Tensor
    tokens_per_block: int
    kv_heads: int = 0
    """KV heads per rank (``TrtllmOptions.kv_heads``): the pool is then described per token; 0: opaque pages."""


def pool_layout(pool: TrtllmKvPool, region: Region) -> PagedKVLayout:
    t = pool.tensor
    if t.dim() != 4:
        raise LayoutError(f"TensorRT-LLM's KV pool is [num_blocks, num_layers, kv_factor, block_size_elems]; "
                          f"got a {t.dim()}-d tensor of shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise LayoutError(f"TensorRT-LLM's KV pool must be contiguous; got strides {t.stride()}")
    if t.dtype not in TORCH_DTYPES:
        raise LayoutError(f"TensorRT-LLM KV pool dtype {t.dtype} is not one of {sorted(map(str, TORCH_DTYPES))}")
    num_blocks, num_layers, kv_factor, elems = t.shape
    tpb = pool.tokens_per_block
    if kv_factor not in (1, 2):
        raise LayoutError(f"TensorRT-LLM KV pool kv_factor must be 1 or 2, got {kv_factor}")
    if tpb <= 0 or elems % tpb:
        raise LayoutError(f"block_size_elems {elems} of the pool does not split into tokens_per_block={tpb} rows "
                          "(check kv_cache_config.tokens_per_block)")
    if pool.kv_heads:
        if elems % (tpb * pool.kv_heads):
            raise LayoutError(f"block_size_elems {elems} of the pool does not split into tokens_per_block={tpb} x "
                              f"kv_heads={pool.kv_heads} heads (check kvstrata's kv_heads: per rank)")
        return trtllm_pool_layout(num_layers=num_layers, num_blocks=num_blocks, block_size=tpb,
                                  num_heads=pool.kv_heads, head_size=elems // tpb // pool.kv_heads,
                                  dtype=TORCH_DTYPES[t.dtype], region=region, kv_size=kv_factor)
    row_bytes = elems // tpb * t.element_size()
    layout = trtllm_pool_layout(num_layers=num_layers, num_blocks=num_blocks, block_size=tpb, num_heads=1,
                                head_size=row_bytes, dtype="uint8", region=region, kv_size=kv_factor)
    return dataclasses.replace(layout, format=FORMAT)


def byte_view(pool: TrtllmKvPool) -> torch.Tensor:
    """The pool as one flat uint8 tensor over the same memory (what copies write into)."""
    return pool.tensor.view(-1).view(torch.uint8)
