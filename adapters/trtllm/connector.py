"""kvstrata's TensorRT-LLM KV cache connector: ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker``
(TensorRT-LLM 1.2.x) translated onto the core's engine runtime.

Enable with ``kv_connector_config`` (three strings; the LLM API or the ``trtllm-serve
--extra_llm_api_options`` YAML, see ``examples/trtllm/``)::

    KvCacheConnectorConfig(connector_module="kvstrata.adapters.trtllm.connector",
                           connector_scheduler_class="KvstrataScheduler",
                           connector_worker_class="KvstrataWorker")

and kvstrata's settings in ``KVSTRATA_TRTLLM_CONFIG`` (:mod:`.settings`). TensorRT-LLM builds the
scheduler on rank 0 only and a worker on every rank; the scheduler's answers and its metadata reach the
other ranks through TensorRT-LLM's own MPI broadcast, which pickles them (that is TensorRT-LLM talking to
itself between its ranks, not kvstrata's wire, which never unpickles). So :class:`KvstrataTrtllmMetadata`
is a plain picklable value.

The life of a cache hit (default, synchronous matching):

1. scheduler, ``get_num_new_matched_tokens`` (first context chunk only): the LOOKUP, waited for here
   (TensorRT-LLM wants an answer now; bounded by ``lookup_timeout``), answers ``(n, False)``: ``n``
   block-aligned tokens, at least one prompt token left for TensorRT-LLM to compute.
2. scheduler, ``update_state_after_alloc`` then ``build_connector_meta``: the load travels to every rank.
3. worker, ``start_load_kv(stream)``: the load starts, ordered after the work already on ``stream``.
4. worker, ``wait_for_layer_load(layer, stream)`` (a ``DecoderLayer`` forward pre-hook): ``stream`` waits
   on the layer's event; the CPU goes on enqueuing. On CPU (the host event backend) there is no stream: the
   wait blocks the thread until the layer's bytes are in place, bounded by ``layer_wait_timeout``.
5. worker, ``wait_for_save`` (end of the forward): raises :class:`KvstrataLoadFailed` if a load of a request
   in this batch failed: TensorRT-LLM 1.2 has no recompute path for a connector, and
   ``PyExecutor._forward_step`` turns the exception into an error for the batch's requests. Recorded as
   ``trtllm_batch_failed``.

With ``async_load: true`` step 1 answers ``(n, True)``; TensorRT-LLM parks the request until every rank
lists it in ``get_finished``'s loaded ids, which each rank does once the request's first slice landed on it.

Stores: ``build_connector_meta`` plans them; ``wait_for_save`` hands them to a store thread that waits for
the forward's writes (a CUDA event on the forward's stream) and STOREs, so the forward never waits for host
memory. ``request_finished`` returns True (hold the blocks) only for a request kvstrata loaded or stored;
each rank reports it in ``get_finished``'s saved ids as soon as no transfer of its touches the blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.requests import LoadSpec, StoreSpec
from kvstrata.core.engine.scheduler_runtime import ScheduledRequest, SchedulerRuntime
from kvstrata.core.engine import slice_width
from kvstrata.core.engine.worker_runtime import WorkerRuntime

from . import settings as trtllm_settings
from .engine_api import connector_base_classes
from .kv_layout import TrtllmKvPool

_SchedulerBase, _WorkerBase, BASE_MODULE = connector_base_classes()

log = logging.getLogger("kvstrata.adapters.trtllm")

LOOKUP_POLL = 0.0005
"""Seconds between looks at a LOOKUP in flight while ``get_num_new_matched_tokens`` waits for it."""


class KvstrataLoadFailed(RuntimeError):
    """A kvstrata load of a request in this batch failed; TensorRT-LLM 1.2 fails the batch on it."""


@dataclass
class KvstrataTrtllmMetadata:
    """Rank 0 -> every rank, once per iteration (pickled by TensorRT-LLM's broadcast)."""

    loads: list[LoadSpec] = field(default_factory=list)
    async_load: bool = False
    stores: list[StoreSpec] = field(default_factory=list)
    scheduled: list[Any] = field(default_factory=list)
    """The engine ids of the requests in this iteration's batch (a failed load fails only their batch)."""


def _tokens_per_block(llm_args: Any) -> int:
    kv_cache_config = getattr(llm_args, "kv_cache_config", None)
    value = getattr(kv_cache_config, "tokens_per_block", None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"kvstrata needs llm_args.kv_cache_config.tokens_per_block (a positive int), got {value!r}")
    return value


def _model_name(llm_args: Any, settings: Any) -> str:
    return settings.model_name or str(getattr(llm_args, "model", "") or "")


def _world_size(llm_args: Any) -> int:
    pp = int(getattr(llm_args, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise ValueError(f"kvstrata's TensorRT-LLM connector does not support pipeline parallelism "
                         f"(pipeline_parallel_size={pp}); TensorRT-LLM's connector API does not either")
    return int(getattr(llm_args, "tensor_parallel_size", 1) or 1)


def _rank() -> int:
    from tensorrt_llm._utils import mpi_rank

    return int(mpi_rank())


class KvstrataScheduler(_SchedulerBase):
    """Rank 0 only: what kvstrata can load for a request, what to store, whether blocks must wait."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.settings, self.options = trtllm_settings.load()
        self.adapter = load_adapter("trtllm")
        self.block_size = _tokens_per_block(llm_args)
        model = _model_name(llm_args, self.settings)
        world = _world_size(llm_args)
        self.runtime = SchedulerRuntime(self.adapter, self.settings, model=model, block_size=self.block_size,
                                        world_size=world)
        self._matched: dict[Any, int] = {}
        self._blocks: dict[Any, list[int]] = {}
        self._touched: set[str] = set()
        """kvstrata ids of requests with a load or store planned: their blocks wait for the workers."""
        log.info("kvstrata TensorRT-LLM scheduler for %s (%d rank(s)): server %s, %s matching, layers_per_slice=%s",
                 model, world, self.settings.server_address, "asynchronous" if self.options.async_load
                 else "synchronous", slice_width.describe(self.settings.layers_per_slice))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """First context chunk: tokens kvstrata loads beyond the ``num_computed_tokens`` TensorRT-LLM reused.

        TensorRT-LLM has no "ask again": the LOOKUP is waited for here, bounded by the runtime's
        ``lookup_timeout`` (after which it answers 0 and backs off).
        """
        rid = request.request_id
        tokens = list(request.get_tokens(0))
        deadline = time.monotonic() + 2 * self.settings.lookup_timeout + 1.0
        while True:
            n = self.runtime.lookup(rid, tokens, num_computed_tokens)
            if n is not None:
                break
            if time.monotonic() > deadline:  # the runtime bounds this itself; only a broken runtime gets here
                log.warning("LOOKUP for request %s not settled after %.1fs; computing it", rid,
                            2 * self.settings.lookup_timeout + 1.0)
                n = 0
                break
            time.sleep(LOOKUP_POLL)
        if n <= 0:
            return 0, False
        self._matched[rid] = n
        return n, self.options.async_load

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """After the first chunk's blocks were allocated: plan the load of a hit into them."""
        rid = request.request_id
        n = self._matched.pop(rid, 0)
        self._blocks[rid] = [int(b) for b in block_ids]
        self.runtime.allocated(rid, [self._blocks[rid]], n)
        if n:
            self._touched.add(self.adapter.request_id(rid))
            if not self.options.async_load:
                self.runtime.released([rid])  # a synchronous match runs now: it is never handed back

    def build_connector_meta(self, scheduler_output: Any) -> KvstrataTrtllmMetadata:
        """Every iteration, on rank 0: this iteration's loads and stores, for every rank."""
        scheduled = []
        for data in scheduler_output.new_requests:
            self._blocks[data.request_id] = [int(b) for b in data.new_block_ids]
            scheduled.append(data)
        for data in scheduler_output.cached_requests:
            self._blocks.setdefault(data.request_id, []).extend(int(b) for b in data.new_block_ids)
            scheduled.append(data)
        plan = self.runtime.plan_step(
            [ScheduledRequest(d.request_id, int(d.computed_position), int(d.num_scheduled_tokens)) for d in scheduled],
            (), block_ids_of=lambda rid: (self._blocks[rid],))
        self._touched.update(s.request_id for s in plan.stores)
        return KvstrataTrtllmMetadata(plan.loads, self.options.async_load, plan.stores,
                                      [d.request_id for d in scheduled])

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """A request finished or was aborted: True holds its blocks until every rank reports it saved."""
        rid = request.request_id
        self.runtime.finished(rid)  # frees the locks of a hit never loaded
        self._matched.pop(rid, None)
        self._blocks.pop(rid, None)
        key = self.adapter.request_id(rid)
        keep = key in self._touched
        self._touched.discard(key)
        return keep

    def shutdown(self) -> None:
        self.runtime.close()


class KvstrataWorker(_WorkerBase):
    """Every rank: its shard of the pool, the loads into it, the stores out of it."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.settings, self.options = trtllm_settings.load()
        self.adapter = load_adapter("trtllm")
        self.tokens_per_block = _tokens_per_block(llm_args)
        self.rank, self.world_size = _rank(), _world_size(llm_args)
        model = _model_name(llm_args, self.settings)
        self.runtime = WorkerRuntime(self.adapter, self.settings, model=model, rank=self.rank,
                                     world_size=self.world_size)
        self._cuda = False
        self._async_loading: set[Any] = set()
        """Ids TensorRT-LLM passed as started loading, not reported loaded yet."""
        self._released_early: set[Any] = set()
        self._saving: set[Any] = set()
        """Ids TensorRT-LLM passed as finished (blocks held), not reported saved yet."""
        self._storing: dict[str, Future] = {}
        self._store_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstrata-trtllm-store")
        self.failed_loads: dict[Any, str] = {}
        """Engine id -> why its load failed: the next batch holding the request fails (see ``wait_for_save``)."""
        self.before_store: Callable[[list[StoreSpec]], None] | None = None
        """Test-only: called on the store thread before a STORE goes out (None in production)."""

    # --- start-up ---------------------------------------------------------------------

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """Once, with the KV cache manager's primary pool: describe it and register it with the server."""
        self._cuda = kv_cache_tensor.device.type == "cuda"
        self.runtime.register(TrtllmKvPool(kv_cache_tensor, self.tokens_per_block, self.options.kv_heads))

    # --- every iteration ----------------------------------------------------------------

    def _meta(self) -> KvstrataTrtllmMetadata:
        meta = self.get_connector_meta()
        if meta is None:
            return KvstrataTrtllmMetadata()
        if not isinstance(meta, KvstrataTrtllmMetadata):
            raise TypeError(f"kvstrata's TensorRT-LLM worker got {type(meta).__name__} connector metadata")
        return meta

    def start_load_kv(self, stream: Any) -> None:
        """Before the forward: reserve this iteration's stores' objects (engine placement: the round trip runs
        during the forward) and start its loads, after what ``stream`` already has queued.

        The blocks may still be read by the previous iteration's forward (the overlap loop enqueues this
        iteration while that one runs), and kvstrata's copies run on their own streams, which take no engine
        event: so on CUDA, and only when loads start, the CPU waits for an event recorded on ``stream`` (the
        work queued before, never a transfer). On CPU the previous forward has returned: nothing to order.
        """
        meta = self._meta()
        self.runtime.reserve_stores(meta.stores)
        if not meta.loads:
            return
        if self._cuda and stream is not None:
            ordered = torch.cuda.Event()
            ordered.record(stream)
            ordered.synchronize()
        self.runtime.start_loads(meta.loads, running=not meta.async_load)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """``DecoderLayer`` pre-hook: the layer's work must come after its loaded bytes (bounded, never raises)."""
        if self._cuda and stream is not None:
            with torch.cuda.stream(stream):
                self.runtime.wait_for_layer(layer_idx)
        else:
            self.runtime.wait_for_layer(layer_idx)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """``DecoderLayer`` post-hook: nothing per layer; kvstrata stores whole prompts after the forward."""

    def wait_for_save(self, stream: Any) -> None:
        """End of the forward: fail the batch on a failed load, then hand the stores to the store thread."""
        meta = self._meta()
        self._collect_failures()
        failed = {r: self.failed_loads.pop(r) for r in meta.scheduled if r in self.failed_loads}
        failed.update(self._failing(meta.scheduled))
        if failed:
            self.runtime.record.write("trtllm_batch_failed", rank=self.rank, request_ids=sorted(map(str, failed)),
                                      reasons=sorted(set(failed.values())), policy="raise in wait_for_save")
            raise KvstrataLoadFailed(
                f"kvstrata could not load the KV of request(s) {sorted(failed)} on rank {self.rank} "
                f"({'; '.join(sorted(set(failed.values())))}); TensorRT-LLM 1.2 has no recompute path for a "
                "connector's failed load, so this batch fails instead of reading KV that never arrived")
        if not meta.stores:
            return
        if not self.runtime.connected:
            # Not registered yet (the server was down at start-up): the runtime connects here, on the engine's
            # thread (retrying at most every 10 s), and stores inline this once; the store thread never connects.
            self.runtime.store(meta.stores)
            return
        written = None
        if self._cuda and stream is not None:
            written = torch.cuda.Event()
            written.record(stream)
        future = self._store_thread.submit(self._store, list(meta.stores), written)
        for spec in meta.stores:
            self._storing[spec.request_id] = future

    def _store(self, stores: list[StoreSpec], written: Any) -> None:
        if written is not None:
            written.synchronize()  # the forward's writes are in the pool
        if self.before_store is not None:
            self.before_store(stores)
        self.runtime.store(stores)  # connected already (wait_for_save checked): this thread never connects

    def _failing(self, engine_ids: list[Any]) -> dict[Any, str]:
        """Loads of these requests that failed but are not reported yet: an engine-placement copy that a layer
        wait gave up on is reported only once it has stopped, and this batch must fail now all the same."""
        transfers = self.runtime.transfers
        if transfers is None:
            return {}
        out = {}
        for engine_id in engine_ids:
            record = transfers.records.get(self.adapter.request_id(engine_id))
            if record is not None and record.failure:
                out[engine_id] = record.failure
        return out

    def _collect_failures(self) -> None:
        for failure in self.runtime.take_load_failures():
            self.failed_loads[failure.request_id] = failure.reason
            log.error("kvstrata load of request %s failed on rank %d: %s; its next batch fails", failure.request_id,
                      self.rank, failure.reason)

    def _busy(self, engine_id: Any) -> bool:
        rid = self.adapter.request_id(engine_id)
        future = self._storing.get(rid)
        if future is not None and future.done():
            del self._storing[rid]
            future = None
        return future is not None or rid in self.runtime.in_flight()

    def get_finished(self, finished_gen_req_ids: list[Any],
                     started_loading_req_ids: list[Any]) -> tuple[list[Any], list[Any]]:
        """After the iteration, never blocking: (ids saved: blocks may go, ids loaded: may run), this rank only.

        An id is returned only after TensorRT-LLM passed it in. A request aborted while loading is reported
        loaded once its transfer stopped, so no rank waits for it.
        """
        self._saving.update(finished_gen_req_ids)
        self._async_loading.update(started_loading_req_ids)
        _, released = self.runtime.poll(finished_gen_req_ids)
        self._collect_failures()
        self._released_early |= set(released)
        loaded = sorted(self._released_early & self._async_loading, key=str)
        self._released_early -= set(loaded)
        self._async_loading -= set(loaded)
        saved = sorted((r for r in self._saving if not self._busy(r)), key=str)
        self._saving -= set(saved)
        for rid in saved:  # it will not run again
            self.failed_loads.pop(rid, None)
            self._released_early.discard(rid)
        return saved, loaded

    def shutdown(self) -> None:
        self._store_thread.shutdown(wait=True)
        self.runtime.close()
