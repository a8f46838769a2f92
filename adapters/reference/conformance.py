"""The reference adapter's conformance driver: the reference engine's engine side, for the conformance suite.

Published in the ``kvstrata.conformance_drivers`` entry-point group (name ``reference``), which only the
conformance suite reads; the adapter (:mod:`kvstrata.adapters.reference`) never imports this module.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstrata.adapters import reference
from kvstrata.adapters.reference import ReferenceKVCache, layer_groups_for, reference_layout
from kvstrata.core.adapter_api.plugins import Adapter, load_adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.adapters.reference.engine import ModelShape, ReferenceEngine, synthetic_kv
from kvstrata.conformance_tests.runtime_driver import RuntimeDriver
from kvstrata.core.transfer.torch_executor import plane_view, scatter_staged


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

    def __init__(self, spec: HarnessSpec, adapter: Adapter | None = None) -> None:
        ReferenceCache.__init__(self, spec)
        RuntimeDriver.__init__(self, spec, adapter or load_adapter(reference))

    def close(self) -> None:
        RuntimeDriver.close(self)
        ReferenceCache.close(self)
