"""``KvstrataLinker``: SGLang's ``UnifiedCacheLinker`` on kvstrata's engine runtime.

Configured with ``--enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
--unified-cache-external-linker-config '{"linker": "KvstrataLinker", "linker_module_path":
"kvstrata.adapters.sglang.linker", "linker_extra_config": {...kvstrata settings...}}'``; SGLang constructs
one per TP rank, in the scheduler process, as ``KvstrataLinker(server_args, params, components=...,
extra_config=..., forward_stream=...)``.

This module is the translation of SGLang's calls onto :class:`~.loader.LayerLoader` (which owns the
runtime): SGLang's ``PoolTransfer`` (page-hash ``keys`` and int64 token-slot ``device_indices``) in, page
counts and booleans out. The KV pool is SGLang's device pool itself (``k_buffer`` / ``v_buffer``, or
``kv_buffer`` for MLA), addressed by :mod:`.kv_layout`; SGLang's pool-group resolver refuses a plain MHA
pool for direct linkers, so the linker names the pool itself (``pools = {PoolName.KV: kvcache}``).
Only the full-attention KV pool is supported: SWA and Mamba components are refused by name.

Shutdown: SGLang closes its linker on the scheduler's graceful exit (a ``ShutdownReq``, which its HTTP server
sends on SIGTERM: the scheduler's event loop ends and ``release_host_resources`` calls
``UnifiedRadixCache.release_host_resources`` -> the linker's ``close``). :meth:`KvstrataLinker.close`
unregisters the cache from the kvstrata server and removes this process's shared-memory segments. As a last
resort it is also an ``atexit`` hook of the scheduler process (an exit SGLang did not close the linker on,
such as the scheduler's exception path). A scheduler killed with SIGKILL (what the offline ``Engine.shutdown``
does to its schedulers, without a ``ShutdownReq``) runs neither: the kvstrata server then forgets its instance
when the connection's lease runs out, and :mod:`.reaper`'s watcher removes its shared-memory segments.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence
from typing import Any

import torch
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from . import hooks, reaper
from .kv_layout import SglangKVBuffers
from .loader import LayerLoader, synchronize_events

log = logging.getLogger(__name__)

CONFIG_WHERE = "--unified-cache-external-linker-config linker_extra_config"


def tp_rank_and_size(group: Any) -> tuple[int, int]:
    """This rank and the world size of SGLang's TP cache group (0, 1 without torch.distributed)."""
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _kv_transfer(transfers: Sequence[PoolTransfer], call: str) -> PoolTransfer:
    for t in transfers:
        if t.name == PoolName.KV:
            return t
    raise ValueError(f"{call}: SGLang passed no {PoolName.KV} transfer (got {[t.name for t in transfers]})")


class KvstrataLinker(UnifiedCacheLinker):
    def __init__(self, server_args: Any, params: Any, *, components: Any = (), extra_config: dict | None = None,
                 forward_stream: Any = None) -> None:
        names = {getattr(c, "name", str(c)) for c in components or ()}
        unsupported = sorted(names - {"FULL"})
        if unsupported:
            raise ValueError(f"kvstrata's SGLang linker loads the full-attention KV pool only; this model also "
                             f"has {unsupported} cache components")
        settings = RuntimeSettings.from_mapping(extra_config or {}, where=CONFIG_WHERE)
        reaper.watch()  # before any segment exists: a SIGKILL of this process leaves none behind
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        buffers = SglangKVBuffers.from_pool(kvcache, params.page_size)
        self.forward_stream = forward_stream
        self.pools = {PoolName.KV: kvcache}
        self.layer_done_counter = LayerWiseLoadCounter(buffers.num_layers)
        rank, world = tp_rank_and_size(getattr(params, "tp_cache_group", None))
        model = settings.model_name or str(getattr(server_args, "served_model_name", None)
                                           or getattr(server_args, "model_path", "sglang-model"))
        runtime = WorkerRuntime(load_adapter(hooks), settings, model=model, rank=rank,
                                world_size=world)
        self.on_cuda = buffers.device.type == "cuda"
        try:
            runtime.register(buffers)
            self.loader = LayerLoader(runtime, self.layer_done_counter, page_size=params.page_size,
                                      wait_for_offload_inputs=synchronize_events if self.on_cuda else None)
        except BaseException:  # SGLang does not close a linker it failed to build: unregister it here
            runtime.close()
            raise
        atexit.register(self.close)
        log.info("kvstrata SGLang linker: %d layers, page %d, rank %d of %d, model %r, server %s", buffers.num_layers,
                 params.page_size, rank, world, model, settings.server_address)

    @property
    def runtime(self) -> WorkerRuntime:
        return self.loader.runtime

    # --- SGLang's calls --------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        keys = list(_kv_transfer(transfers, "lookup").keys or ())
        pages = self.loader.restorable_pages(rid, keys)
        return list(range(1, pages + 1))  # one contiguous pool: every shorter prefix is restorable too

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = _kv_transfer(transfers, "load")
        return self.loader.queue_load(rid, list(kv.keys or ()), kv.device_indices)

    def start_layer_wise_loading(self) -> int:
        return self.loader.start()

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.loader.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        return self.loader.cancel(rid)

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        kv = _kv_transfer(transfers, "offload")
        if not kv.keys or kv.device_indices is None:
            return False
        ready = self.record_offload_ready() if self.on_cuda else []
        self.loader.offload(list(kv.keys), kv.device_indices, ready)
        return True

    def num_completed_offloads(self) -> int:
        return self.loader.num_completed_offloads()

    def pop_completed_offload(self) -> bool:
        return self.loader.pop_completed_offload()

    def reset(self) -> None:
        self.loader.reset()

    def close(self) -> None:
        """Unregister from the kvstrata server and remove this process's segments (idempotent)."""
        atexit.unregister(self.close)
        if self.loader.closed:
            return
        self.loader.close()
        log.info("kvstrata SGLang linker closed (instance %d unregistered if the server answered, "
                 "segments removed)", self.runtime.instance_id)

