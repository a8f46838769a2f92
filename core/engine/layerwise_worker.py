"""The engine-side runtime: submit retrieves, release requests early, wait per layer.

Engine-agnostic: adapters translate their engine's calls into these four.

* :meth:`LayerwiseWorker.submit_retrieve` starts a retrieve with a slice width.
* :meth:`LayerwiseWorker.get_finished` reports a request as soon as its first
  slice has landed (the gate's release policy), and keeps it in a draining set
  until the transfer really completes, so completion and failure are still
  collected and the arrival slot is freed then.
* :meth:`LayerwiseWorker.wait_for_layer` blocks until every released, still
  in-flight retrieve has the layer, bounded by a timeout that logs and reports
  the request's blocks as failed instead of hanging the engine thread.
* :meth:`LayerwiseWorker.take_failed` hands the engine the blocks to recompute.

Two placements share the gate. Server placement: the server writes into the
engine's cache and publishes progress on the arrival board. Engine placement:
the server only locks and locates the chunks; this process maps the L1 pool
(read-only, or writable when it stores: :meth:`LayerwiseWorker.store_to_pool`)
and runs the same planner itself through its one transfer queue
(:mod:`kvstrata.core.engine.transfer_queue`), recording slices straight into the
gate.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvstrata.core.transfer import planner
from kvstrata.core.arrival.gate import LayerArrivalGate, LayerWaitTimeout, TransferFailed
from kvstrata.core.arrival.pool import ArrivalPool, ArrivalSlot
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.arrival.events import EventBackend, HostEventBackend, LocalCopier
from kvstrata.core.engine.requests import ChunkLocations
from kvstrata.core.engine.transfer_queue import (ENQUEUE_AHEAD_BYTES, HANDOVER_SLICES, POLICY_EARLIEST_RELEASED,
                                                 QueuedLoad, TransferQueue)
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE, PagedKVLayout
from kvstrata.core.shm import Segment

log = logging.getLogger(__name__)


@dataclass
class RetrieveRecord:
    """What happened to one retrieve, for logs, tests and benchmarks."""

    request_id: str
    num_tokens: int
    layers_per_slice: int
    submitted_at: float
    released_at: float | None = None
    completed_at: float | None = None
    released_before_complete: bool | None = None
    layer_waits: int = 0
    failure: str | None = None
    fallback: str | None = None
    located_by: str | None = None
    """Engine placement: ``lookup`` (the LOOKUP's reply said where the chunks are) or ``retrieve``."""
    replied_at: float | None = None
    """Engine placement: when the RETRIEVE's reply was resolved, by whichever thread read it (at submit when
    the LOOKUP located the chunks)."""
    located_at: float | None = None
    """Engine placement: when the transfer thread had the chunks' locations."""
    planned_at: float | None = None
    """Engine placement: when the load was planned (its copies and slices), right before its first slice."""
    first_slice_at: float | None = None
    """Engine placement: when the first slice was enqueued (on a GPU: handed to the engine's streams)."""
    last_slice_at: float | None = None
    """Engine placement: when the last slice was enqueued (how long the transfer queue kept enqueuing)."""


@dataclass
class StoreRecord:
    """When the steps of this process's last engine-placement STORE ended (``time.perf_counter()``), for
    benchmarks and logs: where a store's time goes beyond its copies."""

    request_id: str
    started_at: float
    reserved_ahead: bool = False
    """RESERVE_STORE was sent before the store began (:meth:`LayerwiseWorker.reserve_store`)."""
    reserved_at: float | None = None
    """RESERVE_STORE's reply was in hand."""
    enqueued_at: float | None = None
    """This process had enqueued the copies into the reserved objects (host time; they run after)."""
    copied_at: float | None = None
    """The copies into the reserved objects had run."""
    committed_at: float | None = None
    """COMMIT_STORE answered."""


@dataclass
class _InFlight:
    request_id: str
    block_ids: list[list[int]]
    future: Future
    gate: LayerArrivalGate
    slot: ArrivalSlot | None
    width: int
    record: RetrieveRecord
    failed: bool = False
    settled: bool = False
    engine_done: bool = False
    """The engine finished or aborted the request while this transfer was in flight."""
    report_pending: bool = False
    """Failed while this process's own copy was still running: reported once it has stopped."""
    refresh: Callable[[], None] | None = None
    lock_owner: str = ""
    """Whose lookup locks this load's key names: a failed server-placement RETRIEVE leaves them held (a refused
    request frees nothing on the server), so the failure frees them from here."""
    _board_seen: int = field(default=0)

    @property
    def released(self) -> bool:
        """Handed back to the engine (the gate holds it: the transfer queue waits on it too)."""
        return self.gate.released


class LayerwiseWorker:
    def __init__(self, client: CacheClient, instance_id: int, layout: PagedKVLayout, *,
                 placement: str = PLACEMENT_SERVER, event_backend: EventBackend | None = None,
                 local_regions: Sequence[torch.Tensor] | None = None, pool_slots: int = 8,
                 release_after_layers: int = 1, layer_wait_timeout: float = 10.0,
                 retrieve_timeout: float = 120.0, registration_layout: PagedKVLayout | None = None,
                 shm_rings: bool | None = None, transfer_queue_policy: str = POLICY_EARLIEST_RELEASED,
                 pool_writable: bool = False, handover_slices: int = HANDOVER_SLICES,
                 enqueue_ahead_bytes: int | None = ENQUEUE_AHEAD_BYTES) -> None:
        """Engine placement: ``handover_slices``, how many of a released load's slices the engine waits on before
        the transfer queue enqueues more (:data:`~kvstrata.core.engine.transfer_queue.HANDOVER_SLICES`);
        ``enqueue_ahead_bytes``, how far it enqueues ahead of the copies that landed
        (:data:`~kvstrata.core.engine.transfer_queue.ENQUEUE_AHEAD_BYTES`; None: every slice at once, the A/B
        arm)."""
        if placement not in (PLACEMENT_SERVER, PLACEMENT_ENGINE):
            raise ValueError(f"placement must be {PLACEMENT_SERVER!r} or {PLACEMENT_ENGINE!r}")
        if placement == PLACEMENT_ENGINE and local_regions is None:
            raise ValueError("engine placement needs local_regions: the engine cache this process writes")
        self.client = client
        self.instance_id = instance_id
        self.layout = layout
        self.registration_layout = registration_layout or layout
        """What the server is told: the engine cache itself, or (engine placement) a
        ``RegistrationArea``; either way it must share ``layout``'s shape signature."""
        if self.registration_layout.shape_signature() != layout.shape_signature():
            raise ValueError("registration_layout must hold the same (kv, layers, heads, head_bytes) as layout")
        self.placement = placement
        self._event_backend = event_backend or HostEventBackend()
        self.local_regions = list(local_regions) if local_regions is not None else None
        self.release_after_layers = release_after_layers
        self.layer_wait_timeout = layer_wait_timeout
        self.retrieve_timeout = retrieve_timeout
        self.pool = ArrivalPool(pool_slots, layout.num_layers, self._event_backend) if placement == PLACEMENT_SERVER \
            else None
        self._inflight: dict[str, _InFlight] = {}
        self._failed: dict[str, tuple[list[list[int]], str]] = {}
        self._drained: set[str] = set()
        self._registration_lost = False
        self.records: dict[str, RetrieveRecord] = {}
        self.last_store: StoreRecord | None = None
        """Engine placement: the steps of the last :meth:`store_to_pool`."""
        self._lock = threading.RLock()
        self._l1_pool: Segment | None = None
        self._generation_segment: Segment | None = None
        self._generations: np.ndarray | None = None
        self._l1_tensor: torch.Tensor | None = None
        self._copier: LocalCopier | None = None
        self._pool_lock = threading.Lock()
        self.chunk_size: int | None = None
        self._queue = TransferQueue(client, layout, policy=transfer_queue_policy, copier_for=self._copier_for,
                                    chunk_size=lambda: self.chunk_size, retrieve_timeout=retrieve_timeout,
                                    landed=self._event_backend.landed, generations_for=self._generations_for,
                                    handover_slices=handover_slices,
                                    enqueue_ahead_bytes=enqueue_ahead_bytes) \
            if placement == PLACEMENT_ENGINE else None
        self.pool_writable = pool_writable
        """Engine placement: map the server's pool writable too, so this process STOREs by copying into
        objects the server reserved (:meth:`store_to_pool`); otherwise it is mapped read-only."""
        self.shm_rings = placement == PLACEMENT_SERVER if shm_rings is None else shm_rings
        """At registration, attach shared-memory rings for requests and replies (a server on this host then
        sees a RETRIEVE, and get_finished() its reply, without waiting for a ZMQ I/O thread to wake). By
        default only in server placement: an engine-placement load starts from its LOOKUP's locations and
        sends no RETRIEVE on its path, and with the engine computing the rings did not make its first-token
        time shorter (``benchmarks/ttft.py``'s ``-rings`` / ``-norings`` arms are the A/B)."""

    # --- public properties the design asks adapters to use ---------------------------

    @property
    def event_backend(self) -> EventBackend:
        return self._event_backend

    @property
    def device(self) -> str:
        return self._event_backend.device

    # --- registration ----------------------------------------------------------------

    def register(self) -> dict[str, Any]:
        reply = self.client.register_kv_cache(self.instance_id, self.registration_layout, self.placement)
        self.chunk_size = int(reply["chunk_size"])
        if self.placement == PLACEMENT_ENGINE and reply.get("pool"):
            self._map_l1_pool(reply["pool"])  # and register it for DMA on a GPU: once, off the request path
        if self.shm_rings:
            self.client.transport.attach_rings()
        log.info("registered %s cache as instance %d with %s (%s placement, chunk %d)", self.layout.format,
                 self.instance_id, self.client.address, self.placement, self.chunk_size)
        return reply

    # --- retrieve --------------------------------------------------------------------

    def submit_retrieve(self, request_id: str, key: CacheKey, block_ids: Sequence[Sequence[int]], *,
                        skip_first_n_tokens: int = 0, layers_per_slice: int = 0, running: bool = False,
                        located: ChunkLocations | None = None) -> None:
        """Start moving ``key``'s tokens into ``block_ids``; returns at once.

        ``running``: the engine computes this request in the step the load starts (a synchronous match, as
        TensorRT-LLM's ``(n, False)``), so layer waits cover it from the start and it is never handed back.
        ``located``: engine placement, where the LOOKUP found ``key``'s chunks; the load then starts copying
        without a RETRIEVE round trip (ignored in server placement, where the server copies).
        """
        blocks = [list(map(int, g)) for g in block_ids]
        record = RetrieveRecord(request_id, key.num_tokens - skip_first_n_tokens, layers_per_slice, time.perf_counter())
        gate = LayerArrivalGate(self.layout.num_layers, self.release_after_layers)
        width = layers_per_slice
        if width > 0:
            reason = planner.layer_major_fallback_reason(self.layout)
            if reason is not None:
                planner.log_fallback_once(reason)
                record.fallback, width = reason, 0
        if self.placement == PLACEMENT_ENGINE:
            # Where the chunks lie comes with the LOOKUP, or from a RETRIEVE sent from this (the engine's) thread:
            # the queue's thread only waits for the answer.
            try:
                self.layout.check_block_ids(blocks, key.num_tokens)
                reply = self._locate(key, blocks, skip_first_n_tokens, located, record)
            except Exception as exc:  # reported through the load, like any other failure
                reply = Future()
                reply.set_exception(exc)
            reply.add_done_callback(lambda _, r=record: setattr(r, "replied_at", time.perf_counter()))
            fut = self._queue.submit(QueuedLoad(key, blocks, skip_first_n_tokens, width, gate, record, reply))
            inflight = _InFlight(request_id, blocks, fut, gate, None, width, record)
        else:
            slot = self.pool.acquire() if width > 0 else None
            if width > 0 and slot is None:
                record.fallback, width = "arrival pool exhausted", 0
            fut = self.client.retrieve_async(
                key, self.instance_id, blocks, skip_first_n_tokens=skip_first_n_tokens,
                arrival_board=slot.board_ref() if slot else None,
                layer_event_handles=slot.handles if slot else None, layers_per_slice=width)
            fut.add_done_callback(lambda f, r=record: self._note_reply(f, r))
            inflight = _InFlight(request_id, blocks, fut, gate, slot, width, record, lock_owner=key.request_id)
            if slot is not None:
                inflight.refresh = lambda i=inflight: self._refresh_from_board(i)
        if running:
            gate.mark_released()
            record.released_at, record.released_before_complete = record.submitted_at, True
        with self._lock:
            self._inflight[request_id] = inflight
            self.records[request_id] = record

    def _locate(self, key: CacheKey, blocks: list[list[int]], skip: int, located: ChunkLocations | None,
                record: RetrieveRecord) -> Future:
        """Engine placement: where ``key``'s chunks lie in the pool, from the LOOKUP if it said so and its
        objects fit this cache, else from a RETRIEVE (sent now, from the engine's thread)."""
        if located is not None:
            if located.shape == self.layout.shape_signature() and located.num_tokens == key.num_tokens:
                record.located_by = "lookup"
                reply: Future = Future()
                reply.set_result(located.as_retrieve_reply())
                return reply
            log.info("request %s: the LOOKUP's chunks (shape %s, %d tokens) do not fit this cache (shape %s, "
                     "%d tokens); asking RETRIEVE", record.request_id, located.shape, located.num_tokens,
                     self.layout.shape_signature(), key.num_tokens)
        record.located_by = "retrieve"
        return self.client.retrieve_async(key, self.instance_id, blocks, skip_first_n_tokens=skip)

    @staticmethod
    def _note_reply(fut: Future, record: RetrieveRecord) -> None:
        """Keep what only the reply says (a server-side fallback), also when the board settled first."""
        if fut.cancelled() or fut.exception() is not None:
            return
        reply = fut.result()
        if isinstance(reply, dict) and reply.get("fallback"):
            record.fallback = reply["fallback"]

    def _refresh_from_board(self, inf: _InFlight) -> None:
        """Turn board progress into gate slices; the count is published after the events were recorded."""
        progress = inf.slot.progress()
        if progress.failed:
            inf.gate.fail("the server reported the retrieve failed")
            return
        landed = progress.layers
        width = inf.width or self.layout.num_layers
        while inf._board_seen < landed:
            start = inf._board_seen
            count = min(width, landed - start, self.layout.num_layers - start)
            inf.gate.record_slice(start, count, inf.slot.events[start])
            inf._board_seen = start + count

    # --- engine placement ------------------------------------------------------------

    def _map_l1_pool(self, pool: dict[str, Any]) -> torch.Tensor:
        with self._pool_lock:  # the transfer queue's thread and a storing thread may both ask first
            return self._map_l1_pool_locked(pool)

    def _map_l1_pool_locked(self, pool: dict[str, Any]) -> torch.Tensor:
        if self._l1_pool is None or self._l1_pool.name != pool["name"]:
            seg = Segment.attach(pool["name"], int(pool["size"]), readonly=not self.pool_writable)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only mapping: loads never write through it
                tensor = torch.frombuffer(seg.buf, dtype=torch.uint8, count=seg.size)
            if self._copier is not None:
                self._copier.close()  # the server restarted with a new pool
            self._copier = self._event_backend.engine_copier(self.layout, self.local_regions, tensor,
                                                            writable=self.pool_writable)
            if self._l1_pool is not None:
                self._l1_pool.close()
            self._l1_tensor, self._l1_pool = tensor, seg
        return self._l1_tensor

    def reserve_store(self, key: CacheKey, skip_first_n_tokens: int = 0) -> Future:
        """Engine placement, before the forward that computes ``key``'s blocks: send RESERVE_STORE now, so its
        round trip runs while the engine computes. Returns at once; pass the future to :meth:`store_to_pool`
        (``reservation=``), or to :meth:`drop_reservation` if the store will not happen."""
        if self.placement != PLACEMENT_ENGINE or not self.pool_writable:
            raise RuntimeError("reserve_store needs engine placement with pool_writable=True")
        return self.client.reserve_store_async(key, self.instance_id, skip_first_n_tokens)

    def drop_reservation(self, reservation: Future) -> None:
        """Give back the objects of a reservation no store will copy into (bounded; a failed one held none)."""
        try:
            reply = self.client.transport.wait(reservation, timeout=self.retrieve_timeout)
            self.client.commit_store(int(reply["reservation"]), False)
        except Exception as exc:  # the server is gone (it dropped the reservation) or refused it: nothing held
            log.debug("dropping a store reservation: %s", exc)

    def store_to_pool(self, key: CacheKey, block_ids: Sequence[Sequence[int]], skip_first_n_tokens: int = 0, *,
                      reservation: Future | None = None) -> dict[str, Any]:
        """Engine placement STORE: RESERVE_STORE the chunks not stored yet (unless ``reservation``, from
        :meth:`reserve_store` for the same key and skip, already asked), copy the blocks into those objects
        with this process's copier, then COMMIT_STORE once the copies have landed (or drop the reservation if
        they failed: a half-written object is never committed).

        Blocks the calling thread until the copies have run. On a GPU they run on this process's copy
        streams after the work the engine has queued so far; the engine's own stream never waits for them.
        """
        if self.placement != PLACEMENT_ENGINE or not self.pool_writable:
            raise RuntimeError("store_to_pool needs engine placement with pool_writable=True")
        blocks = [list(map(int, g)) for g in block_ids]
        try:
            self.layout.check_block_ids(blocks, key.num_tokens)
        except ValueError:
            if reservation is not None:
                self.drop_reservation(reservation)
            raise
        record = self.last_store = StoreRecord(key.request_id, time.perf_counter(),
                                               reserved_ahead=reservation is not None)
        if reservation is None:
            reply = self.client.reserve_store(key, self.instance_id, skip_first_n_tokens)
        else:
            reply = self.client.transport.wait(reservation, timeout=self.retrieve_timeout)
        record.reserved_at = time.perf_counter()
        landed = False
        try:
            if reply["objects"]:
                copier = self._copier_for(reply["pool"])
                spans = [(int(off), int(tokens), int(start)) for off, _, tokens, start in reply["objects"]]
                done = copier.gather(spans, blocks)
                record.enqueued_at = time.perf_counter()
                copier.finish(done)
            landed = True
            record.copied_at = time.perf_counter()
        finally:
            committed = self.client.commit_store(int(reply["reservation"]), landed)
            record.committed_at = time.perf_counter()
        if reply.get("full"):
            log.warning("STORE of %s kept %d tokens: %s", key.request_id, committed["stored_tokens"], reply["full"])
        return {"stored_tokens": committed["stored_tokens"], "skipped_tokens": reply["skipped_tokens"]}

    def _generations_for(self, pool: dict[str, Any]) -> np.ndarray:
        """The generation table of the pool a reply names, mapped read-only (again after a server restart)."""
        ref = pool["generations"]
        with self._pool_lock:
            if self._generation_segment is None or self._generation_segment.name != ref["name"]:
                seg = Segment.attach(str(ref["name"]), int(ref["slots"]) * 8, readonly=True)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only: this process never writes a word
                    table = np.frombuffer(seg.buf, dtype=np.uint64, count=int(ref["slots"]))
                old, self._generation_segment, self._generations = self._generation_segment, seg, table
                if old is not None:
                    old.close()
            return self._generations

    def _copier_for(self, pool: dict[str, Any]) -> LocalCopier:
        with self._pool_lock:
            self._map_l1_pool_locked(pool)
            return self._copier

    # --- engine side -----------------------------------------------------------------

    def get_finished(self) -> list[str]:
        """Request ids that may go back to the engine now (first slice landed, or transfer done).

        Also collects completed transfers: frees their slots and records failures.
        """
        # The engine polls this anyway: resolve arrived replies here, rather than wait
        # for the client's I/O thread to be woken for them.
        self.client.transport.poll()
        released = []
        with self._lock:
            for inf in list(self._inflight.values()):
                if not inf.released and inf.refresh is not None:
                    inf.refresh()
                # A request the engine already gave up on goes back only once settled: the
                # engine frees its blocks on that report, and a copy must not outlive them.
                ready = inf.gate.release_ready(self._event_backend.landed) and not inf.engine_done
                self._collect(inf)
                if not inf.released and (ready or inf.settled):
                    # A failed retrieve is released too: the engine must get the request
                    # back, with its blocks in take_failed(), rather than wait forever.
                    inf.gate.mark_released()
                    inf.record.released_at = time.perf_counter()
                    inf.record.released_before_complete = not inf.settled
                    released.append(inf.request_id)
                if inf.settled and inf.released:
                    self._inflight.pop(inf.request_id, None)
        return released

    def _collect(self, inf: _InFlight) -> None:
        """If the transfer finished, settle it: success completes the gate, failure marks blocks."""
        if inf.settled:
            return
        fut = inf.future
        done = fut.done()  # looked at once: the transfer queue's thread may resolve it at any moment
        if inf.report_pending and done:
            inf.report_pending = False
            self._failed[inf.request_id] = (inf.block_ids, inf.record.failure or "failed")
        if not done:
            if inf.slot is not None and inf.slot.progress().complete:
                # Every layer landed (published after the copies finished, and the last
                # thing the server writes to the slot): settle without the reply.
                inf.refresh()
                inf.record.completed_at = time.perf_counter()
                self._settle(inf, slot_free=True)
                return
            if time.perf_counter() - inf.record.submitted_at > self.retrieve_timeout:
                self._fail(inf, f"no reply within the {self.retrieve_timeout:.0f}s retrieve timeout")
                if not inf.report_pending:  # a local copy settles once it has stopped
                    self._settle(inf)
            return
        exc = fut.exception()
        if exc is not None:
            if getattr(exc, "code", None) == "unknown_instance":
                self._registration_lost = True
            self._fail(inf, f"{type(exc).__name__}: {exc}")
        else:
            self._note_reply(fut, inf.record)  # its done-callback may not have run yet
            if inf.refresh is not None:
                inf.refresh()
            if not inf.gate.complete and not inf.gate.failure:
                # chunk-major: one slice, complete now that the reply is here
                inf.gate.record_slice(inf.gate.arrived_layers, self.layout.num_layers - inf.gate.arrived_layers)
            inf.record.completed_at = time.perf_counter()
        self._settle(inf)

    def _settle(self, inf: _InFlight, slot_free: bool = False) -> None:
        """Mark the transfer over; ``slot_free``: the board said complete, so the server is done with the slot."""
        inf.settled = True
        if inf.released and inf.engine_done:
            self._drained.add(inf.request_id)
        if inf.slot is not None:
            if slot_free or inf.future.done():
                self.pool.release(inf.slot)
            else:
                # The server may still write this slot late; a reused slot must never see
                # that, so it stays out of the pool (a dead server writes nothing anyway).
                log.warning("arrival slot %d quarantined: its retrieve never answered", inf.slot.index)
            inf.slot = None
            inf.refresh = None
        if inf.released:
            self._inflight.pop(inf.request_id, None)

    def _fail(self, inf: _InFlight, reason: str) -> None:
        if inf.failed:
            return
        inf.failed = True
        inf.record.failure = reason
        inf.gate.fail(reason)
        blocks = sum(len(g) for g in inf.block_ids)
        if self.placement == PLACEMENT_ENGINE and not inf.future.done():
            # This process's copy may be writing a slice: it stops before the next one (the gate failed), and
            # only then may the engine recompute into those blocks, so the report waits for it (see _collect).
            inf.report_pending = True
            log.error("retrieve for request %s failed: %s; its %d blocks are reported for recompute once its "
                      "copy has stopped", inf.request_id, reason, blocks)
            return
        self._failed[inf.request_id] = (inf.block_ids, reason)
        log.error("retrieve for request %s failed: %s; its %d blocks are reported for recompute",
                  inf.request_id, reason, blocks)
        if inf.lock_owner:
            try:
                self.client.transport.send_oneway(RequestType.FREE_LOOKUP_LOCKS, [inf.lock_owner])
            except Exception as exc:  # a closed client: the server frees them when this connection's lease ends
                log.debug("FREE_LOOKUP_LOCKS for %s not sent: %s", inf.lock_owner, exc)

    def wait_for_layer(self, layer: int) -> None:
        """Block until every released, in-flight retrieve has ``layer`` (bounded; failures are reported)."""
        with self._lock:
            waiting = [i for i in self._inflight.values() if i.released and not i.failed]
        on_missing = self._queue.hurry if self._queue is not None else None
        for inf in waiting:
            try:
                if inf.gate.wait_for_layer(layer, self.layer_wait_timeout, refresh=inf.refresh,
                                           on_completion=self._event_backend.wait, on_missing=on_missing):
                    inf.record.layer_waits += 1
            except (LayerWaitTimeout, TransferFailed) as exc:
                with self._lock:
                    self._fail(inf, f"layer {layer}: {exc}")
        with self._lock:
            for inf in waiting:
                self._collect(inf)

    def finish_request(self, request_id: str) -> str | None:
        """The engine finished or aborted ``request_id``. Says how its transfer will be reported.

        * ``None``: nothing in flight; the engine may free the blocks now.
        * ``"recving"``: not released yet; :meth:`get_finished` reports it once the
          transfer has settled (never at the first slice), and the engine frees
          the blocks on that report.
        * ``"draining"``: released and still copying; :meth:`take_drained` reports
          it once settled, and only then may the engine free the blocks.
        """
        with self._lock:
            inf = self._inflight.get(request_id)
            if inf is None:
                return None
            inf.engine_done = True
            if inf.settled:
                if inf.released:
                    self._inflight.pop(request_id, None)
                    return None
                return "recving"
            return "draining" if inf.released else "recving"

    def take_drained(self) -> set[str]:
        """Finished requests whose in-flight transfer has now settled (see :meth:`finish_request`)."""
        self.client.transport.poll()
        with self._lock:
            self._collect_all()
            out, self._drained = self._drained, set()
            return out

    def _collect_all(self) -> None:
        """Settle every finished transfer; forget those already handed back to the engine."""
        for inf in list(self._inflight.values()):
            self._collect(inf)
            if inf.settled and inf.released:
                self._inflight.pop(inf.request_id, None)

    def wait_settled(self, request_ids: set[str], timeout: float | None = None) -> None:
        """Block until these requests' transfers settled (preemption: their blocks are about to go)."""
        deadline = time.monotonic() + (self.layer_wait_timeout if timeout is None else timeout)
        while True:
            self.client.transport.poll()
            with self._lock:
                pending = [self._inflight[r] for r in request_ids if r in self._inflight
                           and not self._inflight[r].settled]
                for inf in pending:
                    self._collect(inf)
                pending = [i for i in pending if not i.settled]
                if not pending:
                    return
                if time.monotonic() > deadline:
                    for inf in pending:
                        self._fail(inf, "still copying when the engine needed its blocks back")
                        self._settle(inf)
                    return
            time.sleep(0.0005)

    def draining(self) -> set[str]:
        """Released requests whose transfer has not finished yet."""
        with self._lock:
            return {i.request_id for i in self._inflight.values() if i.released and not i.future.done()}

    def in_flight(self) -> set[str]:
        with self._lock:
            return set(self._inflight)

    def future_of(self, request_id: str) -> Future | None:
        with self._lock:
            inf = self._inflight.get(request_id)
            return inf.future if inf else None

    def take_registration_lost(self) -> bool:
        """Whether a retrieve was refused for an unknown instance (the server restarted) since the last call."""
        with self._lock:
            lost, self._registration_lost = self._registration_lost, False
            return lost

    def take_failed(self) -> dict[str, tuple[list[list[int]], str]]:
        """Failed retrieves since the last call: request id -> (block ids, reason)."""
        with self._lock:
            out, self._failed = self._failed, {}
            return out

    def wait_all(self, timeout: float = 30.0) -> None:
        """Block until every in-flight retrieve settled (used at shutdown and in tests)."""
        deadline = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < deadline:
            self.get_finished()
            time.sleep(0.001)

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
        if self.pool is not None:
            self.pool.close()
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        self._l1_tensor = None
        self._generations = None
        if self._generation_segment is not None:
            self._generation_segment.close()
            self._generation_segment = None
        if self._l1_pool is not None:
            self._l1_pool.close()
