"""Server placement: the server writes the engine's cache, and says on an arrival board how far it got.

The engine registers its cache itself (shared memory, or CUDA IPC on a GPU) and the server copies into it.
A layer-major load takes a slot of this process's :class:`~kvstrata.core.arrival.pool.ArrivalPool` (one board
word and one event per layer, exported once) and names it in the eight-item RETRIEVE; the server records a
slice's events and only then raises the board's count, so a count this process reads makes those events safe
to wait on. The board's "complete" word is the last thing the server writes to the slot: the load settles on it
without waiting for the reply. A chunk-major load (or one that found no free slot) completes with its reply.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence

from kvstrata.core.arrival.events import EventBackend
from kvstrata.core.arrival.gate import LayerArrivalGate
from kvstrata.core.arrival.pool import ArrivalPool, ArrivalSlot
from kvstrata.core.engine.placement import InFlight, Placement, RetrieveRecord
from kvstrata.core.engine.requests import ChunkLocations
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.block_table import BlockTable
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PagedKVLayout
from kvstrata.core.wire.client import CacheClient

log = logging.getLogger(__name__)


@dataclass
class ServerLoad(InFlight):
    """A load the server copies: its arrival slot (layer-major) and how much of the board it has read."""

    slot: ArrivalSlot | None = None
    board_seen: int = 0


class ServerPlacement(Placement):
    name = PLACEMENT_SERVER

    def __init__(self, client: CacheClient, instance_id: int, layout: PagedKVLayout, *,
                 event_backend: EventBackend | None = None, pool_slots: int = RuntimeSettings.pool_slots,
                 release_after_layers: int = 1,
                 layer_wait_timeout: float = RuntimeSettings.layer_wait_timeout,
                 retrieve_timeout: float = RuntimeSettings.retrieve_timeout,
                 registration_layout: PagedKVLayout | None = None) -> None:
        """``pool_slots``: layer-major loads in flight at once (each holds an arrival slot); a load that finds
        none free runs chunk-major."""
        super().__init__(client, instance_id, layout, event_backend=event_backend,
                         release_after_layers=release_after_layers, layer_wait_timeout=layer_wait_timeout,
                         retrieve_timeout=retrieve_timeout, registration_layout=registration_layout)
        self.pool = ArrivalPool(pool_slots, layout.num_layers, self._event_backend)

    def _start(self, request_id: str, key: CacheKey, blocks: BlockTable, skip: int, width: int,
               gate: LayerArrivalGate, record: RetrieveRecord, located: ChunkLocations | None) -> InFlight:
        slot = self.pool.acquire() if width > 0 else None
        if width > 0 and slot is None:
            record.fallback, width = "arrival pool exhausted", 0
        fut = self.client.retrieve_async(
            key, self.instance_id, blocks, skip_first_n_tokens=skip,
            arrival_board=slot.board_ref() if slot else None,
            layer_event_handles=slot.handles if slot else None, layers_per_slice=width)
        fut.add_done_callback(lambda f, r=record: self._note_reply(f, r))
        load = ServerLoad(request_id, blocks, fut, gate, width, record, lock_owner=key.request_id, slot=slot)
        if slot is not None:
            load.refresh = lambda: self._refresh_from_board(load)
        return load

    def _refresh_from_board(self, load: ServerLoad) -> None:
        """Turn board progress into gate slices; the count is published after the events were recorded."""
        progress = load.slot.progress()
        if progress.failed:
            load.gate.fail("the server reported the retrieve failed")
            return
        landed = progress.layers
        width = load.width or self.layout.num_layers
        while load.board_seen < landed:
            start = load.board_seen
            count = min(width, landed - start, self.layout.num_layers - start)
            load.gate.record_slice(start, count, load.slot.events[start])
            load.board_seen = start + count

    def _complete_without_reply(self, inf: InFlight) -> bool:
        # every layer landed: published after the copies finished, the last thing the server writes to the slot
        return isinstance(inf, ServerLoad) and inf.slot is not None and inf.slot.progress().complete

    def _settled(self, inf: InFlight, board_complete: bool) -> None:
        if not isinstance(inf, ServerLoad) or inf.slot is None:
            return
        if board_complete or inf.future.done():
            self.pool.release(inf.slot)
        else:
            # The server may still write this slot late; a reused slot must never see
            # that, so it stays out of the pool (a dead server writes nothing anyway).
            log.warning("arrival slot %d quarantined: its retrieve never answered", inf.slot.index)
        inf.slot = None
        inf.refresh = None

    # --- stores ----------------------------------------------------------------------

    def prepare_stores(self) -> None:
        """The server reads the engine's blocks: the forward's writes must have landed first."""
        self._event_backend.wait_for_engine_writes()

    def store(self, key: CacheKey, block_ids: Sequence[Sequence[int]], skip_first_n_tokens: int = 0, *,
              reservation: Future | None = None) -> dict[str, Any]:
        """STORE: the server gathers ``key``'s chunks from the engine's blocks (``reservation`` must be None:
        nothing is reserved ahead here)."""
        if reservation is not None:
            raise ValueError("server placement reserves nothing ahead; store() takes no reservation")
        return self.client.store(key, self.instance_id, BlockTable(block_ids), skip_first_n_tokens=skip_first_n_tokens)

    def close(self) -> None:
        self.pool.close()
