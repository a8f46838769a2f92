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
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from kvstrata.core.latency import LatencyHistogram
from kvstrata.core.store.l1_store import L1Store, StoredObject, StoreFull
from kvstrata.core.store.l2.backend import TierBackend, TierUnavailable
from kvstrata.core.store.l2.value import TierKey, TierMiss, decode, encode, layer_groups

log = logging.getLogger(__name__)

WRITE_BATCH_BYTES = 16 << 20
"""How much one write to the tier carries at most (one pipeline per node)."""
FETCH_BATCH_BYTES = 64 << 20
"""How much one read from the tier carries at most (one pipeline per node)."""
READ_AHEAD = 2
"""Reads of a fill queued ahead of the batch being checked and copied."""
HEALTH_INTERVAL = 5.0
"""Seconds between checks of the tier's nodes."""


class ShardOf(Protocol):
    """What of a request's key names the model shard (a :class:`~kvstrata.core.store.keys.CacheKey` is one)."""

    model: str
    world_size: int
    rank: int
    salt: str | None


@dataclass
class _Queued:
    obj: StoredObject
    keys: list[TierKey]
    """One per layer group of the object."""


class _Fill:
    """One fill's objects, reserved in L1 as their first layer group arrives and committed once all have."""

    def __init__(self, store: L1Store, keys: Sequence[Sequence[TierKey]]) -> None:
        self.store = store
        self.keys = keys
        self.run = len(keys)
        """The chunks before this one can still all arrive; a miss anywhere lowers it."""
        self.objects: list[StoredObject | None] = []
        """Per chunk, in order, once its first group arrived: its reserved object (None: already in L1)."""

    def end_run(self, chunk: int) -> bool:
        """End the run before ``chunk``; whether that shortened it (what ended it is then counted)."""
        if chunk >= self.run:
            return False
        self.run = chunk
        return True

    def target(self, chunk: int) -> StoredObject | None | bool:
        """The object chunk's values go into; None where L1 already holds it, False where the run ends."""
        while len(self.objects) <= chunk and len(self.objects) < self.run:
            key = self.keys[len(self.objects)][0]
            try:
                obj = self.store.reserve(key.chunk_hash, key.num_tokens, key.object_bytes, key.shape)
            except StoreFull:
                return False
            if obj is None and self.store.is_pending(key.chunk_hash):  # being stored: not a hit yet
                return False
            self.objects.append(obj)
        return self.objects[chunk] if chunk < len(self.objects) else False

    def finish(self) -> int:
        """Commit the run's objects, drop the rest; returns the run's length."""
        self.run = min(self.run, len(self.objects))
        for i, obj in enumerate(self.objects):
            if obj is not None:
                (self.store.commit if i < self.run else self.store.abandon)(obj)
        return self.run

    def abandon(self) -> None:
        for obj in self.objects:
            if obj is not None:
                self.store.abandon(obj)


class SharedTier:
    """One server's use of a tier backend: write-behind of committed objects, fetches past an L1 hit."""

    def __init__(self, backend: TierBackend, store: L1Store, *, write_queue_bytes: int = 256 << 20,
                 namespace: str = "kvstrata") -> None:
        self.backend = backend
        self.store = store
        self.write_queue_bytes = write_queue_bytes
        self.namespace = namespace
        self.counts: collections.Counter[str] = collections.Counter()
        """written, written_bytes, write_skipped (queue full), write_failed (chunks); asked (chunks looked for
        past an L1 hit), fetched (chunks), fetched_bytes; and per reason a run of fetched chunks ended for
        (``miss_<value.MissReason>``, ``miss_absent``, ``miss_unavailable``, ``miss_no_room``), once per fill."""
        self._counts_lock = threading.Lock()
        self.fetch_seconds = LatencyHistogram()
        self.write_seconds = LatencyHistogram()
        self._queue: collections.deque[_Queued] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._writer = threading.Thread(target=self._write_loop, name="kvstrata-l2-writer", daemon=True)
        self._writer.start()
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstrata-l2-reader")
        """Reads the next batch of a fill while the LOOKUP's thread checks and copies the one before."""
        self.nodes: list[dict] = []
        """The backend's nodes as last checked (every :data:`HEALTH_INTERVAL` seconds), for ``kvstrata status``:
        asking them on SERVER_INFO would hold the server's request loop for a node that does not answer."""
        self._closed = threading.Event()
        self._health = threading.Thread(target=self._check_nodes, name="kvstrata-l2-health", daemon=True)
        self._health.start()

    def _check_nodes(self) -> None:
        while not self._closed.is_set():
            try:
                self.nodes = self.backend.describe()["nodes"]
            except Exception as exc:  # noqa: BLE001 - the next check may do better; status shows the last one
                log.debug("shared tier: checking its nodes: %s", exc)
            self._closed.wait(HEALTH_INTERVAL)

    def _bump(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self.counts[name] += n

    # --- writes ------------------------------------------------------------------------------

    def offer(self, objects: Sequence[tuple[StoredObject, list[TierKey]]]) -> None:
        """Queue committed objects for the tier, each with its layer groups' keys (each object pinned until
        written); those that do not fit the queue's bound are skipped and counted."""
        taken = []
        with self._cond:
            for obj, keys in objects:
                if self._stopping or self._queued_bytes + obj.nbytes > self.write_queue_bytes:
                    self._bump("write_skipped", 1)
                    continue
                taken.append(_Queued(obj, keys))
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
                values = []
                for q in batch:
                    data = self.store.object_bytes(q.obj)
                    values += [(key.name(self.namespace), encode(key, *(data[a:b] for a, b in key.payload_ranges())))
                               for key in q.keys]
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

    def _get(self, keys: Sequence[TierKey]) -> list[bytes | None] | None:
        """The values under ``keys`` (None where absent), or None where the tier did not answer in time."""
        started = time.perf_counter()
        try:
            values = self.backend.get_many([k.name(self.namespace) for k in keys])
        except TierUnavailable as exc:
            log.warning("shared tier: reading %d values: %s", len(keys), exc)
            return None
        self.fetch_seconds.observe(time.perf_counter() - started)
        return values

    @staticmethod
    def _read_order(keys: Sequence[Sequence[TierKey]]) -> list[list[tuple[int, TierKey]]]:
        """Batches of (chunk, key) near :data:`FETCH_BATCH_BYTES`: the first layer group of every chunk, then the
        second of every chunk, and so on, so that a prefix's first layers are in L1 before its last."""
        order = [(chunk, groups[g]) for g in range(max(map(len, keys)))
                 for chunk, groups in enumerate(keys) if g < len(groups)]
        batches: list[list[tuple[int, TierKey]]] = [[]]
        size = 0
        for chunk, key in order:
            if batches[-1] and size + key.payload_bytes > FETCH_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append((chunk, key))
            size += key.payload_bytes
        return batches

    # --- in the server's terms -----------------------------------------------------------------

    @staticmethod
    def object_keys(shard: ShardOf, digest: bytes, num_tokens: int, shape: tuple[int, int, int, int],
                    dtype: str) -> list[TierKey]:
        """The keys of an object's layer groups (:func:`~kvstrata.core.store.l2.value.layer_groups`)."""
        return [TierKey(model=shard.model, world_size=shard.world_size, rank=shard.rank, salt=shard.salt,
                        shape=tuple(shape), dtype=dtype, num_tokens=num_tokens, chunk_hash=digest, layers=group)
                for group in layer_groups(tuple(shape), num_tokens)]

    def offer_committed(self, shard: ShardOf, dtype: str, objects: Sequence[StoredObject]) -> None:
        """Queue objects a STORE of ``shard``'s prompt just committed."""
        self.offer([(obj, self.object_keys(shard, obj.digest, obj.num_tokens, obj.shape_signature, dtype))
                    for obj in objects])

    def fill(self, shard: ShardOf, digests: Sequence[bytes], token_counts: Sequence[int],
             shape: tuple[int, int, int, int], dtype: str) -> int:
        """Fetch the chunks ``digests`` (the run right after an L1 hit) into L1, committed, in order, as far as
        the tier holds every layer group of them, they check out and the pool has room; returns how many are now
        in L1. The next batch is read while this thread checks and copies the one before."""
        if not digests:
            return 0
        self._bump("asked", len(digests))
        fill = _Fill(self.store, [self.object_keys(shard, d, n, shape, dtype) for d, n in zip(digests, token_counts)])
        batches = self._read_order(fill.keys)
        reads: dict[int, concurrent.futures.Future] = {}

        def read_ahead(first: int) -> None:
            for j in range(first, min(first + READ_AHEAD, len(batches))):
                if j not in reads and any(chunk < fill.run for chunk, _ in batches[j]):
                    reads[j] = self._reader.submit(self._get, [key for _, key in batches[j]])

        try:
            for i, batch in enumerate(batches):
                read_ahead(i)
                if i not in reads:
                    continue  # every chunk in it is past the run's end
                values = reads.pop(i).result()
                read_ahead(i + 1)
                if values is None:
                    if fill.end_run(min(chunk for chunk, _ in batch)):
                        self._bump("miss_unavailable", 1)
                else:
                    self._copy_batch(fill, batch, values)
        except BaseException:
            fill.abandon()
            raise
        finally:
            for read in reads.values():
                read.cancel()
        filled = fill.finish()
        self._bump("fetched", filled)
        self._bump("fetched_bytes", sum(k.payload_bytes for groups in fill.keys[:filled] for k in groups))
        return filled

    def _copy_batch(self, fill: _Fill, batch: list[tuple[int, TierKey]], values: list[bytes | None]) -> None:
        for (chunk, key), value in zip(batch, values):
            if chunk >= fill.run:
                continue
            if value is None:
                if fill.end_run(chunk):
                    self._bump("miss_absent", 1)
                continue
            try:
                payload = decode(key, value)
            except TierMiss as miss:
                log.warning("shared tier: chunk %s layers %s is not used: %s", key.chunk_hash.hex()[:12],
                            key.layers, miss)
                if fill.end_run(chunk):
                    self._bump(f"miss_{miss.reason.value}", 1)
                continue
            obj = fill.target(chunk)
            if obj is False:
                if fill.end_run(chunk):
                    self._bump("miss_no_room", 1)
                continue
            if obj is None:
                continue  # L1 holds it already
            data, at = self.store.object_bytes(obj), 0
            for a, b in key.payload_ranges():
                data[a:b] = payload[at:at + b - a]
                at += b - a

    def stats(self) -> dict:
        with self._cond, self._counts_lock:
            return {**self.counts, "write_queue_bytes": self._queued_bytes, "nodes": list(self.nodes)}

    def close(self) -> None:
        self._closed.set()
        with self._cond:
            self._stopping = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._writer.join(timeout=30)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._health.join(timeout=30)
        self.store.unpin([q.obj for q in left])
        self.backend.close()
