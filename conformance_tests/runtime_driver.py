"""A conformance driver for an engine whose engine side calls the core's runtimes directly.

An engine with a connector API of its own (vLLM's ``KVConnectorBase_V1``) is
driven through that API (its adapter's driver). An engine without one, such as
the reference engine or a small in-house engine, calls
:class:`~kvstrata.core.engine.scheduler_runtime.SchedulerRuntime` and
:class:`~kvstrata.core.engine.worker_runtime.WorkerRuntime` itself; this mixin
is that engine side, in the order an engine calls it: lookup until answered,
allocation, one step's plan (settle preempted, start loads, reserve the stores,
store computed prompts), per-layer waits, polls, finish. Combine it with a class
that owns the cache (``allocate``, ``free``, ``clear``, ``prefill``,
``read_layer`` and a ``kv_caches`` attribute).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.adapter_api.types import DriverPoll, HarnessSpec, LoadFailure
from kvstrata.core.engine.scheduler_runtime import ScheduledRequest, SchedulerRuntime
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime

LOOKUP_BOUND = 30.0
"""How long the driver asks again for a lookup before it gives up (only catches hangs)."""


class RuntimeDriver:
    kv_caches: Any

    def __init__(self, spec: HarnessSpec, adapter: Adapter) -> None:
        self.spec = spec
        self.adapter = adapter
        """The adapter whose hooks the runtimes call."""
        self.placement = spec.placement
        self.scheduler: SchedulerRuntime | None = None
        self.runtime: WorkerRuntime | None = None
        self._blocks: dict[str, list[list[int]]] = {}
        self._finished: set[str] = set()

    def start(self, settings: RuntimeSettings) -> None:
        settings = dataclasses.replace(settings, placement=self.placement)
        model = settings.model_name or f"{self.adapter.name}-model"
        self.scheduler = SchedulerRuntime(self.adapter, settings, model=model, block_size=self.spec.block_size)
        self.runtime = WorkerRuntime(self.adapter, settings, model=model)
        self.runtime.register(self.kv_caches)

    def _admit(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> int:
        deadline = time.monotonic() + LOOKUP_BOUND
        while (n := self.scheduler.lookup(request_id, token_ids, 0)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"SchedulerRuntime.lookup kept answering None for {LOOKUP_BOUND:.0f}s")
            time.sleep(0.001)
        self._blocks[request_id] = [list(g) for g in block_ids]
        self.scheduler.allocated(request_id, block_ids, n)
        return n

    def _step(self, scheduled: Sequence[ScheduledRequest] = ()) -> None:
        plan = self.scheduler.plan_step(scheduled, (), block_ids_of=lambda rid: self._blocks[rid])
        self.runtime.settle(plan.preempted)
        self.runtime.start_loads(plan.loads)
        self.runtime.reserve_stores(plan.stores)  # before the forward, as an engine with a step API would
        self.runtime.store(plan.stores)

    def store(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        self._admit(request_id, token_ids, block_ids)
        self._step([ScheduledRequest(request_id, 0, len(token_ids))])
        self.finish(request_id)
        self.poll()

    def load(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> int:
        n = self._admit(request_id, token_ids, block_ids)
        if n:
            self._step()
        return n

    def poll(self) -> DriverPoll:
        finished, self._finished = self._finished, set()
        _, released = self.runtime.poll(finished)
        self.scheduler.released(released)
        failed: set[int] = set()
        for report in self.runtime.take_load_failures():
            if not isinstance(report, LoadFailure):
                raise TypeError(f"kvstrata_report_load_failure returned {type(report).__name__}; this driver "
                                "reads the default LoadFailure")
            failed.update(b for g in report.block_ids for b in g)
        return DriverPoll(sorted(released), failed)

    def wait_for_layer(self, layer: int) -> None:
        self.runtime.wait_for_layer(layer)

    def finish(self, request_id: str) -> None:
        if self._blocks.pop(request_id, None) is not None:
            self.scheduler.finished(request_id)
            self._finished.add(request_id)

    def close(self) -> None:
        for side in (self.runtime, self.scheduler):
            if side is not None:
                side.close()
