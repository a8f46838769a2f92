"""The reply ring: a server's replies to one client, also written into shared memory the client polls.

A transfer's reply over ZMQ crosses two I/O threads (the server's and the
client's) that have slept through the transfer's tens of milliseconds; on the
lent H200's virtual machine that leg measured 0.3 ms against 0.04 ms back to back,
about a third of chunk-major's whole overhead over a raw copy. An engine polls
for finished transfers anyway (vLLM asks its connector every step), so a client
on the same host gives the server a ring in shared memory: the server writes each
reply there first, then sends it over ZMQ as always, and the client's
:meth:`~kvstrata.core.transport.Client.poll` finds it with a memory read.

ZMQ stays the carrier of record: every reply still goes over the socket, the
client resolves a request once (whichever copy comes first), and a ring that is
full, too small for a reply, lapped by the writer or never attached costs only
the speed-up. So the ring needs no flow control and no acknowledgements.

Layout (one writer, the server; one reader, the client)::

    header   64 bytes: magic, slot count, slot bytes
    slot i   slot_bytes each: sequence (u64) | length (u64) | reply frame

Each slot is a sequence lock. The writer stores 0 in the sequence, then the
length and the frame, then the reply's sequence number (1, 2, ...); the reader
takes slot ``(n - 1) % slots`` only if its sequence reads ``n`` both before and
after it copies the frame. The words are aligned 8-byte stores, which are atomic
on the platforms we run on (x86-64, whose stores and loads are each seen in
program order; like the arrival board, this module has no fences for weaker
memory models).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import numpy as np

from .shm import Segment

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"KVSRING1", "little")
HEADER_BYTES = 64
SLOT_HEADER_BYTES = 16
DEFAULT_SLOTS = 64
DEFAULT_SLOT_BYTES = 1024
"""Transfer and lookup replies are under 200 bytes; a worker-placement retrieve's object list may not fit,
and travels over ZMQ only."""
MAX_RING_BYTES = 16 << 20

_NAME = re.compile(r"^kvstrata-ring-\d+-[0-9a-f]{8}$")


class ReplyRingError(ValueError):
    """A ring reference that does not name a usable reply ring."""


def _check_geometry(slots: int, slot_bytes: int) -> None:
    if slots < 1:
        raise ReplyRingError(f"a reply ring needs at least one slot, got {slots}")
    if slot_bytes < 64 or slot_bytes % 64:
        raise ReplyRingError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
    if HEADER_BYTES + slots * slot_bytes > MAX_RING_BYTES:
        raise ReplyRingError(f"a ring of {slots} slots of {slot_bytes} bytes exceeds {MAX_RING_BYTES} bytes")


class ReplyRing:
    """One mapped ring: :meth:`create` on the client (reader), :meth:`attach` on the server (writer)."""

    def __init__(self, segment: Segment, slots: int, slot_bytes: int) -> None:
        self.segment = segment
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.capacity = slot_bytes - SLOT_HEADER_BYTES
        """The largest reply frame a slot holds."""
        self._buf = segment.buf
        self._words = np.frombuffer(segment.buf, dtype=np.uint64, count=segment.size // 8)
        self._stride = slot_bytes // 8
        self._next = 1
        """Writer: the sequence number of the next post. Reader: the one expected next."""
        self._lock = threading.Lock()
        self._closed = False
        self.posted = 0
        self.taken = 0
        self.skipped = 0
        """Reader: replies the writer overwrote before they were read (they arrive over ZMQ)."""

    @classmethod
    def create(cls, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES) -> "ReplyRing":
        _check_geometry(slots, slot_bytes)
        seg = Segment.create("ring", HEADER_BYTES + slots * slot_bytes)
        words = np.frombuffer(seg.buf, dtype=np.uint64, count=3)
        words[1], words[2] = slots, slot_bytes
        words[0] = MAGIC  # last: a ring is attachable once its geometry is written
        del words
        return cls(seg, slots, slot_bytes)

    @classmethod
    def attach(cls, ref: dict[str, Any]) -> "ReplyRing":
        """Map the ring a client named; refuses anything but a kvstrata reply ring of the declared geometry.

        The name comes off the wire: writing replies into some other segment this
        user owns would corrupt it, so the name pattern and the header's magic and
        geometry must all match before the server writes a byte.
        """
        name, slots, slot_bytes = ref["name"], ref["slots"], ref["slot_bytes"]
        if not _NAME.match(name):
            raise ReplyRingError(f"{name!r} is not a kvstrata reply ring name (kvstrata-ring-PID-HEX)")
        _check_geometry(slots, slot_bytes)
        try:
            seg = Segment.attach(name, HEADER_BYTES + slots * slot_bytes)
        except FileNotFoundError:
            raise ReplyRingError(f"no shared-memory segment {name}: the client is not on this host, or "
                                 "has closed it") from None
        header = np.frombuffer(seg.buf, dtype=np.uint64, count=3)
        found = (int(header[0]), int(header[1]), int(header[2]))
        del header
        if found != (MAGIC, slots, slot_bytes):
            seg.close()
            raise ReplyRingError(f"segment {name} is not a reply ring of {slots} slots of {slot_bytes} bytes")
        return cls(seg, slots, slot_bytes)

    @property
    def name(self) -> str:
        return self.segment.name

    def ref(self) -> dict[str, Any]:
        """What ATTACH_REPLY_RING sends (protocol: ``REPLY_RING_REF``)."""
        return {"name": self.name, "slots": self.slots, "slot_bytes": self.slot_bytes}

    def _slot(self, sequence: int) -> tuple[int, int]:
        """(first word, first payload byte) of the slot that holds ``sequence``."""
        index = (sequence - 1) % self.slots
        word = (HEADER_BYTES + index * self.slot_bytes) // 8
        return word, word * 8 + SLOT_HEADER_BYTES

    # --- writer (server) -------------------------------------------------------------------

    def post(self, frame: bytes) -> bool:
        """Write one reply frame; False if it does not fit a slot or the ring is closed (ZMQ carries it)."""
        n = len(frame)
        if n > self.capacity:
            return False
        with self._lock:
            if self._closed:
                return False
            sequence = self._next
            self._next += 1
            word, start = self._slot(sequence)
            self._words[word] = 0  # readers skip the slot while it is rewritten
            self._words[word + 1] = n
            self._buf[start:start + n] = frame
            self._words[word] = sequence  # published last
            self.posted += 1
        return True

    # --- reader (client) ---------------------------------------------------------------

    def take(self) -> list[bytes]:
        """Every reply frame written since the last call, oldest first. One reader thread at a time."""
        out: list[bytes] = []
        if self._closed:
            return out
        while True:
            expected = self._next
            word, start = self._slot(expected)
            sequence = int(self._words[word])
            if sequence == expected:
                n = int(self._words[word + 1])
                frame = bytes(self._buf[start:start + min(n, self.capacity)])
                if int(self._words[word]) == expected and n <= self.capacity:
                    out.append(frame)
                    self._next = expected + 1
                    self.taken += 1
                    continue
            elif sequence < expected:
                return out  # not written yet (0: being written)
            self._resync()

    def _resync(self) -> None:
        """The writer lapped this reader: skip to what follows the newest reply in the ring."""
        newest = max(int(self._words[self._slot(s)[0]]) for s in range(1, self.slots + 1))
        skipped = max(newest + 1 - self._next, 1)
        self.skipped += skipped
        self._next += skipped
        log.debug("reply ring %s lapped: %d replies left to ZMQ", self.name, skipped)

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
