"""kvstrata's vLLM KV connector (KVConnectorBase_V1).

Enable with::

    --kv-transfer-config '{"kv_connector": "KvstrataConnector",
                           "kv_connector_module_path": "kvstrata.adapters.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"server_address": "ipc:///run/kvstrata.sock",
                                                         "layers_per_stage": 1}}'

vLLM builds one instance in the scheduler process (role SCHEDULER) and one in
each worker (role WORKER). Each public method below says which side calls it
and when; the work itself lives in :class:`SchedulerSide` and :class:`WorkerSide`.

The life of a cache hit:

1. scheduler, ``get_num_new_matched_tokens``: LOOKUP goes out asynchronously;
   ``(None, False)`` ("ask again") until the reply, then ``(n, True)`` for a
   block-aligned hit beyond vLLM's own prefix cache (async load).
2. scheduler, ``update_state_after_alloc`` + ``build_connector_meta``: the
   request's block ids and the slice width go to the worker in the metadata.
3. worker, ``bind_connector_metadata``: the retrieve starts.
4. worker, ``get_finished``: the request is reported in ``finished_recving`` as
   soon as its first slice has landed (overlap on) or when complete (off).
5. worker, ``wait_for_layer_load``: before each attention layer, wait for that
   layer across every in-flight retrieve (released blocks are cached and other
   requests in the same step can read them).
6. A transfer that fails after release: its blocks come back from
   ``get_block_ids_with_load_errors`` and vLLM recomputes them
   (``kv_load_failure_policy: "recompute"``).
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

from .settings import ConnectorSettings, requires_piecewise

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstrata.adapters.vllm")


class KvstrataMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: loads to start, stores to make, requests preempted.

    vLLM moves this between its own processes; it carries only plain values.
    """

    def __init__(self, loads: list[dict[str, Any]], stores: list[dict[str, Any]], preempted: list[str]) -> None:
        self.loads = loads
        self.stores = stores
        self.preempted = preempted


class KvstrataConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra_config(extra)
        model = self.settings.model_name or str(vllm_config.model_config.model)
        block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler_side import SchedulerSide

            self._scheduler = SchedulerSide(self.settings, model=model, block_size=block_size)
            self._worker = None
        else:
            from .worker_side import WorkerSide

            rank = getattr(vllm_config.parallel_config, "rank", 0)
            self._worker = WorkerSide(self.settings, model=model, block_size=block_size, rank=rank)
            self._scheduler = None
        log.info("kvstrata connector (%s) for %s: server %s, layers_per_stage=%d%s", role.name, model,
                 self.settings.server_address, self.settings.layers_per_stage,
                 "" if self.settings.layers_per_stage else " (chunk-major, no early release)")

    # --- class-level, called at config time before any worker exists ------------------

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True exactly when overlap is on: a FULL graph replay would skip ``wait_for_layer_load``.

        Read from the same setting that sets the slice width, so the graph mode
        and the width cannot disagree.
        """
        return requires_piecewise(extra_config)

    # --- scheduler side ----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Scheduler, at start-up: kept to read a request's block ids when its prompt is stored."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, each step while admitting a waiting request: how much kvstrata can load."""
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Scheduler, right after blocks were allocated for an admitted request."""
        self._scheduler.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Scheduler, at the end of every schedule() call (also empty steps)."""
        return KvstrataMetadata(**self._scheduler.build_step(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler, every step: learns which requests the workers released."""
        self._scheduler.on_worker_output(connector_output.finished_recving or ())

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once, when a request finishes or is aborted, before its blocks are freed.

        Returns True (keep the blocks) while a released request's transfer may
        still be writing them; the worker reports it in ``finished_sending`` once
        the transfer settled. END_SESSION releases whatever locks it still holds.
        """
        return self._scheduler.request_finished(request), None

    def shutdown(self) -> None:
        """Either side, at exit."""
        side = self._scheduler or self._worker
        if side is not None:
            side.close()

    # --- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once, after vLLM allocated its KV cache: describe it to the server."""
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Worker, every step before the forward: a preempted request's blocks are about to be reused."""
        if isinstance(kv_connector_metadata, KvstrataMetadata) and kv_connector_metadata.preempted:
            self._worker.handle_preemptions(kv_connector_metadata.preempted)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker, every step before the forward: start this step's retrieves."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvstrataMetadata)
        self._worker.start_loads(connector_metadata.loads)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Worker, every step: nothing to do, the loads started in bind_connector_metadata."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, right before each attention layer reads the cache: wait for that layer."""
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Worker, after each attention layer: stores happen once the forward is done (wait_for_save)."""

    def wait_for_save(self) -> None:
        """Worker, after the forward: STORE the prompts that finished prefill this step."""
        meta = self._get_connector_metadata()
        if isinstance(meta, KvstrataMetadata) and meta.stores:
            self._worker.store(meta.stores)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step after the forward: (finished_sending, finished_recving)."""
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step: blocks whose transfer failed, for vLLM to recompute."""
        return self._worker.take_load_errors()
