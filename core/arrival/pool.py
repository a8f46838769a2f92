"""Arrival slots, built once and reused, so a retrieve costs a slot and not driver round trips.

Each slot owns one board entry and one completion object per layer from the
event backend (interprocess CUDA events on a GPU, nothing on CPU where the
board count is the completion). The handles are exported once, when the slot is
built, and sent on the wire as they are with every retrieve that uses it.

An empty pool is not an error: the retrieve runs chunk-major, without early
release, and one log line says so.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvstrata.core.arrival.board import MAX_GENERATION, ArrivalBoard, Progress
from kvstrata.core.arrival.events import EventBackend

log = logging.getLogger(__name__)


@dataclass
class ArrivalSlot:
    index: int
    board: ArrivalBoard
    events: list[Any]
    handles: list[bytes] | None
    generation: int = 0
    in_use: bool = field(default=False)

    def board_ref(self) -> dict[str, Any]:
        return {"name": self.board.name, "slot": self.index, "generation": self.generation}

    def progress(self) -> Progress:
        return self.board.read(self.index, self.generation)


class ArrivalPool:
    def __init__(self, num_slots: int, num_layers: int, event_backend: EventBackend) -> None:
        self.board = ArrivalBoard.create(max(num_slots, 1))
        self.event_backend = event_backend
        self._slots = []
        for i in range(num_slots):
            events = event_backend.create_layer_events(num_layers)
            self._slots.append(ArrivalSlot(i, self.board, events, event_backend.export(events)))
        self._lock = threading.Lock()
        self._exhausted_logged = False

    @property
    def capacity(self) -> int:
        return len(self._slots)

    def in_use(self) -> int:
        with self._lock:
            return sum(1 for s in self._slots if s.in_use)

    def acquire(self) -> ArrivalSlot | None:
        """A free slot stamped with a new generation, or None (logged once per exhaustion episode)."""
        with self._lock:
            for s in self._slots:
                if not s.in_use:
                    s.in_use = True
                    s.generation = s.generation + 1 if s.generation < MAX_GENERATION else 1
                    self._exhausted_logged = False
                    return s
            if not self._exhausted_logged:
                self._exhausted_logged = True
                log.warning("arrival pool exhausted (%d slots in use): retrieves run chunk-major without "
                            "early release until a slot frees", len(self._slots))
            return None

    def release(self, slot: ArrivalSlot) -> None:
        with self._lock:
            slot.in_use = False

    def close(self) -> None:
        self.board.destroy()
