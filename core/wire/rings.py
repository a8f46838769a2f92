"""Shared-memory rings between a client and a server on one host: requests one way, replies the other.

A request or reply over ZMQ crosses two I/O threads, the sender's and the
receiver's, and on a virtual machine a leg takes several times longer when those
threads slept through the transfer's tens of milliseconds than back to back. But both ends of the kvstrata path are already awake when it
matters: the server's polling thread spins (``--busy-poll-ms``) and an engine
polls for finished transfers every step. So a client on the server's host
attaches two rings (ATTACH_RINGS): it writes each request into its request ring
before sending it, which the server's spin watches; the server writes each reply
into the reply ring before sending it, which the client's
:meth:`~kvstrata.core.wire.transport.Client.poll` reads.

ZMQ stays the carrier of record: every frame still goes over the socket, each
request is served and each reply resolved once, from whichever copy comes first,
and the server takes a request from the ring only when it is the next one that
client sent (see :class:`kvstrata.core.wire.transport.Server`), so order is kept. A
ring that is full, too small for a frame, lapped by its writer or never attached
costs only the speed-up; the rings need no flow control and no acknowledgements.

Layout (one writer, one reader)::

    header   64 bytes: the control header (``kvstrata.core.shm``: magic, version, kind, slot count, slot bytes)
    slot i   slot_bytes each: sequence (u64) | length (u64) | frame

Each slot is a sequence lock. The writer stores 0 in the sequence, then the
length and the frame, then the frame's sequence number (1, 2, ...); the reader
takes slot ``(n - 1) % slots`` only if its sequence reads ``n`` both before and
after it copies the frame. The words are aligned 8-byte stores, which are atomic
on the platforms we run on (x86-64, whose stores and loads are each seen in
program order; like the arrival board, this module has no fences for weaker
memory models).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from kvstrata.core.shm import (CONTROL_HEADER_BYTES, Segment, SegmentKind, SegmentKindError, attach_control_segment,
                  create_control_segment)

log = logging.getLogger(__name__)

SLOT_HEADER_BYTES = 16
REPLY_SLOTS, REPLY_SLOT_BYTES = 64, 1024
"""Transfer and lookup replies are under 200 bytes; a engine-placement retrieve's object list may not fit,
and travels over ZMQ only."""
REQUEST_SLOTS, REQUEST_SLOT_BYTES = 4, 1 << 20
"""A RETRIEVE carries its prompt's token ids, 8 bytes each: up to about 120k tokens fit a slot."""
MAX_RING_BYTES = 16 << 20



class RingError(ValueError):
    """A ring reference that does not name a usable kvstrata ring."""


def _check_geometry(slots: int, slot_bytes: int) -> None:
    if slots < 1:
        raise RingError(f"a ring needs at least one slot, got {slots}")
    if slot_bytes < 64 or slot_bytes % 64:
        raise RingError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
    if CONTROL_HEADER_BYTES + slots * slot_bytes > MAX_RING_BYTES:
        raise RingError(f"a ring of {slots} slots of {slot_bytes} bytes exceeds {MAX_RING_BYTES} bytes")


class SlotRing:
    """One mapped ring: :meth:`create` on the client, :meth:`attach` on the server; either end may write."""

    def __init__(self, segment: Segment, slots: int, slot_bytes: int) -> None:
        self.segment = segment
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.capacity = slot_bytes - SLOT_HEADER_BYTES
        """The largest frame a slot holds."""
        self._buf = segment.buf
        self._words = np.frombuffer(segment.buf, dtype=np.uint64, count=segment.size // 8)
        self._next = 1
        """Writer: the sequence number of the next post. Reader: the one expected next."""
        self._lock = threading.Lock()
        self._closed = False
        self.posted = 0
        self.taken = 0
        self.skipped = 0
        """Reader: frames the writer overwrote before they were read (they arrive over ZMQ)."""

    @classmethod
    def create(cls, slots: int, slot_bytes: int, kind: SegmentKind) -> "SlotRing":
        _check_geometry(slots, slot_bytes)
        return cls(create_control_segment(kind, slots, slot_bytes), slots, slot_bytes)

    @classmethod
    def attach(cls, ref: dict[str, Any], kind: SegmentKind) -> "SlotRing":
        """Map the ring a client named; refuses anything but a kvstrata ``kind`` of the declared geometry.

        The name comes off the wire: writing into some other segment this user
        owns would corrupt it, so the header's magic, version, kind and geometry
        must all match before the server touches a byte.
        """
        name, slots, slot_bytes = ref["name"], ref["slots"], ref["slot_bytes"]
        _check_geometry(slots, slot_bytes)
        try:
            seg = attach_control_segment(name, kind, slots=slots, slot_bytes=slot_bytes)
        except (SegmentKindError, ValueError, OSError) as exc:
            raise RingError(str(exc)) from None
        return cls(seg, slots, slot_bytes)

    @property
    def name(self) -> str:
        return self.segment.name

    def ref(self) -> dict[str, Any]:
        """What ATTACH_RINGS sends (protocol: ``RING_REF``)."""
        return {"name": self.name, "slots": self.slots, "slot_bytes": self.slot_bytes}

    def _slot(self, sequence: int) -> tuple[int, int]:
        """(first word, first payload byte) of the slot that holds ``sequence``."""
        index = (sequence - 1) % self.slots
        word = (CONTROL_HEADER_BYTES + index * self.slot_bytes) // 8
        return word, word * 8 + SLOT_HEADER_BYTES

    # --- writer -------------------------------------------------------------------------

    def post(self, frame: bytes) -> bool:
        """Write one frame; False if it does not fit a slot or the ring is closed (ZMQ carries it)."""
        n = len(frame)
        if n > self.capacity:
            return False
        with self._lock:
            if self._closed:
                return False
            sequence = self._next
            self._next += 1
            word = self._write_slot(sequence, frame)
            self._words[word] = sequence  # published last
            self.posted += 1
        return True

    def _write_slot(self, sequence: int, frame: bytes) -> int:
        """Write ``frame`` into the slot of ``sequence`` with its word at 0 (readers skip it); returns the
        word's index, for the caller (or a device) to publish."""
        word, start = self._slot(sequence)
        self._words[word] = 0
        self._words[word + 1] = len(frame)
        self._buf[start:start + len(frame)] = frame
        return word

    # --- reader -------------------------------------------------------------------------

    def take(self) -> list[bytes]:
        """Every frame written since the last call, oldest first. One reader thread at a time."""
        out: list[bytes] = []
        while (frame := self.peek()) is not None:
            out.append(frame)
            self.advance()
        return out

    def peek(self) -> bytes | None:
        """The next frame, without consuming it (None: nothing new). One reader thread at a time."""
        if self._closed:
            return None
        while True:
            expected = self._next
            word, start = self._slot(expected)
            sequence = int(self._words[word])
            if sequence == expected:
                frame = self._read_slot(word, start, expected)
                if frame is not None:
                    return frame
            elif sequence < expected:
                return None  # not written yet (0: being written)
            self._resync()

    def _read_slot(self, word: int, start: int, value: int) -> bytes | None:
        """The slot's frame, if its word held ``value`` before and still does after the copy (else it was
        being rewritten, or is corrupt)."""
        n = int(self._words[word + 1])
        frame = bytes(self._buf[start:start + min(n, self.capacity)])
        return frame if int(self._words[word]) == value and n <= self.capacity else None

    def advance(self) -> None:
        """Consume the frame :meth:`peek` returned."""
        self._next += 1
        self.taken += 1

    def watch(self) -> tuple[int, int]:
        """(address, value): the 64-bit word that holds ``value`` once the next frame is published.

        For a spin outside Python (the CUDA extension's ``spin_until_readable``), so
        a waiting reader sees a frame without a system call or a thread's wake-up.
        """
        return self._words.ctypes.data + 8 * self._slot(self._next)[0], self._next

    def _resync(self) -> None:
        """The writer lapped this reader: skip to what follows the newest frame in the ring."""
        newest = max(int(self._words[self._slot(s)[0]]) for s in range(1, self.slots + 1))
        skipped = max(newest + 1 - self._next, 1)
        self.skipped += skipped
        self._next += skipped
        log.debug("ring %s lapped: %d frames left to ZMQ", self.name, skipped)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        del self._words
        self._buf = None
        self.segment.close()

    def destroy(self) -> None:
        """Close, and unlink the segment if this process created it (the client)."""
        self.close()
        if self.segment.owner:
            self.segment.unlink()


MAILBOX_SLOTS, MAILBOX_SLOT_BYTES = 64, 1024


class Mailbox(SlotRing):
    """Slots addressed by index, whose word a device may write: how the GPU itself says a transfer is done.

    The client creates it beside its rings. When the server enqueues a transfer
    for it, it writes the transfer's success reply into a free slot with the word
    at 0, then has the GPU store the request's id in that word once the copies
    have finished (``Target.completion(signals=...)``). The client's poll finds
    the id among its pending requests and resolves the reply then, with no host
    thread between the copy's end and the engine. The usual reply follows over
    the ring and ZMQ, and whichever copy comes first resolves the request; the
    server reuses a slot only after that reply went out.
    """

    @classmethod
    def create(cls, slots: int, slot_bytes: int, kind: SegmentKind = SegmentKind.MAILBOX) -> "Mailbox":
        return super().create(slots, slot_bytes, kind)  # type: ignore[return-value]

    @classmethod
    def attach(cls, ref: dict[str, Any], kind: SegmentKind = SegmentKind.MAILBOX) -> "Mailbox":
        return super().attach(ref, kind)  # type: ignore[return-value]

    def word_offset(self, index: int) -> int:
        """Byte offset in the segment of slot ``index``'s word."""
        return self._slot(index + 1)[0] * 8

    def fill(self, index: int, frame: bytes) -> bool:
        """Writer: put a reply frame in slot ``index``, its word cleared (the device sets it later)."""
        if len(frame) > self.capacity or self._closed:
            return False
        self._write_slot(index + 1, frame)
        return True

    def _slot_words(self) -> np.ndarray:
        """Every slot's word (a view): 0, or the request id a device stored there."""
        first = CONTROL_HEADER_BYTES // 8
        return self._words[first:first + self.slots * (self.slot_bytes // 8):self.slot_bytes // 8]

    def announced(self) -> set[int]:
        """Reader: the request ids devices have stored in slot words so far (a slot's word is cleared only when
        the server fills it again), whether or not a poll took them before their ZMQ reply came."""
        if self._closed:
            return set()
        words = self._slot_words()
        return {int(words[i]) for i in np.flatnonzero(words)}

    def scan(self, wanted: Any) -> list[bytes]:
        """Reader: the frames of slots whose word holds one of ``wanted`` (request ids), read consistently."""
        if self._closed:
            return []
        words = self._slot_words()
        out = []
        for index in np.flatnonzero(words):
            value = int(words[index])
            if value not in wanted:
                continue
            frame = self._read_slot(*self._slot(int(index) + 1), value)
            if frame is not None:
                out.append(frame)
        self.taken += len(out)
        return out
