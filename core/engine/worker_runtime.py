"""The worker side of an engine: its KV cache, the loads into it, the stores out of it.

One :class:`WorkerRuntime` per engine worker process (one per tensor-parallel
rank), called from the engine's model-runner thread:

* :meth:`register` once, when the engine has allocated its cache;
* :meth:`start_loads` every step, with the loads the scheduler side planned,
  and :meth:`reserve_stores` with the stores it planned (engine placement
  reserves their objects while the forward runs);
* :meth:`wait_for_layer` right before the engine's attention reads a layer;
* :meth:`poll` every step after the forward: which requests go back to the
  engine's scheduler now (first slice landed), and which finished requests'
  blocks may now be freed (their transfers stopped writing them);
* :meth:`take_load_failures` every step: failed loads, already turned into
  what the engine's failure path takes (``kvstrata_report_load_failure``);
* :meth:`store` after a forward that finished prompts.

Every wait is bounded; a transfer that fails turns into a failure report the
engine recomputes or fails by, never into a hang. If the server is down at
start-up or goes away, the engine keeps serving without kvstrata and the
runtime reconnects (and registers again) at most every
:data:`RECONNECT_INTERVAL` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterable, NamedTuple

from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.adapter_api.types import KVCacheDescription
from kvstrata.core.arrival.events import EventBackend
from kvstrata.core.engine.choose_placement import choose_placement, make_placement
from kvstrata.core.engine.placement import Placement
from kvstrata.core.engine.record import EventRecord
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.engine.requests import LoadSpec, StoreSpec, shard_key
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.stats import RuntimeStats, StatsAccumulator
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.layouts import PLACEMENT_ENGINE
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.wire.transport import RemoteError

log = logging.getLogger(__name__)

RECONNECT_INTERVAL = 10.0

UNUSED_RESERVATION_STEPS = 4
"""A store reservation no store has used after this many more steps is given back (its objects are locked in the
server's pool until then)."""


class _AheadReservation(NamedTuple):
    """A RESERVE_STORE :meth:`WorkerRuntime.reserve_stores` sent before the forward."""

    key: CacheKey
    reply: Future
    step: int


class WorkerRuntime:
    def __init__(self, adapter: Adapter, settings: RuntimeSettings, *, model: str, rank: int = 0,
                 world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world size {world_size})")
        self.adapter = adapter
        self.settings = settings
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.instance_id = settings.instance_id + rank
        self.client = CacheClient(settings.server_address, timeout=settings.retrieve_timeout,
                                  **settings.client_options())
        self.record = EventRecord(settings.record_path)
        self.transfers: Placement | None = None
        """The placement that copies this cache's loads and stores, once registered with the server (None while
        it is unreachable)."""
        self.description: KVCacheDescription | None = None
        self.placement: str | None = None
        """The placement's name, chosen once by :meth:`register`."""
        self.event_backend: EventBackend | None = None
        self._engine_ids: dict[str, Any] = {}
        self._released: set[str] = set()
        self._finished_unreleased: set[str] = set()
        self._unloadable: dict[str, tuple[list[list[int]], str]] = {}
        self._failure_reports: list[Any] = []
        self._next_connect = 0.0
        self._refused: str | None = None
        """Why the server refused to register the cache (its error message), while it does."""
        self._reservations: dict[str, _AheadReservation] = {}
        """Engine placement: RESERVE_STOREs sent ahead of their stores (:meth:`reserve_stores`), by request id."""
        self._reservations_lock = threading.Lock()  # the engine's thread reserves, a store thread may store
        self._reserve_steps = 0
        self.stats = StatsAccumulator()
        """Engine-side numbers (see :mod:`kvstrata.core.engine.stats`)."""

    # --- registration ------------------------------------------------------------------

    def register(self, kv_caches: Any) -> None:
        """Describe the engine's cache (the adapter's hooks), then connect if the server answers."""
        self.placement, self.description = choose_placement(self.adapter, self.settings.placement, kv_caches)
        self.event_backend = self.adapter.event_backend(self.description.device)
        if self.settings.pace_loads and self.placement != PLACEMENT_ENGINE:
            log.warning("kvstrata pace_loads applies to engine placement only; placement %s starts every load at "
                        "once", self.placement)
        if not self._connect() and self._refused is None:  # a refusal was logged with the server's reason
            log.warning("kvstrata server %s is not reachable; the engine computes every prompt until it is "
                        "(retrying every %.0fs)", self.settings.server_address, RECONNECT_INTERVAL)

    def connect(self) -> bool:
        """Registered with the server, or registering now (at most every RECONNECT_INTERVAL seconds)?

        For an engine whose loads cannot be refused once started (SGLang aborts a request whose load fails):
        its adapter asks this before it accepts a load, so a server that is down means computing, not failing.
        """
        return self._connect()

    def _connect(self) -> bool:
        """Build the transfer machinery and register with the server; False (retry later) if it is down or
        refused the registration (say, its instance id is another live engine's: the server's reason is logged)."""
        if self.transfers is not None:
            return True
        now = time.monotonic()
        if now < self._next_connect:
            return False
        self._next_connect = now + RECONNECT_INTERVAL
        s, d = self.settings, self.description
        transfers = None
        try:
            transfers = make_placement(
                self.placement, self.client, self.instance_id, d.layout, event_backend=self.event_backend,
                local_regions=d.local_regions, own_registration_area=True, setup_timeout=s.lookup_timeout,
                pool_slots=s.pool_slots, layer_wait_timeout=s.layer_wait_timeout,
                retrieve_timeout=s.retrieve_timeout, pool_writable=s.store, pace_loads=s.pace_loads)
            transfers.register()
        except Exception as exc:
            if transfers is not None:  # its arrival slots, copy threads or area: the next try builds new ones
                try:
                    transfers.close()
                except Exception as again:  # noqa: BLE001 - what it held is lost either way
                    log.debug("closing the transfers of a failed registration: %s", again)
            if isinstance(exc, RemoteError):  # the server answered: it refused, and says why
                self._registration_refused(exc)
            else:
                log.debug("connecting to kvstrata at %s failed: %s", s.server_address, exc)
            return False
        self._refused = None
        self.transfers = transfers
        layout = d.layout
        log.info("registered %d layers (%s, %d blocks of %d tokens, rank %d of %d) with kvstrata at %s as "
                 "instance %d, %s placement", layout.num_layers, layout.format, layout.num_blocks, layout.block_size,
                 self.rank, self.world_size, s.server_address, self.instance_id, self.placement)
        self.record.write("registered", instance_id=self.instance_id, placement=self.placement, rank=self.rank)
        return True

    def _registration_refused(self, exc: RemoteError) -> None:
        reason = str(exc)
        if reason != self._refused:  # once per reason, not at every retry
            log.warning("kvstrata server %s refused to register this cache as instance %d (rank %d of %d): %s "
                        "[%s]; the engine computes every prompt until it is registered (retrying every %.0fs)",
                        self.settings.server_address, self.instance_id, self.rank, self.world_size, reason,
                        exc.code, RECONNECT_INTERVAL)
            self.record.write("register_refused", instance_id=self.instance_id, rank=self.rank, reason=reason,
                              code=exc.code)
        else:
            log.debug("kvstrata server %s still refuses instance %d: %s", self.settings.server_address,
                      self.instance_id, reason)
        self._refused = reason

    def _register_again(self, why: str) -> bool:
        log.warning("kvstrata server %s no longer knows instance %d (%s); registering again",
                    self.settings.server_address, self.instance_id, why)
        try:
            self.transfers.register()
        except Exception as exc:
            log.warning("registering again with kvstrata at %s failed: %s", self.settings.server_address, exc)
            return False
        self.record.write("registered", instance_id=self.instance_id, placement=self.placement, rank=self.rank)
        return True

    @property
    def registration_area(self) -> RegistrationArea | None:
        """What an engine-placement cache registered in its stead (None otherwise, or while unregistered)."""
        return self.transfers.registration_area if self.transfers is not None else None

    @property
    def layout(self) -> Any:
        return self.description.layout if self.description else None

    @property
    def connected(self) -> bool:
        return self.transfers is not None

    # --- loads -------------------------------------------------------------------------

    def start_loads(self, loads: Iterable[LoadSpec], *, running: bool = False) -> None:
        """Start this step's loads (the scheduler side planned them); returns at once.

        ``running``: the engine computes these requests in this very step (a synchronous match): layer waits
        cover them at once, :meth:`poll` never hands them back, and their blocks are freeable once settled.
        """
        loads = list(loads)
        for spec in loads:
            self._engine_ids[spec.request_id] = spec.engine_request_id
            if running:
                self._released.add(spec.request_id)
        if loads and not self._connect():
            for spec in loads:  # the server went away after the lookup: the engine recomputes these
                self._unloadable[spec.request_id] = (
                    spec.block_ids.as_lists(),
                    "server not reachable" if self._refused is None else f"registration refused: {self._refused}")
            return
        for spec in loads:
            key = self._shard_key(spec)
            located = spec.located[self.rank] if spec.located and self.rank < len(spec.located) else None
            self.transfers.submit_retrieve(spec.request_id, key, spec.block_ids, skip_first_n_tokens=spec.skip,
                                           layers_per_slice=spec.layers_per_slice, running=running,
                                           located=located)
            self.stats.bump(loads_started=1)
            self.record.write("load_started", request_id=spec.request_id, rank=self.rank, tokens=spec.num_tokens,
                              skip=spec.skip, layers_per_slice=spec.layers_per_slice, running=running,
                              located_by=getattr(self.transfers.records.get(spec.request_id), "located_by", None))

    def wait_for_layer(self, layer: int) -> None:
        """Before the engine reads ``layer``: every released, in-flight load must have landed it (bounded)."""
        t = self.transfers
        if t is None:
            return
        started = time.perf_counter()
        in_flight = t.draining() if self.record.enabled else ()
        t.wait_for_layer(layer)
        self.stats.bump(layer_waits=1, layer_wait_seconds=time.perf_counter() - started)
        if self.record.enabled:
            self.record.write("wait_for_layer_load", layer=layer, rank=self.rank, in_flight=sorted(in_flight))

    def settle(self, request_ids: Iterable[Any]) -> None:
        """Block (bounded) until these requests' transfers stopped writing: their blocks are about to be reused."""
        if self.transfers is not None:
            self.transfers.wait_settled({self.adapter.request_id(r) for r in request_ids})

    def poll(self, finished: Iterable[Any] = ()) -> tuple[set[Any], set[Any]]:
        """One engine step: (requests whose blocks may be freed now, requests that go back to the scheduler now).

        ``finished`` are the requests the engine finished or aborted since the last poll. A released request
        that finishes while its transfer still writes is returned in the first set once it settled; one that
        finishes before its release goes back (second set) only once settled, never at its first slice.
        """
        unloadable = set(self._unloadable)
        self._collect_failures()
        t = self.transfers
        if t is None:
            return set(), {self._engine(r) for r in unloadable}
        released = set(t.get_finished()) | unloadable
        for rid in released:
            rec = t.records.get(rid)
            if rec is not None and rec.released_at is not None:
                self.stats.bump(loads_released=1, release_seconds=rec.released_at - rec.submitted_at,
                                loads_released_before_complete=int(bool(rec.released_before_complete)))
            self.record.write("released", request_id=rid, rank=self.rank,
                              released_before_complete=bool(rec and rec.released_before_complete),
                              failure=rec.failure if rec else None)
        self._released |= released - self._finished_unreleased
        self._finished_unreleased -= released
        freeable: set[str] = set()
        for engine_id in finished:
            rid = self.adapter.request_id(engine_id)
            state = t.finish_request(rid)
            if state == "recving":
                self._finished_unreleased.add(rid)  # the engine frees its blocks when it gets it back
            if rid in self._released and state is None:
                freeable.add(rid)
                self._released.discard(rid)
        drained = t.take_drained()
        freeable |= drained
        self._released -= drained
        self._collect_failures()
        self._record_settled()
        out = ({self._engine(r) for r in freeable}, {self._engine(r) for r in released})
        for rid in freeable:
            self._engine_ids.pop(rid, None)
        return out

    def _engine(self, rid: str) -> Any:
        return self._engine_ids.get(rid, rid)

    def _collect_failures(self) -> None:
        failed = dict(self._unloadable)
        self._unloadable.clear()
        lost = False
        if self.transfers is not None:
            failed.update(self.transfers.take_failed())
            lost = self.transfers.take_registration_lost()
        for rid, (blocks, reason) in failed.items():
            self.stats.bump(loads_failed=1)
            self.record.write("load_failed", request_id=rid, rank=self.rank, reason=reason)
            self._failure_reports.append(self.adapter.report_load_failure(self._engine(rid), blocks, reason))
        if lost:
            self._register_again("a load was refused for an unknown instance")

    def _record_settled(self) -> None:
        t = self.transfers
        in_flight = t.in_flight()
        for rid, rec in list(t.records.items()):
            if rec.completed_at is None and rec.failure is None:
                continue
            if rid in in_flight:
                # settled but not handed back yet (it completed between this poll's release check and its
                # settle): the poll that releases it reads this record for the release's numbers
                continue
            self.record.write("settled", request_id=rid, rank=self.rank, layer_waits=rec.layer_waits,
                              failure=rec.failure, fallback=rec.fallback,
                              released_before_complete=rec.released_before_complete,
                              release_ms=None if rec.released_at is None
                              else (rec.released_at - rec.submitted_at) * 1e3,
                              complete_ms=None if rec.completed_at is None
                              else (rec.completed_at - rec.submitted_at) * 1e3)
            del t.records[rid]

    def take_load_failures(self) -> list[Any]:
        """Failed loads since the last call, as ``kvstrata_report_load_failure`` turned them."""
        self._collect_failures()
        out, self._failure_reports = self._failure_reports, []
        return out

    def in_flight(self) -> set[str]:
        return self.transfers.in_flight() if self.transfers is not None else set()

    # --- stores ------------------------------------------------------------------------

    def reserve_stores(self, stores: Iterable[StoreSpec]) -> None:
        """Before the forward that computes these prompts: where the placement reserves ahead (engine
        placement), send their RESERVE_STOREs now and return at once, so the round trip runs during the forward
        and :meth:`store` only copies and commits. Elsewhere (server placement, not connected yet) nothing:
        :meth:`store` does it all.

        Call it every step, with the same specs :meth:`store` gets after the forward (an engine without a step
        hook calls it right before it waits for the forward's writes: SGLang's offloads). Reserved objects are
        locked in the server's pool, so a reservation no store used is given back: when the same request
        reserves again, once :data:`UNUSED_RESERVATION_STEPS` more steps have reserved (a forward that
        raised, say), and at :meth:`close`. One a store has taken is never given back under it."""
        if self.transfers is None or not self.transfers.reserves_ahead or not self.settings.store:
            return
        self._reserve_steps += 1
        step = self._reserve_steps
        stores = list(stores)
        with self._reservations_lock:
            again = {spec.request_id for spec in stores}
            unused = {rid: r for rid, r in self._reservations.items()
                      if rid in again or r.step < step - UNUSED_RESERVATION_STEPS}
            for rid in unused:
                del self._reservations[rid]
        late = sorted(rid for rid, r in unused.items() if rid not in again)
        if late:
            log.warning("gave back the store reservations of %s: no store used them within %d steps", late,
                        UNUSED_RESERVATION_STEPS)
        # first: while a reservation holds a prompt's chunks, a new one for it would skip them
        for r in unused.values():
            self.transfers.drop_reservation(r.reply)
        for spec in stores:
            key = self._shard_key(spec)
            try:
                ahead = self.transfers.reserve_store(key, spec.skip)
            except Exception as exc:  # not sent: store() reserves then, and reports what fails
                log.debug("reserving ahead for %s: %s", spec.request_id, exc)
                continue
            with self._reservations_lock:
                self._reservations[spec.request_id] = _AheadReservation(key, ahead, step)

    def drop_store_reservation(self, request_id: str) -> None:
        """Give back the reservation :meth:`reserve_stores` made for ``request_id`` at once (its store will not
        come: the offload that planned it failed before its copies); nothing if it holds none."""
        with self._reservations_lock:
            ahead = self._reservations.pop(request_id, None)
        if ahead is not None and self.transfers is not None:
            self.transfers.drop_reservation(ahead.reply)

    def store(self, stores: Iterable[StoreSpec]) -> None:
        """STORE prompts the engine just computed. A failed store is logged; serving goes on."""
        stores = list(stores)
        if not stores or not self._connect():
            return
        self.transfers.prepare_stores()  # server placement: the forward's writes must have landed
        for spec in stores:
            with self._reservations_lock:
                ahead = self._reservations.pop(spec.request_id, None)
            try:
                reply = self._store_one(spec, ahead)
            except RemoteError as exc:
                if exc.code != "unknown_instance" or not self._register_again("a STORE was refused"):
                    self._store_failed(spec, exc)
                    continue
                try:  # a STORE is idempotent: send it again to the server that now knows the cache
                    reply = self._store_one(spec, None)
                except Exception as again:
                    self._store_failed(spec, again)
                    continue
            except Exception as exc:
                self._store_failed(spec, exc)
                continue
            self.stats.bump(stores=1)
            self.record.write("stored", request_id=spec.request_id, rank=self.rank, **reply)

    def _shard_key(self, spec: LoadSpec | StoreSpec) -> CacheKey:
        """This rank's key of a load's or a store's prompt (the same key: a load reads what a store wrote)."""
        return shard_key(spec.request_id, self.model, spec.tokens, spec.salt, rank=self.rank,
                         world_size=self.world_size, instance_id=self.settings.instance_id,
                         page_hashes=spec.page_hashes, page_size=spec.page_size,
                         attempt=getattr(spec, "attempt", 0))  # a StoreSpec's: attempt 0

    def _store_one(self, spec: StoreSpec, ahead: _AheadReservation | None) -> dict[str, Any]:
        """One STORE; ``ahead``: the reservation :meth:`reserve_stores` sent for it."""
        key, reservation = (ahead.key, ahead.reply) if ahead is not None else (self._shard_key(spec), None)
        return self.transfers.store(key, spec.block_ids, skip_first_n_tokens=spec.skip, reservation=reservation)

    def take_stats(self) -> RuntimeStats:
        """The engine-side numbers since the last call (an engine's stats interval)."""
        return self.stats.take_interval()

    def _store_failed(self, spec: StoreSpec, exc: BaseException) -> None:
        self.stats.bump(stores_failed=1)
        log.warning("STORE of %s failed (%s); the prompt stays uncached", spec.request_id, exc)
        self.record.write("store_failed", request_id=spec.request_id, rank=self.rank, reason=str(exc))

    def close(self) -> None:
        """At engine shutdown: let loads in flight settle (bounded), then unregister the cache."""
        if self.transfers is not None:
            with self._reservations_lock:
                unused, self._reservations = list(self._reservations.values()), {}
            for r in unused:
                self.transfers.drop_reservation(r.reply)
            self.transfers.wait_all(timeout=self.settings.layer_wait_timeout)
            self.transfers.close()
            try:
                self.client.transport.call(RequestType.UNREGISTER_KV_CACHE, [self.instance_id],
                                           timeout=self.settings.lookup_timeout)
            except Exception as exc:  # the server is gone or restarted: nothing of ours is left to free
                log.debug("unregistering instance %d at shutdown: %s", self.instance_id, exc)
        self.client.close()
        self.record.close()
