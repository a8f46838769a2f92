"""The TensorRT-LLM adapter's hook implementations (entry point ``trtllm`` in ``kvstrata.adapters``).

:mod:`.connector` translates TensorRT-LLM's ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker``
onto the core's engine runtime; these hooks are where TensorRT-LLM differs from other engines:

* its cache: one pool ``[num_blocks, num_layers, kv_factor, block_size_elems]`` (HND in a block), moved
  as whole blocks (:mod:`.kv_layout`). On a GPU the pool is ``cudaMalloc``'ed by TensorRT-LLM outside
  torch's caching allocator, so torch cannot export it by CUDA IPC: the engine-placement ``worker``
  placement (this process copies from the server's pool, registered for DMA) needs no export and is the
  GPU placement; ``server`` is refused there by name. On CPU the server placement works only for a pool in
  a cache segment this process made (:func:`kvstrata.core.shm.create_cache_segment`); TensorRT-LLM itself
  does not run on CPU;
* a prompt keeps at least one token for TensorRT-LLM to compute (it must have something to run), so the
  block holding the last prompt token is never loaded;
* on CUDA a layer wait makes the forward's stream wait on the layer's event (no CPU block on the copy).

Importing this module does not import TensorRT-LLM.
"""

from __future__ import annotations

from typing import Any

from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.types import (
    AdapterInfo,
    KVCacheDescription,
    NotSupported,
)
from kvstrata.core.adapter_api.defaults import whole_blocks_before_the_last_token
from kvstrata.core.arrival.events import EventBackend
from kvstrata.core.shm import cache_segment_holding
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE, Region

from .kv_layout import TrtllmKvPool, byte_view, pool_layout

NAME = "trtllm"


def describe(pool: Any, placement: str) -> KVCacheDescription:
    """TensorRT-LLM's pool for a placement: the layout the server is told and this process's region over it."""
    if not isinstance(pool, TrtllmKvPool):
        raise TypeError(f"the TensorRT-LLM adapter registers a TrtllmKvPool (the pool tensor and its "
                        f"tokens_per_block), got {type(pool).__name__}")
    flat = byte_view(pool)
    device = pool.tensor.device
    if placement == PLACEMENT_ENGINE:
        layout = pool_layout(pool, Region("local", flat.numel()))
        return KVCacheDescription(layout, [flat], str(device) if device.type == "cuda" else "cpu")
    if device.type == "cuda":
        raise NotSupported("TensorRT-LLM allocates its KV pool with cudaMalloc outside torch's caching allocator, "
                           "so torch's CUDA IPC export refuses it; use the engine-placement engine placement")
    segment = cache_segment_holding(flat.data_ptr(), flat.numel())
    if segment is None:
        raise NotSupported("this CPU pool is private memory, which the server cannot map (a pool the server may "
                           "write lies in a segment made by kvstrata.core.shm.create_cache_segment)")
    name, base, size = segment
    if flat.data_ptr() != base:
        raise NotSupported(f"the CPU pool starts {flat.data_ptr() - base} bytes into its cache segment {name}; the "
                           "server maps a pool that starts where the segment's cache does")
    return KVCacheDescription(pool_layout(pool, Region("shm", flat.numel(), name)), [flat])


@hookimpl
def kvstrata_adapter_info() -> AdapterInfo:
    return AdapterInfo(name=NAME, engine="TensorRT-LLM", engine_package="tensorrt_llm",
                       install_hint="TensorRT-LLM 1.2.x from NVIDIA's package index "
                                    "(pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com); "
                                    "kvstrata has no extra for it, see examples/trtllm/README.md",
                       description="KvCacheConnectorScheduler/Worker for TensorRT-LLM 1.2.x "
                                   "(kvstrata.adapters.trtllm)",
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
    # TensorRT-LLM needs at least one prompt token to compute: never load the block holding the last one.
    return whole_blocks_before_the_last_token(num_prompt_tokens, block_size)
