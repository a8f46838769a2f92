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

* ``kvstrata-transfer-enqueue`` waits for each load's RETRIEVE reply (sent from the
  engine's thread at submit), plans it, and enqueues its slices in that order;
  each slice's completion goes to the load's gate as soon as it is enqueued (on a
  GPU an event the engine's stream waits on; on the CPU the copy has run). It keeps
  at most about :data:`ENQUEUE_AHEAD_BYTES` of copies queued beyond what has landed,
  and waits without the GIL for the rest: enqueuing a slice is Python on the engine
  process's GIL, and a load's remaining slices enqueued in one burst right after its
  release held the GIL while the engine's thread was launching its first layer. An
  engine's layer wait that finds its layer not enqueued yet ends that bound for the
  loads in hand (:meth:`TransferQueue.hurry`), so a layer wait never waits for it.
* ``kvstrata-transfer-settle`` waits, load by load, until what was enqueued for it
  has run, then frees the server's locks and resolves the load's future: only then
  may the engine free or recompute into its blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

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

RELEASE_HANDOVER_S = 0.003
"""How long the enqueue thread, once a load's first slice has landed, waits at most for the engine to take the
release and wait on the load's first :data:`HANDOVER_SLICES` slices before it enqueues more (see
:meth:`TransferQueue._hand_over_releases`); the slices enqueued while the first one copied keep the copy engine
busy meanwhile."""

HANDOVER_SLICES = 3
"""How many of a released load's slices the engine's layer waits take before the enqueue thread goes on: by
then the engine has launched its first layers, which the GPU is still computing while the enqueue thread holds
the GIL for the remaining slices."""


ENQUEUE_AHEAD_BYTES = 384 << 20
"""How many bytes of copies the enqueue thread keeps queued beyond those that have landed: about 7 ms of a PCIe 5
copy engine. More than CPython's 5 ms switch interval, so an engine thread that keeps the GIL through a burst of
launches does not let the copy engine run dry; little enough that, after a load's first slice, the enqueue thread
is waiting rather than enqueuing when the engine takes the release and launches its first layer."""

LANDING_POLL_S = 0.0005
"""How often the enqueue thread, while the copies queued ahead fill :data:`ENQUEUE_AHEAD_BYTES`, looks whether the
oldest has landed (waiting without the GIL in between; an engine's :meth:`TransferQueue.hurry` wakes it at once)."""


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
    next_slice: int = 0
    last_completion: Any = None
    first_completion: Any = None
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
    filling: bool = False
    """Some object it copies from was still filling from the shared tier when it was located: each slice
    waits for its layers to land (:meth:`TransferQueue._wait_landed`)."""

    @property
    def request_id(self) -> str:
        return self.key.request_id


def slice_order(loads: Sequence[QueuedLoad]) -> Iterator[QueuedLoad]:
    """The loads whose next slice goes to the copy engine next: every slice of one load, then the next's.

    A load that failed (``error`` set) yields no further slice; every other load
    yields once per remaining slice.
    """
    for load in loads:
        while load.error is None and load.next_slice < len(load.slices):
            yield load


class TransferQueue:
    """The queue and its two threads (see the module docstring)."""

    def __init__(self, client: CacheClient, layout: PagedKVLayout, *,
                 copier_for: Callable[[dict[str, Any]], LocalCopier], chunk_size: Callable[[], int],
                 retrieve_timeout: float, landed: Callable[[Any], bool],
                 generations_for: Callable[[dict[str, Any]], Any],
                 handover_slices: int = HANDOVER_SLICES,
                 enqueue_ahead_bytes: int | None = ENQUEUE_AHEAD_BYTES,
                 slice_observer: planner.SliceObserver | None = None) -> None:
        """``copier_for(pool)``: the copier for the pool a reply names (maps it on first use, or again after the
        server restarted with a new pool); ``generations_for(pool)``: that pool's generation and landed words, mapped
        read-only. ``landed(completion)``: whether a slice's copy has run
        (``EventBackend.landed``). ``handover_slices``: see :data:`HANDOVER_SLICES` (1: the first layer wait,
        what ``benchmarks/ttft.py``'s ``-handover1`` arms measure against). ``enqueue_ahead_bytes``: see
        :data:`ENQUEUE_AHEAD_BYTES`; None enqueues every slice at once (``ttft.py``'s ``-ahead0`` arms).
        ``slice_observer``: told of each load's slices as they are enqueued (:data:`~kvstrata.core.transfer.planner.SliceObserver`)."""
        if handover_slices < 1:
            raise ValueError(f"handover_slices must be at least 1, got {handover_slices}")
        self.handover_slices = handover_slices
        if enqueue_ahead_bytes is not None and enqueue_ahead_bytes <= 0:
            raise ValueError(f"enqueue_ahead_bytes must be positive or None, got {enqueue_ahead_bytes}")
        self.enqueue_ahead_bytes = enqueue_ahead_bytes
        self._slice_observer = slice_observer
        self._queued_ahead: deque[tuple[Any, int]] = deque()
        """(completion, bytes) of the slices enqueued and not yet seen landed, oldest first (enqueue thread only)."""
        self._queued_ahead_bytes = 0
        self._hurry = threading.Event()
        self.client = client
        self.layout = layout
        self._copier_for = copier_for
        self._generations_for = generations_for
        self._chunk_size = chunk_size
        self.retrieve_timeout = retrieve_timeout
        self._landed = landed
        self._pending: "queue.Queue[QueuedLoad | None]" = queue.Queue()
        self._enqueued: "queue.Queue[QueuedLoad | None]" = queue.Queue()
        self._enqueue_thread = threading.Thread(target=self._enqueue_loop, name="kvstrata-transfer-enqueue",
                                                daemon=True)
        self._settle_thread = threading.Thread(target=self._settle_loop, name="kvstrata-transfer-settle",
                                               daemon=True)
        self._enqueue_thread.start()
        self._settle_thread.start()

    def submit(self, load: QueuedLoad) -> Future:
        self._pending.put(load)
        return load.future

    def hurry(self) -> None:
        """The engine waits for a layer whose slice is not enqueued yet: enqueue the loads in hand without the
        :data:`ENQUEUE_AHEAD_BYTES` bound (called from the engine's thread, by its layer wait; returns at once)."""
        self._hurry.set()

    def close(self) -> None:
        """Stop taking loads; what was submitted still runs to the end (its copies may be writing)."""
        self._pending.put(None)
        self._enqueue_thread.join()
        self._settle_thread.join()

    # --- the enqueue thread ----------------------------------------------------------

    def _take_batch(self) -> list[QueuedLoad] | None:
        first = self._pending.get()
        if first is None:
            return None
        batch = [first]
        while True:
            try:
                nxt = self._pending.get_nowait()
            except queue.Empty:
                return batch
            if nxt is None:
                self._pending.put(None)  # seen again after this batch
                return batch
            batch.append(nxt)

    def _enqueue_loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                self._enqueued.put(None)
                return
            ready = []
            for load in batch:
                try:
                    self._locate(load)
                    ready.append(load)
                except BaseException as exc:  # noqa: BLE001 - every failure is the load's, reported through it
                    self._stop(load, exc)
                    self._enqueued.put(load)
            awaiting_release: list[QueuedLoad] = []
            self._hurry.clear()  # an engine still waiting says so again (its layer wait keeps asking)
            for load in slice_order(ready):
                nbytes = self._slice_bytes(load)
                self._wait_for_room(nbytes)
                if awaiting_release:
                    self._hand_over_releases(awaiting_release)
                self._enqueue_next_slice(load, nbytes)
                if load.error is not None or load.next_slice >= len(load.slices):
                    self._enqueued.put(load)
                elif load.next_slice == 1 and load.first_completion is not None and not load.gate.released:
                    awaiting_release.append(load)
            for load in ready:  # loads with no slice at all (nothing to copy)
                if not load.slices:
                    self._enqueued.put(load)

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

    def _enqueue_next_slice(self, load: QueuedLoad, nbytes: int) -> None:
        """Enqueue ``load``'s next slice (``nbytes``, from :meth:`_slice_bytes`) and record its completion."""
        start, count = load.slices[load.next_slice]
        try:
            if load.gate.failure:  # the engine gave up on this load: write no further slice
                raise TransferAborted(load.gate.failure)
            if load.filling:
                self._wait_landed(load, start + count)
            planner.enqueue_slice(load.executor, load.job, load.layers_per_slice, load.next_slice, load.request_id,
                                  self._slice_observer)
            completion = load.copier.mark_slice(load.executor)
            if load.next_slice == 0:
                load.record.first_slice_at = time.perf_counter()
                load.first_completion = completion
            load.next_slice += 1
            if load.next_slice == len(load.slices):
                load.record.last_slice_at = time.perf_counter()
            load.last_completion = completion
            if self._landed(completion):  # a copy that ran in the call (CPU): check its source before it counts
                self._check_sources(load)
            if self.enqueue_ahead_bytes is not None:
                self._queued_ahead.append((completion, nbytes))
                self._queued_ahead_bytes += nbytes
            load.gate.record_slice(start, count, completion)
            planner.slice_published(load.request_id, load.next_slice - 1, self._slice_observer)
        except BaseException as exc:  # noqa: BLE001
            self._stop(load, exc)

    def _slice_bytes(self, load: QueuedLoad) -> int:
        """Bytes ``load``'s next slice copies."""
        count = load.slices[load.next_slice][1]
        return self.layout.kv_size * count * load.job.num_tokens * self.layout.token_bytes_per_layer

    def _wait_for_room(self, nbytes: int) -> None:
        """Before enqueuing a slice of ``nbytes``: while the slices queued ahead of the landed ones would then
        exceed :data:`ENQUEUE_AHEAD_BYTES` (two are always allowed, so wide slices still overlap), wait for the
        oldest to land, without the GIL, until the engine hurries the queue."""
        if self.enqueue_ahead_bytes is None:
            return
        while True:
            while self._queued_ahead and self._landed(self._queued_ahead[0][0]):
                self._queued_ahead_bytes -= self._queued_ahead.popleft()[1]
            if (len(self._queued_ahead) < 2 or self._queued_ahead_bytes + nbytes <= self.enqueue_ahead_bytes
                    or self._hurry.is_set()):
                return
            self._hurry.wait(LANDING_POLL_S)

    def _hand_over_releases(self, awaiting: list[QueuedLoad]) -> None:
        """Before enqueuing another slice: let the engine see each load whose first slice has landed, and use it.

        The engine learns of a release by polling on its own thread, then launches its first layers, each
        after a layer wait; all of that needs the GIL. This thread holds the GIL while it enqueues slices, and
        CPython hands it to a waiting thread only after its switch interval (5 ms): the engine would see the
        release, or launch its first layer, only once every slice was enqueued. So once a load's first slice
        has landed, this thread waits (without the GIL) until the engine took the release and its layer waits
        took the load's first :attr:`handover_slices` slices (or as many as are enqueued), for at most
        :data:`RELEASE_HANDOVER_S` in all; the slices enqueued while the first one copied keep the copy engine
        busy meanwhile. An engine that does not poll then costs the queue that bound once per load.
        """
        for load in list(awaiting):
            wanted = min(self.handover_slices, load.next_slice)
            if load.error is not None or load.gate.released and load.gate.slices_waited >= wanted:
                awaiting.remove(load)
            elif self._landed(load.first_completion):
                deadline = time.monotonic() + RELEASE_HANDOVER_S
                if load.gate.wait_released(RELEASE_HANDOVER_S):
                    load.gate.wait_slices_waited(wanted, max(0.0, deadline - time.monotonic()))
                awaiting.remove(load)

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
                try:
                    self.client.transport.submit(RequestType.FREE_LOOKUP_LOCKS, [load.request_id])
                except Exception:  # the server being gone is reported by the load itself
                    pass
            if load.error is not None:
                load.future.set_exception(load.error)
            else:
                load.future.set_result({"retrieved_tokens": load.retrieved_tokens,
                                        "layers_per_slice": load.layers_per_slice})
