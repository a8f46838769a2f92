"""The vLLM adapter's hook implementations (entry point ``vllm`` in ``kvstrata.adapters``).

:mod:`.connector` translates ``KVConnectorBase_V1`` onto the core's engine
runtime; these hooks are where vLLM differs from other engines, and the
runtime calls them:

* its cache: one tensor per layer, ``[blocks, kv_heads, block_size, 2*head]``
  views of one buffer. On CPU the pages move whole as opaque bytes and the
  cache is private memory (engine placement), unless its buffer lies in a cache
  segment this process made (:func:`kvstrata.core.shm.create_cache_segment`:
  server placement too);
  on CUDA the server maps it by CUDA IPC (server placement);
* vLLM recomputes the last prompt token, so the block holding it is never loaded;
* a failed load is reported as block ids, which vLLM recomputes
  (``get_block_ids_with_load_errors``, ``kv_load_failure_policy: "recompute"``);
* on CUDA a layer wait orders the compute stream on the layer's event.

Importing this module does not import vLLM: the GPU tests drive the runtime
with these hooks on a machine where vLLM does not install.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.types import AdapterInfo, KVCacheDescription, NotSupported
from kvstrata.core.adapter_api.defaults import whole_blocks_before_the_last_token
from kvstrata.core.arrival.events import EventBackend
from kvstrata.core.shm import cache_segment_holding
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE, PagedKVLayout, Region

from .kv_layout import PER_TOKEN_ISAS, cpu_attention_isa, cpu_page_layout, cpu_token_layout, cuda_layout

NAME = "vllm"


def describe(kv_caches: dict[str, torch.Tensor], placement: str) -> KVCacheDescription:
    """vLLM's cache for a placement: the layout the server is told and this process's regions over it."""
    first = next(iter(kv_caches.values()))
    if first.device.type == "cuda":
        # server: the server opens the buffer by CUDA IPC; worker: this process copies (no export)
        layout, buffer = cuda_layout(kv_caches, export=placement == PLACEMENT_SERVER)
        return KVCacheDescription(layout, [buffer], str(first.device))
    isa = cpu_attention_isa(first)
    if isa in PER_TOKEN_ISAS:
        layout, regions = cpu_token_layout(kv_caches)
    else:
        layout, regions = cpu_page_layout(kv_caches, isa)
    if placement == PLACEMENT_ENGINE:
        return KVCacheDescription(layout, regions)
    start = min(r.data_ptr() for r in regions)
    end = max(r.data_ptr() + r.numel() for r in regions)
    segment = cache_segment_holding(start, end - start)
    if segment is None:
        raise NotSupported("vLLM allocates its CPU cache in private memory, which the server cannot map (a cache "
                           "the server may write lies in a segment made by kvstrata.core.shm.create_cache_segment)")
    name, base, size = segment
    offsets = tuple(tuple((0, r.data_ptr() - base + off) for _, off in per_kv)
                    for r, per_kv in zip(regions, layout.offsets))
    shared = PagedKVLayout(**{**layout.__dict__, "offsets": offsets, "regions": (Region("shm", size, name),)})
    return KVCacheDescription(shared, regions)


@hookimpl
def kvstrata_adapter_info() -> AdapterInfo:
    return AdapterInfo(name=NAME, engine="vLLM", engine_package="vllm", pip_extra="vllm",
                       description="KVConnectorBase_V1 with first-slice release (kvstrata.adapters.vllm)",
                       placements=(PLACEMENT_SERVER, PLACEMENT_ENGINE))


@hookimpl
def kvstrata_describe_kv_cache(kv_caches: Any, placement: str) -> KVCacheDescription:
    return describe(kv_caches, placement)


@hookimpl
def kvstrata_event_backend(device: str) -> EventBackend:
    from kvstrata.native.cuda_events import event_backend_for

    return event_backend_for(device)


@hookimpl
def kvstrata_loadable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    # vLLM recomputes the last prompt token and writes its KV before the layer wait:
    # a page copy into the block holding it would overwrite that token's KV.
    return whole_blocks_before_the_last_token(num_prompt_tokens, block_size)


@hookimpl
def kvstrata_report_load_failure(engine_request_id: Any, block_ids: list[list[int]], reason: str) -> set[int]:
    return {int(b) for group in block_ids for b in group}
