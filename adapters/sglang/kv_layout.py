"""Describe SGLang's device KV pool as a kvstrata PagedKVLayout.

SGLang 0.5.23's ``MHATokenToKVPool`` keeps one ``[slots, heads, head_dim]`` K tensor and one V tensor per
layer (``k_buffer`` / ``v_buffer``, NHD); ``MLATokenToKVPool`` keeps one ``[slots, 1, kv_lora + rope]``
tensor per layer (``kv_buffer``: one plane). Slots are token positions, allocated a page at a time, so
token slot ``s`` is block ``s // page_size`` and kvstrata moves whole pages. Slot 0's page is SGLang's
padding page; the allocator never hands it out.

The buffers live in the engine's private memory (CPU) or its CUDA context, and the worker copies into them
itself (engine placement). :class:`SglangKVBuffers` is what the linker hands ``WorkerRuntime.register``;
it holds plain tensors, so the GPU tests build one without SGLang installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kvstrata.core.transfer.layouts import (
    LayoutError,
    PagedKVLayout,
    Region,
    sglang_layout,
)

TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.uint8: "uint8", torch.int8: "int8"}


@dataclass(frozen=True)
class SglangKVBuffers:
    """SGLang's per-layer token-slot buffers: K and V (MHA), or one latent plane (MLA, ``v`` is None)."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...] | None
    page_size: int

    @classmethod
    def from_pool(cls, kvcache: Any, page_size: int) -> SglangKVBuffers:
        """The buffers of an SGLang device pool (``token_to_kv_pool_allocator.get_kvcache()``)."""
        layout = getattr(kvcache, "kv_cache_layout", "nhd")
        if layout != "nhd":
            raise LayoutError(f"SGLang KV cache layout {layout!r}: kvstrata's SGLang adapter addresses the NHD "
                              "layout only (unset SGLANG_USE_HND_KVCACHE)")
        if getattr(kvcache, "start_layer", 0):
            raise LayoutError("SGLang pipeline-parallel stages (start_layer > 0) are not supported")
        if getattr(kvcache, "k_buffer", None) is not None and getattr(kvcache, "v_buffer", None) is not None:
            return cls(tuple(kvcache.k_buffer), tuple(kvcache.v_buffer), page_size)
        if getattr(kvcache, "kv_buffer", None) is not None:
            return cls(tuple(kvcache.kv_buffer), None, page_size)
        raise LayoutError(f"{type(kvcache).__name__} has neither k_buffer/v_buffer (MHA) nor kv_buffer (MLA)")

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def planes(self) -> list[torch.Tensor]:
        return list(self.k) + (list(self.v) if self.v is not None else [])


def _check_layers(name: str, tensors: Sequence[torch.Tensor], first: torch.Tensor) -> None:
    for layer, t in enumerate(tensors):
        if t.dim() != 3 or t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise LayoutError(f"SGLang {name} layer {layer}: every layer must be a contiguous {tuple(first.shape)} "
                              f"{first.dtype} [slots, heads, head_dim] tensor, got {tuple(t.shape)} {t.dtype}")
        if t.device != first.device:
            raise LayoutError(f"SGLang {name} layer {layer} is on {t.device}, layer 0 on {first.device}")


def describe_buffers(buffers: SglangKVBuffers) -> tuple[PagedKVLayout, list[torch.Tensor]]:
    """The layout of SGLang's buffers and this process's byte regions over them (one per layer and plane)."""
    if not buffers.k:
        raise LayoutError("SGLang handed no KV layers")
    first = buffers.k[0]
    if first.dim() != 3:
        raise LayoutError(f"expected SGLang's [slots, heads, head_dim] per layer, got shape {tuple(first.shape)}")
    if first.dtype not in TORCH_DTYPES:
        raise LayoutError(f"SGLang KV dtype {first.dtype} is not one kvstrata moves ({sorted(TORCH_DTYPES.values())})")
    _check_layers("k_buffer" if buffers.v is not None else "kv_buffer", buffers.k, first)
    if buffers.v is not None:
        if len(buffers.v) != len(buffers.k):
            raise LayoutError(f"SGLang has {len(buffers.k)} K layers and {len(buffers.v)} V layers")
        _check_layers("v_buffer", buffers.v, first)  # kvstrata's planes share one head size
    ps = buffers.page_size
    if ps <= 0:
        raise LayoutError(f"SGLang page size must be positive, got {ps}")
    slots, heads, head_dim = first.shape
    num_slots = (slots // ps) * ps
    regions = [t.view(-1).view(torch.uint8) for t in buffers.planes()]
    local = [Region("local", r.numel()) for r in regions]
    nk = len(buffers.k)
    layout = sglang_layout(num_layers=nk, num_slots=num_slots, page_size=ps, num_heads=heads, head_size=head_dim,
                           dtype=TORCH_DTYPES[first.dtype], k_regions=local[:nk],
                           v_regions=local[nk:] if buffers.v is not None else None)
    return layout, regions


def blocks_of_slots(slots: torch.Tensor, page_size: int) -> list[int]:
    """SGLang token slots (whole pages, in order) as kvstrata block ids; LayoutError if they are not pages."""
    flat = slots.reshape(-1).to(device="cpu", dtype=torch.int64)
    n = flat.numel()
    if n == 0 or n % page_size:
        raise LayoutError(f"{n} token slots are not a whole number of {page_size}-token pages")
    pages = flat.view(-1, page_size)
    starts = pages[:, 0]
    if bool((starts % page_size).any()) or not torch.equal(pages - starts[:, None],
                                                          torch.arange(page_size).expand_as(pages)):
        raise LayoutError("the token slots are not whole, page-aligned pages (SGLang's paged allocator hands "
                          "those out when page_size > 1)")
    return (starts // page_size).tolist()


HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
"""SGLang HiCache host layouts kvstrata's storage backend describes (``--hicache-mem-layout``)."""


@dataclass(frozen=True)
class SglangHostPool:
    """SGLang's HiCache host pool (``MHATokenToKVPoolHost``): its K and V tensors in one host layout.

    Shapes per layout (SGLang's ``init_kv_buffer``), for K and for V:
    ``layer_first`` ``[layers, slots, heads, dim]``, ``page_first`` ``[slots, layers, heads, dim]``,
    ``page_first_direct`` ``[pages, layers, page, heads, dim]``.
    """

    k: torch.Tensor
    v: torch.Tensor
    layout: str
    page_size: int

    @classmethod
    def from_host_pool(cls, host_pool: Any) -> SglangHostPool:
        layout = getattr(host_pool, "layout", None)
        if layout not in HOST_LAYOUTS:
            raise LayoutError(f"SGLang host layout {layout!r}: kvstrata's HiCache backend describes {HOST_LAYOUTS}")
        if getattr(host_pool, "k_buffer", None) is None or getattr(host_pool, "v_buffer", None) is None:
            raise LayoutError(f"{type(host_pool).__name__} has no k_buffer/v_buffer: only MHA host pools are "
                              "supported by kvstrata's HiCache backend")
        return cls(host_pool.k_buffer, host_pool.v_buffer, layout, int(host_pool.page_size))

    @property
    def device(self) -> torch.device:
        return self.k.device


def describe_host_pool(pool: SglangHostPool) -> tuple[PagedKVLayout, list[torch.Tensor]]:
    """The strided layout of a HiCache host pool: region 0 is K, region 1 is V, both in ``pool.layout``."""
    k, v, ps = pool.k, pool.v, pool.page_size
    if k.shape != v.shape or k.dtype != v.dtype or not k.is_contiguous() or not v.is_contiguous():
        raise LayoutError(f"SGLang host K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} must be "
                          "contiguous tensors of one shape (kvstrata's planes share one head size)")
    if k.dtype not in TORCH_DTYPES:
        raise LayoutError(f"SGLang host KV dtype {k.dtype} is not one kvstrata moves")
    es = k.element_size()
    if pool.layout == "layer_first":
        layers, slots, heads, dim = k.shape
        hb = dim * es
        layer_offset, token_stride = slots * heads * hb, heads * hb
        block_stride = ps * token_stride
    elif pool.layout == "page_first":
        slots, layers, heads, dim = k.shape
        hb = dim * es
        layer_offset, token_stride = heads * hb, layers * heads * hb
        block_stride = ps * token_stride
    else:  # page_first_direct
        pages, layers, page, heads, dim = k.shape
        if page != ps:
            raise LayoutError(f"SGLang page_first_direct host pool pages of {page} tokens, page size {ps}")
        slots, hb = pages * page, dim * es
        layer_offset, token_stride = page * heads * hb, heads * hb
        block_stride = layers * page * heads * hb
    regions = [k.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)]
    layout = PagedKVLayout(
        format=f"sglang-host-{pool.layout}", num_layers=layers, kv_size=2, num_blocks=slots // ps, block_size=ps,
        num_heads=heads, head_bytes=hb, dtype=TORCH_DTYPES[k.dtype],
        offsets=tuple(((0, i * layer_offset), (1, i * layer_offset)) for i in range(layers)),
        block_stride=block_stride, token_stride=token_stride, head_stride=hb,
        regions=(Region("local", regions[0].numel()), Region("local", regions[1].numel())))
    return layout, regions
