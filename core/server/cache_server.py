"""The cache server: protocol handlers over the L1 store, registered engine caches and the planner.

Each handler takes exactly its request type's declared payload items (checked
at registration). Handlers that move bytes run on the transport's transfer
threads; every failure becomes an error reply naming the request type, and the
server keeps serving. A retrieve that fails part-way marks its arrival-board
slot failed, so a worker that released the request early learns it at once
instead of waiting out its timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from kvstrata.core.transfer import planner
from kvstrata.core.arrival.board import ArrivalBoard, pack
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.store.l1_store import L1Store, StoreFull, StoredObject
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_WORKER, LayoutError, PagedKVLayout
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.server.metrics import ServerMetrics
from kvstrata.core.server.targets import Completion, HostSignal, Target, TargetOpener, open_target
from kvstrata.core.shm import SegmentKindError, sweep_stale_segments
from kvstrata.core.wire.transport import DEFAULT_MAX_MESSAGE_BYTES, Deferred, Server, hands_over_turn

log = logging.getLogger(__name__)

VERSION = "0.1.0"


@dataclass
class ServerConfig:
    address: str
    l1_bytes: int = 1 << 30
    chunk_size: int = 256
    transfer_threads: int = 4
    allow_remote: bool = False
    busy_poll_ms: float = 25.0
    """With a GPU cache registered: after each request, poll the socket without sleeping this long (0: off)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free port; None: no endpoint). Loopback unless
    ``allow_remote``."""
    deferred_replies: bool = True
    """With busy polling on, the polling thread answers a transfer once its copies are done, so the handler's
    thread is free as soon as they are enqueued; False has the handler's thread wait and answer (for A/B
    measurements)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """The largest frame taken (ZMQ_MAXMSGSIZE): a peer sending a longer one is disconnected before it is read."""
    curve_secret_key: str | None = None
    """The server's CURVE secret key file (``NAME.key_secret``); with ``curve_clients``, only clients whose
    public key is there are served (required on tcp://, see :mod:`kvstrata.core.wire.curve`)."""
    curve_clients: str | None = None
    """The directory of the authorized clients' CURVE public keys (``NAME.key``), read at start."""


@dataclass
class _Reservation:
    """L1 objects an engine copies a prompt's chunks into itself (worker placement); uncommitted until it says
    the copies landed, so no LOOKUP sees them and no eviction frees them meanwhile."""

    instance_id: int
    owner: bytes | None
    request_id: str
    objects: list[tuple[StoredObject, int]]
    """(object, tokens)"""


@dataclass
class _Instance:
    instance_id: int
    layout: PagedKVLayout
    placement: str
    target: Target
    owner: bytes | None
    """The connection that registered it (its routing id): the only one that may use or unregister it.
    None when registered from inside the server process (tests calling handlers directly)."""
    transfers: int = 0
    """STOREs and RETRIEVEs using its target now: it is closed only once they have ended."""
    retired: bool = False
    """Unregistered or replaced: its target closes when the last transfer using it ends."""


class RequestError(ValueError):
    """A well-formed request that cannot be served (unknown instance, bad block ids, ...)."""


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
    def __init__(self, config: ServerConfig, target_openers: Mapping[str, TargetOpener] | None = None) -> None:
        """``target_openers``: region kinds beyond shared memory this server can write into, by kind
        (``kvstrata serve`` passes :func:`kvstrata.native.target_openers`: CUDA IPC)."""
        if config.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {config.chunk_size}")
        self.config = config
        self.target_openers = dict(target_openers or {})
        sweep_stale_segments()  # what crashed servers and engines left behind
        self.store = L1Store(config.l1_bytes)
        self._instances: dict[int, _Instance] = {}
        self._boards: dict[str, ArrivalBoard] = {}
        self._looked_up: dict[str, tuple[CacheKey, list[bytes]]] = {}
        self._reservations: dict[int, _Reservation] = {}
        self._next_reservation = 1
        """Per request holding lookup locks: its LOOKUP's key and digests, so RETRIEVE need not hash again."""
        self._lock = threading.Lock()
        self._busy_polling = False
        self.transport = Server(config.address, transfer_threads=config.transfer_threads,
                                allow_remote=config.allow_remote, defer_replies=config.deferred_replies,
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
            RequestType.END_SESSION: self.end_session,
            RequestType.RESERVE_STORE: self.reserve_store,
            RequestType.COMMIT_STORE: self.commit_store,
        }
        self.metrics = ServerMetrics(self)
        self.metrics_port: int | None = None
        for rt, h in handlers.items():
            self.transport.register(rt, self.metrics.instrument(rt, h))

    @property
    def address(self) -> str:
        return self.transport.address

    def start(self) -> None:
        self.transport.start()
        if self.config.metrics_port is not None:
            host = "0.0.0.0" if self.config.allow_remote else "127.0.0.1"
            self.metrics_port = self.metrics.serve_http(host, self.config.metrics_port)
        log.info("kvstrata server %s listening on %s: L1 %d MiB in shared memory %s, chunk %d tokens, "
                 "%d transfer threads", VERSION, self.address, self.config.l1_bytes >> 20,
                 self.store.segment.name, self.config.chunk_size, self.config.transfer_threads)

    def stop(self) -> None:
        self.metrics.close()
        self.transport.stop()
        with self._lock:
            for inst in self._instances.values():
                inst.target.close()
            self._instances.clear()
            for b in self._boards.values():
                b.close()
            self._boards.clear()
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
                "rings": {"clients": self.transport.ring_clients, "requests": self.transport.ring_requests},
                "gpu_signals": sum(getattr(i.target, "signals", 0) for i in list(self._instances.values()))}

    def register_kv_cache(self, instance_id: int, descriptor: dict[str, Any]) -> dict[str, Any]:
        caller = self.transport.current_client()
        with self._lock:
            held = self._instances.get(instance_id)
        if held is not None and not self._may_replace(held, caller):
            raise RequestError(f"instance {instance_id} is registered by another connection, which is still "
                               "connected; register this cache under another instance id")
        placement = descriptor.get("placement") if isinstance(descriptor, dict) else None
        if placement not in (PLACEMENT_SERVER, PLACEMENT_WORKER):
            raise LayoutError(f"placement must be {PLACEMENT_SERVER!r} or {PLACEMENT_WORKER!r}, got {placement!r}")
        layout = PagedKVLayout.from_wire(descriptor)
        target = open_target(layout, self.store.pool, pool_segment=self.store.segment, openers=self.target_openers)
        with self._lock:
            old = self._instances.get(instance_id)
            if old is not None and not self._may_replace(old, caller):
                target.close()
                raise RequestError(f"instance {instance_id} was registered by another connection meanwhile")
            self._instances[instance_id] = _Instance(instance_id, layout, placement, target, caller)
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
        return {"instance_id": instance_id, "chunk_size": self.config.chunk_size, "device": target.device,
                "pool": self._pool_ref()}

    def _may_replace(self, held: _Instance, caller: bytes | None) -> bool:
        """A registration may be replaced by the connection that made it, or once that connection is gone
        (an engine that restarted registers its cache again under the same id)."""
        return held.owner is None or held.owner == caller or not self.transport.is_connected(held.owner)

    def unregister_kv_cache(self, instance_id: int) -> bool:
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                return False
            self._check_owner(inst)
            del self._instances[instance_id]
        self._retire(inst)
        log.info("unregistered instance %d", instance_id)
        return True

    def lookup(self, key: dict[str, Any]) -> dict[str, Any]:
        ck = CacheKey.from_wire(key)
        digests = ck.chunk_hashes(self.config.chunk_size)
        hit = self.store.lookup(ck.request_id, digests)
        reply: dict[str, Any] = {"hit_tokens": sum(o.num_tokens for o in hit), "chunk_size": self.config.chunk_size}
        if hit:
            self._looked_up[ck.request_id] = (ck, digests)
            reply["located"] = self._locations(hit)
        return reply

    def _locations(self, objects: list[StoredObject]) -> dict[str, Any] | None:
        """Where a LOOKUP's locked hit lies in the pool, for an engine that copies it itself (worker placement).

        The locks keep these objects in place until FREE_LOOKUP_LOCKS or END_SESSION, so an engine that has
        this needs no RETRIEVE round trip before its first copy. ``None`` when the objects do not share one
        shape (the engine then sends RETRIEVE, which names the mismatch).
        """
        shape = objects[0].shape_signature
        if any(o.shape_signature != shape for o in objects):
            return None
        return {"pool": self._pool_ref(), "shape": list(shape),
                "objects": [[o.offset, o.nbytes, o.num_tokens] for o in objects]}

    def _pool_ref(self) -> dict[str, Any]:
        """The L1 pool as an engine maps it: the segment's name and size."""
        return {"name": self.store.segment.name, "size": self.store.capacity}

    def free_lookup_locks(self, request_id: str) -> int:
        return self._release_locks(request_id)

    def end_session(self, request_id: str) -> int:
        return self._release_locks(request_id)

    def _release_locks(self, request_id: str) -> int:
        self._looked_up.pop(request_id, None)
        return self.store.release_locks(request_id)

    @hands_over_turn
    def store_kv(self, key: dict[str, Any], instance_id: int, block_ids: list[list[int]],
                 event_handle: bytes | None, skip_first_n_tokens: int) -> dict[str, Any] | Deferred:
        inst = self._acquire(instance_id)
        return self._while_in_use(inst, lambda: self._store(inst, key, block_ids, event_handle, skip_first_n_tokens))

    def _store(self, inst: _Instance, key: dict[str, Any], block_ids: list[list[int]], event_handle: bytes | None,
               skip_first_n_tokens: int) -> dict[str, Any] | Deferred:
        ck = CacheKey.from_wire(key)
        n = ck.num_tokens
        layout = inst.layout
        if not 0 <= skip_first_n_tokens <= n:
            raise RequestError(f"skip_first_n_tokens {skip_first_n_tokens} is not in [0, {n}] (the key's tokens)")
        layout.check_block_ids(block_ids, n)
        cs = self.config.chunk_size
        digests = ck.iter_chunk_hashes(cs)  # hashed as the loop goes: the first copy waits for one digest
        inst.target.wait_for_engine(event_handle)
        if not inst.target.enqueues:
            self.transport.release_turn()  # this target copies in the call: free the socket first
        skipped = 0
        # Every chunk's gather is enqueued before one finish(): a device target then
        # copies chunk after chunk back to back instead of idling between them.
        pending: list[tuple[StoredObject, int]] = []
        full: StoreFull | None = None
        try:
            try:
                for obj, start, count in self._reserve_chunks(digests, n, layout, skip_first_n_tokens):
                    if obj is None:
                        skipped += count
                        continue
                    pending.append((obj, count))
                    job = planner.TransferJob(layout, block_ids, [planner.ChunkCopy(0, 0, count, start)])
                    executor = inst.target.executor([obj])
                    try:
                        executor.gather(job)
                    finally:
                        executor.close()
                    self.transport.release_turn()  # the copy engine has work: other requests may be taken now
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
            if full is not None:
                raise full
            return {"stored_tokens": stored, "skipped_tokens": skipped}

        return self._answer(inst.target, done, settle)

    def _reserve_chunks(self, digests: Iterable[bytes], num_tokens: int, layout: PagedKVLayout,
                        skip: int) -> Iterator[tuple[StoredObject | None, int, int]]:
        """For each chunk of a prompt being stored, in order: (its new uncommitted object, first token, tokens),
        or ``None`` for the object where the chunk is before ``skip`` or already stored.

        STORE and RESERVE_STORE both walk a prompt this way. Lazy, so a STORE starts copying its first chunk
        before the later ones are hashed; raises :class:`StoreFull` at the first chunk that finds no room (the
        objects yielded before it stay reserved, for the caller to keep or drop).
        """
        cs = self.config.chunk_size
        for index, digest in enumerate(digests):
            start = index * cs
            count = min(cs, num_tokens - start)
            if start + count <= skip:
                yield None, start, count
                continue
            yield self.store.reserve(digest, count, layout.object_bytes(count), layout.shape_signature()), start, count

    def reserve_store(self, key: dict[str, Any], instance_id: int, skip_first_n_tokens: int) -> dict[str, Any]:
        """Worker placement: reserve objects for the key's chunks that are not stored yet; the engine copies
        into them (it maps the pool) and then sends COMMIT_STORE. Chunks already stored are skipped."""
        ck = CacheKey.from_wire(key)
        n = ck.num_tokens
        inst = self._acquire(instance_id)
        try:
            if inst.placement != PLACEMENT_WORKER:
                raise RequestError(f"instance {instance_id} is registered in {inst.placement} placement: the "
                                   "server gathers its STOREs itself; RESERVE_STORE is for worker placement")
            if not 0 <= skip_first_n_tokens <= n:
                raise RequestError(f"skip_first_n_tokens {skip_first_n_tokens} is not in [0, {n}] (the key's "
                                   "tokens)")
            reserved: list[tuple[StoredObject, int]] = []
            objects, skipped, full = [], 0, None
            try:
                for obj, start, count in self._reserve_chunks(ck.iter_chunk_hashes(self.config.chunk_size), n,
                                                              inst.layout, skip_first_n_tokens):
                    if obj is None:
                        skipped += count
                        continue
                    reserved.append((obj, count))
                    objects.append([obj.offset, obj.nbytes, count, start])
            except StoreFull as exc:
                full = str(exc)  # reserve what fits, from the prompt's start; the rest is not stored
            with self._lock:
                rid = self._next_reservation
                self._next_reservation += 1
                self._reservations[rid] = _Reservation(instance_id, self.transport.current_client(), ck.request_id,
                                                       reserved)
        finally:
            self._release(inst)
        return {"reservation": rid, "objects": objects, "skipped_tokens": skipped, "full": full,
                "pool": self._pool_ref()}

    def commit_store(self, reservation: int, landed: bool) -> dict[str, Any]:
        """Commit a reservation whose copies the engine saw complete, or drop it (``landed`` false)."""
        with self._lock:
            res = self._reservations.get(reservation)
            caller = self.transport.current_client()
            if res is None:
                raise RequestError(f"no store reservation {reservation} (committed or dropped already, or its "
                                   "instance was unregistered)")
            if res.owner is not None and caller is not None and caller != res.owner:
                raise RequestError(f"store reservation {reservation} belongs to another connection")
            del self._reservations[reservation]
        stored = stored_bytes = 0
        for obj, count in res.objects:
            if landed:
                self.store.commit(obj)
                stored, stored_bytes = stored + count, stored_bytes + obj.nbytes
            else:
                self.store.abandon(obj)
        if not landed and res.objects:
            log.warning("store reservation %d for request %s dropped: the engine says no copy landed in it",
                        reservation, res.request_id)
        return {"stored_tokens": stored, "stored_bytes": stored_bytes}

    def _drop_reservations(self, instance_id: int) -> None:
        """An instance went away (unregistered, or replaced by a restarted engine): its reservations go too."""
        with self._lock:
            dropped = [r for k, r in list(self._reservations.items()) if r.instance_id == instance_id
                       and self._reservations.pop(k)]
        for res in dropped:
            for obj, _ in res.objects:
                self.store.abandon(obj)
        if dropped:
            log.warning("instance %d went away with %d store reservation(s) not committed: dropped", instance_id,
                        len(dropped))

    @hands_over_turn
    def retrieve(self, key: dict[str, Any], instance_id: int, block_ids: list[list[int]],
                 event_handle: bytes | None, skip_first_n_tokens: int, arrival_board: dict[str, Any] | None,
                 layer_event_handles: list[bytes] | None, layers_per_stage: int) -> dict[str, Any] | Deferred:
        ck = CacheKey.from_wire(key)
        try:
            inst = self._acquire(instance_id)
        except Exception:
            self._release_locks(ck.request_id)
            raise
        return self._while_in_use(inst, lambda: self._retrieve(inst, ck, block_ids, event_handle, skip_first_n_tokens,
                                                               arrival_board, layer_event_handles, layers_per_stage))

    def _retrieve(self, inst: _Instance, ck: CacheKey, block_ids: list[list[int]], event_handle: bytes | None,
                  skip_first_n_tokens: int, arrival_board: dict[str, Any] | None,
                  layer_event_handles: list[bytes] | None, layers_per_stage: int) -> dict[str, Any] | Deferred:
        board: ArrivalBoard | None = None
        keep_locks = False
        copying = False
        try:
            # Everything is checked before anything is written: a rejected RETRIEVE writes no board word,
            # no cache byte and no mailbox slot.
            if not 0 <= skip_first_n_tokens <= ck.num_tokens:
                raise RequestError(f"skip_first_n_tokens {skip_first_n_tokens} is not in [0, {ck.num_tokens}] "
                                   "(the key's tokens)")
            if layers_per_stage < 0:
                raise RequestError(f"layers_per_stage must be >= 0 (0: chunk-major), got {layers_per_stage}")
            if arrival_board is not None:
                board = self._board(arrival_board)
            if inst.placement == PLACEMENT_WORKER:
                result = self._retrieve_for_worker(ck, inst, block_ids, skip_first_n_tokens)
                keep_locks = True  # the worker copies now; FREE_LOOKUP_LOCKS or END_SESSION unpins
                return result
            plan = self._plan_retrieve(ck, inst, block_ids, skip_first_n_tokens, board, event_handle,
                                       layer_event_handles, layers_per_stage)
            copying = True  # from here on a failure is the transfer's, reported on its (verified) board
            done, settle = self._retrieve_into_cache(ck, inst, board, arrival_board, plan)
            keep_locks = True  # from here the settle below releases them, however it ends
        except Exception:
            if copying and board is not None:
                board.fail(arrival_board["slot"], arrival_board["generation"])
            raise
        finally:
            if not keep_locks:
                self._release_locks(ck.request_id)
        return self._answer(inst.target, done,
                            self._settling_retrieve(settle, ck.request_id, board, arrival_board))

    def _while_in_use(self, inst: _Instance, transfer: Callable[[], dict[str, Any] | Deferred]) -> dict[str, Any] | Deferred:
        """Run a transfer on an acquired instance; let the instance go once the transfer has ended (at once,
        or when its Deferred settles), so that an UNREGISTER meanwhile closes its target only after that."""
        try:
            reply = transfer()
        except BaseException:
            self._release(inst)
            raise
        if not isinstance(reply, Deferred):
            self._release(inst)
            return reply
        settle = reply.settle

        def settle_then_release() -> dict[str, Any]:
            try:
                return settle()
            finally:
                self._release(inst)

        reply.settle = settle_then_release
        return reply

    @staticmethod
    def _answer(target: Target, done: Completion, settle: Callable[[], dict[str, Any]]) -> dict[str, Any] | Deferred:
        """A transfer's reply: from the transport's polling thread once a device target's copies are done,
        or now from a target that copied inside the executor's calls."""
        return Deferred(settle, done.ready, done.handle) if target.enqueues else settle()

    def _settling_retrieve(self, settle: Callable[[], dict[str, Any]], request_id: str, board: ArrivalBoard | None,
                           board_ref: dict[str, Any] | None) -> Callable[[], dict[str, Any]]:
        """A retrieve's settle with the failure and lock handling retrieve() gives its start."""

        def run() -> dict[str, Any]:
            try:
                return settle()
            except Exception:
                if board is not None and board_ref is not None:
                    board.fail(board_ref["slot"], board_ref["generation"])
                raise
            finally:
                self._release_locks(request_id)

        return run

    # --- retrieve paths --------------------------------------------------------------

    def _locked_objects(self, ck: CacheKey, layout: PagedKVLayout) -> list[StoredObject]:
        digests = ck.chunk_hashes(self.config.chunk_size, self._looked_up.get(ck.request_id))
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
        """Worker placement: hand back where the objects are; the locks stay until FREE_LOOKUP_LOCKS."""
        # block_ids name the worker's own cache, which only the worker can check
        objects = self._locked_objects(ck, inst.layout)
        return {"retrieved_tokens": max(ck.num_tokens - skip, 0), "layers_per_stage": 0, "fallback": None,
                "objects": [[o.offset, o.nbytes, o.num_tokens] for o in objects], "pool": self._pool_ref()}

    def _plan_retrieve(self, ck: CacheKey, inst: _Instance, block_ids: list[list[int]], skip: int,
                       board: ArrivalBoard | None, event_handle: bytes | None,
                       layer_event_handles: list[bytes] | None, layers_per_stage: int) -> "_RetrievePlan":
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
        width = layers_per_stage
        fallback = None
        if width > 0:
            if board is None:
                raise RequestError("layers_per_stage > 0 needs an arrival board reference")
            fallback = planner.layer_major_fallback_reason(layout, native_available=inst.target.native_available)
            if fallback is not None:
                planner.log_fallback_once(fallback)
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
            # The engine may run now; another thread takes the socket only after this point.
            self.transport.release_turn()

        if not target.enqueues:
            self.transport.release_turn()  # this target copies in the call: free the socket first
        started = time.perf_counter()
        executor = target.executor(objects)
        try:
            planner.run_transfer(executor, job, width, on_layer_batch, ck.request_id)
        finally:
            executor.close()
        if plan.end_events is not None:
            target.record(plan.end_events)
        reply = {"retrieved_tokens": job.num_tokens, "layers_per_stage": width, "fallback": fallback,
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

    def _end_signals(self, board: ArrivalBoard | None, board_ref: dict[str, Any] | None, num_layers: int,
                     reply: dict[str, Any]) -> list[HostSignal]:
        """What the device should store itself when this retrieve's copies end (see ``Target.completion``).

        Layer-major: the board slot's "complete" word, which the worker settles on.
        Chunk-major: the request's id, in a slot of the client's mailbox that holds
        the reply already (:class:`~kvstrata.core.wire.rings.Mailbox`). Either way an
        engine polling its memory learns of the end with no server thread between
        the copy's end and it; the reply still follows as usual.
        """
        if board is not None:
            slot, generation = board_ref["slot"], board_ref["generation"]
            return [HostSignal(board.segment, board.word_offset(slot), pack(generation, num_layers, complete=True))]
        mail = self.transport.mailbox_slot()
        if mail is not None and mail.fill(reply):
            return [HostSignal(mail.segment, mail.word_offset, mail.request_id)]
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
            inst.target.close()
            log.info("instance %d's cache closed: its last transfer has ended", inst.instance_id)

    def _retire(self, inst: _Instance) -> None:
        """Close an unregistered or replaced instance's target now, or once its transfers end."""
        self._drop_reservations(inst.instance_id)
        with self._lock:
            inst.retired = True
            close = inst.transfers == 0
        if close:
            inst.target.close()
        else:
            log.info("instance %d's cache stays open until its %d transfer(s) in flight end", inst.instance_id,
                     inst.transfers)

    def _check_owner(self, inst: _Instance) -> None:
        caller = self.transport.current_client()
        if inst.owner is not None and caller is not None and caller != inst.owner:
            raise RequestError(f"instance {inst.instance_id} belongs to another connection (the one that "
                               "registered it); this client may not use or unregister it")

    def _board(self, ref: dict[str, Any]) -> ArrivalBoard:
        """The arrival board a RETRIEVE names, mapped only once its header says it is one, with the slot and
        generation checked against it (see ``kvstrata.core.shm``); raises before writing anything."""
        if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
            raise RequestError(f"arrival_board must be {{'name', 'slot', 'generation'}}, got {ref!r}")
        name = ref["name"]
        if name == self.store.segment.name:
            raise RequestError(f"arrival board {name} is the server's own L1 pool, not an arrival board")
        with self._lock:
            board = self._boards.get(name)
        if board is None:
            try:
                board = ArrivalBoard.attach(name)
            except (SegmentKindError, ValueError, OSError) as exc:
                raise RequestError(f"arrival board refused: {exc}") from None
            with self._lock:
                board = self._boards.setdefault(name, board)
        try:
            board.check_ref(ref.get("slot"), ref.get("generation"))
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return board
