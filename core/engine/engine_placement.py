"""Engine placement: this engine process copies between its own cache and the server's L1 pool.

The server only locks and locates the chunks. At registration this process maps the server's pool (read-only,
or writable when it stores) and, on a GPU, registers it for DMA once, off the request path. A load starts from
where its LOOKUP found the locked chunks (``LoadSpec.located``), checked against this cache's shape; only a
load without such locations sends a RETRIEVE, which then just locates them, from the engine's thread. Every
load of the process goes through its one :class:`~kvstrata.core.engine.transfer_queue.TransferQueue`, which
records each slice straight into the load's gate and frees the lookup locks once the copies have run.

A STORE is RESERVE_STORE (sent before the forward where the engine has a step hook:
:meth:`EnginePlacement.reserve_store`), this process's copies into the reserved objects, then its marks once
they landed, so no half-written object is ever visible. The server is told a small
:class:`~kvstrata.core.engine.registration_area.RegistrationArea` of the cache's geometry instead of the cache.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from kvstrata.core.arrival.events import EventBackend, LocalCopier
from kvstrata.core.arrival.gate import LayerArrivalGate
from kvstrata.core.engine.placement import InFlight, Placement, RetrieveRecord, StoreRecord
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.engine.requests import ChunkLocations
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.transfer_queue import FirstLayerAhead, QueuedLoad, TransferQueue
from kvstrata.core.shm import Segment
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.store.l1_store import split_generation_table
from kvstrata.core.transfer.block_table import BlockTable
from kvstrata.core.transfer.layouts import PLACEMENT_ENGINE, PagedKVLayout
from kvstrata.core.transfer.planner import SliceObserver
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType

log = logging.getLogger(__name__)


class EngineLoad(InFlight):
    """A load this process copies: its place in the transfer queue."""

    load: QueuedLoad | None = None


class ServerWords:
    """A table of 64-bit words the server shares by segment name (the generation table, the store marks), mapped
    on first use and again when a reply names another segment (the server restarted with a new pool)."""

    def __init__(self, words_per_slot: int, writable: bool) -> None:
        self.words_per_slot = words_per_slot
        self.writable = writable
        self._segment: Segment | None = None
        self._words: np.ndarray | None = None

    def words(self, ref: dict[str, Any]) -> np.ndarray:
        """The words of the segment ``ref`` names (``{"name", "slots"}``); the caller serializes calls."""
        if self._segment is None or self._segment.name != ref["name"]:
            count = self.words_per_slot * int(ref["slots"])
            segment = Segment.attach(str(ref["name"]), 8 * count, readonly=not self.writable)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy warns of a read-only buffer: this process never writes it
                words = np.frombuffer(segment.buf, dtype=np.uint64, count=count)
            self.close()
            self._segment, self._words = segment, words
        return self._words

    def close(self) -> None:
        self._words = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None


class EnginePlacement(Placement):
    name = PLACEMENT_ENGINE
    reserves_ahead = True

    def __init__(self, client: CacheClient, instance_id: int, layout: PagedKVLayout, *,
                 local_regions: Sequence[torch.Tensor], event_backend: EventBackend | None = None,
                 release_after_layers: int = 1, layer_wait_timeout: float = RuntimeSettings.layer_wait_timeout,
                 retrieve_timeout: float = RuntimeSettings.retrieve_timeout,
                 registration_layout: PagedKVLayout | None = None, own_registration_area: bool = False,
                 setup_timeout: float | None = None,
                 pool_writable: bool = False,
                 slice_observer: SliceObserver | None = None, pace_loads: bool = False) -> None:
        """``local_regions``: the engine cache this process writes (and reads, to store).
        ``registration_layout``: what the server is told instead of the cache; with ``own_registration_area``
        this placement makes its own :class:`RegistrationArea` at registration (sized from the server's chunk
        size, asked with ``setup_timeout``) and removes it at :meth:`close`. ``pool_writable``: map the server's
        pool writable too, so this process STOREs by copying into objects the server reserved
        (:meth:`store`); otherwise it is mapped read-only. ``slice_observer``: told of each load's slices as the
        queue enqueues them (:data:`~kvstrata.core.transfer.planner.SliceObserver`). ``pace_loads``: the queue
        plans each load only once this placement settled the one before (:attr:`TransferQueue.pace_loads`)."""
        if local_regions is None:
            raise ValueError("engine placement needs local_regions: the engine cache this process writes")
        if own_registration_area and registration_layout is not None:
            raise ValueError("give registration_layout or own_registration_area, not both")
        super().__init__(client, instance_id, layout, event_backend=event_backend,
                         release_after_layers=release_after_layers, layer_wait_timeout=layer_wait_timeout,
                         retrieve_timeout=retrieve_timeout, registration_layout=registration_layout)
        self.local_regions = list(local_regions)
        self.pool_writable = pool_writable
        self.own_registration_area = own_registration_area
        self.setup_timeout = setup_timeout
        self.registration_area: RegistrationArea | None = None
        """The area this placement registers in the cache's stead, when it makes its own."""
        self.last_store: StoreRecord | None = None
        """The steps of the last :meth:`store`."""
        self._l1_pool: Segment | None = None
        self._generation_table = ServerWords(words_per_slot=2, writable=False)
        """The pool's generation and landed words (read-only): what each load checks its sources against."""
        self._store_mark_table = ServerWords(words_per_slot=1, writable=True)
        """The store marks (writable): where a store says its copies landed."""
        self._l1_tensor: torch.Tensor | None = None
        self._copier: LocalCopier | None = None
        self._pool_lock = threading.Lock()
        self._submitting = threading.local()
        """``ahead``: the :class:`FirstLayerAhead` of the load this thread is submitting, if any."""
        self._queue = TransferQueue(client, layout, copier_for=self._copier_for,
                                    chunk_size=lambda: self.chunk_size, retrieve_timeout=retrieve_timeout,
                                    landed=self._event_backend.landed, generations_for=self._generations_for,
                                    copy_rate=lambda: self.slice_width.copy_rate, slice_observer=slice_observer,
                                    pace_loads=pace_loads)

    # --- registration ----------------------------------------------------------------

    def _before_register(self) -> None:
        if self.own_registration_area and self.registration_area is None:
            info = self.client.transport.call(RequestType.SERVER_INFO, [], timeout=self.setup_timeout)
            self.registration_area = RegistrationArea(self.layout, chunk_size=int(info["chunk_size"]))
            self.registration_layout = self.registration_area.layout

    def _registered(self, reply: dict[str, Any]) -> None:
        if reply.get("pool"):
            self._map_l1_pool(reply["pool"])  # and register it for DMA on a GPU: once, off the request path

    # --- loads -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _load_starting(self, key: CacheKey, skip: int, located: ChunkLocations | None) -> Iterator[None]:
        """Where the LOOKUP located the chunks and the load will be planned right away, its first layer's copy goes
        to the GPU before anything else is done for it (:meth:`TransferQueue.first_layer_ahead`): planning the
        load takes this thread longer than the copy needs to start. Given back when the submit returns, where the
        load's plan did not take it."""
        ahead = self._first_layer_ahead(key, skip, located)
        self._submitting.ahead = ahead
        try:
            yield
        finally:
            self._submitting.ahead = None
            if ahead is not None:
                ahead.close()  # a no-op where the load's plan took it; else its staging is given back

    def _first_layer_ahead(self, key: CacheKey, skip: int, located: ChunkLocations | None) -> FirstLayerAhead | None:
        copier, pool = self._copier, self._l1_pool
        stage = getattr(copier, "stage_first_layer", None)
        if (stage is None or located is None or skip or pool is None or located.pool_name != pool.name
                or not self._fits(key, located)):
            return None
        reply = located.as_retrieve_reply()
        return self._queue.first_layer_ahead(reply["pool"], reply["objects"], stage)

    def _start(self, request_id: str, key: CacheKey, blocks: BlockTable, skip: int, width: int,
               gate: LayerArrivalGate, record: RetrieveRecord, located: ChunkLocations | None) -> InFlight:
        # Where the chunks lie comes with the LOOKUP, or from a RETRIEVE sent from this (the engine's) thread:
        # the queue's thread only waits for the answer.
        try:
            self.layout.check_block_ids(blocks, key.num_tokens)
            reply = self._locate(key, blocks, skip, located, record)
        except Exception as exc:  # reported through the load, like any other failure
            reply = Future()
            reply.set_exception(exc)
        reply.add_done_callback(lambda _, r=record: setattr(r, "replied_at", time.perf_counter()))
        ahead = getattr(self._submitting, "ahead", None)
        if ahead is not None:
            record.first_layer_handed_at = ahead.handed_at
        load = QueuedLoad(key, blocks, skip, width, gate, record, reply, ahead=ahead)
        inflight = EngineLoad(request_id, blocks, self._queue.submit(load), gate, width, record)
        inflight.load = load
        return inflight

    def _locate(self, key: CacheKey, blocks: BlockTable, skip: int, located: ChunkLocations | None,
                record: RetrieveRecord) -> Future:
        """Where ``key``'s chunks lie in the pool, from the LOOKUP if it said so and its objects fit this cache,
        else from a RETRIEVE (sent now, from the engine's thread)."""
        if located is not None:
            if self._fits(key, located):
                record.located_by = "lookup"
                reply: Future = Future()
                reply.set_result(located.as_retrieve_reply())
                return reply
            log.info("request %s: the LOOKUP's chunks (shape %s, %d tokens) do not fit this cache (shape %s, "
                     "%d tokens); asking RETRIEVE", record.request_id, located.shape, located.num_tokens,
                     self.layout.shape_signature(), key.num_tokens)
        record.located_by = "retrieve"
        return self.client.retrieve_async(key, self.instance_id, blocks, skip_first_n_tokens=skip)

    def _fits(self, key: CacheKey, located: ChunkLocations) -> bool:
        """Whether the LOOKUP's objects are of this cache's shape and hold ``key``'s tokens."""
        return located.shape == self.layout.shape_signature() and located.num_tokens == key.num_tokens

    def _complete_without_reply(self, inf: InFlight) -> bool:
        return isinstance(inf, EngineLoad) and self._queue.landed_and_checked(inf.load)

    def _copy_may_write(self, inf: InFlight) -> bool:
        return not inf.future.done()

    def _settled(self, inf: InFlight, board_complete: bool) -> None:
        if isinstance(inf, EngineLoad):
            if board_complete:  # settled here, before the queue's thread got to it
                self._queue.free_locks(inf.load)
            self._queue.engine_settled(inf.load)

    # --- the server's pool -----------------------------------------------------------

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

    def _generations_for(self, pool: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """The generation words and the landed words of the pool a reply names, mapped read-only (again after a
        server restart)."""
        ref = pool["generations"]
        with self._pool_lock:
            return split_generation_table(self._generation_table.words(ref), int(ref["slots"]))

    def _map_store_marks(self, ref: dict[str, Any]) -> np.ndarray:
        """The store-mark words a RESERVE_STORE reply names, mapped writable (again after a server restart)."""
        with self._pool_lock:
            return self._store_mark_table.words(ref)

    def _copier_for(self, pool: dict[str, Any]) -> LocalCopier:
        with self._pool_lock:
            self._map_l1_pool_locked(pool)
            return self._copier

    # --- stores ----------------------------------------------------------------------

    def reserve_store(self, key: CacheKey, skip_first_n_tokens: int = 0) -> Future:
        """Send RESERVE_STORE now (see :meth:`Placement.reserve_store`)."""
        if not self.pool_writable:
            raise RuntimeError("reserve_store needs engine placement with pool_writable=True")
        return self.client.reserve_store_async(key, self.instance_id, skip_first_n_tokens)

    def drop_reservation(self, reservation: Future) -> None:
        """Give back the objects of a reservation no store will copy into (bounded; a failed one held none)."""
        try:
            reply = self.client.transport.wait(reservation, timeout=self.retrieve_timeout)
            if reply["reservation"]:
                self.client.commit_store(int(reply["reservation"]), False)
        except Exception as exc:  # the server is gone (it dropped the reservation) or refused it: nothing held
            log.debug("dropping a store reservation: %s", exc)

    def store(self, key: CacheKey, block_ids: Sequence[Sequence[int]], skip_first_n_tokens: int = 0, *,
              reservation: Future | None = None) -> dict[str, Any]:
        """RESERVE_STORE the chunks not stored yet (unless ``reservation``, from :meth:`reserve_store` for the
        same key and skip, already asked), copy the blocks into those objects with this process's copier, then,
        once the copies have landed, mark the objects stored (the server commits them before it answers any
        request that could see them: :mod:`kvstrata.core.store.l1_store`). If the copies fail, COMMIT_STORE drops
        the reservation: a half-written object is never committed.

        Blocks the calling thread until the copies have run, and no longer: no round trip follows them. On a
        GPU they run on this process's copy streams after the work the engine has queued so far; the engine's
        own stream never waits for them.
        """
        if not self.pool_writable:
            raise RuntimeError("store needs engine placement with pool_writable=True")
        blocks = BlockTable(block_ids)
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
        rows = reply["objects"]
        if rows:
            try:
                copier = self._copier_for(reply["pool"])
                marks = self._map_store_marks(reply["store_marks"])
                done = copier.gather([(int(row[0]), int(row[2]), int(row[3])) for row in rows], blocks)
                record.enqueued_at = time.perf_counter()
                copier.finish(done)
            except BaseException:
                self._drop_reserved(int(reply["reservation"]), key)
                raise
        record.copied_at = time.perf_counter()
        for row in rows:  # the copies landed: the server commits the objects once every mark is in
            marks[int(row[4])] = int(row[5])
        record.committed_at = time.perf_counter()
        stored = sum(int(row[2]) for row in rows)
        if reply.get("full"):
            log.warning("STORE of %s kept %d tokens: %s", key.request_id, stored, reply["full"])
        return {"stored_tokens": stored, "skipped_tokens": reply["skipped_tokens"]}

    def _drop_reserved(self, reservation: int, key: CacheKey) -> None:
        """The copies into ``reservation`` failed: give its objects back (bounded; the failure raised stays
        what the caller sees)."""
        try:
            self.client.commit_store(reservation, False)
        except Exception as exc:  # the server is gone: it dropped the reservation with the connection
            log.warning("STORE of %s: dropping its reservation after a failed copy: %s", key.request_id, exc)

    def close(self) -> None:
        self._queue.close()
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        self._l1_tensor = None
        self._generation_table.close()
        self._store_mark_table.close()
        if self._l1_pool is not None:
            self._l1_pool.close()
        if self.registration_area is not None:
            self.registration_area.close()
            self.registration_area = None
