"""kvstrata's vLLM KV connector: ``KVConnectorBase_V1`` translated onto the core's engine runtime.

Enable with::

    --kv-transfer-config '{"kv_connector": "KvstrataConnector",
                           "kv_connector_module_path": "kvstrata.adapters.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"server_address": "ipc:///run/kvstrata.sock",
                                                         "layers_per_slice": 1}}'

(the settings are :class:`kvstrata.core.engine.settings.RuntimeSettings`).
vLLM builds one instance in the scheduler process (role SCHEDULER) and one in
each worker (role WORKER, one per tensor-parallel rank). Each method says which
side calls it and when; the work is the runtime's
(:class:`~kvstrata.core.engine.scheduler_runtime.SchedulerRuntime`,
:class:`~kvstrata.core.engine.worker_runtime.WorkerRuntime`), and what is
vLLM's own answers through the adapter's hooks (:mod:`.hooks`).

The life of a cache hit:

1. scheduler, ``get_num_new_matched_tokens``: ``(None, False)`` ("ask again")
   until every rank's LOOKUP is answered, then ``(n, True)`` for a
   block-aligned hit beyond vLLM's own prefix cache (async load).
2. scheduler, ``update_state_after_alloc`` + ``build_connector_meta``: the load
   (block ids, slice width) goes to the workers in the metadata.
3. worker, ``bind_connector_metadata``: the load starts.
4. worker, ``get_finished``: the request is in ``finished_recving`` as soon as
   its first slice has landed (chunk-major: when complete).
5. worker, ``wait_for_layer_load``: before each attention layer, wait for that
   layer across every load in flight (released blocks are cached, and other
   requests in the same step can read them).
6. A load that fails after release: its blocks come back from
   ``get_block_ids_with_load_errors`` and vLLM recomputes them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.requests import LoadSpec, StoreSpec
from kvstrata.core.engine.scheduler_runtime import ScheduledRequest, SchedulerRuntime
from kvstrata.core.engine import slice_width
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.stats import RuntimeStats
from kvstrata.core.engine.worker_runtime import WorkerRuntime

from .kv_layout import layer_index

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstrata.adapters.vllm")

SETTINGS_WHERE = "kv_connector_extra_config"


def salt_of(request: Any) -> str | None:
    """Requests that must not share KV (a cache salt, a LoRA adapter) get different keys."""
    parts = [p for p in (getattr(request, "cache_salt", None),
                         getattr(getattr(request, "lora_request", None), "lora_name", None)) if p]
    return "|".join(map(str, parts)) or None


class KvstrataConnectorStats(KVConnectorStats):
    """The worker runtime's numbers for one stats interval, as vLLM collects a connector's stats.

    vLLM sends ``data`` from each worker to its logger, sums the workers' with :meth:`aggregate` and logs
    :meth:`reduce` once per interval ("KV Transfer metrics: loads_started=..., mean_release_ms=...").
    """

    def reset(self) -> None:
        self.data = RuntimeStats().as_dict()

    def aggregate(self, other: KVConnectorStats) -> "KvstrataConnectorStats":
        total = RuntimeStats.from_dict(self.data).add(RuntimeStats.from_dict(other.data))
        return KvstrataConnectorStats(data=total.as_dict())

    def reduce(self) -> dict[str, int | float]:
        return RuntimeStats.from_dict(self.data).summary()

    def is_empty(self) -> bool:
        return RuntimeStats.from_dict(self.data).is_empty()


class KvstrataMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: loads to start, stores to make, preempted requests to settle."""

    def __init__(self, loads: list[LoadSpec], stores: list[StoreSpec], preempted: list[str]) -> None:
        self.loads = loads
        self.stores = stores
        self.preempted = preempted


def _tensor_parallel(vllm_config: "VllmConfig", role: KVConnectorRole) -> tuple[int, int]:
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ValueError("kvstrata's vLLM connector does not support pipeline parallelism yet "
                         f"(pipeline_parallel_size={parallel.pipeline_parallel_size})")
    world = int(getattr(parallel, "tensor_parallel_size", 1))
    if role == KVConnectorRole.SCHEDULER or world == 1:
        return 0, world
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), world


def engine_key(vllm_config: "VllmConfig") -> str | None:
    """What makes this engine's default instance id (:func:`~kvstrata.core.engine.settings.engine_instance_id`):
    ``kv_transfer_config.engine_id``, a UUID vLLM draws once per engine (``KVTransferConfig.__post_init__``), which
    its scheduler and every worker see (they get the engine's config; vLLM broadcasts tensor-parallel rank 0's
    to the other ranks, and suffixes it per data-parallel rank). Not ``vllm_config.instance_id``: vLLM redraws
    that (a timestamp) whenever the config is rebuilt."""
    engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None)
    return str(engine_id) if engine_id else None


class KvstrataConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = RuntimeSettings.from_mapping(vllm_config.kv_transfer_config.kv_connector_extra_config,
                                                     where=SETTINGS_WHERE, engine_key=engine_key(vllm_config))
        adapter = load_adapter("vllm")
        model = self.settings.model_name or str(vllm_config.model_config.model)
        block_size = vllm_config.cache_config.block_size
        rank, world = _tensor_parallel(vllm_config, role)
        self.scheduler_runtime: SchedulerRuntime | None = None
        self.worker_runtime: WorkerRuntime | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_runtime = SchedulerRuntime(adapter, self.settings, model=model, block_size=block_size,
                                                      world_size=world)
        else:
            self.worker_runtime = WorkerRuntime(adapter, self.settings, model=model, rank=rank, world_size=world)
        self._kv_cache_manager: Any = None
        self._layer_of: dict[str, int] = {}
        log.info("kvstrata connector (%s%s) for %s: server %s, instance %d%s, layers_per_slice=%s%s", role.name,
                 f", rank {rank} of {world}" if world > 1 else "", model, self.settings.server_address,
                 self.settings.instance_id, "" if world == 1 else " + rank",
                 slice_width.describe(self.settings.layers_per_slice),
                 "" if self.settings.layers_per_slice else " (chunk-major, no early release)")

    # --- class-level, called at config time before any worker exists ------------------

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True exactly when overlap is on: a FULL graph replay would skip ``wait_for_layer_load``.

        Read from the same setting that sets the slice width, so the graph mode
        and the width cannot disagree.
        """
        return RuntimeSettings.from_mapping(extra_config, where=SETTINGS_WHERE).layers_per_slice != 0  # N or auto

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvstrataConnectorStats:
        """vLLM's logger process, each time workers' stats arrive: our stats class over their data."""
        return KvstrataConnectorStats(data=dict(data) if data else RuntimeStats().as_dict())

    # --- scheduler side ----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Scheduler, at start-up: kept to read a request's block ids when its prompt is stored."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, each step while admitting a waiting request: how much kvstrata can load (async)."""
        n = self.scheduler_runtime.lookup(request.request_id, request.prompt_token_ids, num_computed_tokens,
                                          salt_of(request))
        return (None, False) if n is None else (n, n > 0)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Scheduler, right after blocks were allocated for an admitted request."""
        self.scheduler_runtime.allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Scheduler, at the end of every ``schedule()`` (empty steps too), before requests' progress advances."""
        counts = scheduler_output.num_scheduled_tokens
        scheduled = [ScheduledRequest(r.req_id, r.num_computed_tokens, counts.get(r.req_id, 0))
                     for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [ScheduledRequest(rid, done, counts.get(rid, 0))
                      for rid, done in zip(cached.req_ids, cached.num_computed_tokens)]
        plan = self.scheduler_runtime.plan_step(scheduled, scheduler_output.preempted_req_ids or (),
                                                block_ids_of=self._block_ids_of)
        return KvstrataMetadata(plan.loads, plan.stores, list(plan.preempted))

    def _block_ids_of(self, request_id: str) -> tuple[list[int], ...]:
        if self._kv_cache_manager is None:
            raise RuntimeError("vLLM never bound its KV cache manager (bind_kv_cache_manager): cannot store")
        return self._kv_cache_manager.get_block_ids(request_id)

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler, every step: learns which requests the workers released."""
        self.scheduler_runtime.released(connector_output.finished_recving or ())

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once, when a request finishes or is aborted, before its blocks are freed.

        True (keep the blocks) while a released request's load may still be
        writing them; the worker reports it in ``finished_sending`` once settled.
        """
        return self.scheduler_runtime.finished(request.request_id), None

    def shutdown(self) -> None:
        """Either side, at exit."""
        runtime = self.scheduler_runtime or self.worker_runtime
        if runtime is not None:
            runtime.close()

    # --- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once, after vLLM allocated its KV cache: describe it and register it with the server."""
        self._layer_of = {name: layer_index(name) for name in kv_caches}
        self.worker_runtime.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Worker, every step before the forward: a preempted request's blocks are about to be reused."""
        if isinstance(kv_connector_metadata, KvstrataMetadata) and kv_connector_metadata.preempted:
            self.worker_runtime.settle(kv_connector_metadata.preempted)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker, every step before the forward: start this step's loads, and reserve the objects of the
        stores ``wait_for_save`` will make (engine placement: that round trip then runs during the forward)."""
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KvstrataMetadata):
            raise TypeError(f"kvstrata's connector got {type(connector_metadata).__name__} metadata")
        self.worker_runtime.start_loads(connector_metadata.loads)
        self.worker_runtime.reserve_stores(connector_metadata.stores)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Worker, every step: nothing to do, the loads started in ``bind_connector_metadata``."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, right before each attention layer reads the cache: wait for that layer (bounded)."""
        self.worker_runtime.wait_for_layer(self._layer_of[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Worker, after each attention layer: stores happen once the forward is done (``wait_for_save``)."""

    def wait_for_save(self) -> None:
        """Worker, after the forward: STORE the prompts that finished prefill this step."""
        meta = self._get_connector_metadata()
        if isinstance(meta, KvstrataMetadata) and meta.stores:
            self.worker_runtime.store(meta.stores)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step after the forward: (finished_sending, finished_recving)."""
        freeable, released = self.worker_runtime.poll(finished_req_ids)
        return freeable or None, released or None

    def get_kv_connector_stats(self) -> KvstrataConnectorStats | None:
        """Worker, every step: the runtime's numbers since the last call (None when nothing happened)."""
        if self.worker_runtime is None:
            return None
        stats = self.worker_runtime.take_stats()
        return None if stats.is_empty() else KvstrataConnectorStats(data=stats.as_dict())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step: blocks whose load failed, for vLLM to recompute."""
        return set().union(*self.worker_runtime.take_load_failures())
