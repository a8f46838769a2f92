"""Engine placement: this engine process's one transfer queue for its loads.

In engine placement (:mod:`kvstrata.core.engine.engine_placement`) the server only locks and locates the
chunks; this process copies them from the server's L1 pool into its own cache.
Every load of the process goes through one :class:`TransferQueue`, so the order
in which the slices of concurrent loads reach the copy engine is a decision
rather than whatever order threads happen to run in: one load's slices after
another's, in the order the loads were submitted (earliest released first). The
first load is released on its first slice and its last layer lands as early as
it can; the next follows right behind it. (Taking one slice of each load in turn
made every load's last layer land late: see docs/decisions.md.)

Two threads, so that enqueuing never waits for a copy to finish:

* A load whose LOOKUP said where its chunks are is planned at submit, on the engine's
  thread, when nothing submitted before it is still unplanned and the load planned
  before it has no copy left to run (handing it to another thread would make its
  copies wait until the interpreter lets that thread run: up to a switch interval,
  5 ms, each time, while the engine's thread stays in Python). Otherwise
  ``kvstrata-transfer-enqueue`` does it: waits for the load's RETRIEVE reply (sent from
  the engine's thread at submit, if any) and plans it. A load submitted while another's
  copies still run would wait behind them on the copy engine anyway; planned at
  submit, a burst of loads would keep the engine's thread from its step until every
  one was planned, and the first request from its release (docs/decisions.md, "A load
  behind running copies is planned off the engine's thread"). The enqueue thread plans
  a load only once the load planned before it has at most :data:`PLAN_LEAD_S` of
  copies left, so the GPU never holds a whole burst: whatever waits for the engine's
  context to be idle would wait for all of it (docs/decisions.md, "The queue plans a
  load once the copies ahead of it are down to a lead"). With ``pace_loads``, the next load
  is planned only once the engine's thread has settled the one before (seen it complete when it
  polled), as chunk-major served one request after another starts its next transfer: concurrent
  requests then go back about one per engine step (:meth:`TransferQueue.engine_settled`;
  docs/decisions.md, "Loads can be paced to the engine's polls"). On a GPU, a load that will be
  planned right away at submit has its first layer's copy into staging handed to the GPU before
  anything else is done for it (:meth:`TransferQueue.first_layer_ahead`): planning the load
  takes longer than that copy needs to start. A load's first layer is planned
  alone, inside the copier's ``slice_program``, which on a GPU hands its driver calls to
  the copier's native thread in one call (``kvstrata.native.load_issuer``), so it is on
  its way before anything else is planned; the rest of its first slice, then every later
  slice, follow in one program each (the copier's ``enqueue_slices``), planned at a few
  integer operations a slice. Once handed over, no
  Python thread has to run for the slices to reach the GPU. Each slice's completion goes
  to the load's gate (on a GPU an event the engine's stream waits on once it is issued;
  on the CPU, where slices are planned one by one, the copy has run).
* ``kvstrata-transfer-settle`` waits, load by load, until what was enqueued for it
  has run, then frees the server's locks and resolves the load's future: only then
  may the engine free or recompute into its blocks. The engine's thread may see it
  first (:meth:`TransferQueue.landed_and_checked`, when it polls) and settle the load
  itself: an engine thread that stays in Python hands the GIL to another thread only
  every switch interval, and each of the settle thread's steps that let go of it
  would wait that long again.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvstrata.core.arrival.events import LocalCopier
from kvstrata.core.arrival.gate import LayerArrivalGate
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.store.l1_store import FillFailed, generations_unchanged, layers_landed
from kvstrata.core.transfer import planner
from kvstrata.core.transfer.block_table import BlockTable
from kvstrata.core.transfer.layouts import PagedKVLayout
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType

log = logging.getLogger(__name__)

LANDING_POLL_S = 0.0005
"""How often a slice of a load whose objects are still filling from the shared tier looks whether its layers
have landed in the pool (sleeping, without the GIL, in between)."""


PLAN_LEAD_S = 0.010
"""How much of the last planned load's copies may still be ahead of the copy engine when the enqueue thread plans the
next load: two switch intervals, the longest the thread may wait for the GIL after its wait (while the engine's
thread stays in Python) and again while it plans. Planned with less ahead, the copy engine could run dry between
loads; with more, the GPU would hold every queued load's copies at once, and whatever waits for the engine's
context to be idle (a kernel PyTorch loads on its first launch, a ``cudaFree``) would wait for all of them."""


class TransferAborted(RuntimeError):
    """A engine-placement copy stopped between slices because its load had already failed."""


class SourceEvicted(RuntimeError):
    """The L1 objects a load copied from were freed while it copied (its lookup locks were lost): what it
    copied may be another object's bytes, so the load fails and the engine recomputes its blocks."""


@dataclass(eq=False)
class QueuedLoad:
    """One load on its way through the queue (compared by identity: two loads are never the same load)."""

    key: CacheKey
    block_ids: BlockTable
    skip_first_n_tokens: int
    layers_per_slice: int
    gate: LayerArrivalGate
    record: Any
    """The load's ``RetrieveRecord``: ``located_at`` and ``first_slice_at`` are set here."""
    reply: Future
    """The RETRIEVE's reply: where the locked chunks lie in the pool."""
    future: Future = field(default_factory=Future)
    """Resolved (result or exception) once nothing of this load is still copying."""
    slices: list[tuple[int, int]] = field(default_factory=list)
    last_completion: Any = None
    executor: Any = None
    job: planner.TransferJob | None = None
    copier: LocalCopier | None = None
    error: BaseException | None = None
    retrieved_tokens: int = 0
    sources: list[tuple[int, int]] = field(default_factory=list)
    """(slot, generation) of every object it copies from: checked against the pool's generation table once a
    copy has run, before the engine is told it landed."""
    generations: Any = None
    """The pool's generation table (read-only words)."""
    landed: Any = None
    """The pool's landed words (read-only): how many leading layers of each object are in the pool."""
    locks_freed: bool = False
    """FREE_LOOKUP_LOCKS was sent for it (:meth:`TransferQueue.free_locks`)."""
    filling: bool = False
    """Some object it copies from was still filling from the shared tier when it was located: each slice
    waits for its layers to land (:meth:`TransferQueue._wait_landed`)."""
    slice_ends: list[tuple[int, Any]] = field(default_factory=list)
    """(layers landed once it has run, completion) of each slice planned so far, in order."""
    ahead: "FirstLayerAhead | None" = None
    """Its first layer's copy, handed to the GPU at submit (:meth:`TransferQueue.first_layer_ahead`)."""
    engine_settled: threading.Event = field(default_factory=threading.Event)
    """Set once the engine's thread settled it (:meth:`TransferQueue.engine_settled`): with ``pace_loads``, the
    load after it is planned only then."""

    @property
    def request_id(self) -> str:
        return self.key.request_id


class FirstLayerAhead:
    """A load's first layer, copied into staging before the load was planned, with the queue's planning held for
    that load (see :meth:`TransferQueue.first_layer_ahead`). The submitting thread closes it once the submit is
    done, whatever happened: what was not planned from it is given back then."""

    def __init__(self, queue: "TransferQueue", staged: Any) -> None:
        self.handed_at = time.perf_counter()
        """When the copy had been handed over (the load's ``first_layer_handed_at``)."""
        self.staged = staged
        """The copier's staged copy (``StagedFirstLayer``: ``taken``, ``usable_here()``, ``close(planned)``, the
        last two meaningful on the submitting thread only: on another it is neither used nor closed)."""
        self.planning_held = True
        """This still holds the queue's planning lock (until the submit takes it over)."""
        self._queue = queue

    def close(self, planned: bool = False) -> None:
        """``planned``: the load's first layer was planned since (called right after it was)."""
        try:
            self.staged.close(planned)
        finally:
            if self.planning_held:
                self.planning_held = False
                self._queue._planning.release()


class TransferQueue:
    """The queue and its two threads (see the module docstring)."""

    def __init__(self, client: CacheClient, layout: PagedKVLayout, *,
                 copier_for: Callable[[dict[str, Any]], LocalCopier], chunk_size: Callable[[], int],
                 retrieve_timeout: float, landed: Callable[[Any], bool],
                 generations_for: Callable[[dict[str, Any]], Any],
                 copy_rate: Callable[[], float] | None = None,
                 slice_observer: planner.SliceObserver | None = None, pace_loads: bool = False) -> None:
        """``copier_for(pool)``: the copier for the pool a reply names (maps it on first use, or again after the
        server restarted with a new pool); ``generations_for(pool)``: that pool's generation and landed words, mapped
        read-only. ``landed(completion)``: whether a slice's copy has run
        (``EventBackend.landed``). ``copy_rate()``: the bytes a second this process's copies move (the slice-width
        model's measure), from which the enqueue thread tells when the copies ahead of a load are down to
        :attr:`plan_lead`; without it, it plans each load at once. ``slice_observer``: told of each load's slices
        as they are enqueued (:data:`~kvstrata.core.transfer.planner.SliceObserver`). ``pace_loads``: plan a
        load only once the engine's thread settled the load planned before it (see :attr:`pace_loads`)."""
        self._slice_observer = slice_observer
        self.pace_loads = pace_loads
        """Plan each load only once the engine's thread has settled the load planned before it
        (:meth:`engine_settled`), so that loads complete at most one per engine poll, as chunk-major served one
        request after another does; otherwise (the default) a load is planned once the copies ahead of it are
        down to :attr:`plan_lead`. Waiting for the engine leaves the copy engine idle while the engine's thread
        is busy in its step, so concurrent requests go back spread over the engine's steps rather than together
        into one large step."""
        self.waiting_for_engine: str | None = None
        """The request whose settle by the engine's thread the enqueue thread is waiting for (``pace_loads``)."""
        self._closing = False
        self.client = client
        self.layout = layout
        self._copier_for = copier_for
        self._generations_for = generations_for
        self._chunk_size = chunk_size
        self.retrieve_timeout = retrieve_timeout
        self._landed = landed
        self._pending: deque[QueuedLoad | None] = deque()
        """Loads submitted and not planned yet, in submission order (None: closing)."""
        self._pending_cond = threading.Condition()
        self._handed_over = False
        """Set (under ``_pending_cond``) when a load is left to the enqueue thread, and cleared when it wakes: it wakes
        only for that. Woken because anything is pending, a thread late back from its last round would take the
        planning lock from under a submit about to plan its own load."""
        self._free_lock = threading.Lock()
        self._planning = threading.Lock()
        """Held while a load is planned, by whichever thread plans it: loads are planned one at a time, in order."""
        self._last_planned: QueuedLoad | None = None
        """The load planned last (under ``_planning``): while its copies run, later loads are not planned at submit."""
        self._copy_rate = copy_rate
        self.plan_lead = PLAN_LEAD_S
        """Seconds of the last planned load's copies the enqueue thread lets run before it plans the next
        (:data:`PLAN_LEAD_S`; 0: once they all ran)."""
        self._enqueued: "queue.Queue[QueuedLoad | None]" = queue.Queue()
        self._enqueue_thread = threading.Thread(target=self._enqueue_loop, name="kvstrata-transfer-enqueue",
                                                daemon=True)
        self._settle_thread = threading.Thread(target=self._settle_loop, name="kvstrata-transfer-settle",
                                               daemon=True)
        self._enqueue_thread.start()
        self._settle_thread.start()

    def submit(self, load: QueuedLoad) -> Future:
        """Queue ``load``; called from the engine's thread. When the load already knows where its chunks are (its
        LOOKUP said so), nothing submitted before it is still unplanned and no earlier load's copies are still
        running, it is planned right here: the engine's thread holds the GIL anyway, and handing the load to the
        enqueue thread would make its copies wait until the interpreter lets that thread run (up to a switch
        interval, 5 ms, each time an engine thread that stays in Python holds the GIL). Behind running copies,
        the enqueue thread has that long and more, and the engine's thread goes back to its step."""
        with self._pending_cond:
            self._pending.append(load)
        held = load.ahead is not None and load.ahead.planning_held
        if held:
            load.ahead.planning_held = False  # released by _plan_ready now
        self._plan_ready(block=False, held=held)
        with self._pending_cond:
            # the enqueue thread is woken only for what this thread left unplanned: woken for every load, it would
            # take the planning lock from under the next submit for nothing
            if self._pending:
                self._hand_over()
        return load.future

    def first_layer_ahead(self, pool: dict[str, Any], objects: Sequence[Sequence[int]],
                          stage: Callable[[list[tuple[int, int]]], Any]) -> FirstLayerAhead | None:
        """Called from the engine's thread at the very start of a load whose LOOKUP located its chunks
        (``pool`` and ``objects`` as a RETRIEVE reply has them): when the load is certain to be planned right
        away on this thread (nothing submitted before it still unplanned, no earlier load's copies still running,
        no slice observer), copy its first
        layer into staging now with ``stage(spans)`` (``CudaLocalCopier.stage_first_layer``), before the load
        is planned, and hold the queue's planning for it. None where that does not apply: the load is planned as
        any other. Objects still filling from the shared tier are not copied ahead (their first layer may not
        have landed)."""
        if self._observer_active() or not self._planning.acquire(blocking=False):
            return None
        try:
            with self._pending_cond:
                busy = bool(self._pending)
            if not busy and not self._behind_copies():
                _, landed = self._generations_for(pool)
                if layers_landed(landed, [int(row[3]) for row in objects]) >= self.layout.num_layers:
                    staged = stage([(int(row[0]), int(row[2])) for row in objects])
                    if staged is not None:
                        return FirstLayerAhead(self, staged)
        except BaseException:  # noqa: BLE001 - the load is then planned as any other and reports its own errors
            log.debug("copying a load's first layer ahead of its plan failed", exc_info=True)
        self._planning.release()
        return None

    def close(self) -> None:
        """Stop taking loads; what was submitted still runs to the end (its copies may be writing)."""
        self._closing = True  # a paced wait for the engine's thread ends: no engine polls a closing queue
        with self._pending_cond:
            self._pending.append(None)
            self._hand_over()
        self._enqueue_thread.join()
        self._settle_thread.join()

    def landed_and_checked(self, load: QueuedLoad) -> bool:
        """Whether every slice of ``load`` was enqueued, has run and read the objects its LOOKUP locked: then the
        engine may settle it from its own thread (:meth:`Placement._complete_without_reply`), without waiting for
        the settle thread, which still frees the locks and resolves the future. Never blocks."""
        if load.error is not None or load.record.last_slice_at is None:
            return False
        if load.last_completion is not None and not self._landed(load.last_completion):
            return False
        return load.generations is None or generations_unchanged(load.generations, load.sources)

    def engine_settled(self, load: QueuedLoad) -> None:
        """Called from the engine's thread once it settled ``load`` (saw it complete or failed, when it polled):
        with :attr:`pace_loads`, the load after it may be planned now."""
        load.engine_settled.set()

    def free_locks(self, load: QueuedLoad) -> None:
        """Send FREE_LOOKUP_LOCKS for ``load`` unless already sent: by the settle thread, or first by the engine's
        thread when it settles the load itself, so that what the engine sends after it sees the load settled
        reaches the server after the free."""
        with self._free_lock:
            if load.locks_freed:
                return
            load.locks_freed = True
        try:
            self.client.transport.submit(RequestType.FREE_LOOKUP_LOCKS, [load.request_id])
        except Exception:  # the server being gone is reported by the load itself
            pass

    # --- the enqueue thread ----------------------------------------------------------

    def _hand_over(self) -> None:
        """Call holding ``_pending_cond``: wake the enqueue thread for what is pending."""
        self._handed_over = True
        self._pending_cond.notify()

    def _enqueue_loop(self) -> None:
        while True:
            with self._pending_cond:
                self._pending_cond.wait_for(lambda: self._handed_over)
                self._handed_over = False
            if not self._plan_ready(block=True):
                self._enqueued.put(None)
                return

    def _plan_ready(self, block: bool, held: bool = False) -> bool:
        """Plan the loads at the head of the queue, in order. ``block`` (the enqueue thread): wait for the planning
        lock and for the head's RETRIEVE reply; otherwise (the engine's thread, at submit) plan only while the
        lock is free (or ``held`` for this call, by a :class:`FirstLayerAhead`) and the head's locations are in
        hand. Returns False once the queue was closed."""
        if not held and not self._planning.acquire(blocking=block):
            return True
        try:
            while True:
                with self._pending_cond:
                    if not self._pending:
                        return True
                    load = self._pending[0]
                    if load is None:
                        return not block  # the enqueue thread takes the end-of-queue mark
                    if not block and (not load.reply.done() or self._observer_active() or self._behind_copies()):
                        return True  # the enqueue thread waits for the reply; an observer may block
                    self._pending.popleft()
                if block:
                    self._wait_for_lead()
                if not self._plan(load, inline=not block):
                    with self._pending_cond:  # its slices must wait for the shared tier: not on the engine's thread
                        self._pending.appendleft(load)
                        self._hand_over()
                    return True
        finally:
            self._planning.release()

    def _observer_active(self) -> bool:
        """Whether the slice observer may be told anything (see :data:`~kvstrata.core.transfer.planner.SliceObserver`):
        then loads are planned on the enqueue thread only, since an observer may block."""
        observer = self._slice_observer
        return observer is not None and bool(getattr(observer, "active", lambda: True)())

    def _behind_copies(self) -> bool:
        """Whether the load planned last still has copies to run (called holding ``_planning``): a load planned now
        would queue behind them on the copy engine. With :attr:`pace_loads`, until the engine's thread settled it."""
        last = self._last_planned
        if last is None or last.error is not None:
            return False
        if self.pace_loads:
            return not last.engine_settled.is_set()
        return last.last_completion is not None and not self._landed(last.last_completion)

    def _wait_for_lead(self) -> None:
        """On the enqueue thread, holding ``_planning``, before it plans a load: wait, without the GIL, until the load
        planned last has at most :attr:`plan_lead` of copies left to run (by the measured copy rate), so that the
        GPU holds at most that and one load's copies at a time. Its failure is its own: the wait just ends.
        With :attr:`pace_loads`: until the engine's thread settled it (:meth:`_wait_for_engine`)."""
        last = self._last_planned
        if self.pace_loads:
            self._wait_for_engine(last)
            return
        if (self._copy_rate is None or last is None or last.error is not None or last.job is None
                or not last.slice_ends):
            return
        layers = self.layout.num_layers
        layer_s = self.layout.object_bytes(last.job.num_tokens) / layers / max(self._copy_rate(), 1.0)
        for landed_layers, completion in [(0, None), *last.slice_ends]:
            if (layers - landed_layers) * layer_s <= self.plan_lead:
                break
        else:
            return  # its slices are not all planned: it failed
        if completion is None or self._landed(completion):
            return
        try:
            last.copier.finish(completion)
        except BaseException:  # noqa: BLE001 - reported by that load when it settles
            log.debug("waiting for load %s's copies before planning the next ended early", last.request_id,
                      exc_info=True)

    def _wait_for_engine(self, last: QueuedLoad | None) -> None:
        """``pace_loads``: wait, without the GIL, until the engine's thread settled ``last`` (the load planned
        before), it failed here, or the queue closes. Bounded by the retrieve timeout: an engine that stopped polling
        does not hold every later load; that wait is logged."""
        if last is None:
            return
        deadline = time.monotonic() + self.retrieve_timeout
        self.waiting_for_engine = last.request_id
        try:
            while not last.engine_settled.wait(0.05):
                if last.error is not None or self._closing:
                    return
                if time.monotonic() > deadline:
                    log.warning("pace_loads: the engine's thread did not settle request %s within the %g s retrieve "
                                "timeout; planning the next load without it", last.request_id, self.retrieve_timeout)
                    return
        finally:
            self.waiting_for_engine = None

    def _plan(self, load: QueuedLoad, inline: bool) -> bool:
        """Locate and plan ``load`` and hand it to the settle thread; False (nothing planned) when ``inline`` and
        its chunks are still filling from the shared tier."""
        try:
            if load.job is None:
                self._locate(load)
        except BaseException as exc:  # noqa: BLE001 - every failure is the load's, reported through it
            self._stop(load, exc)
        else:
            if inline and load.filling:
                return False
            self._enqueue_slices(load)
            self._last_planned = load
        self._enqueued.put(load)
        return True

    def _locate(self, load: QueuedLoad) -> None:
        reply = self.client.transport.wait(load.reply, timeout=self.retrieve_timeout)
        load.record.located_at = time.perf_counter()
        load.copier = self._copier_for(reply["pool"])
        load.generations, load.landed = self._generations_for(reply["pool"])
        rows = reply["objects"]
        spans = [(int(row[0]), int(row[2])) for row in rows]
        load.sources = [(int(row[3]), int(row[4])) for row in rows]
        load.filling = layers_landed(load.landed, [slot for slot, _ in load.sources]) < self.layout.num_layers
        copies = planner.plan_copies([t for _, t in spans], self._chunk_size(), 0, load.skip_first_n_tokens)
        load.job = planner.TransferJob(self.layout, load.block_ids, copies)
        load.retrieved_tokens = load.job.num_tokens
        load.executor = load.copier.executor(spans)
        load.slices = planner.layer_slices(self.layout.num_layers, load.layers_per_slice)
        load.record.planned_at = time.perf_counter()

    def _enqueue_slices(self, load: QueuedLoad) -> None:
        """Plan the slices of ``load``: in a few programs where the copier takes several slices in one
        (``enqueue_slices``, see :meth:`_enqueue_in_programs`), else one by one; record each slice's completion in
        the gate as it is planned."""
        enqueue_slices = getattr(load.copier, "enqueue_slices", None)
        if enqueue_slices is not None and not load.filling and not self._observer_active():
            self._enqueue_in_programs(load, enqueue_slices)
            return
        if load.ahead is not None:
            load.ahead.close()  # planned slice by slice below, none from a staged first layer
        observer = self._slice_observer
        for index, (start, count) in enumerate(load.slices):
            try:
                if index == 0 and observer is not None:
                    observer(load.request_id, 0)  # outside any program: an observer may block (a test's hold)
                if load.gate.failure:  # the engine gave up on this load: write no further slice
                    raise TransferAborted(load.gate.failure)
                if load.filling:
                    self._wait_landed(load, start + count)
                with load.copier.slice_program():
                    planner.enqueue_slice(load.executor, load.job, load.layers_per_slice, index)
                    completion = load.copier.mark_slice(load.executor)
                if index == 0:
                    load.record.first_slice_at = time.perf_counter()
                load.last_completion = completion
                if self._landed(completion):  # a copy that ran in the call (CPU): check its source before it counts
                    self._check_sources(load)
                load.gate.record_slice(start, count, completion)
                load.slice_ends.append((start + count, completion))
                planner.slice_published(load.request_id, index, observer)
            except BaseException as exc:  # noqa: BLE001 - every failure is the load's, reported through it
                self._stop(load, exc)
                return
        load.record.last_slice_at = time.perf_counter()

    def _enqueue_in_programs(self, load: QueuedLoad, enqueue_slices: Callable[..., list[Any]]) -> None:
        """Hand ``load`` to the copier in at most three programs: its first layer alone, the rest of its first
        slice, then every later slice at once (``enqueue_slices``).

        The copy engine starts on layer 0 as soon as that one layer is planned: a wide first slice planned whole
        keeps it idle meanwhile (chunk-major's first slice is every layer, each staging piece of it planned
        before the first copy could start). The first slice is recorded in the gate before the later ones are
        planned, so the engine may be released on it meanwhile."""
        observer = self._slice_observer
        (start, count), later = load.slices[0], load.slices[1:]
        try:
            if observer is not None:
                observer(load.request_id, 0)
            if load.gate.failure:
                raise TransferAborted(load.gate.failure)
            ahead = load.ahead
            with load.copier.slice_program():
                if ahead is not None and ahead.staged.usable_here():  # its first layer's copy is on the GPU already
                    load.executor.staged_first = ahead.staged
                load.executor.scatter(load.job, start, 1)
                completion = load.copier.mark_slice(load.executor)
            if ahead is not None:
                load.record.first_layer_ahead = ahead.staged.taken
                ahead.close(planned=True)  # hands the rest of the first layer to the native thread
            load.record.first_slice_at = time.perf_counter()
            if count > 1:
                [completion] = enqueue_slices(load.executor, load.job, [(start + 1, count - 1)])
            load.last_completion = completion
            load.gate.record_slice(start, count, completion)
            load.slice_ends.append((start + count, completion))
            planner.slice_published(load.request_id, 0, observer)
            if later:
                if load.gate.failure:
                    raise TransferAborted(load.gate.failure)
                completions = enqueue_slices(load.executor, load.job, later)
                load.gate.record_slices(later, completions)
                load.slice_ends += [(first + layers, done) for (first, layers), done in zip(later, completions)]
                load.last_completion = completions[-1]
        except BaseException as exc:  # noqa: BLE001 - every failure is the load's, reported through it
            self._stop(load, exc)
            return
        load.record.last_slice_at = time.perf_counter()

    def _wait_landed(self, load: QueuedLoad, layers: int) -> None:
        """Wait (without the GIL between looks) until the first ``layers`` layers of every object ``load`` copies
        from are in the pool; raises :class:`FillFailed` if a fill failed, TimeoutError after the load's
        retrieve timeout."""
        slots = [slot for slot, _ in load.sources]
        deadline = time.monotonic() + self.retrieve_timeout
        while layers_landed(load.landed, slots) < layers:
            if not generations_unchanged(load.generations, load.sources):
                raise FillFailed(f"a chunk request {load.request_id} loads did not arrive whole from the shared "
                                 "tier; its blocks are recomputed")
            if load.gate.failure:
                raise TransferAborted(load.gate.failure)
            if time.monotonic() > deadline:
                raise TimeoutError(f"layers {layers} of request {load.request_id}'s chunks still arriving from the "
                                   f"shared tier after {self.retrieve_timeout:g} s")
            time.sleep(LANDING_POLL_S)

    @staticmethod
    def _check_sources(load: QueuedLoad) -> None:
        """Raise :class:`SourceEvicted` unless every object ``load`` copied from is still the one it looked up."""
        if not generations_unchanged(load.generations, load.sources):
            raise SourceEvicted(f"the L1 objects request {load.request_id} copied from were evicted while it "
                                "copied (its lookup locks were lost); its blocks are recomputed")

    def _stop(self, load: QueuedLoad, exc: BaseException) -> None:
        """No further slice of ``load``; the gate fails now, the future once its copies have run."""
        load.error = exc
        load.gate.fail(f"{type(exc).__name__}: {exc}")

    # --- the settle thread -----------------------------------------------------------

    def _settle_loop(self) -> None:
        while True:
            load = self._enqueued.get()
            if load is None:
                return
            try:
                if load.copier is not None:
                    load.copier.finish(load.last_completion)  # what was enqueued for it has run
                    if load.error is None and load.generations is not None:
                        self._check_sources(load)  # before the future says the load is complete
            except BaseException as exc:  # noqa: BLE001
                if load.error is None:
                    self._stop(load, exc)
            finally:
                close = getattr(load.executor, "close", None)
                if close is not None:
                    close()
                self.free_locks(load)
            if load.error is not None:
                load.future.set_exception(load.error)
            else:
                load.future.set_result({"retrieved_tokens": load.retrieved_tokens,
                                        "layers_per_slice": load.layers_per_slice})
