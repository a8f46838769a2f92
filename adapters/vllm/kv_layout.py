"""Describe vLLM's registered KV cache tensors as a kvstrata PagedKVLayout.

vLLM (0.32 / 0.33) hands ``register_kv_caches`` one tensor per attention layer,
logical shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, all views
of one shared buffer.

* CPU: the CPU attention kernel stores K transposed inside a (block, head) page
  (``[head_size][block_size]``) and V row-major. On its ``vec`` and ``vec16``
  paths kvstrata reads that per token (:func:`cpu_token_layout`: K's elements a
  block's tokens apart), so the objects are the per-token ones every engine of
  the model shares; the other paths (``amx``, ``neon``, ...) pack otherwise, and
  their whole (layer, block) pages move as opaque bytes (:func:`cpu_page_layout`,
  the packing in the format, and so in every key). The cache is private memory,
  so this is the engine placement.
* CUDA: per-token addressing is real (LBNHC or LBHNC, read from the strides), the
  server maps the buffer by CUDA IPC and writes it itself (server placement).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kvstrata.core.transfer.layouts import LayoutError, PagedKVLayout, Region, vllm_layout

_LAYER_INDEX = re.compile(r"\.(\d+)\.")

TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.uint8: "uint8", torch.int8: "int8"}


def layer_index(name: str) -> int:
    """``model.layers.17.self_attn.attn`` -> 17 (the one integer in vLLM's layer names)."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if len(found) != 1:
        raise LayoutError(f"cannot tell the layer index of {name!r}: expected exactly one integer in the name")
    return int(found[0])


def ordered_layers(kv_caches: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    items = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
    indices = [layer_index(n) for n, _ in items]
    if indices != list(range(len(items))):
        raise LayoutError(f"vLLM layer indices {indices} are not 0..{len(items) - 1}; "
                          "pipeline-parallel stages are not supported yet")
    return items


def cpu_attention_isa(kv_cache: torch.Tensor) -> str:
    """The instruction-set path vLLM's CPU attention kernel takes for this cache (``vec``, ``vec16``, ``amx``,
    ...: vLLM's choice from the dtype, block size and head size), which decides how it packs a page."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, _, block_size, two_heads = kv_cache.shape
    return _get_attn_isa(kv_cache.dtype, block_size, two_heads // 2)


PER_TOKEN_ISAS = ("vec", "vec16")
"""The CPU kernel's paths whose page is read here per token (K transposed: ``[head_size][block_size]`` per
head, then V ``[block_size][head_size]``), as checked against vLLM's own ``cpu_attn_reshape_and_cache``; any
other (``amx``, ``neon``, ...) packs otherwise, and its pages move opaque."""


def _cpu_layers(kv_caches: dict[str, torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    layers = ordered_layers(kv_caches)
    first = layers[0][1]
    if first.dim() != 4:
        raise LayoutError(f"expected [blocks, kv_heads, block_size, 2*head] per layer, got shape {tuple(first.shape)}")
    regions = []
    for name, t in layers:
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise LayoutError(f"layer {name}: every layer must be a contiguous {tuple(first.shape)} "
                              f"{first.dtype} tensor, got {tuple(t.shape)} {t.dtype}")
        regions.append(t.view(-1).view(torch.uint8))
    return layers, regions


def cpu_token_layout(kv_caches: dict[str, torch.Tensor]) -> tuple[PagedKVLayout, list[torch.Tensor]]:
    """The per-token layout of a CPU cache the kernel packs on one of :data:`PER_TOKEN_ISAS`: K and V
    planes of each (block, head) page, K's elements a block's tokens apart (``PagedKVLayout.plane_strides``),
    so its objects are kvstrata's per-token ones, the bytes SGLang and vLLM on CUDA store for the same model."""
    layers, regions = _cpu_layers(kv_caches)
    first = layers[0][1]
    num_blocks, heads, block_size, two_heads = first.shape
    if first.dtype not in TORCH_DTYPES:
        raise LayoutError(f"vLLM CPU KV dtype {first.dtype} is not one kvstrata reads per token")
    es = first.element_size()
    head_bytes = two_heads // 2 * es
    v_offset = block_size * head_bytes  # V follows K inside a (block, head) page
    layout = PagedKVLayout(
        format="vllm-cpu", num_layers=len(layers), kv_size=2, num_blocks=num_blocks, block_size=block_size,
        num_heads=heads, head_bytes=head_bytes, dtype=TORCH_DTYPES[first.dtype],
        offsets=tuple(((l, 0), (l, v_offset)) for l in range(len(layers))),
        block_stride=first.stride(0) * es, token_stride=head_bytes, head_stride=first.stride(1) * es,
        regions=tuple(Region("local", r.numel()) for r in regions),
        plane_strides=((es, block_size * es), (head_bytes, es)),
    )
    return layout, regions


def cpu_page_layout(kv_caches: dict[str, torch.Tensor], isa: str = "") -> tuple[PagedKVLayout, list[torch.Tensor]]:
    """The opaque-page layout of a CPU cache and the per-layer byte regions it addresses. The kernel's path
    (``isa``, :func:`cpu_attention_isa`) and the dtype name the pages' format, and so are in every chunk's key:
    a host taking another path (AMX or not) never reads these pages, through a shared tier either."""
    layers, regions = _cpu_layers(kv_caches)
    first = layers[0][1]
    packing = f"{isa}-{str(first.dtype).removeprefix('torch.')}" if isa else ""
    num_blocks, _, block_size, _ = first.shape
    page_bytes = first.stride(0) * first.element_size()
    if page_bytes % block_size:
        raise LayoutError(f"page of {page_bytes} bytes does not split into {block_size} rows")
    row = page_bytes // block_size
    layout = PagedKVLayout(
        format=f"vllm-cpu-{packing}-pages" if packing else "vllm-cpu-pages", num_layers=len(layers), kv_size=1,
        num_blocks=num_blocks, block_size=block_size,
        num_heads=1, head_bytes=row, dtype="uint8",
        offsets=tuple(((l, 0),) for l in range(len(layers))),
        block_stride=page_bytes, token_stride=row, head_stride=row,
        regions=tuple(Region("local", r.numel()) for r in regions),
    )
    return layout, regions


def cuda_layout(kv_caches: dict[str, torch.Tensor], *, export: bool = True) -> tuple[PagedKVLayout, Any]:
    """The per-token layout of a CUDA cache and its one buffer (a flat uint8 tensor over the shared storage).

    ``export``: the region is exported by CUDA IPC for the server to open (server placement); without it the
    region is this process's own (engine-placement loads: no IPC export needed).
    """
    layers = ordered_layers(kv_caches)
    first = layers[0][1]
    num_blocks, heads, block_size, channels = first.shape
    es = first.element_size()
    if first.stride(3) != 1:
        raise LayoutError("the channel dim of vLLM's KV view must be contiguous")
    if first.stride(2) == channels and first.stride(1) == block_size * channels:
        physical = "LBHNC"
    elif first.stride(1) == channels and first.stride(2) == heads * channels:
        physical = "LBNHC"
    else:
        raise LayoutError(f"unrecognised vLLM KV strides {first.stride()} for shape {tuple(first.shape)}")
    storage = first.untyped_storage()
    base = storage.data_ptr()
    buffer = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    if export:
        from kvstrata.native.cuda_ipc import export_region

        region = export_region(buffer)
    else:
        region = Region("local", buffer.numel())
    offsets = [t.data_ptr() - base for _, t in layers]
    layer_bytes = offsets[1] - offsets[0] if len(offsets) > 1 else num_blocks * first.stride(0) * es
    if offsets != [i * layer_bytes for i in range(len(offsets))]:
        raise LayoutError("vLLM layers are not evenly spaced in their shared buffer")
    layout = vllm_layout(num_layers=len(layers), num_blocks=num_blocks, block_size=block_size, num_heads=heads,
                         head_size=channels // 2, dtype=TORCH_DTYPES[first.dtype], region=region,
                         physical=physical, layer_bytes=layer_bytes)
    return layout, buffer
