"""kvstrata's side of SGLang's unified-cache linker: lookups, queued loads, per-layer completion, offloads.

SGLang's linker contract (``mem_cache/unified_cache/unified_cache_linker.py``) is: ``lookup`` answers at
once how many pages are restorable; ``load`` only queues; ``start_layer_wise_loading`` starts the queued
loads right before the forward that reads them and returns a ``LayerWiseLoadCounter`` index; the attention
of layer ``l`` blocks in ``wait_until(l)`` until the layer's future resolves; ``finish_layer_wise_loading``
after the forward says whether every layer landed (if not, SGLang aborts the batch's loading requests).

:class:`LayerLoader` does all of that on the core's :class:`WorkerRuntime` (engine placement: the copy runs
in this process, one slice of layers at a time). One loader thread owns every runtime call: it starts a
batch's retrieves, waits (bounded) until the runtime releases them on their first slice, then waits on each
layer in turn with the runtime's own per-layer wait and ``complete``\\ s the layer in SGLang's counter only
when that wait returned with the layer's bytes in place; a failure anywhere ``fail``\\ s the counter with the
runtime's reason (which its record also holds), so ``finish`` reports it and SGLang aborts only those
requests. Offloads run on the same thread, after the loads queued before them; each reserves its objects
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
from kvstrata.core.engine.requests import ChunkLocations, LoadSpec, StoreSpec, lock_owner, shard_key
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.transfer.layouts import LayoutError
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType

from .hooks import SglangLoadFailure
from .kv_layout import blocks_of_slots

log = logging.getLogger(__name__)

BACK_OFF_TIMEOUTS = 5
"""After a LOOKUP timed out, lookups skip kvstrata for this many lookup timeouts (the engine computes)."""
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
        # lookups go on their own connection: the scheduler asks while the loader thread may be in a wait
        self.client = CacheClient(self.settings.server_address, timeout=self.settings.lookup_timeout,
                                  **self.settings.client_options())
        self._queued: dict[str, LoadSpec] = {}
        self._failures: dict[str, str] = {}
        self._reported: set[str] = set()
        """Loads whose failure the runtime reported (and recorded) since their batch started."""
        self._offload_results: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._runtime_lock = threading.Lock()
        self._down_until = 0.0
        self._unreachable_logged = False
        self._offload_ids = 0
        self._closed = False
        """Set by :meth:`close`: from then on nothing reaches the runtime (no call may register it again)."""
        self._thread = threading.Thread(target=self._run, name="kvstrata-sglang-loader", daemon=True)
        self._thread.start()

    # --- keys ----------------------------------------------------------------------------

    def _key(self, request_id: str, page_hashes: Sequence[str]) -> Any:
        r = self.runtime
        return shard_key(request_id, r.model, b"", None, rank=r.rank, world_size=r.world_size,
                         instance_id=r.settings.instance_id, page_hashes=tuple(page_hashes),
                         page_size=self.page_size)

    def _lookup_pages(self, request_id: str, page_hashes: Sequence[str]) -> int | None:
        """Whole pages of ``page_hashes`` the server holds, locked for ``request_id``; None if it did not answer."""
        reply = self._lookup(request_id, page_hashes)
        return None if reply is None else self._whole_pages(reply, page_hashes)

    def _whole_pages(self, reply: dict[str, Any], page_hashes: Sequence[str]) -> int:
        """Whole pages of ``page_hashes`` a LOOKUP reply says the server holds."""
        return min(int(reply["hit_tokens"]) // self.page_size, len(page_hashes))

    def _lookup(self, request_id: str, page_hashes: Sequence[str]) -> dict[str, Any] | None:
        """The LOOKUP's reply for ``page_hashes`` (its hit locked for ``request_id``); None if it did not answer."""
        if time.monotonic() < self._down_until:
            return None
        try:
            reply = self.client.transport.wait(self.client.lookup_async(self._key(request_id, page_hashes)))
        except TimeoutError:
            self._down_until = time.monotonic() + self.settings.lookup_timeout * BACK_OFF_TIMEOUTS
            if not self._unreachable_logged:
                self._unreachable_logged = True
                log.warning("kvstrata server %s did not answer LOOKUP within %.1fs; SGLang computes prompts "
                            "instead (logged once until it answers again)", self.settings.server_address,
                            self.settings.lookup_timeout)
            self._free_lookup_locks(request_id)
            return None
        except Exception as exc:  # a server error: this request computes, the next asks again
            log.warning("LOOKUP for %s failed (%s); SGLang computes the prompt instead", request_id, exc)
            self._free_lookup_locks(request_id)
            return None
        self._unreachable_logged = False
        return reply

    def _free_lookup_locks(self, request_id: str) -> None:
        """Release ``request_id``'s lookup locks (fire and forget: a lost release only delays an eviction).
        Sent on the connection whose LOOKUP took them (the server lets only it, or the connection that
        registered the owner's instance, free them)."""
        owner = lock_owner(request_id, self.runtime.instance_id)
        try:
            self.client.transport.send_oneway(RequestType.FREE_LOOKUP_LOCKS, [owner])
        except Exception as exc:  # only a closed client raises here
            log.debug("FREE_LOOKUP_LOCKS for %s not sent: %s", owner, exc)

    # --- the scheduler's calls (SGLang's scheduler thread) -------------------------------------

    def restorable_pages(self, request_id: str, page_hashes: Sequence[str]) -> int:
        """How many leading pages of ``page_hashes`` kvstrata can load now (0 when the server is down)."""
        if not page_hashes or not self._connected():
            return 0
        probe = f"{request_id}#lookup"
        pages = self._lookup_pages(probe, page_hashes)
        if pages is None:
            return 0
        self._free_lookup_locks(probe)  # load() locks what it will really retrieve
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
        reply = self._lookup(request_id, page_hashes)  # locks the chunks for the load
        pages = None if reply is None else self._whole_pages(reply, page_hashes)
        if pages != len(page_hashes):
            log.info("load for %s refused: the server holds %s of its %d pages now (evicted since the lookup?)",
                     request_id, pages, len(page_hashes))
            self._free_lookup_locks(request_id)
            return False
        r = self.runtime
        self._queued[request_id] = LoadSpec(
            request_id, request_id, b"", None, (tuple(blocks),), 0, self.settings.layers_per_slice,
            tuple(page_hashes), self.page_size,
            located=ChunkLocations.for_rank(reply, pages * self.page_size, r.rank, r.world_size))
        return True

    def cancel(self, request_id: str) -> bool:
        """Drop a queued load that has not started (its slots are about to be freed)."""
        if self._queued.pop(request_id, None) is None:
            return False
        self._free_lookup_locks(request_id)
        return True

    def start(self) -> int:
        """Start every queued load; SGLang's counter index for them, or -1 if none was queued."""
        if not self._queued:
            return -1
        specs, self._queued = list(self._queued.values()), {}
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
        stored = self._lookup_pages(request_id, page_hashes)  # skip what the server already holds
        self._free_lookup_locks(request_id)
        if stored is None:
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
                self.client.close()
