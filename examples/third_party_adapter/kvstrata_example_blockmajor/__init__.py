"""A kvstrata adapter for an engine with a block-major KV pool, shipped as its own distribution.

The engine keeps one shared-memory pool ``[blocks, layers, kv, heads, tokens, head]``
(what TensorRT-LLM hands a connector, HND inside a block). Everything kvstrata
needs from it goes through the hooks below; kvstrata itself knows nothing of
this package beyond its entry point.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

import torch

from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import AdapterInfo, HarnessSpec, KVCacheDescription, NotSupported
from kvstrata.core.testing.runtime_driver import RuntimeDriver
from kvstrata.core.transfer.layouts import DTYPE_SIZES, PagedKVLayout, Region, trtllm_pool_layout
from kvstrata.core.shm import create_cache_segment
from kvstrata.core.testing.reference_engine import ModelShape, synthetic_kv
from kvstrata.core.transfer.torch_executor import plane_view, scatter_staged

NAME = "blockmajor"


@dataclass(frozen=True)
class BlockMajorPool:
    """What the engine hands its connector: the pool's memory and shape."""

    segment_name: str
    size: int
    num_blocks: int
    block_size: int
    shape: ModelShape


def pool_bytes(shape: ModelShape, num_blocks: int, block_size: int) -> int:
    return (num_blocks * shape.num_layers * shape.kv_size * shape.num_heads * block_size * shape.head_size
            * DTYPE_SIZES[shape.dtype])


@hookimpl
def kvstrata_adapter_info() -> AdapterInfo:
    return AdapterInfo(name=NAME, engine="block-major example engine", engine_package=None,
                       install_hint="pip install ./examples/third_party_adapter", placements=("server",))


def pool_layout(pool: BlockMajorPool) -> PagedKVLayout:
    s = pool.shape
    return trtllm_pool_layout(num_layers=s.num_layers, num_blocks=pool.num_blocks, block_size=pool.block_size,
                              num_heads=s.num_heads, head_size=s.head_size, dtype=s.dtype,
                              region=Region("shm", pool.size, pool.segment_name), kv_size=s.kv_size)


@hookimpl
def kvstrata_describe_kv_cache(kv_caches: BlockMajorPool, placement: str) -> KVCacheDescription:
    if placement != "server":
        raise NotSupported("the block-major example is written by the server only")
    return KVCacheDescription(pool_layout(kv_caches), [])


@hookimpl
def kvstrata_conformance_driver(spec: HarnessSpec) -> "BlockMajorDriver":
    if spec.kv_groups > 1:
        raise NotSupported("the block-major engine has one block table for all layers (no hybrid models)")
    return BlockMajorDriver(spec)


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

    def __init__(self, spec: HarnessSpec) -> None:
        BlockMajorEngine.__init__(self, spec)
        RuntimeDriver.__init__(self, spec, load_adapter(sys.modules[__name__]))

    def close(self) -> None:
        RuntimeDriver.close(self)
        BlockMajorEngine.close(self)
