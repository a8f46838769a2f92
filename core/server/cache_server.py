"""The cache server: protocol handlers over the L1 store, registered engine caches and the planner.

Each handler takes exactly its request type's declared payload items (checked
at registration). Handlers that move bytes run on the transport's transfer
threads; every failure becomes an error reply naming the request type, and the
server keeps serving. A retrieve that fails part-way marks its arrival-board
slot failed, so a worker that released the request early learns it at once
instead of waiting out its timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from kvstrata.core.transfer import planner
from kvstrata.core.arrival.board import ArrivalBoard, pack
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.store.l1_store import FILL_WAIT_S, L1Store, StoreFull, StoredObject
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE, LayoutError, PagedKVLayout
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.server.config import ServerConfig
from kvstrata.core.server.connections import Connection
from kvstrata.core.server.metrics import ServerMetrics
from kvstrata.core.server.targets import Completion, HostSignal, Target, TargetOpener, open_target
from kvstrata.core.shm import SegmentKindError, sweep_stale_segments
from kvstrata.core.wire.transport import Server

if TYPE_CHECKING:  # the shared tier needs the l2 extra: imported only when configured
    from kvstrata.core.store.l2.tier import SharedTier

log = logging.getLogger(__name__)

VERSION = "0.1.0"


@dataclass
class _Reservation:
    """L1 objects an engine copies a prompt's chunks into itself (engine placement); uncommitted until it marks
    them stored (:meth:`~kvstrata.core.store.l1_store.L1Store.marked_stored`) or sends COMMIT_STORE, so no
    LOOKUP sees them and no eviction frees them meanwhile."""

    instance_id: int
    owner: bytes | None
    key: CacheKey
    """The STORE's key: its request, and the model shard that names the objects in the shared tier."""
    objects: list[tuple[StoredObject, int]]
    """(object, tokens)"""
    connection: Connection | None = None

    @property
    def request_id(self) -> str:
        return self.key.request_id

    @property
    def nbytes(self) -> int:
        return sum(obj.nbytes for obj, _ in self.objects)


@dataclass
class _Instance:
    instance_id: int
    layout: PagedKVLayout
    placement: str
    target: Target
    owner: bytes | None
    """The connection that registered it (its routing id): the only one that may use or unregister it.
    None when registered from inside the server process (tests calling handlers directly)."""
    connection: Connection | None = None
    transfers: int = 0
    """STOREs and RETRIEVEs using its target now: it is closed only once they have ended."""
    retired: bool = False
    """Unregistered or replaced: its target closes when the last transfer using it ends."""
    layer_major_fallback: str | None = None
    """Why this server-placement instance's layer-major retrieves run chunk-major (None: they need not),
    decided once at registration from its layout and target, and told to the engine in the reply."""


class RequestError(ValueError):
    """A well-formed request that cannot be served (unknown instance, bad block ids, ...)."""


class NotYours(RequestError):
    """The request names state another connection holds (its lock owner, instance or reservation)."""

    error_code = "not_owner"


class LimitExceeded(RequestError):
    """A per-connection bound (a server setting, named in the message) would be exceeded."""

    error_code = "limit"


_OWNER_INSTANCE = re.compile(r"@i(\d+)(?!.*@i\d)")
"""The instance id a lock owner names (``request@iN``, see ``kvstrata.core.engine.requests.lock_owner``)."""


def instance_of_lock_owner(owner: str) -> int | None:
    m = _OWNER_INSTANCE.search(owner)
    return int(m.group(1)) if m else None


class InstanceTaken(RequestError):
    """The instance id is registered by another live connection: the engine must use another id."""

    error_code = "instance_taken"


class UnknownInstance(RequestError):
    """The instance is not registered here: the engine registers its cache again (error code on the wire)."""

    error_code = "unknown_instance"


@dataclass
class _RetrievePlan:
    """A checked server-placement retrieve, ready to copy."""

    objects: list[StoredObject]
    job: planner.TransferJob
    events: list[Any] | None
    end_events: list[Any] | None
    """The engine's event to record after every copy (RETRIEVE's event_handle), opened."""
    width: int
    fallback: str | None


class CacheServer:
    def __init__(self, config: ServerConfig, target_openers: Mapping[str, TargetOpener] | None = None, *,
                 slice_observer: planner.SliceObserver | None = None) -> None:
        """``target_openers``: region kinds beyond shared memory this server can write into, by kind
        (``kvstrata serve`` passes :func:`kvstrata.native.target_openers`: CUDA IPC). ``slice_observer``: told
        of each server-placement transfer's slices as they are enqueued
        (:data:`~kvstrata.core.transfer.planner.SliceObserver`)."""
        config.check()
        self.config = config
        self.limits = config.limits
        self.target_openers = dict(target_openers or {})
        self._slice_observer = slice_observer
        sweep_stale_segments()  # what crashed servers and engines left behind
        self.store = L1Store(config.l1_bytes)
        self.tier: SharedTier | None = None
        """The shared tier (``--l2``), if configured."""
        if config.l2:
            try:
                from kvstrata.core.store.l2 import tier as l2_tier
                from kvstrata.core.store.l2.choose_backend import open_backend

                self.tier = l2_tier.SharedTier(open_backend(config.l2, password_file=config.l2_password_file,
                                                            timeout=config.l2_timeout), self.store,
                                       write_queue_bytes=config.l2_write_queue)
            except ModuleNotFoundError as exc:
                self.store.close()
                raise ValueError(f"--l2 needs the shared tier's packages (pip install 'kvstrata[l2]'): {exc}") \
                    from None
            except BaseException:
                self.store.close()
                raise
            log.info("shared tier %s: committed chunks are written behind to it, hits past L1 read from it",
                     config.l2)
        self._instances: dict[int, _Instance] = {}
        self._connections: dict[bytes | None, Connection] = {}
        self._draining: list[_Instance] = []
        """Retired instances whose transfers have not ended yet (their targets stay open)."""
        self._graveyard: list[tuple[float, Callable[[], None]]] = []
        """(when parked, close) of what ended connections mapped (arrival boards): closed by the lease watcher a
        period later and only while no transfer is in flight, so no copy or device signal still reaches them (unregistering a segment the GPU signals into must not wait on a device that waits on us)."""
        self._looked_up: dict[str, tuple[CacheKey, list[bytes]]] = {}
        """Per lock owner holding lookup locks: its LOOKUP's key (cut to the hit) and digests, so RETRIEVE need
        not hash again."""
        self._reservations: dict[int, _Reservation] = {}
        self._next_reservation = 1
        self._lock = threading.RLock()
        self._leases = threading.Thread(target=self._watch_leases, name="kvstrata-leases", daemon=True)
        self._stopping = threading.Event()
        self.connections_ended = 0
        self._busy_polling = False
        self.transport = Server(config.address, transfer_threads=config.transfer_threads,
                                allow_remote=config.allow_remote,
                                max_message_bytes=config.max_message_bytes,
                                curve_secret_key=config.curve_secret_key, curve_clients=config.curve_clients)
        handlers = {
            RequestType.PING: self.ping,
            RequestType.SERVER_INFO: self.server_info,
            RequestType.REGISTER_KV_CACHE: self.register_kv_cache,
            RequestType.UNREGISTER_KV_CACHE: self.unregister_kv_cache,
            RequestType.LOOKUP: self.lookup,
            RequestType.STORE: self.store_kv,
            RequestType.RETRIEVE: self.retrieve,
            RequestType.FREE_LOOKUP_LOCKS: self.free_lookup_locks,
            RequestType.RESERVE_STORE: self.reserve_store,
            RequestType.COMMIT_STORE: self.commit_store,
        }
        self.metrics = ServerMetrics(self)
        self.metrics_port: int | None = None
        for rt, h in handlers.items():
            # a LOOKUP that may read the shared tier waits on the network: a transfer thread runs it, so the
            # thread that answers PING and the other quick requests is never held by it
            slow = rt == RequestType.LOOKUP and self.tier is not None
            self.transport.register(rt, self.metrics.instrument(rt, h), blocking=True if slow else None)

    @property
    def address(self) -> str:
        return self.transport.address

    def start(self) -> None:
        if self.config.metrics_port is not None:  # before any request is served: SERVER_INFO names the port
            host = "0.0.0.0" if self.config.allow_remote else "127.0.0.1"
            self.metrics_port = self.metrics.serve_http(host, self.config.metrics_port)
        self.transport.start()
        self._leases.start()
        log.info("kvstrata server %s listening on %s: L1 %d MiB in shared memory %s, chunk %d tokens, "
                 "%d transfer threads", VERSION, self.address, self.config.l1_bytes >> 20,
                 self.store.segment.name, self.config.chunk_size, self.config.transfer_threads)

    def stop(self) -> None:
        self._stopping.set()
        self.metrics.close()
        self.transport.stop()
        if self._leases.is_alive():
            self._leases.join(timeout=10)
        with self._lock:
            for inst in self._instances.values():
                inst.target.close()
            self._instances.clear()
            for conn in self._connections.values():
                for b in conn.boards.values():
                    b.close()
                conn.boards.clear()
            self._connections.clear()
            graveyard, self._graveyard = self._graveyard, []
        for _, close in graveyard:  # every transfer was settled by the transport's stop
            close()
        if self.tier is not None:
            self.tier.close()  # chunks still queued for it are dropped: the tier is a cache
        self.store.close()
        log.info("kvstrata server stopped; shared-memory segment %s removed", self.store.segment.name)

    # --- handlers --------------------------------------------------------------------

    def ping(self) -> str:
        return "pong"

    def state(self) -> dict[str, Any]:
        """What the server holds now: L1 use and every registered instance (for metrics and status)."""
        with self._lock:
            instances = [{"instance_id": i.instance_id, "format": i.layout.format, "placement": i.placement,
                          "device": i.target.device, "layers": i.layout.num_layers, "blocks": i.layout.num_blocks,
                          "block_size": i.layout.block_size, "transfers": i.transfers}
                         for i in sorted(self._instances.values(), key=lambda i: i.instance_id)]
        return {"l1": self.store.stats(), "instances": instances}

    def token_bytes(self, instance_id: int) -> int:
        """KV bytes of one token (every layer) in instance ``instance_id``'s cache; 0 if it is gone."""
        with self._lock:
            inst = self._instances.get(instance_id)
        return inst.layout.object_bytes(1) if inst is not None else 0

    def server_info(self) -> dict[str, Any]:
        state = self.state()
        return {"version": VERSION, "chunk_size": self.config.chunk_size,
                "uptime_s": round(time.time() - self.metrics.started_at, 3),
                "l1": state["l1"], "pool": self._pool_ref(),
                "instances": [i["instance_id"] for i in state["instances"]], "instance_details": state["instances"],
                "transfers_in_flight": sum(i["transfers"] for i in state["instances"]),
                "totals": self.metrics.totals(), "metrics_port": self.metrics_port,
                "gpu_signals": sum(getattr(i.target, "signals", 0) for i in list(self._instances.values())),
                "l2": None if self.tier is None else {"address": self.config.l2, **self.tier.stats()}}

    def register_kv_cache(self, instance_id: int, descriptor: dict[str, Any]) -> dict[str, Any]:
        caller = self.transport.current_client()
        conn = self._connection(caller)
        with self._lock:
            held = self._instances.get(instance_id)
            if instance_id not in conn.instances and len(conn.instances) >= self.limits.max_instances_per_connection:
                raise LimitExceeded(f"this connection has registered {len(conn.instances)} caches, the most "
                                    f"max_instances_per_connection={self.limits.max_instances_per_connection} "
                                    "allows; unregister one first")
        if held is not None and not self._may_replace(held, caller):
            raise InstanceTaken(f"instance {instance_id} is registered by another connection, which is still "
                                "connected; register this cache under another instance id")
        placement = descriptor.get("placement") if isinstance(descriptor, dict) else None
        if placement not in (PLACEMENT_SERVER, PLACEMENT_ENGINE):
            raise LayoutError(f"placement must be {PLACEMENT_SERVER!r} or {PLACEMENT_ENGINE!r}, got {placement!r}")
        layout = PagedKVLayout.from_wire(descriptor)
        target = open_target(layout, self.store.pool, pool_segment=self.store.segment, openers=self.target_openers)
        with self._lock:
            old = self._instances.get(instance_id)
            if old is not None and not self._may_replace(old, caller):
                target.close()
                raise InstanceTaken(f"instance {instance_id} was registered by another connection meanwhile")
            if conn.ended:
                target.close()
                raise RequestError("this connection's lease ended while it registered; register again")
            fallback = (planner.layer_major_fallback_reason(layout, native_available=target.native_available)
                        if placement == PLACEMENT_SERVER else None)
            self._instances[instance_id] = _Instance(instance_id, layout, placement, target, caller, conn,
                                                     layer_major_fallback=fallback)
            conn.instances.add(instance_id)
        if old is not None:
            self._retire(old)
            log.info("instance %d re-registered; the previous registration was replaced", instance_id)
        busy_wait = getattr(target, "busy_wait", None)
        if busy_wait is not None and self.config.busy_poll_ms > 0:
            if not self._busy_polling:  # once per server, not once per GPU an engine registers
                log.info("busy polling for %g ms after each request (about one core while it lasts; "
                         "--busy-poll-ms 0 turns it off)", self.config.busy_poll_ms)
            self._busy_polling = True
            self.transport.enable_busy_poll(busy_wait, self.config.busy_poll_ms)
        log.info("registered instance %d: %s cache, %d layers x %d blocks x %d tokens, %s placement on %s",
                 instance_id, layout.format, layout.num_layers, layout.num_blocks, layout.block_size,
                 placement, target.device)
        if fallback is not None:
            log.warning("instance %d's layer-major retrieves will run chunk-major: %s", instance_id, fallback)
        return {"instance_id": instance_id, "chunk_size": self.config.chunk_size, "device": target.device,
                "pool": self._pool_ref(), "layer_major_fallback": fallback}

    def _may_replace(self, held: _Instance, caller: bytes | None) -> bool:
        """A registration may be replaced by the connection that made it, or once that connection is gone
        (an engine that restarted registers its cache again under the same id)."""
        if held.owner is None or held.owner == caller:
            return True
        if self.transport.is_connected(held.owner):
            return False
        self.end_connection(held.owner, "it disconnected")  # what it held goes with it, not just this instance
        return True

    def unregister_kv_cache(self, instance_id: int) -> bool:
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                return False
            self._check_owner(inst)
            del self._instances[instance_id]
            if inst.connection is not None:
                inst.connection.instances.discard(instance_id)
        self._retire(inst)
        log.info("unregistered instance %d", instance_id)
        return True

    def lookup(self, key: dict[str, Any]) -> dict[str, Any]:
        ck = self._key(key)
        self._commit_marked_reservations()  # a store that returned before this LOOKUP was sent is found
        caller = self.transport.current_client()
        owner = ck.request_id
        self._check_may_use_owner(owner, caller)
        conn = self._connection(caller)
        digests = list(self._digests(ck))
        locked: list[list[StoredObject]] = []

        def lock_hit() -> None:
            with self._lock:
                if conn.ended:
                    raise RequestError("this connection's lease has ended; send the request again")
                new_owner = owner not in conn.owners and self.store.holder(owner) is None
                if new_owner and len(conn.owners) >= self.limits.max_lock_owners_per_connection:
                    raise LimitExceeded(f"this connection holds the lookup locks of {len(conn.owners)} requests, "
                                        "the most max_lock_owners_per_connection="
                                        f"{self.limits.max_lock_owners_per_connection} allows; free some first")
                hit = self.store.lookup(owner, digests, holder=caller)
                if hit:
                    if self.store.holder(owner) == caller:
                        conn.owners.add(owner)
                    self._looked_up[owner] = (ck.prefix(sum(o.num_tokens for o in hit)), digests[:len(hit)])
            locked.append(hit)

        if self.tier is not None:
            self._fill_from_tier(ck, digests, before_streaming=lock_hit)
        if not locked:
            lock_hit()
        hit = locked[0]
        reply: dict[str, Any] = {"hit_tokens": sum(o.num_tokens for o in hit), "chunk_size": self.config.chunk_size,
                                 "hash_page": self.config.hash_page}
        if hit:
            reply["located"] = self._locations(hit)
        return reply

    def _fill_from_tier(self, ck: CacheKey, digests: list[bytes], before_streaming: Callable[[], None]) -> None:
        """Bring the chunks right after what L1 holds of ``ck`` in from the shared tier, as far as it has them,
        calling ``before_streaming`` once they are published (:meth:`SharedTier.fill`). The objects' shape is the
        cache of the instance the lock owner names (``request@iN``); a key that names none is served from L1
        alone."""
        instance_id = instance_of_lock_owner(ck.request_id)
        with self._lock:
            inst = self._instances.get(instance_id) if instance_id is not None else None
        if inst is None:
            return
        in_l1 = len(self.store.lookup(ck.request_id, digests, lock=False))
        if in_l1 == len(digests):
            return
        cs, n = self.config.chunk_size, ck.num_tokens
        counts = [min(cs, n - i * cs) for i in range(in_l1, len(digests))]
        layout = inst.layout
        self.tier.fill(ck, digests[in_l1:], counts, layout.shape_signature(), layout.dtype, before_streaming)

    def _key(self, key: dict[str, Any], instance_id: int | None = None) -> CacheKey:
        """The request's key, refused before anything is done if it is longer than the server's bounds, with
        the object form every chunk digest includes (``PagedKVLayout.object_form``: the KV dtype, so that a
        prompt cached in bfloat16 is not a hit for a float16 cache of the same model, though both hold the same
        bytes per head; an engine's own page format where its pages move opaque): that of the registered cache
        the request is for (``instance_id``; a LOOKUP's: the one its lock owner names, ``request@iN``), else the
        one the key carries, else the one every registered cache has. A key naming none where the caches differ
        is refused."""
        ck = CacheKey.from_wire(key)
        limits = self.limits
        if len(ck.request_id.encode("utf-8", "surrogatepass")) > limits.max_request_id_bytes:
            raise LimitExceeded(f"request id of {len(ck.request_id)} characters is longer than "
                                f"max_request_id_bytes={limits.max_request_id_bytes}")
        if ck.num_tokens > limits.max_prompt_tokens:
            raise LimitExceeded(f"the key names {ck.num_tokens} tokens, more than "
                                f"max_prompt_tokens={limits.max_prompt_tokens}")
        if instance_id is None:
            instance_id = instance_of_lock_owner(ck.request_id)
        with self._lock:
            inst = self._instances.get(instance_id) if instance_id is not None else None
        if inst is not None:
            form = inst.layout.object_form()
            if ck.dtype is not None and ck.dtype != form:
                raise RequestError(f"the key says dtype {ck.dtype!r}, the cache of instance {instance_id} holds "
                                   f"{form!r}")
            return dataclasses.replace(ck, dtype=form)
        if ck.dtype is not None:
            return ck
        with self._lock:
            dtypes = {i.layout.object_form() for i in self._instances.values()}
        if len(dtypes) > 1:
            raise RequestError(f"key {ck.request_id!r} names no registered cache (a lock owner request@iN) and no "
                               f"dtype, and the registered caches hold {sorted(dtypes)}: say which")
        return dataclasses.replace(ck, dtype=dtypes.pop()) if dtypes else ck

    def _digests(self, ck: CacheKey, known: tuple[CacheKey, list[bytes]] | None = None) -> Iterator[bytes]:
        """``ck``'s chunk digests in this server's chunks and hash chain (:mod:`kvstrata.core.store.keys`)."""
        return ck.iter_chunk_hashes(self.config.chunk_size, known, self.config.hash_page)

    def _check_may_use_owner(self, owner: str, caller: bytes | None) -> None:
        """Refuse a request naming lock owner ``owner`` unless ``caller`` may use its locks: the connection that
        holds them, or the one that registered the instance the owner names (``request@iN``: the engine's
        worker, whose scheduler took the locks on its own connection). Nothing is changed by a refusal."""
        holder = self.store.holder(owner)
        if holder is None or caller is None or holder == caller:
            return
        instance_id = instance_of_lock_owner(owner)
        with self._lock:
            inst = self._instances.get(instance_id) if instance_id is not None else None
            if inst is not None and inst.owner == caller:
                return
        raise NotYours(f"the lookup locks of {owner!r} are held by another connection; this connection may not "
                       "use or free them")

    def _locations(self, objects: list[StoredObject]) -> dict[str, Any] | None:
        """Where a LOOKUP's locked hit lies in the pool, for an engine that copies it itself (engine placement).

        The locks keep these objects in place until FREE_LOOKUP_LOCKS (or their holder's lease ends), so an engine that has
        this needs no RETRIEVE round trip before its first copy. ``None`` when the objects do not share one
        shape (the engine then sends RETRIEVE, which names the mismatch).
        """
        shape = objects[0].shape_signature
        if any(o.shape_signature != shape for o in objects):
            return None
        return {"pool": self._pool_ref(), "shape": list(shape), "objects": self._object_rows(objects)}

    @staticmethod
    def _object_rows(objects: list[StoredObject]) -> list[list[int]]:
        """What an engine copying from the pool needs of each object: ``[offset, nbytes, tokens, slot,
        generation]`` (the last two: its generation-table word, checked once the copy has ended)."""
        return [[o.offset, o.nbytes, o.num_tokens, o.slot, o.generation] for o in objects]

    def _pool_ref(self) -> dict[str, Any]:
        """The L1 pool as an engine maps it: the segment's name and size, and its generation table's (``2 *
        slots`` words: the generations, then the landed words, :func:`~kvstrata.core.store.l1_store.split_generation_table`)."""
        return {"name": self.store.segment.name, "size": self.store.capacity,
                "generations": {"name": self.store.generation_segment.name, "slots": self.store.max_objects}}

    def free_lookup_locks(self, request_id: str) -> int:
        """Release the lookup locks of lock owner ``request_id`` (a request's, or one rank's of it); how many."""
        self._check_may_use_owner(request_id, self.transport.current_client())
        return self._release_locks(request_id)

    def _release_locks(self, request_id: str) -> int:
        with self._lock:
            holder = self.store.holder(request_id)
            conn = self._connections.get(holder) if holder is not None else None
            if conn is not None:
                conn.owners.discard(request_id)
            self._looked_up.pop(request_id, None)
            return self.store.release_locks(request_id)

    def store_kv(self, key: dict[str, Any], instance_id: int, block_ids: list[list[int]],
                 event_handle: bytes | None, skip_first_n_tokens: int) -> dict[str, Any]:
        ck = self._key(key, instance_id)
        self._commit_marked_reservations()  # chunks a finished engine-placement store holds are skipped
        inst = self._acquire(instance_id)
        return self._while_in_use(inst, lambda: self._store(inst, ck, block_ids, event_handle, skip_first_n_tokens))

    def _store(self, inst: _Instance, ck: CacheKey, block_ids: list[list[int]], event_handle: bytes | None,
               skip_first_n_tokens: int) -> dict[str, Any]:
        n = ck.num_tokens
        layout = inst.layout
        if not 0 <= skip_first_n_tokens <= n:
            raise RequestError(f"skip_first_n_tokens {skip_first_n_tokens} is not in [0, {n}] (the key's tokens)")
        layout.check_block_ids(block_ids, n)
        digests = self._digests(ck)  # hashed as the loop goes: the first copy waits for one digest
        inst.target.wait_for_engine(event_handle)
        skipped = in_progress = 0
        # Every chunk's gather is enqueued before one finish(): a device target then
        # copies chunk after chunk back to back instead of idling between them.
        pending: list[tuple[StoredObject, int]] = []
        full: StoreFull | None = None
        try:
            try:
                for obj, start, count, busy in self._reserve_chunks(digests, n, layout, skip_first_n_tokens):
                    if obj is None:
                        if busy:
                            in_progress += count
                        else:
                            skipped += count
                        continue
                    pending.append((obj, count))
                    job = planner.TransferJob(layout, block_ids, [planner.ChunkCopy(0, 0, count, start)])
                    executor = inst.target.executor([obj])
                    try:
                        executor.gather(job)
                    finally:
                        executor.close()
            except StoreFull as exc:
                full = exc  # keep what was gathered so far, as before, then report
            done = inst.target.completion()
        except BaseException:
            try:
                inst.target.finish()  # no copy may still write into memory handed back below
            except Exception:
                pass
            for obj, _ in pending:
                self.store.abandon(obj)
            raise

        def settle() -> dict[str, Any]:
            try:
                done.wait()
            except BaseException:
                for obj, _ in pending:
                    self.store.abandon(obj)
                raise
            stored = 0
            for obj, count in pending:
                self.store.commit(obj)
                stored += count
            if self.tier is not None and pending:
                self.tier.offer_committed(ck, layout.dtype, [obj for obj, _ in pending])
            if full is not None:
                raise full
            return {"stored_tokens": stored, "skipped_tokens": skipped, "in_progress_tokens": in_progress}

        return settle()

    def _reserve_chunks(self, digests: Iterable[bytes], num_tokens: int, layout: PagedKVLayout, skip: int,
                        budget: Callable[[int], None] | None = None
                        ) -> Iterator[tuple[StoredObject | None, int, int, bool]]:
        """For each chunk of a prompt being stored, in order: (its new uncommitted object, first token, tokens,
        False), or ``None`` for the object where the chunk is before ``skip`` or already stored, or (the flag
        True) being stored by another request whose bytes have not landed yet (not a hit until they do).
        ``budget(nbytes)`` is asked before each object is reserved and raises :class:`StoreFull` to stop.

        STORE and RESERVE_STORE both walk a prompt this way. Lazy, so a STORE starts copying its first chunk
        before the later ones are hashed; raises :class:`StoreFull` at the first chunk that finds no room (the
        objects yielded before it stay reserved, for the caller to keep or drop).
        """
        cs = self.config.chunk_size
        for index, digest in enumerate(digests):
            start = index * cs
            count = min(cs, num_tokens - start)
            if start + count <= skip:
                yield None, start, count, False
                continue
            nbytes = layout.object_bytes(count)
            if budget is not None:
                budget(nbytes)
            obj = self.store.reserve(digest, count, nbytes, layout.shape_signature())
            yield obj, start, count, obj is None and self.store.is_pending(digest)

    def reserve_store(self, key: dict[str, Any], instance_id: int, skip_first_n_tokens: int) -> dict[str, Any]:
        """Engine placement: reserve objects for the key's chunks that are not stored yet; the engine copies
        into them (it maps the pool) and then marks them stored (or drops them with COMMIT_STORE). Chunks already
        stored are skipped; where none is reserved, the reply's reservation is 0."""
        ck = self._key(key, instance_id)
        n = ck.num_tokens
        caller = self.transport.current_client()
        conn = self._connection(caller)
        self._commit_marked_reservations()  # chunks a finished store holds are skipped, and its share is free
        inst = self._acquire(instance_id)
        try:
            if inst.placement != PLACEMENT_ENGINE:
                raise RequestError(f"instance {instance_id} is registered in {inst.placement} placement: the "
                                   "server gathers its STOREs itself; RESERVE_STORE is for engine placement")
            if not 0 <= skip_first_n_tokens <= n:
                raise RequestError(f"skip_first_n_tokens {skip_first_n_tokens} is not in [0, {n}] (the key's "
                                   "tokens)")
            reserved: list[tuple[StoredObject, int]] = []
            objects, skipped, in_progress, full = [], 0, 0, None
            share = int(self.limits.max_reserved_fraction * self.store.capacity)
            taken = 0

            def budget(nbytes: int) -> None:
                if conn.reserved_bytes + taken + nbytes > share:
                    raise StoreFull(f"this connection's store reservations would hold {conn.reserved_bytes + taken + nbytes} "
                                    f"bytes, more than max_reserved_fraction={self.limits.max_reserved_fraction} of "
                                    f"the pool ({share} bytes); commit or drop some first")

            try:
                bounded = budget if self.limits.max_reserved_fraction < 1 else None  # 1: the pool is the bound
                for obj, start, count, busy in self._reserve_chunks(self._digests(ck), n,
                                                                    inst.layout, skip_first_n_tokens, bounded):
                    if obj is None:
                        if busy:
                            in_progress += count
                        else:
                            skipped += count
                        continue
                    reserved.append((obj, count))
                    taken += obj.nbytes
                    objects.append([obj.offset, obj.nbytes, count, start, obj.slot, obj.generation])
            except StoreFull as exc:
                full = str(exc)  # reserve what fits, from the prompt's start; the rest is not stored
            with self._lock:
                if conn.ended:
                    for obj, _ in reserved:
                        self.store.abandon(obj)
                    raise RequestError("this connection's lease has ended; send the request again")
                rid = 0  # nothing reserved (every chunk stored or in progress, or no room): nothing to commit
                if reserved:
                    rid = self._next_reservation
                    self._next_reservation += 1
                    self._reservations[rid] = _Reservation(instance_id, caller, ck, reserved, conn)
                    conn.reservations.add(rid)
                    conn.reserved_bytes += taken
        finally:
            self._release(inst)
        return {"reservation": rid, "objects": objects, "skipped_tokens": skipped, "in_progress_tokens": in_progress,
                "full": full, "pool": self._pool_ref(),
                "store_marks": {"name": self.store.store_mark_segment.name, "slots": self.store.max_objects}}

    def commit_store(self, reservation: int, landed: bool) -> dict[str, Any]:
        """Commit a reservation whose copies the engine saw complete, or drop it (``landed`` false). An engine
        that marks its objects stored (what kvstrata's does) needs this only to drop one."""
        with self._lock:
            res = self._reservations.get(reservation)
            caller = self.transport.current_client()
            if res is None:
                raise RequestError(f"no store reservation {reservation} (committed or dropped already, or its "
                                   "instance was unregistered)")
            if res.owner is not None and caller is not None and caller != res.owner:
                raise NotYours(f"store reservation {reservation} belongs to another connection")
            self._forget_reservation(reservation, res)
        if landed:
            return self._commit_reservation(res)
        for obj, _ in res.objects:
            self.store.abandon(obj)
        if res.objects:
            log.warning("store reservation %d for request %s dropped: the engine says no copy landed in it",
                        reservation, res.request_id)
        return {"stored_tokens": 0, "stored_bytes": 0}

    def _commit_reservation(self, res: _Reservation) -> dict[str, Any]:
        """Make a reservation taken off the books a stored prompt: its objects visible to LOOKUP, offered to the
        shared tier."""
        stored = stored_bytes = 0
        for obj, count in res.objects:
            self.store.commit(obj)
            stored, stored_bytes = stored + count, stored_bytes + obj.nbytes
        if self.tier is not None and res.objects:
            with self._lock:
                inst = self._instances.get(res.instance_id)
            if inst is not None:
                self.tier.offer_committed(res.key, inst.layout.dtype, [obj for obj, _ in res.objects])
        self.metrics.count_committed_store(stored, stored_bytes)
        return {"stored_tokens": stored, "stored_bytes": stored_bytes}

    def _marked(self, res: _Reservation) -> bool:
        return all(self.store.marked_stored(obj) for obj, _ in res.objects)

    def _commit_marked_reservations(self) -> None:
        """Commit every reservation whose engine has marked all its objects stored (see
        :mod:`kvstrata.core.store.l1_store`): called before anything that could find or skip their chunks, and by
        the lease watcher, so what a store copied is visible to every request sent after it returned."""
        with self._lock:
            if not self._reservations:
                return
            marked = [(k, r) for k, r in self._reservations.items() if self._marked(r)]
            for k, r in marked:
                self._forget_reservation(k, r)
        for _, res in marked:
            self._commit_reservation(res)

    def _settle_ended_reservations(self, ended: list[_Reservation]) -> int:
        """Reservations taken off the books because their instance or connection went: those the engine marked
        stored before it went are committed (their bytes are in), the rest dropped; how many were dropped."""
        dropped = 0
        for res in ended:
            if self._marked(res):
                self._commit_reservation(res)
            else:
                dropped += 1
                for obj, _ in res.objects:
                    self.store.abandon(obj)
        return dropped

    def _forget_reservation(self, reservation: int, res: _Reservation) -> None:
        """Take a reservation off the books (under the lock); its objects are the caller's to commit or drop."""
        del self._reservations[reservation]
        if res.connection is not None:
            res.connection.reservations.discard(reservation)
            res.connection.reserved_bytes -= res.nbytes

    def _drop_reservations(self, instance_id: int) -> None:
        """An instance went away (unregistered, or replaced by a restarted engine): its reservations go too."""
        with self._lock:
            dropped = [(k, r) for k, r in list(self._reservations.items()) if r.instance_id == instance_id]
            for k, r in dropped:
                self._forget_reservation(k, r)
        lost = self._settle_ended_reservations([r for _, r in dropped])
        if lost:
            log.warning("instance %d went away with %d store reservation(s) not committed: dropped", instance_id,
                        lost)

    def retrieve(self, key: dict[str, Any], instance_id: int, block_ids: list[list[int]],
                 event_handle: bytes | None, skip_first_n_tokens: int, arrival_board: dict[str, Any] | None,
                 layer_event_handles: list[bytes] | None, layers_per_slice: int) -> dict[str, Any]:
        # A refused RETRIEVE frees nothing: the locks it names stay with their holder, who frees them (the
        # engine's runtime does on any failed load) or loses them with its lease.
        ck = self._key(key, instance_id)
        self._check_may_use_owner(ck.request_id, self.transport.current_client())
        inst = self._acquire(instance_id)
        return self._while_in_use(inst, lambda: self._retrieve(inst, ck, block_ids, event_handle, skip_first_n_tokens,
                                                               arrival_board, layer_event_handles, layers_per_slice))

    def _retrieve(self, inst: _Instance, ck: CacheKey, block_ids: list[list[int]], event_handle: bytes | None,
                  skip_first_n_tokens: int, arrival_board: dict[str, Any] | None,
                  layer_event_handles: list[bytes] | None, layers_per_slice: int) -> dict[str, Any]:
        board: ArrivalBoard | None = None
        copying = False
        plan: _RetrievePlan | None = None
        try:
            # Everything is checked before anything is written: a rejected RETRIEVE writes no board word
            # and no cache byte.
            if not 0 <= skip_first_n_tokens <= ck.num_tokens:
                raise RequestError(f"skip_first_n_tokens {skip_first_n_tokens} is not in [0, {ck.num_tokens}] "
                                   "(the key's tokens)")
            if layers_per_slice < 0:
                raise RequestError(f"layers_per_slice must be >= 0 (0: chunk-major), got {layers_per_slice}")
            if arrival_board is not None:
                board = self._board(arrival_board)
            if inst.placement == PLACEMENT_ENGINE:
                # the worker copies now; its FREE_LOOKUP_LOCKS unpins
                return self._retrieve_for_worker(ck, inst, block_ids, skip_first_n_tokens)
            plan = self._plan_retrieve(ck, inst, block_ids, skip_first_n_tokens, board, event_handle,
                                       layer_event_handles, layers_per_slice)
            # The copy pins its objects itself: whatever happens to the lookup locks meanwhile (freed, their
            # holder's lease ended), no object it reads is evicted before the copy has ended.
            self.store.pin(plan.objects)
            copying = True  # from here on a failure is the transfer's, reported on its (verified) board
            done, settle = self._retrieve_into_cache(ck, inst, board, arrival_board, plan)
        except Exception:
            if copying:
                self.store.unpin(plan.objects)
                self._release_locks(ck.request_id)  # it was served, and failed: its locks are done with
                if board is not None:
                    board.fail(arrival_board["slot"], arrival_board["generation"])
            raise
        return self._settling_retrieve(settle, ck.request_id, board, arrival_board, plan.objects)()

    def _while_in_use(self, inst: _Instance, transfer: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run a transfer on an acquired instance and let the instance go once it has ended, so that an
        UNREGISTER meanwhile closes its target only after that."""
        try:
            return transfer()
        finally:
            self._release(inst)

    def _settling_retrieve(self, settle: Callable[[], dict[str, Any]], request_id: str, board: ArrivalBoard | None,
                           board_ref: dict[str, Any] | None,
                           pinned: list[StoredObject]) -> Callable[[], dict[str, Any]]:
        """A retrieve's settle with the failure and lock handling retrieve() gives its start."""

        def run() -> dict[str, Any]:
            try:
                return settle()
            except Exception:
                if board is not None and board_ref is not None:
                    board.fail(board_ref["slot"], board_ref["generation"])
                raise
            finally:
                self.store.unpin(pinned)
                self._release_locks(request_id)

        return run

    # --- retrieve paths --------------------------------------------------------------

    def _locked_objects(self, ck: CacheKey, layout: PagedKVLayout) -> list[StoredObject]:
        digests = list(self._digests(ck, self._looked_up.get(ck.request_id)))
        objects = self.store.get_locked(ck.request_id, digests)
        signature = layout.shape_signature()
        for o in objects:
            if o.shape_signature != signature:
                raise RequestError(
                    f"stored chunk {o.digest.hex()[:12]} has shape (kv, layers, heads, head_bytes) = "
                    f"{o.shape_signature}, the registered cache has {layout.shape_signature()}"
                )
        return objects

    def _retrieve_for_worker(self, ck: CacheKey, inst: _Instance, block_ids: list[list[int]],
                             skip: int) -> dict[str, Any]:
        """Engine placement: hand back where the objects are; the locks stay until FREE_LOOKUP_LOCKS."""
        # block_ids name the worker's own cache, which only the worker can check
        objects = self._locked_objects(ck, inst.layout)
        return {"retrieved_tokens": max(ck.num_tokens - skip, 0), "layers_per_slice": 0, "fallback": None,
                "objects": self._object_rows(objects), "pool": self._pool_ref()}

    def _plan_retrieve(self, ck: CacheKey, inst: _Instance, block_ids: list[list[int]], skip: int,
                       board: ArrivalBoard | None, event_handle: bytes | None,
                       layer_event_handles: list[bytes] | None, layers_per_slice: int) -> "_RetrievePlan":
        """Check a server-placement retrieve and plan it; raises before anything is written."""
        layout = inst.layout
        n = ck.num_tokens
        layout.check_block_ids(block_ids, n)
        if layer_event_handles is not None and len(layer_event_handles) != layout.num_layers:
            raise RequestError(f"layer_event_handles lists {len(layer_event_handles)} events, the cache has "
                               f"{layout.num_layers} layers")
        objects = self._locked_objects(ck, layout)
        copies = planner.plan_copies([o.num_tokens for o in objects], self.config.chunk_size, 0, skip)
        job = planner.TransferJob(layout, block_ids, copies)
        events = inst.target.open_layer_events(layer_event_handles)
        end_events = inst.target.open_layer_events([event_handle]) if event_handle is not None else None
        width = layers_per_slice
        fallback = None
        if width > 0:
            if board is None:
                raise RequestError("layers_per_slice > 0 needs an arrival board reference")
            fallback = inst.layer_major_fallback  # an engine that ignored the REGISTER reply's
            if fallback is not None:
                width = 0
        return _RetrievePlan(objects, job, events, end_events, width, fallback)

    def _retrieve_into_cache(self, ck: CacheKey, inst: _Instance,
                             board: ArrivalBoard | None, board_ref: dict[str, Any] | None,
                             plan: "_RetrievePlan") -> tuple[Completion, Callable[[], dict[str, Any]]]:
        """Enqueue the transfer; returns its completion and the settle that finishes it once that is done."""
        layout = inst.layout
        target = inst.target
        objects, job, events, width, fallback = plan.objects, plan.job, plan.events, plan.width, plan.fallback

        def on_layer_batch(layer_start: int, layer_count: int) -> None:
            # Record the slice's events first, publish the count last: the count is
            # what makes those events safe to wait on.
            if events is not None:
                target.record(events[layer_start:layer_start + layer_count])
            if board is not None:
                board.publish(board_ref["slot"], board_ref["generation"], layer_start + layer_count)

        started = time.perf_counter()
        executor = target.executor(objects)
        try:
            planner.run_transfer(executor, job, width, on_layer_batch, ck.request_id, self._slice_observer,
                                 self._layers_needed(objects))
        finally:
            executor.close()
        if plan.end_events is not None:
            target.record(plan.end_events)
        reply = {"retrieved_tokens": job.num_tokens, "layers_per_slice": width, "fallback": fallback,
                 "objects": None, "pool": None}
        done = target.completion(self._end_signals(board, board_ref, layout.num_layers, reply))

        def settle() -> dict[str, Any]:
            done.wait()
            if board is not None and not done.signalled:
                # The worker settles on this word without waiting for the reply, so it is the
                # last thing this retrieve writes to the slot (the slot may be reused at once).
                board.publish(board_ref["slot"], board_ref["generation"], layout.num_layers, complete=True)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("retrieve %s: %d tokens into instance %d, width %d, %.2f ms", ck.request_id,
                          job.num_tokens, inst.instance_id, width, (time.perf_counter() - started) * 1e3)
            return reply

        return done, settle

    def _layers_needed(self, objects: list[StoredObject]) -> planner.LayersNeeded | None:
        """A retrieve's wait for the layers of objects still filling from the shared tier (None: none is; one
        whose fill failed already fails the retrieve at its first slice)."""
        if not any(o.filling or o.failed for o in objects):
            return None
        return lambda layers: self.store.wait_landed(objects, layers, FILL_WAIT_S)

    def _end_signals(self, board: ArrivalBoard | None, board_ref: dict[str, Any] | None, num_layers: int,
                     reply: dict[str, Any]) -> list[HostSignal]:
        """What the device should store itself when this retrieve's copies end (see ``Target.completion``).

        Layer-major: the board slot's "complete" word, which the engine settles on without waiting for the
        reply. Chunk-major: nothing; the reply says it.
        """
        if board is not None:
            slot, generation = board_ref["slot"], board_ref["generation"]
            return [HostSignal(board.segment, board.word_offset(slot), pack(generation, num_layers, complete=True))]
        return []

    # --- helpers ---------------------------------------------------------------------

    def _acquire(self, instance_id: int) -> _Instance:
        """The caller's registered instance ``instance_id``, counted as in use by one more transfer (see
        :meth:`_release`); another connection's is refused."""
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                raise UnknownInstance(f"instance {instance_id} is not registered (REGISTER_KV_CACHE first)")
            self._check_owner(inst)
            inst.transfers += 1
            return inst

    def _release(self, inst: _Instance) -> None:
        with self._lock:
            inst.transfers -= 1
            close = inst.retired and inst.transfers == 0
            if close:
                self._draining = [i for i in self._draining if i is not inst]
        if close:
            inst.target.close()
            log.info("instance %d's cache closed: its last transfer has ended", inst.instance_id)

    def _retire(self, inst: _Instance) -> None:
        """Close an unregistered or replaced instance's target now, or once its transfers end."""
        self._drop_reservations(inst.instance_id)
        with self._lock:
            inst.retired = True
            close = inst.transfers == 0
            if not close:
                self._draining.append(inst)
        if close:
            inst.target.close()
        else:
            log.info("instance %d's cache stays open until its %d transfer(s) in flight end", inst.instance_id,
                     inst.transfers)

    def _check_owner(self, inst: _Instance) -> None:
        caller = self.transport.current_client()
        if inst.owner is not None and caller is not None and caller != inst.owner:
            raise NotYours(f"instance {inst.instance_id} belongs to another connection (the one that "
                           "registered it); this client may not use or unregister it")

    # --- connections and leases ------------------------------------------------------

    def _connection(self, identity: bytes | None) -> Connection:
        """The record of what connection ``identity`` holds (made at its first request that takes anything)."""
        with self._lock:
            conn = self._connections.get(identity)
            if conn is None:
                conn = self._connections[identity] = Connection(identity)
            return conn

    def _watch_leases(self) -> None:
        """End every connection that went away or whose lease ran out (see :mod:`.connections`)."""
        lease = self.limits.lease_seconds
        period = min(1.0, lease / 4)
        while not self._stopping.wait(period):
            try:
                now = time.monotonic()
                with self._lock:
                    identities = [i for i in self._connections if i is not None]
                for identity in identities:
                    seen = self.transport.last_seen(identity)
                    if seen is None or now - seen > lease:
                        self.end_connection(identity, f"its lease ran out (silent for more than {lease:g}s)")
                    elif not self.transport.is_connected(identity):
                        self.end_connection(identity, "it disconnected")
                self.transport.forget_silent(lease)
                self._commit_marked_reservations()  # a finished store no request has looked at yet
                self._bury(now - period)
            except Exception:  # the watcher must outlive any one failure, or leases would stop ending
                if self._stopping.is_set():
                    return
                log.exception("lease watcher: unexpected error; it goes on")

    def end_connection(self, identity: bytes, why: str) -> None:
        """Let go of everything connection ``identity`` holds: its instances (closed once their transfers end),
        its store reservations, the lookup locks it holds and those naming its instances, and its arrival
        boards. A request it sends later starts afresh (an instance it names is unknown: it registers again)."""
        with self._lock:
            conn = self._connections.pop(identity, None)
            if conn is None:
                return
            conn.ended = True
            instances = [self._instances.pop(i) for i in sorted(conn.instances) if
                         self._instances.get(i) is not None and self._instances[i].connection is conn]
            reservations = [(k, self._reservations[k]) for k in sorted(conn.reservations) if k in self._reservations]
            for k, res in reservations:
                self._forget_reservation(k, res)
            mine = {inst.instance_id for inst in instances}
            owners = set(conn.owners) | {o for o in self._looked_up if instance_of_lock_owner(o) in mine}
        self._settle_ended_reservations([r for _, r in reservations])
        for owner in owners:
            self._release_locks(owner)
        for inst in instances:
            self._retire(inst)
        with self._lock:
            boards, conn.boards = list(conn.boards.values()), {}
        self._park([board.close for board in boards])
        self.transport.forget(identity)
        self.connections_ended += 1
        log.info("connection %s ended (%s): released %d cache instance(s) %s, %d store reservation(s), the lookup "
                 "locks of %d request(s), %d arrival board(s)", conn.label(), why, len(instances), sorted(mine),
                 len(reservations), len(owners), len(boards))

    def _park(self, closers: list[Callable[[], None]]) -> None:
        now = time.monotonic()
        with self._lock:
            self._graveyard += [(now, close) for close in closers]

    def _bury(self, parked_before: float) -> None:
        """Close what was parked before ``parked_before``, if no transfer is in flight anywhere now."""
        with self._lock:
            busy = any(i.transfers for i in self._instances.values()) or bool(self._draining)
            if busy or not self._graveyard:
                return
            due = [c for t, c in self._graveyard if t <= parked_before]
            self._graveyard = [(t, c) for t, c in self._graveyard if t > parked_before]
        for close in due:
            try:
                close()
            except Exception as exc:  # one mapping that will not close must not keep the others open
                log.warning("closing a mapping of an ended connection failed: %s", exc)

    def _board(self, ref: dict[str, Any]) -> ArrivalBoard:
        """The arrival board a RETRIEVE names, mapped only once its header says it is one, with the slot and
        generation checked against it (see ``kvstrata.core.shm``); raises before writing anything."""
        if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
            raise RequestError(f"arrival_board must be {{'name', 'slot', 'generation'}}, got {ref!r}")
        name = ref["name"]
        if name == self.store.segment.name:
            raise RequestError(f"arrival board {name} is the server's own L1 pool, not an arrival board")
        conn = self._connection(self.transport.current_client())
        with self._lock:
            board = conn.boards.get(name)
        if board is None:
            if len(conn.boards) >= self.limits.max_instances_per_connection:
                raise LimitExceeded(f"this connection has named {len(conn.boards)} arrival boards, the most "
                                    "max_instances_per_connection="
                                    f"{self.limits.max_instances_per_connection} allows (one per registered cache)")
            try:
                board = ArrivalBoard.attach(name)
            except (SegmentKindError, ValueError, OSError) as exc:
                raise RequestError(f"arrival board refused: {exc}") from None
            with self._lock:
                if conn.ended:
                    board.close()
                    raise RequestError("this connection's lease has ended; register again")
                kept = conn.boards.setdefault(name, board)
            if kept is not board:
                board.close()
            board = kept
        try:
            board.check_ref(ref.get("slot"), ref.get("generation"))
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return board
