"""The block-major example's conformance driver: its engine side, for the conformance suite only.

Published in entry-point group ``kvstrata.conformance_drivers`` under the adapter's own name
(``blockmajor``, see pyproject.toml); the suite calls ``BlockMajorDriver(spec, adapter)``. It imports the
adapter; the adapter never imports it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstrata.conformance_tests.runtime_driver import RuntimeDriver
from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.adapter_api.types import HarnessSpec, NotSupported
from kvstrata.core.shm import create_cache_segment
from kvstrata.adapters.reference.engine import ModelShape, synthetic_kv
from kvstrata.core.transfer.torch_executor import plane_view, scatter_staged

from . import BlockMajorPool, pool_bytes, pool_layout


class BlockMajorEngine:
    """The engine: allocates blocks from the pool, "prefills" synthetic KV, reads layers back."""

    def __init__(self, spec: HarnessSpec) -> None:
        self.spec = spec
        shape = ModelShape(spec.num_layers, spec.kv_size, spec.num_heads, spec.head_size, spec.dtype)
        self.shape = shape
        size = pool_bytes(shape, spec.num_blocks, spec.block_size)
        self._segment = create_cache_segment("blockmajor", size)  # the server checks its proof of ownership
        self._regions = [torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=size)]
        self.kv_caches = BlockMajorPool(self._segment.name, size, spec.num_blocks, spec.block_size, shape)
        self._layout = pool_layout(self.kv_caches)
        self._free = list(range(spec.num_blocks))

    def allocate(self, num_tokens: int) -> list[list[int]]:
        need = -(-num_tokens // self.spec.block_size)
        if need > len(self._free):
            raise RuntimeError(f"block-major pool out of blocks: {need} needed, {len(self._free)} free")
        blocks, self._free = self._free[:need], self._free[need:]
        return [blocks]

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        self._free.extend(block_ids[0])

    def clear(self, block_ids: Sequence[Sequence[int]]) -> None:
        for layer in range(self.shape.num_layers):
            for k in range(self.shape.kv_size):
                plane_view(self._regions, self._layout, layer, k)[list(block_ids[0])] = 0

    def _slots(self, blocks: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n, dtype=torch.int64)
        return torch.as_tensor(list(blocks), dtype=torch.int64)[pos // self.spec.block_size], pos % self.spec.block_size

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)
        pos = torch.arange(len(tokens))
        staged = torch.stack([
            torch.stack([synthetic_kv(tokens, pos, layer, k, self.shape) for layer in range(self.shape.num_layers)])
            for k in range(self.shape.kv_size)])
        b, o = self._slots(block_ids[0], len(tokens))
        scatter_staged(staged, self._regions, self._layout, [b], [o])

    def read_layer(self, block_ids: Sequence[Sequence[int]], layer: int, num_tokens: int) -> bytes:
        b, o = self._slots(block_ids[0], num_tokens)
        planes = [plane_view(self._regions, self._layout, layer, k)[b, o] for k in range(self.shape.kv_size)]
        return torch.stack(planes).contiguous().numpy().tobytes()

    def close(self) -> None:
        self._regions.clear()
        self.kv_caches = None
        self._segment.destroy()


class BlockMajorDriver(RuntimeDriver, BlockMajorEngine):
    """The engine side the conformance suite drives: this engine calls kvstrata's runtimes directly."""

    def __init__(self, spec: HarnessSpec, adapter: Adapter) -> None:
        if spec.kv_groups > 1:
            raise NotSupported("the block-major engine has one block table for all layers (no hybrid models)")
        BlockMajorEngine.__init__(self, spec)
        RuntimeDriver.__init__(self, spec, adapter)

    def close(self) -> None:
        RuntimeDriver.close(self)
        BlockMajorEngine.close(self)
