"""The arrival board: how far each in-flight retrieve has got, shared across processes.

A per-layer completion event says "these bytes are on the device" but cannot say
"the server got this far": an event nobody has recorded yet reports complete. So
the server raises a count here *after* it records a slice's events, and the
worker trusts an event only once the count covers its layer.

The segment starts with the control header every segment the server writes into
carries (``kvstrata.core.shm``: magic, version, kind, slot count, slot size); the
server maps a board only once that header says it is one, and bounds-checks every
slot index against it. Then one slot per in-flight retrieve, each on its own
64-byte cache line, one writer (the server) and one reader (the worker), so
neither side takes a lock. The
slot's only word packs everything the reader needs into one aligned 8-byte
store, which is atomic on the platforms we run on:

    bits 63..32  generation  (stamped by the worker per retrieve; a reused slot's
                              old progress has an old generation and reads as 0)
    bit  31      failed      (the server gave up on this retrieve)
    bit  30      complete    (every layer landed)
    bits 23..0   layers landed, counted from layer 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstrata.core.shm import CONTROL_HEADER_BYTES, Segment, SegmentKind, attach_control_segment, create_control_segment

SLOT_BYTES = 64
_WORDS_PER_SLOT = SLOT_BYTES // 8
_FAILED = 1 << 31
_COMPLETE = 1 << 30
_LAYER_MASK = (1 << 24) - 1
MAX_GENERATION = (1 << 32) - 1


@dataclass(frozen=True)
class Progress:
    layers: int
    failed: bool
    complete: bool


NO_PROGRESS = Progress(0, False, False)


def pack(generation: int, layers: int, *, failed: bool = False, complete: bool = False) -> int:
    if not 0 <= layers <= _LAYER_MASK:
        raise ValueError(f"layer count {layers} does not fit the board")
    return (generation << 32) | (_FAILED if failed else 0) | (_COMPLETE if complete else 0) | layers


def unpack(word: int, generation: int) -> Progress:
    if word >> 32 != generation:
        return NO_PROGRESS
    return Progress(word & _LAYER_MASK, bool(word & _FAILED), bool(word & _COMPLETE))


class ArrivalBoard:
    """A mapped board; the worker creates it, the server attaches to it by name."""

    def __init__(self, segment: Segment, num_slots: int) -> None:
        self.segment = segment
        self.num_slots = num_slots
        self._words = np.frombuffer(segment.buf, dtype=np.uint64, count=num_slots * _WORDS_PER_SLOT,
                                    offset=CONTROL_HEADER_BYTES)

    @classmethod
    def create(cls, num_slots: int) -> "ArrivalBoard":
        if num_slots <= 0:
            raise ValueError("an arrival board needs at least one slot")
        return cls(create_control_segment(SegmentKind.ARRIVAL_BOARD, num_slots, SLOT_BYTES), num_slots)

    @classmethod
    def attach(cls, name: str) -> "ArrivalBoard":
        """Map the board a request names; raises SegmentKindError if the segment is not an arrival board."""
        seg = attach_control_segment(name, SegmentKind.ARRIVAL_BOARD, slot_bytes=SLOT_BYTES)
        return cls(seg, (seg.size - CONTROL_HEADER_BYTES) // SLOT_BYTES)

    @property
    def name(self) -> str:
        return self.segment.name

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"board {self.name} has {self.num_slots} slots, slot {slot} asked")

    def check_ref(self, slot: Any, generation: Any) -> None:
        """Raise ValueError unless (slot, generation) can name a retrieve on this board (checked before any
        write: a request naming a slot past the end or a generation that does not fit writes nothing)."""
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"arrival board {self.name} has {self.num_slots} slots; slot {slot!r} is not one")
        if not isinstance(generation, int) or not 0 < generation <= MAX_GENERATION:
            raise ValueError(f"arrival board generation {generation!r} is not in [1, {MAX_GENERATION}]")

    def word_offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s word in the segment: where a device may store it (see publish())."""
        self._check(slot)
        return CONTROL_HEADER_BYTES + slot * SLOT_BYTES

    # writer side (server)
    def publish(self, slot: int, generation: int, layers: int, *, complete: bool = False) -> None:
        self._check(slot)
        self._words[slot * _WORDS_PER_SLOT] = pack(generation, layers, complete=complete)

    def fail(self, slot: int, generation: int, layers: int = 0) -> None:
        self._check(slot)
        self._words[slot * _WORDS_PER_SLOT] = pack(generation, layers, failed=True)

    # reader side (worker)
    def read(self, slot: int, generation: int) -> Progress:
        self._check(slot)
        return unpack(int(self._words[slot * _WORDS_PER_SLOT]), generation)

    def close(self) -> None:
        del self._words
        self.segment.close()

    def destroy(self) -> None:
        del self._words
        self.segment.destroy()
