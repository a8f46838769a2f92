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
from typing import Callable, Protocol, Sequence

import numpy as np

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
BAD_VALUES_KEPT = 4096
"""How many names of values that did not check out a server remembers."""


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
    """One fill: the run of chunks whose every layer group the tier holds, published in L1 before their bytes
    are in (each object's landed word then rises group by group), and ended complete or failed."""

    def __init__(self, store: L1Store, keys: Sequence[Sequence[TierKey]]) -> None:
        self.store = store
        self.keys = keys
        self.objects: list[StoredObject | None] = []
        """Per chunk of the run: its object while it fills (None: L1 held it already, or its fill ended)."""
        self.groups_in: list[int] = []
        self.run = 0
        self.completed = 0
        self.completed_bytes = 0

    def publish(self, chunks: int) -> int:
        """Reserve and publish the first ``chunks`` objects, as far as the pool has room and none is being
        stored meanwhile; returns how many are published (or were in L1 already)."""
        for groups in self.keys[:chunks]:
            key = groups[0]
            try:
                obj = self.store.reserve(key.chunk_hash, key.num_tokens, key.object_bytes, key.shape)
            except StoreFull:
                break
            if obj is None and self.store.is_pending(key.chunk_hash):  # a STORE's bytes still on the way
                break
            if obj is not None:
                self.store.publish_filling(obj)
            self.objects.append(obj)
        self.groups_in = [0] * len(self.objects)
        self.run = len(self.objects)
        return self.run

    def target(self, chunk: int) -> StoredObject | None:
        """The object chunk's values are copied into (None: nothing to copy, L1 held it or it failed)."""
        return self.objects[chunk] if chunk < self.run else None

    def group_landed(self, chunk: int, key: TierKey) -> None:
        """``key``'s group of chunk is in the pool (the groups before it too: they are read in order)."""
        obj = self.objects[chunk]
        self.groups_in[chunk] += 1
        if self.groups_in[chunk] < len(self.keys[chunk]):
            self.store.set_landed(obj, key.layers[1])
            return
        self.store.end_fill(obj, complete=True)
        self.objects[chunk] = None
        self.completed += 1
        self.completed_bytes += key.object_bytes

    def fail_from(self, chunk: int) -> bool:
        """End the run before ``chunk``: its objects and those after it fail. Whether that shortened it."""
        if chunk >= self.run:
            return False
        for i in range(chunk, self.run):
            if self.objects[i] is not None:
                self.store.end_fill(self.objects[i], complete=False)
                self.objects[i] = None
        self.run = chunk
        return True


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
        (``miss_<value.MissReason>``, ``miss_absent``, ``miss_known_bad``, ``miss_unavailable``, ``miss_no_room``),
        once per fill."""
        self._counts_lock = threading.Lock()
        self.fetch_seconds = LatencyHistogram()
        self.write_seconds = LatencyHistogram()
        self._queue: collections.deque[_Queued] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._writer = threading.Thread(target=self._write_loop, name="kvstrata-l2-writer", daemon=True)
        self._writer.start()
        self._filler = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstrata-l2-fill")
        """Streams published fills' bytes in, one fill after another, in the order their LOOKUPs came."""
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstrata-l2-reader")
        """Reads the next batch of a fill while the fill's thread checks and copies the one before."""
        self._direct = backend.direct_reader()
        """Reads values straight into the pool where the backend can (used by the fill thread alone); None:
        the client's reads, copied in."""
        self._fills_open = 0
        self._fills_changed = threading.Condition()
        self._bad: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Names whose value did not check out when read (the latest :data:`BAD_VALUES_KEPT`): a later fill
        ends its run before them instead of failing a load on them again; this server's own write of one
        clears it."""
        self._bad_lock = threading.Lock()
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
                with self._bad_lock:
                    for name, _ in values:
                        self._bad.pop(name, None)
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
             shape: tuple[int, int, int, int], dtype: str,
             before_streaming: Callable[[], None] | None = None) -> int:
        """Bring the chunks ``digests`` (the run right after an L1 hit) into L1 from the tier, as far as it
        holds every layer group of them and the pool has room; returns how many are now in L1 or on their way.

        Only which values the tier holds is asked here (one round trip per node); the objects are then
        published in L1 at once, filling, and their bytes read behind, the first layer group of every chunk
        first (:meth:`_stream`), so that the load of a LOOKUP's hit starts on its first layers while the rest
        still arrive. A value that then does not check out, or a read that fails, fails the chunk's object and
        the ones after it: a load waiting on them fails and the engine recomputes those blocks.

        ``before_streaming`` runs once the run is published and before any of its values is read (also when
        nothing was published): a LOOKUP takes its locks there, so that the hit it reports is the run it then
        loads, whole or failed, never one a fast failure already cut short. The stream starts even if it raises.
        """
        fill = self._publish(shard, digests, token_counts, shape, dtype)
        try:
            if before_streaming is not None:
                before_streaming()
        finally:
            if fill is not None:
                self._start(fill)
        return fill.run if fill is not None else 0

    def _publish(self, shard: ShardOf, digests: Sequence[bytes], token_counts: Sequence[int],
                 shape: tuple[int, int, int, int], dtype: str) -> _Fill | None:
        """The run of ``digests`` the tier holds whole, published filling in L1 (None: nothing to read)."""
        if not digests or self._closed.is_set():
            return None
        self._bump("asked", len(digests))
        keys = [self.object_keys(shard, d, n, shape, dtype) for d, n in zip(digests, token_counts)]
        try:
            held = self.backend.exists_many([k.name(self.namespace) for groups in keys for k in groups])
        except TierUnavailable as exc:
            self._bump("miss_unavailable", 1)
            log.warning("shared tier: looking up %d chunks: %s", len(keys), exc)
            return None
        with self._bad_lock:
            bad = [k.name(self.namespace) in self._bad for groups in keys for k in groups]
        run, at = 0, 0
        for groups in keys:
            if not all(held[at:at + len(groups)]):
                self._bump("miss_absent", 1)
                break
            if any(bad[at:at + len(groups)]):
                self._bump("miss_known_bad", 1)
                break
            run, at = run + 1, at + len(groups)
        fill = _Fill(self.store, keys[:run])
        published = fill.publish(run)
        if published < run:
            self._bump("miss_no_room", 1)
        return fill if published else None

    def _start(self, fill: _Fill) -> None:
        """Stream a published fill in on the fill thread (failed at once if the tier is closing)."""
        with self._fills_changed:
            self._fills_open += 1
        try:
            self._filler.submit(self._stream, fill)
        except RuntimeError:  # closed meanwhile: nothing will stream them in
            fill.fail_from(0)
            with self._fills_changed:
                self._fills_open -= 1
                self._fills_changed.notify_all()

    def _stream(self, fill: _Fill) -> None:
        """Read a published fill's values into its objects and end every one of them, complete or failed,
        whatever happens."""
        batches = self._read_order(fill.keys[:fill.run]) if fill.run else []
        try:
            if self._direct is not None:
                self._stream_direct(fill, batches)
            else:
                self._stream_through_client(fill, batches)
        except BaseException as exc:  # noqa: BLE001 - on this thread nobody else would see it
            log.error("shared tier: a fill stopped: %s: %s", type(exc).__name__, exc)
        finally:
            fill.fail_from(0)  # whatever has not arrived whole by now never will
            self._bump("fetched", fill.completed)
            self._bump("fetched_bytes", fill.completed_bytes)
            with self._fills_changed:
                self._fills_open -= 1
                self._fills_changed.notify_all()

    def _stream_direct(self, fill: _Fill, batches: list[list[tuple[int, TierKey]]]) -> None:
        """Each batch's values received straight into the objects (:mod:`.valkey_reader`), then landed in the
        batch's order (a layer group after the ones before it)."""
        for batch in batches:
            if self._closed.is_set():
                return
            wanted = [(chunk, key) for chunk, key in batch if fill.target(chunk) is not None]
            if not wanted:
                continue
            items = [(key.name(self.namespace), key, self.store.object_bytes(fill.target(chunk)))
                     for chunk, key in wanted]
            started = time.perf_counter()
            try:
                outcomes = self._direct.read_into(items)
            except TierUnavailable as exc:
                log.warning("shared tier: reading %d values: %s", len(items), exc)
                if fill.fail_from(min(chunk for chunk, _ in wanted)):
                    self._bump("miss_unavailable", 1)
                continue
            self.fetch_seconds.observe(time.perf_counter() - started)
            for (chunk, key), outcome in zip(wanted, outcomes):
                if fill.target(chunk) is None:
                    continue  # failed meanwhile, by an earlier value of this batch
                if outcome.landed:
                    fill.group_landed(chunk, key)
                elif outcome.redirected:  # moved by a resharding: the client follows it
                    values = self._get([key])
                    if values is None:
                        if fill.fail_from(chunk):
                            self._bump("miss_unavailable", 1)
                    else:
                        self._take_value(fill, chunk, key, values[0])
                elif outcome.absent:
                    self._missing(fill, chunk)
                else:
                    self._bad_value(fill, chunk, key, outcome.miss)

    def _stream_through_client(self, fill: _Fill, batches: list[list[tuple[int, TierKey]]]) -> None:
        """The client's reads (the next batch read while this thread checks and copies the one before)."""
        reads: dict[int, concurrent.futures.Future] = {}

        def read_ahead(first: int) -> None:
            for j in range(first, min(first + READ_AHEAD, len(batches))):
                if j not in reads and any(fill.target(chunk) is not None for chunk, _ in batches[j]):
                    reads[j] = self._reader.submit(self._get, [key for _, key in batches[j]])

        try:
            for i, batch in enumerate(batches):
                if self._closed.is_set():
                    return
                read_ahead(i)
                if i not in reads:
                    continue  # nothing in it is still wanted
                values = reads.pop(i).result()
                read_ahead(i + 1)
                if values is None:
                    if fill.fail_from(min(chunk for chunk, _ in batch)):
                        self._bump("miss_unavailable", 1)
                    continue
                for (chunk, key), value in zip(batch, values):
                    if fill.target(chunk) is not None:
                        self._take_value(fill, chunk, key, value)
        finally:
            for read in reads.values():
                read.cancel()

    def wait_fills(self, timeout: float) -> bool:
        """Whether every fill begun has ended (complete or failed) within ``timeout`` seconds."""
        with self._fills_changed:
            return self._fills_changed.wait_for(lambda: self._fills_open == 0, timeout)

    def _take_value(self, fill: _Fill, chunk: int, key: TierKey, value: bytes | None) -> None:
        """One value the client read for a chunk still filling: checked, copied into its object, landed."""
        if value is None:  # gone since the fill looked (evicted by the tier, say)
            self._missing(fill, chunk)
            return
        try:
            payload = decode(key, value)
        except TierMiss as miss:
            self._bad_value(fill, chunk, key, miss)
            return
        data, source, at = np.frombuffer(self.store.object_bytes(fill.target(chunk)), np.uint8), \
            np.frombuffer(payload, np.uint8), 0
        for a, b in key.payload_ranges():
            np.copyto(data[a:b], source[at:at + b - a])  # without the GIL, which the reader's parsing needs
            at += b - a
        fill.group_landed(chunk, key)

    def _missing(self, fill: _Fill, chunk: int) -> None:
        if fill.fail_from(chunk):
            self._bump("miss_absent", 1)

    def _bad_value(self, fill: _Fill, chunk: int, key: TierKey, miss: TierMiss) -> None:
        """A value that did not check out: its chunk and those after it fail, and it is remembered."""
        log.warning("shared tier: chunk %s layers %s is not used: %s", key.chunk_hash.hex()[:12], key.layers, miss)
        with self._bad_lock:
            self._bad[key.name(self.namespace)] = None
            while len(self._bad) > BAD_VALUES_KEPT:
                self._bad.popitem(last=False)
        if fill.fail_from(chunk):
            self._bump(f"miss_{miss.reason.value}", 1)

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
        self._filler.shutdown(wait=True)  # every fill ends, its objects complete or failed
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._health.join(timeout=30)
        if self._direct is not None:
            self._direct.close()
        self.store.unpin([q.obj for q in left])
        self.backend.close()
