"""``KvstrataHiCacheStorage``: a HiCache storage backend (SGLang's ``--hicache-storage-backend dynamic``).

Configured with ``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name": "kvstrata", "module_path":
"kvstrata.adapters.sglang.hicache", "class_name": "KvstrataHiCacheStorage", "interface_v1": 1, ...kvstrata
settings...}'``. SGLang constructs it as ``Cls(storage_config, kwargs)`` in each TP rank's scheduler process,
then hands it the host pool (``register_mem_pool_host``), and with ``interface_v1`` calls the zero-copy
``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` with page-hash keys and host token indices.

The host pool is registered with the kvstrata server through a ``WorkerRuntime`` (engine placement: this
process copies between its host pool and the server's L1 pool); lookups, their locks and the back-off from a
server that does not answer are this rank's ``SchedulerRuntime``'s, as for the linker (:mod:`.loader`). Its layout descriptor says which host layout
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
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.requests import LoadSpec, StoreSpec
from kvstrata.core.engine.scheduler_runtime import SchedulerRuntime
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.transfer.layouts import LayoutError

from . import hooks, reaper
from .kv_layout import SglangHostPool, blocks_of_slots
from .loader import lookup_pages_now

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
        self.scheduler: SchedulerRuntime | None = None
        self.page_size = 0
        self._ids = itertools.count(1)
        self._runtime_lock = threading.Lock()
        self._scheduler_lock = threading.Lock()
        """HiCache calls from its prefetch and its backup threads at once; each runtime is one engine thread's."""
        self._closed = False
        atexit.register(self.close)

    # --- set-up ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = SglangHostPool.from_host_pool(mem_pool_host)
        self.page_size = pool.page_size
        adapter = load_adapter(hooks)
        self.runtime = WorkerRuntime(adapter, self.settings, model=self.model, rank=self.rank,
                                     world_size=self.world_size)
        # HiCache fills host memory before the request runs: its loads are planned chunk-major
        self.scheduler = SchedulerRuntime(adapter, dataclasses.replace(self.settings, layers_per_slice=0),
                                          model=self.model, block_size=self.page_size, world_size=self.world_size,
                                          rank=self.rank)
        self.runtime.register(pool)
        log.info("kvstrata HiCache backend: host layout %s, page %d, rank %d of %d, model %r, server %s",
                 pool.layout, pool.page_size, self.rank, self.world_size, self.model, self.settings.server_address)

    # --- lookups (the scheduler runtime) -------------------------------------------------------

    def _held(self, owners: Sequence[str], keys: Sequence[str]) -> list[bool]:
        """Which pages the server holds, page i looked up as request ``owners[i]`` and locked for it until its
        load or :meth:`_forget`. The LOOKUPs go out together and are answered in one round trip; a server that
        does not answer or errs holds nothing (SGLang computes)."""
        if not keys:
            return []
        with self._scheduler_lock:
            if self._closed or self.scheduler is None:
                return [False] * len(keys)
            tokens = lookup_pages_now(self.scheduler, [(o, (h,)) for o, h in zip(owners, keys, strict=True)])
        return [t > 0 for t in tokens]

    def _forget(self, owners: Sequence[str]) -> None:
        """These lookups are done with: the locks of those that planned no load go now."""
        with self._scheduler_lock:
            if self.scheduler is not None:
                for o in owners:
                    self.scheduler.finished(o)

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
        batch = next(self._ids)
        owners = [f"hicache-exists-{batch}-{i}" for i in range(len(keys))]
        held = self._held(owners, keys)
        self._forget(owners)
        return held.index(False) if False in held else len(held)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load each page into the host pool at ``host_indices``; per page, whether it landed."""
        blocks = self._blocks(host_indices, keys)
        if blocks is None or self.runtime is None or not self._connected():
            return [False] * len(keys)
        batch = next(self._ids)
        owners = [f"hicache-get-{batch}-{i}" for i in range(len(keys))]
        held = self._held(owners, keys)
        with self._scheduler_lock:  # plan the held pages' loads (one each, from where their LOOKUP found them)
            if self._closed:
                return [False] * len(keys)
            for o, b, ok in zip(owners, blocks, held, strict=True):
                if ok:
                    self.scheduler.allocated(o, ((b,),), self.page_size)
            specs = self.scheduler.plan_step((), (), lambda _: ()).loads
        self._forget(owners)  # a planned load's locks are the worker side's; the others go now
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
        batch = next(self._ids)
        owners = [f"hicache-set-{batch}-{i}" for i in range(len(keys))]
        held = self._held(owners, keys)
        self._forget(owners)
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
                self.runtime.store([StoreSpec(owners[i], b"", None, ((b,),), 0, (h,), self.page_size)])
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
                with self._scheduler_lock:
                    if self.scheduler is not None:
                        self.scheduler.close()
        log.info("kvstrata HiCache backend closed (instance %d unregistered if the server answered, "
                 "segments removed)", self.settings.instance_id + self.rank)
