"""The reference adapter: kvstrata's reference engine plugged in through the hook specification.

It is registered exactly as every other adapter is (entry point ``reference``
in group ``kvstrata.adapters``, see pyproject.toml) and needs nothing but
kvstrata, so the conformance suite always has one adapter that runs anywhere,
and adapter authors have a complete, small example of each hook.

The engine is :class:`kvstrata.core.testing.reference_engine.ReferenceEngine`:
a paged KV cache in one private shared-memory segment, laid out
``[layer][kv, block, token, head, head_size]``, whose "prefill" writes KV that
is a pure function of token, position, layer and plane. What it hands an
adapter as its KV cache is a :class:`ReferenceKVCache` (the analogue of vLLM's
``dict[layer_name, Tensor]``), and :func:`kvstrata_describe_kv_layout`
translates that into the core's strided :class:`PagedKVLayout`.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import AdapterInfo, HarnessSpec, KVCacheDescription, NotSupported
from kvstrata.core.testing.runtime_driver import RuntimeDriver
from kvstrata.core.testing.reference_engine import ModelShape, ReferenceEngine, synthetic_kv
from kvstrata.core.transfer.layouts import PagedKVLayout, Region, blocks_layout
from kvstrata.core.transfer.torch_executor import plane_view, scatter_staged

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


@hookimpl
def kvstrata_conformance_driver(spec: HarnessSpec) -> "ReferenceConformanceDriver":
    return ReferenceConformanceDriver(spec)


# --- the engine side the conformance suite drives --------------------------------------


class ReferenceCache:
    """The reference engine's cache, with what the conformance suite reads and writes in it.

    Supports hybrid caches: with ``kv_groups > 1`` each group of layers has its
    own block table (``allocate`` hands out distinct blocks per group), which
    is exactly what the planner must refuse to stage layer by layer.
    """

    def __init__(self, spec: HarnessSpec) -> None:
        self.spec = spec
        self.shape = ModelShape(spec.num_layers, spec.kv_size, spec.num_heads, spec.head_size, spec.dtype)
        groups = layer_groups_for(spec.num_layers, spec.kv_groups)
        self._engine = ReferenceEngine(self.shape, num_blocks=spec.num_blocks, block_size=spec.block_size)
        self.kv_caches = ReferenceKVCache(self._engine.segment.name, self._engine.regions[0].numel(), self.shape,
                                          spec.num_blocks, spec.block_size, groups,
                                          tuple(self._engine.regions))
        # The engine's own view of its cache, hybrid or not (what its kernels would address).
        self._layout = reference_layout(self.kv_caches)
        self._group_of_layer = self._layout.group_of_layer()
        self._num_groups = len(self._layout.groups)

    def allocate(self, num_tokens: int) -> list[list[int]]:
        return [self._engine.allocate(num_tokens) for _ in range(self._num_groups)]

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        for group in block_ids:
            self._engine.free(group)

    def clear(self, block_ids: Sequence[Sequence[int]]) -> None:
        for layer in range(self.shape.num_layers):
            blocks = list(block_ids[self._group_of_layer[layer]])
            for k in range(self.shape.kv_size):
                plane_view(self._engine.regions, self._layout, layer, k)[blocks] = 0

    def _slots(self, blocks: Sequence[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(num_tokens, dtype=torch.int64)
        bs = self.spec.block_size
        return torch.as_tensor(list(blocks), dtype=torch.int64)[pos // bs], pos % bs

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)
        n = len(tokens)
        pos = torch.arange(n)
        staged = torch.stack([
            torch.stack([synthetic_kv(tokens, pos, layer, k, self.shape) for layer in range(self.shape.num_layers)])
            for k in range(self.shape.kv_size)])
        slots = [self._slots(block_ids[g], n) for g in range(self._num_groups)]
        scatter_staged(staged, self._engine.regions, self._layout, [b for b, _ in slots], [o for _, o in slots])

    def read_layer(self, block_ids: Sequence[Sequence[int]], layer: int, num_tokens: int) -> bytes:
        b, o = self._slots(block_ids[self._group_of_layer[layer]], num_tokens)
        planes = [plane_view(self._engine.regions, self._layout, layer, k)[b, o] for k in range(self.shape.kv_size)]
        return torch.stack(planes).contiguous().numpy().tobytes()

    def close(self) -> None:
        self.kv_caches = None  # drop the views before the segment goes
        self._engine.close()


class ReferenceConformanceDriver(RuntimeDriver, ReferenceCache):
    """The reference engine's engine side: it calls the core's runtimes directly (it has no connector API)."""

    def __init__(self, spec: HarnessSpec, adapter: Any = None) -> None:
        ReferenceCache.__init__(self, spec)
        RuntimeDriver.__init__(self, spec, adapter or load_adapter(sys.modules[__name__]))

    def close(self) -> None:
        RuntimeDriver.close(self)
        ReferenceCache.close(self)
