"""The one interface the engine runtime calls to load into and store out of an engine's cache.

A *placement* is who runs the copies. Each way of copying is one class behind this interface, chosen once
at registration (:mod:`kvstrata.core.engine.choose_placement`):

* :class:`~kvstrata.core.engine.server_placement.ServerPlacement`: the server writes the engine's cache
  (shared memory or CUDA IPC) and publishes each slice's progress on an arrival board (the eight-item
  RETRIEVE);
* :class:`~kvstrata.core.engine.engine_placement.EnginePlacement`: the engine process copies from the
  server's L1 pool itself, through its one transfer queue.

What every placement shares lives here: a load's arrival gate, the release of a request as soon as its
first slice has landed, the per-layer wait, settling, and the failure reports.

* :meth:`Placement.submit_retrieve` starts a load with a slice width.
* :meth:`Placement.get_finished` reports a request as soon as its first slice has landed (the gate's release
  policy), and keeps it in a draining set until the transfer really completes, so completion and failure are
  still collected and whatever the load holds is freed then.
* :meth:`Placement.wait_for_layer` blocks until every released, still in-flight load has the layer, bounded by
  a timeout that logs and reports the request's blocks as failed instead of hanging the engine thread.
* :meth:`Placement.take_failed` hands the engine the blocks to recompute.
* :meth:`Placement.store` stores a computed prompt (:meth:`Placement.reserve_store` ahead of it, where the
  placement can).

Whether a layer-major load runs chunk-major instead is decided once, from the cache the placement registers
and the server's REGISTER reply (:attr:`Placement.layer_major_fallback`); what the load finds at its start
(server placement: no free arrival slot) is recorded with the load.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Sequence

from kvstrata.core.arrival.events import EventBackend, HostEventBackend
from kvstrata.core.arrival.gate import LayerArrivalGate, LayerWaitTimeout, TransferFailed
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.engine.requests import ChunkLocations
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.slice_width import AUTO, SliceWidthModel
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer import planner
from kvstrata.core.transfer.block_table import BlockTable
from kvstrata.core.transfer.layouts import PagedKVLayout
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType

log = logging.getLogger(__name__)


@dataclass
class RetrieveRecord:
    """What happened to one retrieve, for logs, tests and benchmarks."""

    request_id: str
    num_tokens: int
    layers_per_slice: int
    """The width the load ran with (chosen by the slice-width model when ``auto_width``)."""
    submitted_at: float
    """When the engine called submit (``time.perf_counter()``): the times below count from it."""
    released_at: float | None = None
    completed_at: float | None = None
    """When this process settled the load (saw it complete)."""
    transfer_ended_at: float | None = None
    """When the load's transfer ended, successfully or not: the server's reply (server placement), the last
    slice landed and checked (engine placement); before :attr:`completed_at`, which waits for a poll."""
    released_before_complete: bool | None = None
    layer_waits: int = 0
    failure: str | None = None
    fallback: str | None = None
    auto_width: bool = False
    """``layers_per_slice: auto`` asked for this load's width."""
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
    first_layer_handed_at: float | None = None
    """Engine placement on a GPU: when the first layer's copy was handed to the copier at submit, before the load
    was planned (None where it was not)."""
    first_layer_ahead: bool = False
    """Engine placement on a GPU: the first layer's copy went to the GPU at submit, before the load was planned
    (and its plan scattered from it)."""
    last_slice_at: float | None = None
    """Engine placement: when the last slice was enqueued (how long the transfer queue kept enqueuing)."""


@dataclass
class StoreRecord:
    """When the steps of this process's last engine-placement STORE ended (``time.perf_counter()``), for
    benchmarks and logs: where a store's time goes beyond its copies."""

    request_id: str
    started_at: float
    reserved_ahead: bool = False
    """RESERVE_STORE was sent before the store began (:meth:`Placement.reserve_store`)."""
    reserved_at: float | None = None
    """RESERVE_STORE's reply was in hand."""
    enqueued_at: float | None = None
    """This process had enqueued the copies into the reserved objects (host time; they run after)."""
    copied_at: float | None = None
    """The copies into the reserved objects had run."""
    committed_at: float | None = None
    """The objects were marked stored: any request sent from now on sees them committed."""


@dataclass
class InFlight:
    """One load between its submit and the moment it is settled and handed back."""

    request_id: str
    block_ids: BlockTable
    future: Future
    """Resolved once the transfer is over (its reply, or this process's copy having stopped)."""
    gate: LayerArrivalGate
    width: int
    """The slice width the load runs with (0: chunk-major)."""
    record: RetrieveRecord
    failed: bool = False
    settled: bool = False
    engine_done: bool = False
    """The engine finished or aborted the request while this transfer was in flight."""
    report_pending: bool = False
    """Failed while this process's own copy was still running: reported once it has stopped."""
    refresh: Callable[[], None] | None = None
    """Turns progress published elsewhere (the server's arrival board) into gate slices; None: the gate is fed
    directly."""
    lock_owner: str = ""
    """Whose lookup locks this load's key names, when a failed load leaves them held (a refused request frees
    nothing on the server): the failure frees them from here."""

    @property
    def released(self) -> bool:
        """Handed back to the engine (the gate holds it: the transfer queue waits on it too)."""
        return self.gate.released


class Placement(ABC):
    """Who runs the copies of one registered cache, and the loads in flight into it (see the module docstring).

    Subclasses supply how a load starts (:meth:`_start`), how a store runs (:meth:`store`), what registration
    sets up (:meth:`_registered`), and the few points where a load's end differs; everything the engine's
    threads call is here.
    """

    name: ClassVar[str]
    """The placement's name on the wire and in settings (``server``, ``engine``)."""
    reserves_ahead: ClassVar[bool] = False
    """Whether :meth:`reserve_store` sends a reservation before the forward (the runtime then keeps them)."""
    registration_area: RegistrationArea | None = None
    """What this placement registered in the cache's stead, when it made that itself (engine placement)."""

    def __init__(self, client: CacheClient, instance_id: int, layout: PagedKVLayout, *,
                 event_backend: EventBackend | None = None, release_after_layers: int = 1,
                 layer_wait_timeout: float = RuntimeSettings.layer_wait_timeout,
                 retrieve_timeout: float = RuntimeSettings.retrieve_timeout,
                 registration_layout: PagedKVLayout | None = None) -> None:
        self.client = client
        self.instance_id = instance_id
        self.layout = layout
        self.registration_layout = registration_layout or layout
        """What the server is told: the engine cache itself, or (engine placement) a
        ``RegistrationArea``; either way it must share ``layout``'s shape signature."""
        if self.registration_layout.shape_signature() != layout.shape_signature():
            raise ValueError("registration_layout must hold the same (kv, layers, heads, head_bytes) as layout")
        self._event_backend = event_backend or HostEventBackend()
        self.release_after_layers = release_after_layers
        self.layer_wait_timeout = layer_wait_timeout
        self.retrieve_timeout = retrieve_timeout
        self.layer_major_fallback = planner.layer_major_fallback_reason(layout)
        """Why this cache's layer-major loads run chunk-major (None: they need not), decided once: from the
        cache (several KV groups) at construction, or from the server's REGISTER reply (server placement: its
        target cannot copy by layer)."""
        self.chunk_size: int | None = None
        self.slice_width = SliceWidthModel(layout.num_layers, layout.kv_size * layout.token_bytes_per_layer,
                                           self._event_backend.device)
        """Chooses the width of loads asked for with ``layers_per_slice: auto``."""
        self._inflight: dict[str, InFlight] = {}
        self._failed: dict[str, tuple[list[list[int]], str]] = {}
        self._drained: set[str] = set()
        self._registration_lost = False
        self.records: dict[str, RetrieveRecord] = {}
        self._lock = threading.RLock()

    # --- public properties the design asks adapters to use ---------------------------

    @property
    def event_backend(self) -> EventBackend:
        return self._event_backend

    @property
    def device(self) -> str:
        return self._event_backend.device

    # --- registration ----------------------------------------------------------------

    def register(self) -> dict[str, Any]:
        """REGISTER_KV_CACHE (again after the server lost the instance); returns the server's reply."""
        self._before_register()
        reply = self.client.register_kv_cache(self.instance_id, self.registration_layout, self.name)
        self.chunk_size = int(reply["chunk_size"])
        if self.layer_major_fallback is None and reply.get("layer_major_fallback"):
            self.layer_major_fallback = str(reply["layer_major_fallback"])  # what the server's copies cannot do
        if self.layer_major_fallback is not None:
            planner.log_fallback_once(self.layer_major_fallback)
        self._registered(reply)
        log.info("registered %s cache as instance %d with %s (%s placement, chunk %d)", self.layout.format,
                 self.instance_id, self.client.address, self.name, self.chunk_size)
        return reply

    def _before_register(self) -> None:
        """What must exist before REGISTER_KV_CACHE is sent (nothing by default)."""

    def _registered(self, reply: dict[str, Any]) -> None:
        """What the server's REGISTER reply lets this placement set up (nothing by default)."""

    # --- retrieve --------------------------------------------------------------------

    def submit_retrieve(self, request_id: str, key: CacheKey, block_ids: Sequence[Sequence[int]], *,
                        skip_first_n_tokens: int = 0, layers_per_slice: int = 0, running: bool = False,
                        located: ChunkLocations | None = None) -> None:
        """Start moving ``key``'s tokens into ``block_ids``; returns at once.

        ``running``: the engine computes this request in the step the load starts (a synchronous match, as
        TensorRT-LLM's ``(n, False)``), so layer waits cover it from the start and it is never handed back.
        ``located``: where the LOOKUP found ``key``'s chunks; engine placement then starts copying without a
        RETRIEVE round trip (server placement ignores it: the server copies).
        """
        submitted_at = time.perf_counter()
        with self._load_starting(key, skip_first_n_tokens, located):
            blocks = BlockTable(block_ids)
            tokens = key.num_tokens - skip_first_n_tokens
            width = self.slice_width.choose(tokens) if layers_per_slice == AUTO else layers_per_slice
            record = RetrieveRecord(request_id, tokens, width, submitted_at, auto_width=layers_per_slice == AUTO)
            gate = LayerArrivalGate(self.layout.num_layers, self.release_after_layers)
            if width > 0 and self.layer_major_fallback is not None:
                record.fallback, width = self.layer_major_fallback, 0
            with self._lock:
                alone = not any(not i.future.done() for i in self._inflight.values())
            inflight = self._start(request_id, key, blocks, skip_first_n_tokens, width, gate, record, located)
            inflight.future.add_done_callback(lambda f, r=record, a=alone: self._transfer_ended(f, r, a))
            if running:
                gate.mark_released()
                record.released_at, record.released_before_complete = record.submitted_at, True
            with self._lock:
                self._inflight[request_id] = inflight
                self.records[request_id] = record

    def _load_starting(self, key: CacheKey, skip: int, located: ChunkLocations | None) -> ContextManager[None]:
        """Entered first in :meth:`submit_retrieve`, once the submit's time is taken (a load's times count from the
        engine's call), and left when the submit returns: what a placement starts before the load is planned.
        Nothing by default."""
        return contextlib.nullcontext()

    def _transfer_ended(self, future: Future, record: RetrieveRecord, alone: bool) -> None:
        """Note when a transfer ended; one that had the copies to itself from submit to end and succeeded tells
        the slice-width model its copy rate."""
        if record.transfer_ended_at is None:  # else the engine's thread saw it end first
            record.transfer_ended_at = time.perf_counter()
        if alone and future.exception() is None:
            # no lock: this runs on the thread that settles transfers, which the engine's thread may be waiting on
            others = list(self._inflight.values())
            if not any(not i.future.done() and i.record is not record for i in others):
                self.slice_width.observe(record.num_tokens * self.slice_width.layer_bytes_per_token
                                         * self.layout.num_layers, record.transfer_ended_at - record.submitted_at)

    @abstractmethod
    def _start(self, request_id: str, key: CacheKey, blocks: BlockTable, skip: int, width: int,
               gate: LayerArrivalGate, record: RetrieveRecord, located: ChunkLocations | None) -> InFlight:
        """Send the load on its way (returns at once) and say how its progress and end are observed."""

    def _complete_without_reply(self, inf: InFlight) -> bool:
        """Whether ``inf``'s transfer is known complete before its future resolved, seen from the engine's thread
        (server placement: the arrival board's last word; engine placement: the last slice's copies ran and read
        what the LOOKUP locked). A future is resolved by another thread, which an engine thread that stays in
        Python lets run only every switch interval; False by default."""
        return False

    def _copy_may_write(self, inf: InFlight) -> bool:
        """Whether a copy run by this process may still write ``inf``'s blocks (its report must wait)."""
        return False

    def _settled(self, inf: InFlight, board_complete: bool) -> None:
        """Free what ``inf`` held for its transfer (nothing by default)."""

    # --- engine side -----------------------------------------------------------------

    def get_finished(self) -> list[str]:
        """Request ids that may go back to the engine now (first slice landed, or transfer done).

        Also collects completed transfers: frees what they held and records failures.
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

    def _collect(self, inf: InFlight) -> None:
        """If the transfer finished, settle it: success completes the gate, failure marks blocks."""
        if inf.settled:
            return
        fut = inf.future
        done = fut.done()  # looked at once: the transfer queue's thread may resolve it at any moment
        if inf.report_pending and done:
            inf.report_pending = False
            self._failed[inf.request_id] = (inf.block_ids.as_lists(), inf.record.failure or "failed")
        if not done:
            if self._complete_without_reply(inf):
                # Every layer landed: settle without waiting for the future (see _complete_without_reply).
                if inf.refresh is not None:
                    inf.refresh()
                inf.record.completed_at = time.perf_counter()
                if inf.record.transfer_ended_at is None:  # seen before the future resolved: the earlier time
                    inf.record.transfer_ended_at = inf.record.completed_at
                self._settle(inf, board_complete=True)
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

    @staticmethod
    def _note_reply(fut: Future, record: RetrieveRecord) -> None:
        """Keep what only the reply says (a server-side fallback), also when the board settled first."""
        if fut.cancelled() or fut.exception() is not None:
            return
        reply = fut.result()
        if isinstance(reply, dict) and reply.get("fallback"):
            record.fallback = reply["fallback"]

    def _settle(self, inf: InFlight, board_complete: bool = False) -> None:
        """Mark the transfer over; ``board_complete``: the board said complete, so the server is done with it."""
        inf.settled = True
        if inf.released and inf.engine_done:
            self._drained.add(inf.request_id)
        self._settled(inf, board_complete)
        if inf.released:
            self._inflight.pop(inf.request_id, None)

    def _fail(self, inf: InFlight, reason: str) -> None:
        if inf.failed:
            return
        inf.failed = True
        inf.record.failure = reason
        inf.gate.fail(reason)
        blocks = inf.block_ids.num_blocks
        if self._copy_may_write(inf):
            # This process's copy may be writing a slice: it stops before the next one (the gate failed), and
            # only then may the engine recompute into those blocks, so the report waits for it (see _collect).
            inf.report_pending = True
            log.error("retrieve for request %s failed: %s; its %d blocks are reported for recompute once its "
                      "copy has stopped", inf.request_id, reason, blocks)
            return
        self._failed[inf.request_id] = (inf.block_ids.as_lists(), reason)
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
        for inf in waiting:
            try:
                if inf.gate.wait_for_layer(layer, self.layer_wait_timeout, refresh=inf.refresh,
                                           on_completion=self._event_backend.wait):
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
                # every load, not only these: one of them may wait for an earlier load to be settled here first
                # (an engine placement's pace_loads)
                for inf in list(self._inflight.values()):
                    self._collect(inf)
                pending = [self._inflight[r] for r in request_ids if r in self._inflight
                           and not self._inflight[r].settled]
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

    # --- stores ----------------------------------------------------------------------

    def prepare_stores(self) -> None:
        """Right before this step's :meth:`store` calls, after the forward that computed their blocks (nothing
        by default)."""

    def reserve_store(self, key: CacheKey, skip_first_n_tokens: int = 0) -> Future | None:
        """Before the forward that computes ``key``'s blocks: reserve their room now, so the round trip runs while
        the engine computes. Returns at once; pass the result to :meth:`store` (``reservation=``) or to
        :meth:`drop_reservation`. None where nothing is reserved ahead (:attr:`reserves_ahead` is False)."""
        return None

    def drop_reservation(self, reservation: Future) -> None:
        """Give back a reservation no store will use (bounded; nothing where none is made)."""

    @abstractmethod
    def store(self, key: CacheKey, block_ids: Sequence[Sequence[int]], skip_first_n_tokens: int = 0, *,
              reservation: Future | None = None) -> dict[str, Any]:
        """STORE ``key``'s tokens out of ``block_ids``; returns ``stored_tokens`` and ``skipped_tokens``."""

    @abstractmethod
    def close(self) -> None:
        """Give back what registration and the loads set up in this process."""
