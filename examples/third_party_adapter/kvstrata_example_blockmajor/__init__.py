"""A kvstrata adapter for an engine with a block-major KV pool, shipped as its own distribution.

The engine keeps one shared-memory pool ``[blocks, layers, kv, heads, tokens, head]``
(what TensorRT-LLM hands a connector, HND inside a block). Everything kvstrata
needs from it goes through the hooks below; kvstrata itself knows nothing of
this package beyond its entry points.

Its conformance driver (:mod:`.conformance`, the engine side the conformance
suite drives) is published in the suite's own entry-point group,
``kvstrata.conformance_drivers``; this module, which an engine loads, never
imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.types import AdapterInfo, KVCacheDescription, NotSupported
from kvstrata.adapters.reference.engine import ModelShape
from kvstrata.core.transfer.layouts import DTYPE_SIZES, PagedKVLayout, Region, trtllm_pool_layout

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
