"""``KvstrataHiCacheStorage``: a HiCache storage backend (SGLang's ``--hicache-storage-backend dynamic``).

Configured with ``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name": "kvstrata", "module_path":
"kvstrata.adapters.sglang.hicache", "class_name": "KvstrataHiCacheStorage", "interface_v1": 1, ...kvstrata
settings...}'``. SGLang constructs it as ``Cls(storage_config, kwargs)`` in each TP rank's scheduler process,
then hands it the host pool (``register_mem_pool_host``), and with ``interface_v1`` calls the zero-copy
``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` with page-hash keys and host token indices.

The host pool is registered with the kvstrata server through a ``WorkerRuntime`` (engine placement: this
process copies between its host pool and the server's L1 pool). Its layout descriptor says which host layout
wrote each page (``layer_first``, ``page_first`` or ``page_first_direct``): a STORE gathers a page through
the writer's layout into kvstrata's layout-free ``[kv, layer, token, head, bytes]`` object, and a RETRIEVE
scatters it through the reader's layout, so a page written in one layout is read converted in another,
never as wrong bytes; an object whose shape (layers, heads, head bytes) differs from the reader's is
refused by the server, which this backend reports as a miss.

Each page is stored under its own one-page key (``CacheKey.for_page_hashes`` with one hash): HiCache hands
over any run of pages, from any position, so one page per object keeps every page addressable whatever the
server's chunk size. HiCache fills host memory before the request is scheduled (its own host-to-device load
is per layer), so these loads run chunk-major.

Shutdown: SGLang closes its storage backend when the scheduler process exits (``UnifiedRadixCache`` registers
an ``atexit`` hook that detaches the backend: its storage threads stop, then ``close``). The backend registers
an ``atexit`` hook of its own as the last resort should that detach fail part way (registered later, it runs
first; SGLang's ``close`` then finds the backend closed).
:meth:`KvstrataHiCacheStorage.close` unregisters the host pool from the kvstrata server and removes this
process's shared-memory segments; from then on every call is answered as a miss without reaching the server.
A scheduler killed with SIGKILL (the offline ``Engine.shutdown``) closes nothing: the server forgets its
instance when the connection's lease runs out, and :mod:`.reaper`'s watcher removes its segments.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.requests import ChunkLocations, LoadSpec, StoreSpec, lock_owner, shard_key
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.transfer.layouts import LayoutError
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType

from . import hooks, reaper
from .kv_layout import SglangHostPool, blocks_of_slots

log = logging.getLogger(__name__)

CONFIG_WHERE = "--hicache-storage-backend-extra-config"
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
                         "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                         "hicache_storage_pass_prefix_keys", "allocator"})
"""Keys of the extra-config JSON that SGLang itself reads; the rest are kvstrata's settings."""
POLL_INTERVAL = 0.0005


class KvstrataHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = {k: v for k, v in (storage_config.extra_config or {}).items() if k not in SGLANG_KEYS}
        if not (storage_config.extra_config or {}).get("interface_v1"):
            raise ValueError(f"{CONFIG_WHERE}: kvstrata's HiCache backend is zero-copy only; set \"interface_v1\": 1")
        if storage_config.is_mla_model:
            raise ValueError("kvstrata's HiCache backend supports MHA host pools only (this model is MLA)")
        self.settings = RuntimeSettings.from_mapping(extra, where=CONFIG_WHERE)
        reaper.watch()  # before any segment exists: a SIGKILL of this process leaves none behind
        self.rank, self.world_size = int(storage_config.tp_rank), int(storage_config.tp_size)
        self.model = self.settings.model_name or str(storage_config.model_name or "sglang-model")
        self.runtime: WorkerRuntime | None = None
        self.page_size = 0
        self.client = CacheClient(self.settings.server_address, timeout=self.settings.lookup_timeout,
                                  **self.settings.client_options())
        self._ids = itertools.count(1)
        self._runtime_lock = threading.Lock()
        self._client_lock = threading.Lock()
        """HiCache calls from its prefetch and its backup threads at once; the runtime is one engine thread's."""
        self._closed = False
        atexit.register(self.close)

    # --- set-up ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = SglangHostPool.from_host_pool(mem_pool_host)
        self.page_size = pool.page_size
        self.runtime = WorkerRuntime(load_adapter(hooks), self.settings, model=self.model, rank=self.rank,
                                     world_size=self.world_size)
        self.runtime.register(pool)
        log.info("kvstrata HiCache backend: host layout %s, page %d, rank %d of %d, model %r, server %s",
                 pool.layout, pool.page_size, self.rank, self.world_size, self.model, self.settings.server_address)

    # --- keys --------------------------------------------------------------------------------

    def _key(self, owner: str, page_hash: str) -> Any:
        return shard_key(owner, self.model, b"", None, rank=self.rank, world_size=self.world_size,
                         instance_id=self.settings.instance_id, page_hashes=(page_hash,),
                         page_size=self.page_size)

    def _held(self, owners: Sequence[str], keys: Sequence[str]) -> list[bool]:
        """Which pages the server holds (page i locked for ``owners[i]`` until its FREE_LOOKUP_LOCKS or
        RETRIEVE)."""
        return [reply is not None for reply in self._lookups(owners, keys)]

    def _lookups(self, owners: Sequence[str], keys: Sequence[str]) -> list[dict[str, Any] | None]:
        """Each page's LOOKUP reply where the server holds it (locked for ``owners[i]``), else None.
        The LOOKUPs go out together and are answered in one round trip."""
        if not keys:
            return []
        if self._closed:
            return [None] * len(keys)
        try:
            with self._client_lock:
                futures = [self.client.lookup_async(self._key(o, h)) for o, h in zip(owners, keys, strict=True)]
            replies = [self.client.transport.wait(f, timeout=self.settings.lookup_timeout) for f in futures]
            return [r if int(r["hit_tokens"]) > 0 else None for r in replies]
        except Exception as exc:  # a server that is down or errs: nothing is held, SGLang computes
            log.warning("kvstrata LOOKUP of %d pages failed (%s); reported as misses", len(keys), exc)
            for o in set(owners):
                self._free_lookup_locks(o)
            return [None] * len(keys)

    def _free_lookup_locks(self, owner: str) -> None:
        """Release ``owner``'s lookup locks, on the connection whose LOOKUPs took them (fire and forget)."""
        owner = lock_owner(owner, self.settings.instance_id + self.rank)
        try:
            with self._client_lock:
                self.client.transport.send_oneway(RequestType.FREE_LOOKUP_LOCKS, [owner])
        except Exception as exc:  # only a closed client raises here
            log.debug("FREE_LOOKUP_LOCKS for %s not sent: %s", owner, exc)

    def _connected(self) -> bool:
        """Registered with the server (or registering now); False once closed, so nothing registers again."""
        with self._runtime_lock:
            return not self._closed and self.runtime.connect()

    def _blocks(self, host_indices: torch.Tensor, keys: Sequence[str]) -> list[int] | None:
        try:
            blocks = blocks_of_slots(host_indices, self.page_size)
        except LayoutError as exc:
            log.warning("HiCache host indices refused: %s", exc)
            return None
        if len(blocks) != len(keys):
            log.warning("HiCache handed %d pages of host indices for %d keys", len(blocks), len(keys))
            return None
        return blocks

    # --- HiCache's zero-copy interface ------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` the server holds."""
        owner = f"hicache-exists-{next(self._ids)}"
        held = self._held([owner] * len(keys), keys)
        self._free_lookup_locks(owner)
        return held.index(False) if False in held else len(held)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load each page into the host pool at ``host_indices``; per page, whether it landed."""
        blocks = self._blocks(host_indices, keys)
        if blocks is None or self.runtime is None or not self._connected():
            return [False] * len(keys)
        batch = next(self._ids)
        owners = [f"hicache-get-{batch}-{i}" for i in range(len(keys))]
        replies = self._lookups(owners, keys)
        held = [r is not None for r in replies]
        specs = [LoadSpec(o, o, b"", None, ((b,),), 0, 0, (h,), self.page_size,
                          located=ChunkLocations.for_rank(r, self.page_size, self.rank, self.world_size))
                 for o, h, b, r in zip(owners, keys, blocks, replies, strict=True) if r is not None]
        for o, ok in zip(owners, held, strict=True):
            if not ok:
                self._free_lookup_locks(o)
        with self._runtime_lock:
            landed = self._run_loads(specs)
        return [ok and landed.get(o, False) for o, ok in zip(owners, held, strict=True)]

    def _run_loads(self, specs: list[LoadSpec]) -> dict[str, bool]:
        """Start the loads, wait (bounded) until every one settled; request id -> landed."""
        if not specs or self._closed:
            return {}
        runtime = self.runtime
        runtime.start_loads(specs)
        records = {s.request_id: runtime.transfers.records.get(s.request_id) for s in specs} \
            if runtime.transfers is not None else {}
        rids = {s.request_id for s in specs}
        deadline = time.monotonic() + self.settings.retrieve_timeout
        while rids & runtime.in_flight() and time.monotonic() < deadline:
            runtime.poll()
            time.sleep(POLL_INTERVAL)
        runtime.poll(rids)
        failed = {getattr(f, "request_id", None) for f in runtime.take_load_failures()}
        out = {}
        for rid in rids:
            rec = records.get(rid)
            out[rid] = rec is not None and rec.failure is None and rec.completed_at is not None and rid not in failed
            if not out[rid]:
                log.warning("HiCache page load %s did not land (%s); reported as a miss", rid,
                            rec.failure if rec is not None else "not started")
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store each page from the host pool, skipping those the server holds; per page, whether it is held."""
        blocks = self._blocks(host_indices, keys)
        if blocks is None or self.runtime is None or not self._connected():
            return [False] * len(keys)
        owner = f"hicache-set-{next(self._ids)}"
        held = self._held([owner] * len(keys), keys)
        self._free_lookup_locks(owner)
        out = []
        for i, (h, b, ok) in enumerate(zip(keys, blocks, held, strict=True)):
            if ok:
                out.append(True)
                continue
            with self._runtime_lock:
                if self._closed:
                    out.append(False)
                    continue
                failed_before = self.runtime.stats.total.stores_failed
                self.runtime.store([StoreSpec(f"{owner}-{i}", b"", None, ((b,),), 0, (h,), self.page_size)])
                out.append(self.runtime.stats.total.stores_failed == failed_before)
        return out

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- the copying interface kvstrata does not offer ----------------------------------------

    def _copying(self, call: str) -> Any:
        raise NotImplementedError(f"KvstrataHiCacheStorage.{call}: kvstrata's HiCache backend is zero-copy only "
                                  f"(set \"interface_v1\": 1 in {CONFIG_WHERE})")

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self._copying("get")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        return self._copying("batch_get")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._copying("set")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return self._copying("batch_set")

    def clear(self) -> None:
        """SGLang's flush: the kvstrata server's store is shared with other engines, so nothing is deleted."""

    def close(self) -> None:
        """Unregister the host pool from the kvstrata server and remove this process's shared-memory segments
        (the runtime's registration area and its connections' rings). Idempotent; each step runs even if the
        one before it failed."""
        atexit.unregister(self.close)
        with self._runtime_lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.runtime is not None:
                    self.runtime.close()
            finally:
                with self._client_lock:
                    self.client.close()
        log.info("kvstrata HiCache backend closed (instance %d unregistered if the server answered, "
                 "segments removed)", self.settings.instance_id + self.rank)
