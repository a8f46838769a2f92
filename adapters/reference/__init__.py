"""The reference adapter: kvstrata's reference engine plugged in through the hook specification.

It is registered exactly as every other adapter is (entry point ``reference``
in group ``kvstrata.adapters``, see pyproject.toml) and needs nothing but
kvstrata, so the conformance suite always has one adapter that runs anywhere,
and adapter authors have a complete, small example of each hook.

The engine is :class:`kvstrata.adapters.reference.engine.ReferenceEngine`:
a paged KV cache in one private shared-memory segment, laid out
``[layer][kv, block, token, head, head_size]``, whose "prefill" writes KV that
is a pure function of token, position, layer and plane. What it hands an
adapter as its KV cache is a :class:`ReferenceKVCache` (the analogue of vLLM's
``dict[layer_name, Tensor]``), and :func:`kvstrata_describe_kv_cache`
translates that into the core's strided :class:`PagedKVLayout`.

Its conformance driver (the engine side the suite drives) is
:mod:`kvstrata.adapters.reference.conformance`, published in the suite's own
entry-point group ``kvstrata.conformance_drivers``; this module never imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.types import AdapterInfo, KVCacheDescription, NotSupported
from kvstrata.adapters.reference.engine import ModelShape
from kvstrata.core.transfer.layouts import PagedKVLayout, Region, blocks_layout

NAME = "reference"


@dataclass(frozen=True)
class ReferenceKVCache:
    """What the reference engine hands its adapter: where its cache is and how it is shaped."""

    segment_name: str
    size: int
    shape: ModelShape
    num_blocks: int
    block_size: int
    layer_groups: tuple[tuple[int, ...], ...]
    regions: tuple[torch.Tensor, ...]
    """This process's views of the cache (engine placement copies through them)."""


def layer_groups_for(num_layers: int, kv_groups: int) -> tuple[tuple[int, ...], ...]:
    """Split layers into ``kv_groups`` contiguous groups (empty tuple: one group, not hybrid)."""
    if kv_groups <= 1:
        return ()
    if kv_groups > num_layers:
        raise NotSupported(f"{kv_groups} KV groups need at least that many layers, the model has {num_layers}")
    bounds = [round(i * num_layers / kv_groups) for i in range(kv_groups + 1)]
    return tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(kv_groups))


# --- hooks ----------------------------------------------------------------------------


@hookimpl
def kvstrata_adapter_info() -> AdapterInfo:
    return AdapterInfo(name=NAME, engine="kvstrata reference engine", engine_package=None,
                       description="CPU paged KV cache in shared memory; the conformance suite's always-available "
                                   "adapter and the worked example of every hook")


def reference_layout(kv_caches: "ReferenceKVCache") -> PagedKVLayout:
    s = kv_caches.shape
    layout = blocks_layout(num_layers=s.num_layers, kv_size=s.kv_size, num_blocks=kv_caches.num_blocks,
                           block_size=kv_caches.block_size, num_heads=s.num_heads, head_size=s.head_size,
                           dtype=s.dtype, region=Region("shm", kv_caches.size, kv_caches.segment_name))
    if kv_caches.layer_groups:
        layout = dataclasses.replace(layout, layer_groups=kv_caches.layer_groups)
    return layout


@hookimpl
def kvstrata_describe_kv_cache(kv_caches: Any, placement: str) -> KVCacheDescription:
    # The cache is in shared memory, so both placements describe it the same way; worker
    # placement copies through the engine's own views of it (the regions).
    if not isinstance(kv_caches, ReferenceKVCache):
        raise TypeError(f"the reference adapter describes a ReferenceKVCache, got {type(kv_caches).__name__}")
    return KVCacheDescription(reference_layout(kv_caches), list(kv_caches.regions))
