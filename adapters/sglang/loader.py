"""kvstrata's side of SGLang's unified-cache linker: lookups, queued loads, per-layer completion, offloads.

SGLang's linker contract (``mem_cache/unified_cache/unified_cache_linker.py``) is: ``lookup`` answers at
once how many pages are restorable; ``load`` only queues; ``start_layer_wise_loading`` starts the queued
loads right before the forward that reads them and returns a ``LayerWiseLoadCounter`` index; the attention
of layer ``l`` blocks in ``wait_until(l)`` until the layer's future resolves; ``finish_layer_wise_loading``
after the forward says whether every layer landed (if not, SGLang aborts the batch's loading requests).

:class:`LayerLoader` does all of that on the core's engine runtime, as vLLM's and TensorRT-LLM's connectors
do: lookups, their locks and the back-off from a server that does not answer are the
:class:`SchedulerRuntime`'s (one per TP rank: SGLang runs a scheduler per rank, keyed by its page hashes,
answered at once with :meth:`~SchedulerRuntime.wait_for_lookups`), the copies the :class:`WorkerRuntime`'s
(engine placement: the copy runs in this process, one slice of layers at a time). One loader thread owns
every worker-runtime call: it starts a batch's retrieves, waits (bounded) until the runtime releases them on
their first slice, then waits on each layer in turn with the runtime's own per-layer wait and
``complete``\\ s the layer in SGLang's counter only when that wait returned with the layer's bytes in place;
a failure anywhere ``fail``\\ s the counter with the runtime's reason (which its record also holds), so
``finish`` reports it and SGLang aborts only those requests. Offloads run on the same thread, after the loads queued before them; each reserves its objects
on the server before it waits for the forward's writes, so that round trip overlaps the forward.

It needs no SGLang import: the linker hands it SGLang's counter, and the GPU tests a stand-in for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from kvstrata.core.engine.requests import LoadSpec, StoreSpec
from kvstrata.core.engine.scheduler_runtime import SchedulerRuntime
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.transfer.layouts import LayoutError

from .hooks import SglangLoadFailure
from .kv_layout import blocks_of_slots

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.0005
IDLE_POLL = 0.02
"""How often the idle loader thread polls transfers that outlived their batch."""


class LoadCounter(Protocol):
    """What the loader calls on SGLang's ``LayerWiseLoadCounter`` (its names and meaning)."""

    num_layers: int

    def update_producer(self) -> int: ...
    def complete(self, index: int, layer: int) -> None: ...
    def fail(self, index: int, error: BaseException) -> None: ...
    def finish(self, index: int) -> bool: ...
    def reset(self) -> None: ...


def synchronize_events(events: Sequence[Any]) -> None:
    """The wait for an offload's inputs on CUDA: block until each of SGLang's offload-ready events (its
    ``record_offload_ready``: the indices on the scheduler's stream, the pages on the forward stream) is done."""
    for event in events:
        event.synchronize()


def lookup_pages_now(scheduler: SchedulerRuntime, lookups: Sequence[tuple[str, Sequence[str]]]) -> list[int]:
    """Tokens the server holds of each ``(request id, page hashes)``, locked for the request, answered now (SGLang
    asks no second time). The LOOKUPs go out together and are waited for once, bounded by ``lookup_timeout``.
    0 for a miss and whenever the server did not answer (the runtime freed what they locked and backs off).
    The request ids must differ; each hit stays locked until the runtime plans its load or is told it
    ``finished``."""
    hashes = dict(lookups)
    try:
        answers = {rid: scheduler.lookup_pages(rid, pages) for rid, pages in hashes.items()}
        while waiting := [rid for rid, tokens in answers.items() if tokens is None]:
            scheduler.wait_for_lookups(waiting)
            answers.update({rid: scheduler.lookup_pages(rid, hashes[rid]) for rid in waiting})
    except Exception as exc:  # a LOOKUP not even sent (the connection is closed): nothing is held, SGLang computes
        log.warning("kvstrata LOOKUP of %d requests not sent (%s); SGLang computes them", len(hashes), exc)
        for rid in hashes:
            scheduler.finished(rid)
        return [0] * len(lookups)
    return [int(answers[rid] or 0) for rid, _ in lookups]


class KvstrataLoadFailed(RuntimeError):
    """A kvstrata load did not land; what SGLang's counter holds for the layers it could not complete."""


@dataclass
class _Batch:
    index: int
    specs: list[LoadSpec]

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.specs]


class LayerLoader:
    def __init__(self, runtime: WorkerRuntime, counter: LoadCounter, *, page_size: int,
                 wait_for_offload_inputs: Callable[[Sequence[Any]], None] | None = None) -> None:
        """``runtime`` is registered already. ``wait_for_offload_inputs(events)``: block until an offload's
        pages are written (on CUDA: synchronize SGLang's offload-ready events); None on CPU."""
        self.runtime = runtime
        self.counter = counter
        self.page_size = page_size
        self.settings = runtime.settings
        self._wait_for_offload_inputs = wait_for_offload_inputs
        # this rank's scheduler side, on its own connection: SGLang asks while the loader thread may be in a wait
        self.scheduler = SchedulerRuntime(runtime.adapter, self.settings, model=runtime.model, block_size=page_size,
                                          world_size=runtime.world_size, rank=runtime.rank)
        self._scheduler_lock = threading.Lock()
        """SGLang's scheduler thread looks up and queues loads; the loader thread looks offloads up and ends loads."""
        self._queued: set[str] = set()
        """Loads planned in the scheduler runtime, not started yet."""
        self._loads_of: dict[str, int] = {}
        """Request id -> its loads queued or running: the scheduler runtime forgets it once none is left (a
        request loaded again while an earlier load of it still runs is looked up under a new lock attempt)."""
        self._failures: dict[str, str] = {}
        self._reported: set[str] = set()
        """Loads whose failure the runtime reported (and recorded) since their batch started."""
        self._offload_results: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._runtime_lock = threading.Lock()
        self._offload_ids = 0
        self._closed = False
        """Set by :meth:`close`: from then on nothing reaches the runtime (no call may register it again)."""
        self._thread = threading.Thread(target=self._run, name="kvstrata-sglang-loader", daemon=True)
        self._thread.start()

    # --- the scheduler runtime ----------------------------------------------------------------

    def _held_pages(self, request_id: str, page_hashes: Sequence[str]) -> int:
        """Whole pages of ``page_hashes`` the server holds, locked for ``request_id`` (0 if it did not answer).
        The caller holds the scheduler lock."""
        tokens = lookup_pages_now(self.scheduler, [(request_id, page_hashes)])[0]
        return min(tokens // self.page_size, len(page_hashes))

    def _load_ended(self, request_id: str) -> int:
        """One load of ``request_id`` was dropped or has settled; how many of its loads are left. The caller
        holds the scheduler lock."""
        left = self._loads_of.pop(request_id, 1) - 1
        if left > 0:
            self._loads_of[request_id] = left
        return left

    # --- the scheduler's calls (SGLang's scheduler thread) -------------------------------------

    def restorable_pages(self, request_id: str, page_hashes: Sequence[str]) -> int:
        """How many leading pages of ``page_hashes`` kvstrata can load now (0 when the server is down)."""
        if not page_hashes or not self._connected():
            return 0
        probe = f"{request_id}#lookup"
        with self._scheduler_lock:
            pages = self._held_pages(probe, page_hashes)
            self.scheduler.finished(probe)  # its locks go now: load() locks what it will really retrieve
        return pages

    def _connected(self) -> bool:
        """Whether loads can run: the runtime is registered with the server, or registers now (it retries at
        most every ``RECONNECT_INTERVAL``). Never blocks on a load in flight: a connected runtime answers
        without the lock, and an unconnected one has nothing in flight. False once closed."""
        if self._closed:
            return False
        if self.runtime.connected:
            return True
        with self._runtime_lock:
            return self.runtime.connect()

    def queue_load(self, request_id: str, page_hashes: Sequence[str], slots: torch.Tensor) -> bool:
        """Queue the load of ``page_hashes`` into SGLang's token ``slots``; False: refused, SGLang computes."""
        if request_id in self._queued:
            raise RuntimeError(f"a kvstrata load for request {request_id!r} is already queued")
        if self._closed or not self.runtime.connected:  # a load now would only fail (SGLang aborts it): compute
            log.info("load for %s refused: not registered with kvstrata at %s", request_id,
                     self.settings.server_address)
            return False
        try:
            blocks = blocks_of_slots(slots, self.page_size)
        except LayoutError as exc:
            log.warning("load for %s refused: %s", request_id, exc)
            return False
        if len(blocks) != len(page_hashes):
            log.warning("load for %s refused: %d pages of slots for %d page hashes", request_id, len(blocks),
                        len(page_hashes))
            return False
        with self._scheduler_lock:
            pages = self._held_pages(request_id, page_hashes)  # locks the chunks for the load
            if pages != len(page_hashes):
                log.info("load for %s refused: the server holds %d of its %d pages now (evicted since the "
                         "lookup?)", request_id, pages, len(page_hashes))
                self.scheduler.finished(request_id)  # frees what it locked
                return False
            self.scheduler.allocated(request_id, (tuple(blocks),), pages * self.page_size)  # plans the load
            self._queued.add(request_id)
            self._loads_of[request_id] = self._loads_of.get(request_id, 0) + 1
        return True

    def cancel(self, request_id: str) -> bool:
        """Drop a queued load that has not started (its slots are about to be freed)."""
        with self._scheduler_lock:
            if request_id not in self._queued:
                return False
            self._queued.discard(request_id)
            self._load_ended(request_id)
            self.scheduler.finished(request_id)  # drops the load it planned, and frees its locks
        return True

    def start(self) -> int:
        """Start every queued load; SGLang's counter index for them, or -1 if none was queued."""
        if not self._queued:
            return -1
        with self._scheduler_lock:
            # every queued load, in queue order (no step plans a store: SGLang offloads explicitly)
            specs = self.scheduler.plan_step((), (), lambda _: ()).loads
            self._queued.clear()
        batch = _Batch(self.counter.update_producer(), specs)
        self._tasks.put(lambda: self._load(batch))
        return batch.index

    def finish(self, index: int) -> bool:
        """After the forward: True when every layer of the batch landed (bounded: the loader resolves every
        layer's future, each wait it makes is bounded)."""
        return self.counter.finish(index)

    def offload(self, page_hashes: Sequence[str], slots: torch.Tensor, ready: Sequence[Any] = ()) -> None:
        """Store SGLang's pages ``page_hashes`` from ``slots``; the result is popped later (see below)."""
        if self._closed:
            self._offload_results.put(False)
            return
        self._offload_ids += 1
        request_id = f"sglang-offload-{self._offload_ids}"
        hashes, slots = tuple(page_hashes), slots.to(device="cpu", dtype=torch.int64).clone()
        self._tasks.put(lambda: self._offload(request_id, hashes, slots, ready))

    def num_completed_offloads(self) -> int:
        return self._offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._offload_results.get_nowait()

    # --- the loader thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=IDLE_POLL)
            except queue.Empty:
                self._drain_leftovers()
                continue
            try:
                if task is None:
                    return
                task()
            except BaseException:  # a task resolves its own counter entries; this only keeps the thread alive
                log.exception("kvstrata SGLang loader task failed")
            finally:
                self._tasks.task_done()

    def _drain_leftovers(self) -> None:
        """While idle: a transfer that outlived its batch (held, stalled, failed late) still gets polled, so
        it settles, its record is written and its locks go, with no engine step needed."""
        with self._runtime_lock:
            if self.runtime.connected and self.runtime.in_flight():
                self.runtime.poll()
                self._take_failures(())
                self._failures.clear()  # no batch is running: these belong to batches SGLang already finished
                self._reported.clear()

    def _failed(self, rids: Sequence[str], records: dict[str, Any]) -> dict[str, str]:
        """The batch's failed loads: by their records (at once) or by the runtime's reports (a load that could
        not even start has no record)."""
        failed = self._take_failures(rids)
        for rid, rec in records.items():
            if rec is None and rid not in failed and rid not in self.runtime.in_flight():
                failed[rid] = "the load did not start"
            elif rec is not None and rec.failure and rid not in failed:
                failed[rid] = rec.failure
        return failed

    def _record_unreported(self, failed: dict[str, str]) -> None:
        """SGLang aborts these requests now: the runtime's record must say why now, too. A load whose copy
        is still stalled has no failure report yet (the runtime writes one once the copy stops): the loader
        writes the record's ``load_failed`` for it, saying the copy had not stopped."""
        for rid, why in failed.items():
            if rid in self._reported:
                self._reported.discard(rid)
                continue
            self.runtime.record.write("load_failed", request_id=rid, rank=self.runtime.rank, reason=why,
                                      copy_stopped=False)

    def _take_failures(self, request_ids: Sequence[str]) -> dict[str, str]:
        for report in self.runtime.take_load_failures():
            if isinstance(report, SglangLoadFailure):
                self._failures[report.request_id] = report.reason
                self._reported.add(report.request_id)
        return {r: self._failures.pop(r) for r in request_ids if r in self._failures}

    def _load(self, batch: _Batch) -> None:
        rids = batch.request_ids
        completed = 0
        failed: dict[str, str] = {}
        try:
            with self._runtime_lock:
                self.runtime.start_loads(batch.specs)
                # Each load's record says at once when it failed; the runtime's failure *report* waits until a
                # engine-placement copy has stopped, and a layer must not be completed meanwhile.
                transfers = self.runtime.transfers
                records = {r: transfers.records.get(r) for r in rids} if transfers is not None else {}
                released: set[str] = set()
                deadline = time.monotonic() + self.settings.retrieve_timeout
                for layer in range(self.counter.num_layers):
                    failed = self._wait_layer(layer, rids, released, deadline, records)
                    if failed:
                        break
                    self.counter.complete(batch.index, layer)  # every load of the batch has its bytes in place
                    completed += 1
                self._settle(rids)  # a failed copy gets (bounded) time to stop: SGLang frees the slots next
                if failed:
                    self._record_unreported(failed)
        except BaseException as exc:
            failed = failed or {r: f"{type(exc).__name__}: {exc}" for r in rids}
            raise
        finally:
            if completed < self.counter.num_layers:
                reason = "; ".join(f"{r}: {why}" for r, why in failed.items()) or "the load stopped"
                log.error("kvstrata load of %s failed after %d of %d layers: %s", rids, completed,
                          self.counter.num_layers, reason)
                self.counter.fail(batch.index, KvstrataLoadFailed(reason))
            with self._scheduler_lock:  # the worker side freed the locks; the scheduler side forgets the request
                for rid in rids:
                    if self._load_ended(rid) == 0:
                        self.scheduler.finished(rid)

    def _wait_layer(self, layer: int, rids: Sequence[str], released: set[str], deadline: float,
                    records: dict[str, Any]) -> dict[str, str]:
        """Return once every load of the batch has ``layer`` in place (empty dict), or their failures.

        The runtime's layer wait covers the loads it has released (first slice landed). In engine placement
        the copies of one batch run one after another, so a later load is released only once the earlier
        ones have moved on: the wait is made again whenever more of the batch was released, and the layer
        is done when a wait made after the last release returned. Bounded by ``retrieve_timeout`` for the
        batch, and each runtime wait by ``layer_wait_timeout``.
        """
        waited_with: set[str] | None = None
        while True:
            released |= set(self.runtime.poll()[1]) & set(rids)
            failed = self._failed(rids, records)
            if failed:
                return failed
            if released != waited_with:
                self.runtime.wait_for_layer(layer)  # a timeout fails the load: its record says so at once
                waited_with = set(released)
                failed = self._failed(rids, records)
                if failed:
                    return failed
            if waited_with >= set(rids):
                return {}
            if time.monotonic() > deadline:
                return {r: f"not released within retrieve_timeout {self.settings.retrieve_timeout:.1f}s"
                        for r in set(rids) - released}
            time.sleep(POLL_INTERVAL)

    def _settle(self, rids: Sequence[str]) -> None:
        """Wait (bounded) until the batch's transfers stopped writing, then let the runtime forget them."""
        deadline = time.monotonic() + self.settings.layer_wait_timeout
        while set(rids) & self.runtime.in_flight() and time.monotonic() < deadline:
            self.runtime.poll()
            time.sleep(POLL_INTERVAL)
        self.runtime.poll(rids)
        self._take_failures(rids)  # a failure after the last layer landed changes nothing SGLang reads

    def _offload(self, request_id: str, page_hashes: tuple[str, ...], slots: torch.Tensor,
                 ready: Sequence[Any]) -> None:
        """Reserve the pages' objects first, then wait for the forward's writes, then copy and commit: the
        RESERVE_STORE round trip runs while the forward that computed the pages may still be running, as
        vLLM's and TensorRT-LLM's reservations before their forward do."""
        ok = False
        spec: StoreSpec | None = None
        try:
            blocks = blocks_of_slots(slots, self.page_size)
            if len(blocks) != len(page_hashes):
                raise LayoutError(f"{len(blocks)} pages of slots for {len(page_hashes)} page hashes")
            with self._runtime_lock:
                spec, ok = self._plan_store(request_id, page_hashes, blocks)
                if spec is not None:
                    self.runtime.reserve_stores([spec])
            if spec is None:
                return
            if self._wait_for_offload_inputs is not None:
                self._wait_for_offload_inputs(ready)
            with self._runtime_lock:
                failed_before = self.runtime.stats.total.stores_failed
                self.runtime.store([spec])
                ok = self.runtime.stats.total.stores_failed == failed_before
        except Exception as exc:
            log.warning("offload of %d pages failed: %s", len(page_hashes), exc)
        finally:
            if spec is not None:  # a reservation no store took (the wait failed, say) goes back now
                with self._runtime_lock:
                    self.runtime.drop_store_reservation(spec.request_id)
            self._offload_results.put(ok)

    def _plan_store(self, request_id: str, page_hashes: tuple[str, ...],
                    blocks: list[int]) -> tuple[StoreSpec | None, bool]:
        """The store an offload needs (None if none) and, when none, whether the offload succeeded."""
        if not self.runtime.connect():
            log.info("offload of %d pages skipped: kvstrata server %s not reachable", len(page_hashes),
                     self.settings.server_address)
            return None, False
        with self._scheduler_lock:
            stored = self._held_pages(request_id, page_hashes)  # skip what the server already holds
            self.scheduler.finished(request_id)  # its locks go at once
            if self.scheduler.backing_off:  # the server did not answer: a store could only wait for it too
                return None, False
        if stored >= len(page_hashes):
            return None, True
        return StoreSpec(request_id, b"", None, (tuple(blocks),), stored * self.page_size, page_hashes,
                         self.page_size), False

    # --- lifecycle -----------------------------------------------------------------------------

    def drain(self) -> None:
        """Wait until every started load and queued offload has run (each is bounded)."""
        self._tasks.join()

    def reset(self) -> None:
        """Quiesce (SGLang's ``flush_cache``): finish what runs, drop queued loads and offload results."""
        self.drain()
        for rid in list(self._queued):
            self.cancel(rid)
        while not self._offload_results.empty():
            self._offload_results.get_nowait()
        self.counter.reset()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """At engine shutdown: finish what runs (bounded), stop the loader thread, unregister the cache from
        the server and remove this process's shared-memory segments (the runtime's registration area and its
        connections' rings). Idempotent, and each step runs even if one before it failed."""
        if self._closed:
            return
        self._closed = True
        try:
            self.reset()
        finally:
            self._tasks.put(None)
            self._thread.join(timeout=self.settings.layer_wait_timeout + self.settings.retrieve_timeout)
            try:
                with self._runtime_lock:
                    self.runtime.close()
            finally:
                self.scheduler.close()
