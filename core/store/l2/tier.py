"""The server's side of the shared tier: committed chunks written behind to the tier, and chunks past the end of
an L1 hit fetched from it.

Writes never hold up a STORE: :meth:`SharedTier.offer` pins the committed objects (so eviction cannot take
their bytes) and queues them; one writer thread encodes them straight from the pool and sends them in batches.
The queue is bounded in bytes: when the tier is slower than the stores, further objects are skipped and
counted, not waited for. Reads are bounded by the backend's timeout; whatever does not check out
(:mod:`kvstrata.core.store.l2.value`) ends the run of fetched chunks there, counted by reason. Only a
contiguous run from the first chunk asked for is returned, so a load never has a hole.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from kvstrata.core.latency import LatencyHistogram
from kvstrata.core.store.l1_store import L1Store, StoredObject, StoreFull
from kvstrata.core.store.l2.backend import TierBackend, TierUnavailable
from kvstrata.core.store.l2.value import TierKey, TierMiss, decode, encode

log = logging.getLogger(__name__)

WRITE_BATCH_BYTES = 16 << 20
"""How much one write to the tier carries at most (one pipeline per node)."""


class ShardOf(Protocol):
    """What of a request's key names the model shard (a :class:`~kvstrata.core.store.keys.CacheKey` is one)."""

    model: str
    world_size: int
    rank: int
    salt: str | None


@dataclass
class _Queued:
    obj: StoredObject
    key: TierKey


class SharedTier:
    """One server's use of a tier backend: write-behind of committed objects, fetches past an L1 hit."""

    def __init__(self, backend: TierBackend, store: L1Store, *, write_queue_bytes: int = 256 << 20,
                 namespace: str = "kvstrata") -> None:
        self.backend = backend
        self.store = store
        self.write_queue_bytes = write_queue_bytes
        self.namespace = namespace
        self.counts: collections.Counter[str] = collections.Counter()
        """written, written_bytes, write_skipped (queue full), write_failed, fetched, fetched_bytes, misses by
        reason (``miss_<reason>``, ``miss_absent``, ``miss_unavailable``)."""
        self._counts_lock = threading.Lock()
        self.fetch_seconds = LatencyHistogram()
        self.write_seconds = LatencyHistogram()
        self._queue: collections.deque[_Queued] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._writer = threading.Thread(target=self._write_loop, name="kvstrata-l2-writer", daemon=True)
        self._writer.start()

    def _bump(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self.counts[name] += n

    # --- writes ------------------------------------------------------------------------------

    def offer(self, objects: Sequence[tuple[StoredObject, TierKey]]) -> None:
        """Queue committed objects for the tier (each pinned until written); those that do not fit the queue's
        bound are skipped and counted."""
        taken = []
        with self._cond:
            for obj, key in objects:
                if self._stopping or self._queued_bytes + obj.nbytes > self.write_queue_bytes:
                    self._bump("write_skipped", 1)
                    continue
                taken.append(_Queued(obj, key))
                self._queued_bytes += obj.nbytes
            if taken:
                self.store.pin([q.obj for q in taken])
                self._queue.extend(taken)
                self._cond.notify()

    def queued_bytes(self) -> int:
        with self._cond:
            return self._queued_bytes

    def wait_written(self, timeout: float) -> bool:
        """Whether every offered object was written (or given up on) within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued_bytes == 0, timeout)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                batch, size = [], 0
                while self._queue and (not batch or size + self._queue[0].obj.nbytes <= WRITE_BATCH_BYTES):
                    q = self._queue.popleft()
                    batch.append(q)
                    size += q.obj.nbytes
            try:
                started = time.perf_counter()
                values = [(q.key.name(self.namespace), encode(q.key, self.store.object_bytes(q.obj))) for q in batch]
                self.backend.set_many(values)
                self.write_seconds.observe(time.perf_counter() - started)
                self._bump("written", len(batch))
                self._bump("written_bytes", size)
            except (TierUnavailable, OSError, ValueError) as exc:
                self._bump("write_failed", len(batch))
                log.warning("shared tier: %d chunks not written: %s", len(batch), exc)
            finally:
                self.store.unpin([q.obj for q in batch])
                with self._cond:
                    self._queued_bytes -= size
                    self._cond.notify_all()

    # --- reads -------------------------------------------------------------------------------

    def fetch(self, keys: Sequence[TierKey]) -> list[memoryview]:
        """The payloads of the longest run of ``keys`` from the first that the tier holds and that check out."""
        if not keys:
            return []
        started = time.perf_counter()
        try:
            values = self.backend.get_many([k.name(self.namespace) for k in keys])
            self.fetch_seconds.observe(time.perf_counter() - started)
        except TierUnavailable as exc:
            self._bump("miss_unavailable", 1)
            log.warning("shared tier: lookup of %d chunks: %s", len(keys), exc)
            return []
        payloads = []
        for key, value in zip(keys, values):
            if value is None:
                self._bump("miss_absent", 1)
                break
            try:
                payloads.append(decode(key, value))
            except TierMiss as miss:
                self._bump(f"miss_{miss.reason.value}", 1)
                log.warning("shared tier: chunk %s is not used: %s", key.chunk_hash.hex()[:12], miss)
                break
        self._bump("fetched", len(payloads))
        self._bump("fetched_bytes", sum(len(p) for p in payloads))
        return payloads

    # --- in the server's terms -----------------------------------------------------------------

    @staticmethod
    def key(shard: ShardOf, digest: bytes, num_tokens: int, shape: tuple[int, int, int, int],
            dtype: str) -> TierKey:
        return TierKey(model=shard.model, world_size=shard.world_size, rank=shard.rank, salt=shard.salt,
                       shape=tuple(shape), dtype=dtype, num_tokens=num_tokens, chunk_hash=digest)

    def offer_committed(self, shard: ShardOf, dtype: str, objects: Sequence[StoredObject]) -> None:
        """Queue objects a STORE of ``shard``'s prompt just committed."""
        self.offer([(obj, self.key(shard, obj.digest, obj.num_tokens, obj.shape_signature, dtype))
                    for obj in objects])

    def fill(self, shard: ShardOf, digests: Sequence[bytes], token_counts: Sequence[int],
             shape: tuple[int, int, int, int], dtype: str) -> int:
        """Fetch the chunks ``digests`` (the run right after an L1 hit) into L1, committed, in order, as far as
        the tier holds them, they check out and the pool has room; returns how many are now in L1."""
        keys = [self.key(shard, d, n, shape, dtype) for d, n in zip(digests, token_counts)]
        filled = 0
        for key, payload in zip(keys, self.fetch(keys)):
            nbytes = key.payload_bytes
            if len(payload) != nbytes:
                self._bump("miss_size", 1)
                break
            try:
                obj = self.store.reserve(key.chunk_hash, key.num_tokens, nbytes, key.shape)
            except StoreFull:
                self._bump("fill_no_room", 1)
                break
            if obj is None:  # stored meanwhile (or being stored: then not a hit yet, and the run ends)
                if self.store.is_pending(key.chunk_hash):
                    break
                filled += 1
                continue
            try:
                self.store.object_bytes(obj)[:] = payload
            except BaseException:
                self.store.abandon(obj)
                raise
            self.store.commit(obj)
            filled += 1
        return filled

    def stats(self) -> dict[str, int]:
        with self._cond, self._counts_lock:
            return {**self.counts, "write_queue_bytes": self._queued_bytes}

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._writer.join(timeout=30)
        self.store.unpin([q.obj for q in left])
        self.backend.close()
