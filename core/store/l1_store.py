"""The L1 store: chunk objects in one host shared-memory pool, LRU-evicted, lock-aware.

Why one pool sized at start: the GPU path pins (``cudaHostRegister``) the pool
once, and a worker-executed retrieve maps it read-only once; allocating per
object would make both per-object costs. Objects are ``[kv, layer, token,
hidden]`` bytes at an aligned offset; the store tracks only offsets, sizes and
locks, never the bytes' meaning beyond the shape signature.

Locks: LOOKUP read-locks the chunks it reports for a *lock owner* (a request of
one engine rank), so they cannot be evicted or moved between LOOKUP and RETRIEVE,
or, in engine placement, until the engine's own copy from the offsets the LOOKUP
reported is done. RETRIEVE (server placement) and FREE_LOOKUP_LOCKS release them.
Each owner is held by one connection (its *holder*, the server's
:class:`~kvstrata.core.server.connections.Connection`); the server checks who may
name it. A STORE that cannot find room after evicting every unlocked object fails
with :class:`StoreFull`; it never overwrites a locked object.

Generations: a lock can still be lost (its holder's lease ran out, a bug, another
process), and an engine that copies from the pool itself must then never take
evicted-and-reused bytes for its KV. So every object has a slot in a small
shared-memory *generation table* (one 64-bit word per slot, mapped read-only by
engines) holding the object's generation while it lives; the word is cleared
before the object's memory can be handed to another object. A reader that noted
(slot, generation) before its copy and finds the word unchanged after it knows
the bytes it copied were the object's (:func:`generations_unchanged`).

Filling: an object brought in from the shared tier is published (visible to
LOOKUP, locked by its fill) before all its bytes are in, so that a load can start
on its first layers while the rest still arrive. A second table beside the
generations, the *landed* words, says per slot how many leading layers (K and V)
are in the pool (:data:`ALL_LAYERS` for every object not filling); a reader waits
for the layers it copies next (:meth:`L1Store.wait_landed` in the server,
:func:`layers_landed` in an engine). A fill that fails clears the object's
generation word, so a reader waiting on it, or one that copied from it, fails;
the object leaves the index once its last lock goes.

Store marks: an engine that copies a prompt into objects the server reserved
(engine placement) says its copies landed by writing each object's generation
into that object's slot of a third table, the *store marks*, which engines map
writable (:meth:`L1Store.marked_stored`). The server commits a reservation once
every one of its objects is marked, at the next request that could see it
(LOOKUP, a store) or its lease watcher's next turn, so the engine's store ends
when its copies do, with no round trip after them, and any LOOKUP sent after the
store returned finds the prompt. A mark holding another generation (a slot's
earlier object) commits nothing. Writing marks gives an engine no power it does
not have already: it maps the pool itself writable.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from kvstrata.core.shm import Segment

log = logging.getLogger(__name__)

ALIGNMENT = 512
ALL_LAYERS = np.uint64(2**64 - 1)
"""The landed word of an object whose every layer is in the pool."""
FILL_WAIT_S = 120.0
"""How long a reader waits at most for a filling object's next layers: only a backstop, since every fill ends
(complete or failed) by itself, each of its reads bounded by the shared tier's timeout."""


class StoreFull(RuntimeError):
    """No room for an object even after evicting everything unlocked."""


class FillFailed(RuntimeError):
    """An object a load waited on did not arrive whole from the shared tier: the engine recomputes its blocks."""


@dataclass
class StoredObject:
    digest: bytes
    offset: int
    nbytes: int
    num_tokens: int
    shape_signature: tuple[int, int, int, int]
    """(kv, layers, heads, head_bytes) of the cache it was gathered from."""
    locks: int = 0
    committed: bool = False
    slot: int = 0
    """Its word in the generation table."""
    generation: int = 0
    """What that word holds while this object lives (never 0)."""
    filling: bool = False
    """Published while its layers still arrive from the shared tier (its landed word says how many have)."""
    failed: bool = False
    """Its fill failed: no LOOKUP finds it, and it is freed once its last lock goes."""


def object_view(pool: torch.Tensor, obj: StoredObject) -> torch.Tensor:
    """The ``[kv, layers, tokens, heads, head_bytes]`` uint8 view of an object in the pool."""
    kv, layers, heads, head_bytes = obj.shape_signature
    return pool[obj.offset:obj.offset + obj.nbytes].view(kv, layers, obj.num_tokens, heads, head_bytes)


def span_view(pool: torch.Tensor, shape_signature: tuple[int, int, int, int], offset: int,
              num_tokens: int) -> torch.Tensor:
    """The view of an object a RETRIEVE reply located at ``offset`` (an engine mapping the pool read-only).

    The reply comes from another process, so the span is checked against the pool before it is viewed.
    """
    kv, layers, heads, head_bytes = shape_signature
    nbytes = kv * layers * num_tokens * heads * head_bytes
    if offset < 0 or num_tokens <= 0 or offset + nbytes > pool.numel():
        raise ValueError(f"L1 object at offset {offset} with {num_tokens} tokens lies outside the "
                         f"{pool.numel()}-byte pool")
    return pool[offset:offset + nbytes].view(kv, layers, num_tokens, heads, head_bytes)


def split_generation_table(words: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The generation words and the landed words of a generation table segment's ``2 * slots`` words."""
    return words[:slots], words[slots:2 * slots]


def layers_landed(landed: np.ndarray, slots: "Sequence[int]") -> int:
    """How many leading layers are in the pool for every object at ``slots`` (a landed table's words; the
    largest uint64 where every layer of each is)."""
    if not len(slots):
        return int(ALL_LAYERS)
    return int(landed[np.asarray(slots, dtype=np.int64)].min())


def generations_unchanged(table: np.ndarray, rows: "Iterable[tuple[int, int]]") -> bool:
    """Whether every (slot, generation) in ``rows`` still holds in ``table`` (a generation table's words).

    Read after a copy from the objects has ended: True means none of them was freed before then, so no other
    object's bytes can have been written where they were copied from."""
    rows = list(rows)
    if not rows:
        return True
    slots = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    expected = np.fromiter((r[1] for r in rows), dtype=np.uint64, count=len(rows))
    if slots.min() < 0 or slots.max() >= table.shape[0]:
        return False
    return bool(np.array_equal(table[slots], expected))


class _FreeList:
    """First-fit allocator over [0, size) with coalescing of neighbours."""

    def __init__(self, size: int) -> None:
        self._starts = [0]
        self._sizes = {0: size}

    def alloc(self, nbytes: int) -> int | None:
        nbytes = -(-nbytes // ALIGNMENT) * ALIGNMENT
        for start in self._starts:
            size = self._sizes[start]
            if size >= nbytes:
                self._starts.remove(start)
                del self._sizes[start]
                if size > nbytes:
                    self._insert(start + nbytes, size - nbytes)
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        nbytes = -(-nbytes // ALIGNMENT) * ALIGNMENT
        i = bisect.bisect_left(self._starts, start)
        # merge with the following free range
        if i < len(self._starts) and self._starts[i] == start + nbytes:
            nxt = self._starts.pop(i)
            nbytes += self._sizes.pop(nxt)
        # merge with the preceding free range
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == start:
                self._sizes[prev] += nbytes
                return
        self._insert(start, nbytes)

    def _insert(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._sizes[start] = size

    @property
    def free_bytes(self) -> int:
        return sum(self._sizes.values())


class L1Store:
    """Chunk objects keyed by rolling-hash digest, in one shared-memory pool."""

    def __init__(self, capacity_bytes: int, max_objects: int | None = None) -> None:
        """``max_objects``: slots of the generation table (default: one per 4 KiB of pool, at least 1,024)."""
        # populated now: an engine registering the pool for DMA must not be the one to allocate its pages
        self.segment = Segment.create("l1", capacity_bytes, populate=True)
        log.info("L1 pool of %d MiB allocated in %.2f s", capacity_bytes >> 20, self.segment.populate_seconds)
        self.capacity = capacity_bytes
        self.pool = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.max_objects = max_objects or max(1024, capacity_bytes >> 12)
        try:
            self.generation_segment = Segment.create("l1gen", self.max_objects * 16)
        except BaseException:
            self.segment.destroy()
            raise
        try:
            self.store_mark_segment = Segment.create("l1mark", self.max_objects * 8)
        except BaseException:
            self.segment.destroy()
            self.generation_segment.destroy()
            raise
        self.generations, self.landed = split_generation_table(
            np.frombuffer(self.generation_segment.buf, dtype=np.uint64), self.max_objects)
        self.store_marks = np.frombuffer(self.store_mark_segment.buf, dtype=np.uint64)
        """Per slot: the generation of the reserved object an engine's copies filled (the module docstring)."""
        self._free_slots = list(range(self.max_objects - 1, -1, -1))
        self._next_generation = 1
        self._free = _FreeList(capacity_bytes)
        self._objects: "collections.OrderedDict[bytes, StoredObject]" = collections.OrderedDict()
        self._lookup_locks: dict[str, collections.Counter[bytes]] = {}
        self._holders: dict[str, object] = {}
        """Lock owner -> the connection holding its locks (see the module docstring)."""
        self._lock = threading.RLock()
        self._landed_changed = threading.Condition(self._lock)
        self.evictions = 0

    # --- views -----------------------------------------------------------------------

    def object_view(self, obj: StoredObject) -> torch.Tensor:
        return object_view(self.pool, obj)

    def object_bytes(self, obj: StoredObject) -> memoryview:
        """The object's bytes in the pool, without a copy (valid while it is locked or pinned)."""
        return self.segment.buf[obj.offset:obj.offset + obj.nbytes]

    # --- lookup and locks ------------------------------------------------------------

    def lookup(self, request_id: str, digests: list[bytes], lock: bool = True,
               holder: object = None) -> list[StoredObject]:
        """The longest run of committed objects from the first digest on; locked for request_id, whose locks
        ``holder`` (a connection) then holds."""
        with self._lock:
            hit = []
            for d in digests:
                obj = self._objects.get(d)
                if obj is None or not obj.committed:
                    break
                hit.append(obj)
            if lock and hit:
                self._holders.setdefault(request_id, holder)
                held = self._lookup_locks.setdefault(request_id, collections.Counter())
                for obj in hit:
                    obj.locks += 1
                    held[obj.digest] += 1
                    self._objects.move_to_end(obj.digest)
            return hit

    def get_locked(self, request_id: str, digests: Iterable[bytes]) -> list[StoredObject]:
        """The objects for digests, each of which must be held by request_id's lookup locks."""
        with self._lock:
            held = self._lookup_locks.get(request_id, collections.Counter())
            out = []
            for d in digests:
                if held[d] <= 0:
                    raise KeyError(
                        f"chunk {d.hex()[:12]} is not locked for request {request_id!r}: LOOKUP it first"
                    )
                out.append(self._objects[d])
            return out

    def holder(self, request_id: str) -> object:
        """The connection holding request_id's lookup locks (None: none held, or held from inside the server)."""
        with self._lock:
            return self._holders.get(request_id)

    def pin(self, objects: Iterable[StoredObject]) -> None:
        """Lock objects for a transfer of the server's own (released by :meth:`unpin`), whatever happens to the
        lookup locks meanwhile."""
        with self._lock:
            for obj in objects:
                obj.locks += 1

    def unpin(self, objects: Iterable[StoredObject]) -> None:
        with self._lock:
            for obj in objects:
                obj.locks -= 1
                self._free_if_failed(obj)

    def release_locks(self, request_id: str) -> int:
        """Release every lookup lock request_id holds; returns how many."""
        with self._lock:
            self._holders.pop(request_id, None)
            held = self._lookup_locks.pop(request_id, None)
            if not held:
                return 0
            n = 0
            for d, count in held.items():
                obj = self._objects.get(d)
                if obj is not None:
                    obj.locks -= count
                    n += count
                    self._free_if_failed(obj)
            return n

    # --- allocation ------------------------------------------------------------------

    def reserve(self, digest: bytes, num_tokens: int, nbytes: int,
                shape_signature: tuple[int, int, int, int]) -> StoredObject | None:
        """Allocate an uncommitted, locked object, evicting LRU unlocked ones to make room.

        Returns None if the digest is already stored (or being stored). Raises
        StoreFull if no room can be made without touching a locked object.
        """
        if nbytes > self.capacity:
            raise StoreFull(f"an object of {nbytes} bytes is larger than the whole L1 pool ({self.capacity})")
        with self._lock:
            held = self._objects.get(digest)
            if held is not None and held.failed and held.locks == 0:
                self._free_object(held)
            elif held is not None:
                self._objects.move_to_end(digest)
                return None
            while not self._free_slots:
                if not self._evict_one():
                    raise StoreFull(f"L1 object table full: all {self.max_objects} objects are locked")
            offset = self._free.alloc(nbytes)
            while offset is None:
                if not self._evict_one():
                    raise StoreFull(
                        f"L1 pool full: {nbytes} bytes needed, {self._free.free_bytes} free of {self.capacity} "
                        f"and every remaining object is locked"
                    )
                offset = self._free.alloc(nbytes)
            slot = self._free_slots.pop()
            generation = self._next_generation
            self._next_generation += 1
            self.generations[slot] = generation
            self.landed[slot] = 0
            self.store_marks[slot] = 0
            obj = StoredObject(digest, offset, nbytes, num_tokens, shape_signature, locks=1, slot=slot,
                               generation=generation)
            self._objects[digest] = obj
            return obj

    def is_pending(self, digest: bytes) -> bool:
        """Whether digest is reserved by a store whose bytes have not landed yet (not visible to LOOKUP)."""
        with self._lock:
            obj = self._objects.get(digest)
            return obj is not None and not obj.committed

    def marked_stored(self, obj: StoredObject) -> bool:
        """Whether the engine copying into reserved ``obj`` has marked it stored (its copies landed)."""
        return int(self.store_marks[obj.slot]) == obj.generation

    def _free_object(self, obj: StoredObject) -> None:
        """Forget ``obj`` and give its memory back; its generation word is cleared first, so a reader that
        copied from it learns that its bytes may be overwritten from now on."""
        del self._objects[obj.digest]
        self.generations[obj.slot] = 0
        self._free_slots.append(obj.slot)
        self._free.free(obj.offset, obj.nbytes)

    def commit(self, obj: StoredObject) -> None:
        with self._lock:
            self.landed[obj.slot] = ALL_LAYERS
            obj.committed = True
            obj.locks -= 1

    # --- filling from the shared tier ------------------------------------------------

    def publish_filling(self, obj: StoredObject) -> None:
        """Make a reserved object visible to LOOKUP before its bytes are in; its fill keeps the reservation's
        lock until :meth:`end_fill`, and says what has landed with :meth:`set_landed`."""
        with self._lock:
            obj.committed = True
            obj.filling = True

    def set_landed(self, obj: StoredObject, layers: int) -> None:
        """The first ``layers`` layers (K and V) of a filling object are in the pool."""
        with self._landed_changed:
            self.landed[obj.slot] = layers
            self._landed_changed.notify_all()

    def end_fill(self, obj: StoredObject, complete: bool) -> None:
        """A fill is over: with every layer in (``complete``) the object is like any other; else it fails (its
        generation word is cleared, no LOOKUP finds it, and it is freed once its last lock goes)."""
        with self._landed_changed:
            obj.filling = False
            if complete:
                self.landed[obj.slot] = ALL_LAYERS
            else:
                obj.committed = False
                obj.failed = True
                self.generations[obj.slot] = 0
            obj.locks -= 1
            self._free_if_failed(obj)
            self._landed_changed.notify_all()

    def wait_landed(self, objects: Sequence[StoredObject], layers: int, timeout: float) -> None:
        """Wait until the first ``layers`` layers of every one of ``objects`` are in the pool; raises
        :class:`FillFailed` if a fill failed, TimeoutError after ``timeout`` seconds."""
        def ready() -> bool:
            return any(o.failed for o in objects) or all(int(self.landed[o.slot]) >= layers for o in objects)

        with self._landed_changed:
            if not self._landed_changed.wait_for(ready, timeout):
                raise TimeoutError(f"layers of {len(objects)} chunks still arriving from the shared tier after "
                                   f"{timeout:g} s")
            failed = [o for o in objects if o.failed]
        if failed:
            raise FillFailed(f"chunk {failed[0].digest.hex()[:12]} did not arrive whole from the shared tier")

    def _free_if_failed(self, obj: StoredObject) -> None:
        if obj.failed and obj.locks == 0 and self._objects.get(obj.digest) is obj:
            self._free_object(obj)

    def abandon(self, obj: StoredObject) -> None:
        """Drop a reserved object whose bytes never arrived."""
        with self._lock:
            if self._objects.get(obj.digest) is obj:
                self._free_object(obj)

    def _evict_one(self) -> bool:
        for obj in self._objects.values():
            if obj.locks == 0 and (obj.committed or obj.failed):
                self._free_object(obj)
                self.evictions += 1
                return True
        return False

    # --- stats -----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "capacity_bytes": self.capacity,
                "free_bytes": self._free.free_bytes,
                "objects": len(self._objects),
                "locked_objects": sum(1 for o in self._objects.values() if o.locks > 0),
                "evictions": self.evictions,
            }

    def close(self) -> None:
        del self.pool
        del self.generations
        del self.store_marks
        self.segment.destroy()
        self.generation_segment.destroy()
        self.store_mark_segment.destroy()
