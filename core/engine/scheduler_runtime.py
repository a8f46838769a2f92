"""The scheduler side of an engine: what kvstrata can load for a request, what to store, when blocks may go.

One :class:`SchedulerRuntime` per engine, called from the engine's scheduling
thread, so nothing here blocks: LOOKUP goes out asynchronously and the engine
asks again next step (:meth:`lookup` returns ``None``) until every rank's reply
is in, bounded by ``lookup_timeout``; a server that does not answer in time is
left alone for five timeouts (the engine computes meanwhile), and that is
logged once until it answers again.

With tensor parallelism each rank stores and loads its own shard under its own
key; a hit is what every rank's shard has (the smallest of the ranks' hits).

Lookup locks are released on every path: a hit the engine will not use, a
request that finishes before its load was planned, a lookup that timed out
(FREE_LOOKUP_LOCKS). Once a load is planned, the worker side owns its locks (the
RETRIEVE, or FREE_LOOKUP_LOCKS after a engine-placement copy), so a chunk is
never unpinned under a copy in flight.

A request the engine admits again (vLLM re-admits one whose load failed, or
that it preempted, and asks :meth:`SchedulerRuntime.lookup` again) starts
afresh: a new LOOKUP under a new *attempt* of its lock owner
(:func:`~kvstrata.core.engine.requests.lock_owner`), whose hit gets a load of
its own. The earlier attempt's locks are freed if no load was planned for them
(else the worker side frees them), and a late release of them can never free
the new attempt's.

Engines differ in three ways this side serves with the same machinery (no
engine-specific branch): an engine that names a prompt by its own page-hash
chain instead of its token ids (SGLang) looks it up with :meth:`lookup_pages`;
one whose API must answer a lookup at once, not "ask again" (SGLang's linker,
its HiCache backend), waits for the LOOKUPs it sent with
:meth:`wait_for_lookups` and then asks again, which answers; and one that runs a
scheduler per tensor-parallel rank (SGLang) gives its runtime that ``rank``, so
it looks up and plans loads of that rank's shard only.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.engine.requests import (ChunkLocations, LoadSpec, PromptRequest, StoreSpec, lock_owner,
                                           shard_key, shard_keys)
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.store.keys import CacheKey, pack_tokens
from kvstrata.core.transfer.block_table import BlockTable
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType

log = logging.getLogger(__name__)

BACK_OFF_TIMEOUTS = 5
"""After a LOOKUP timed out, new requests skip kvstrata for this many lookup timeouts."""


@dataclass
class _Pending:
    futures: list[Future]
    started: float


@dataclass
class _Hit:
    request: PromptRequest
    engine_request_id: Any
    tokens: int
    local: int
    """Tokens the engine had computed itself (its own prefix cache) when the hit was reported."""
    located: tuple[ChunkLocations | None, ...]
    """Per rank, where its LOOKUP found the hit in the pool (see :class:`ChunkLocations`)."""
    attempt: int = 0
    """The lookup attempt whose locks hold the hit (:func:`lock_owner`)."""
    page_hashes: tuple[str, ...] | None = None
    """The prompt's page-hash chain when it was looked up by it (:meth:`SchedulerRuntime.lookup_pages`)."""


@dataclass(frozen=True)
class ScheduledRequest:
    """A request the engine scheduled this step, and how far its prompt will be computed by the end of it."""

    engine_request_id: Any
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class StepPlan:
    """What the worker side does this step: loads to start, stores to make, preempted requests to settle."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted: list[Any] = field(default_factory=list)


class SchedulerRuntime:
    def __init__(self, adapter: Adapter, settings: RuntimeSettings, *, model: str, block_size: int,
                 world_size: int = 1, rank: int | None = None) -> None:
        """``rank``: this runtime serves that tensor-parallel rank only (an engine that runs one scheduler per
        rank, each loading its own shard: SGLang); it looks up, locks and plans loads of that rank's key alone.
        ``None``: one scheduler for every rank (vLLM, TensorRT-LLM)."""
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world size {world_size})")
        self.adapter = adapter
        self.settings = settings
        self.model = model
        self.block_size = block_size
        self.world_size = world_size
        self.rank = rank
        self._ranks: tuple[int, ...] = tuple(range(world_size)) if rank is None else (rank,)
        """The ranks whose shards this runtime looks up (their lock owners are its to free)."""
        self.client = CacheClient(settings.server_address, timeout=settings.lookup_timeout,
                                  **settings.client_options())
        self.chunk_size: int | None = None
        self._requests: dict[str, tuple[Any, PromptRequest]] = {}
        self._lookups: dict[str, _Pending] = {}
        self._hits: dict[str, _Hit] = {}
        self._pending_loads: list[LoadSpec] = []
        self._attempts: dict[str, int] = {}
        """Request id -> its current lookup attempt (its lock owners, :func:`lock_owner`), from its first lookup
        until it finished."""
        self._looked_up: set[str] = set()
        """Requests whose current attempt sent a LOOKUP whose locks are not freed yet (by this side or, once its
        load is planned, the worker side)."""
        self._loads_planned: dict[str, int] = {}
        """Request id -> the attempt of its last load planned (the worker side owns that attempt's locks)."""
        self._loads_sent: set[str] = set()
        """Requests with a load handed to the worker side (in a step's plan), of any attempt."""
        self._released: set[str] = set()
        self._stored: set[str] = set()
        self._unreachable_logged = False
        self._hash_page_noted = False
        self._down_until = 0.0

    # --- admission ---------------------------------------------------------------------

    def lookup(self, engine_request_id: Any, token_ids: Sequence[int], num_computed_tokens: int,
               salt: str | None = None) -> int | None:
        """Tokens kvstrata can load for this request beyond the ``num_computed_tokens`` the engine has.

        ``None``: ask again next step (the LOOKUP is out). ``0``: nothing to load (miss, no gain, server
        down). A positive count is block-aligned and what every rank's shard holds.
        """
        rid = self.adapter.request_id(engine_request_id)
        return self._lookup(engine_request_id, PromptRequest(rid, token_ids, salt), len(token_ids),
                            num_computed_tokens, None)

    def lookup_pages(self, engine_request_id: Any, page_hashes: Sequence[str], num_computed_tokens: int = 0,
                     salt: str | None = None) -> int | None:
        """:meth:`lookup` for an engine that names a prompt by its page-hash chain instead of its token ids
        (SGLang's storage hashes: page i's hash covers every token up to the end of page i; one page is
        ``block_size`` tokens). The keys are :meth:`CacheKey.for_page_hashes`, and a load planned from the hit
        carries the hashes (``LoadSpec.page_hashes``). Same answers as :meth:`lookup`, in tokens."""
        rid = self.adapter.request_id(engine_request_id)
        hashes = tuple(page_hashes)
        return self._lookup(engine_request_id, PromptRequest(rid, (), salt), len(hashes) * self.block_size,
                            num_computed_tokens, hashes)

    def _note_hash_page(self, hash_page: int, by_page_hashes: bool) -> None:
        """Say once if this engine's chunks cannot be other engines' hits: an engine naming prompts by its own
        page-hash chain (SGLang) shares chunks with engines naming them by token ids only where its page is the
        server's hash page (``kvstrata serve --page-hash-tokens``)."""
        if self._hash_page_noted or not by_page_hashes:
            return
        self._hash_page_noted = True
        if self.block_size != hash_page:
            log.warning("this engine's page is %d tokens, the kvstrata server hashes prompts in pages of %d "
                        "(--page-hash-tokens): what it stores is a hit for engines of its own page size only, "
                        "not for vLLM or TensorRT-LLM engines on the same server", self.block_size, hash_page)

    def _lookup(self, engine_request_id: Any, request: PromptRequest, num_prompt_tokens: int,
                num_computed_tokens: int, page_hashes: tuple[str, ...] | None) -> int | None:
        rid = request.request_id
        self._requests[rid] = (engine_request_id, request)
        if rid not in self._lookups:
            self._new_attempt(rid)
        bs = self.block_size
        loadable = self.adapter.loadable_tokens(num_prompt_tokens, bs)
        if loadable <= num_computed_tokens:
            return 0
        pending = self._lookups.get(rid)
        if pending is None:
            if time.monotonic() < self._down_until:
                return 0  # the server just failed to answer: compute, and try again after the back-off
            keys = self._keys(request, loadable, page_hashes)
            futures = [self.client.transport.submit(RequestType.LOOKUP, [k.to_wire()]) for k in keys]
            self._lookups[rid] = _Pending(futures, time.monotonic())
            self._looked_up.add(rid)
            return None
        if not all(f.done() for f in pending.futures):
            if time.monotonic() - pending.started < self.settings.lookup_timeout:
                return None
            self._lookups.pop(rid)
            self._end_session(rid)
            self._down_until = time.monotonic() + self.settings.lookup_timeout * BACK_OFF_TIMEOUTS
            if not self._unreachable_logged:
                self._unreachable_logged = True
                log.warning("kvstrata server %s did not answer LOOKUP within %.1fs; computing prompts instead "
                            "(logged once until it answers again)", self.settings.server_address,
                            self.settings.lookup_timeout)
            return 0
        self._lookups.pop(rid)
        try:
            replies = [f.result() for f in pending.futures]
        except Exception as exc:
            log.warning("LOOKUP for %s failed (%s); computing the prompt instead", rid, exc)
            self._end_session(rid)
            return 0
        self._unreachable_logged = False
        self.chunk_size = int(replies[0]["chunk_size"])
        self._note_hash_page(int(replies[0].get("hash_page", self.chunk_size)), page_hashes is not None)
        hit = (min(min(int(r["hit_tokens"]) for r in replies), loadable) // bs) * bs
        external = hit - num_computed_tokens
        if external <= 0:
            self._free_locks(rid)
            return 0
        by_rank = dict(zip(self._ranks, replies, strict=True))
        located = tuple(ChunkLocations.from_lookup_reply(by_rank[r]) if r in by_rank else None
                        for r in range(self.world_size))
        self._hits[rid] = _Hit(request, engine_request_id, hit, num_computed_tokens, located, self._attempts[rid],
                               page_hashes[:hit // bs] if page_hashes is not None else None)
        log.debug("request %s: %d tokens from kvstrata after %d local", rid, external, num_computed_tokens)
        return external

    def allocated(self, engine_request_id: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """The engine allocated blocks for an admitted request: plan its load if kvstrata reported a hit."""
        rid = self.adapter.request_id(engine_request_id)
        hit = self._hits.get(rid)
        if num_external_tokens <= 0 or hit is None or self._loads_planned.get(rid) == hit.attempt:
            return
        located = tuple(loc.covering(hit.tokens) if loc is not None else None for loc in hit.located)
        by_pages = hit.page_hashes is not None
        self._pending_loads.append(LoadSpec(
            rid, engine_request_id, b"" if by_pages else pack_tokens(list(hit.request.token_ids[:hit.tokens])),
            hit.request.salt, BlockTable(block_ids), hit.local,
            self.settings.layers_per_slice, hit.page_hashes, self.block_size if by_pages else 0,
            located=located if any(loc is not None for loc in located) else None, attempt=hit.attempt))
        self._loads_planned[rid] = hit.attempt

    def wait_for_lookups(self, engine_request_ids: Iterable[Any]) -> None:
        """Block until the LOOKUPs :meth:`lookup` / :meth:`lookup_pages` sent for these requests are answered,
        or their ``lookup_timeout`` ran out; the next lookup of each then answers (never ``None``).

        For an engine whose API must answer a lookup at once rather than ask again next step (SGLang's linker
        and HiCache backend): it looks up every request it needs (the LOOKUPs go out together), waits here
        once, then looks them up again. The only call of this side that blocks, and only this long. A request
        with no LOOKUP in flight is not waited for.
        """
        pending = [p for p in (self._lookups.get(self.adapter.request_id(e)) for e in engine_request_ids)
                   if p is not None]
        for p in pending:
            while not all(f.done() for f in p.futures):
                waited = time.monotonic() - p.started
                if waited >= self.settings.lookup_timeout:  # as :meth:`lookup` tells: it answers 0 now
                    break
                wait(p.futures, timeout=self.settings.lookup_timeout - waited)

    @property
    def backing_off(self) -> bool:
        """Whether lookups skip the server now: it did not answer one within ``lookup_timeout``, and it is left
        alone for :data:`BACK_OFF_TIMEOUTS` timeouts (lookups answer 0 meanwhile). An engine that would
        otherwise go on to store what a lookup said is missing skips that store too (it could only wait)."""
        return time.monotonic() < self._down_until

    # --- every step --------------------------------------------------------------------

    def plan_step(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[Any],
                  block_ids_of: Callable[[Any], Sequence[Sequence[int]]]) -> StepPlan:
        """This step's plan for the worker side. ``block_ids_of(engine id)``: the request's blocks, one list per
        KV group, in order (read only for prompts whose last whole block is computed by the end of this step,
        to store them)."""
        loads, self._pending_loads = self._pending_loads, []
        self._loads_sent.update(spec.request_id for spec in loads)
        stores = self._stores_for(scheduled, block_ids_of) if self.settings.store else []
        settle = [r for r in preempted if self.adapter.request_id(r) in self._loads_sent]
        return StepPlan(loads, stores, settle)

    def _stores_for(self, scheduled: Iterable[ScheduledRequest],
                    block_ids_of: Callable[[Any], Sequence[Sequence[int]]]) -> list[StoreSpec]:
        out = []
        bs = self.block_size
        for s in scheduled:
            rid = self.adapter.request_id(s.engine_request_id)
            entry = self._requests.get(rid)
            if entry is None or rid in self._stored:
                continue
            request = entry[1]
            n_prompt = len(request.token_ids)
            if s.num_computed_tokens + s.num_scheduled_tokens < n_prompt:
                continue
            self._stored.add(rid)
            n = (n_prompt // bs) * bs
            hit = self._hits[rid].tokens if rid in self._hits else 0
            chunk = self.chunk_size or bs
            skip = (hit // chunk) * chunk  # what the store already holds: only the rest is sent
            if n <= skip:
                continue
            blocks = BlockTable.prefix(block_ids_of(s.engine_request_id), n // bs)
            out.append(StoreSpec(rid, pack_tokens(list(request.token_ids[:n])), request.salt, blocks, skip))
        return out

    def released(self, engine_request_ids: Iterable[Any]) -> None:
        """The worker side handed these requests back to the engine (their first slice landed)."""
        self._released.update(self.adapter.request_id(r) for r in engine_request_ids)

    def finished(self, engine_request_id: Any) -> bool:
        """The request finished or was aborted, before the engine frees its blocks.

        True: keep the blocks until the worker side reports them freeable (a released load may still be
        writing them). Locks of a load never planned are released here; a planned load's are the worker
        side's to release, or a chunk could be evicted under a copy in flight.
        """
        rid = self.adapter.request_id(engine_request_id)
        self._drop_unsent_load(rid)
        keep = rid in self._loads_sent and rid in self._released
        if rid in self._looked_up and self._loads_planned.get(rid) != self._attempts.get(rid):
            self._end_session(rid)  # its current attempt's LOOKUP never got a load
        for d in (self._hits, self._requests, self._lookups, self._attempts, self._loads_planned):
            d.pop(rid, None)
        for tracked in (self._looked_up, self._loads_sent, self._released, self._stored):
            tracked.discard(rid)
        return keep

    def _new_attempt(self, rid: str) -> None:
        """``lookup`` found no LOOKUP of ``rid`` in flight: the engine admits the request, maybe again.

        If its current attempt sent a LOOKUP, that attempt is over: its locks are freed here unless a load was
        planned for them (the worker side frees those once it stopped copying), and the next LOOKUP goes out
        under the next attempt, so no late release of this one can touch its locks. What a load handed to the
        worker side means for the request's end (:meth:`finished`: keep the blocks once it was released) stays:
        the worker side reports the request freeable then, whichever attempt that load was.
        """
        attempt = self._attempts.setdefault(rid, 0)
        self._drop_unsent_load(rid)
        self._hits.pop(rid, None)
        if rid not in self._looked_up:
            return  # nothing of this attempt is on the server: the next LOOKUP may use it
        if self._loads_planned.get(rid) != attempt:
            self._free_locks(rid, attempt)
        self._looked_up.discard(rid)
        self._attempts[rid] = attempt + 1
        log.debug("request %s admitted again: lookup attempt %d", rid, attempt + 1)

    def _drop_unsent_load(self, rid: str) -> None:
        """A load planned for ``rid`` that no step's plan handed to the worker side yet never will be: the engine
        admitted or finished the request again before building its next step."""
        unsent = [spec for spec in self._pending_loads if spec.request_id == rid]
        if not unsent:
            return
        self._pending_loads = [spec for spec in self._pending_loads if spec.request_id != rid]
        for spec in unsent:
            if self._loads_planned.get(rid) == spec.attempt:
                del self._loads_planned[rid]  # its locks are this side's to free again

    # --- keys and locks ----------------------------------------------------------------

    def _keys(self, request: PromptRequest, num_tokens: int, page_hashes: tuple[str, ...] | None) -> list[CacheKey]:
        """The keys of this runtime's ranks (rank order) for the first ``num_tokens`` tokens of the prompt, by
        its token ids or, if given, by its page hashes; under the request's current lookup attempt."""
        attempt = self._attempts[request.request_id]
        if page_hashes is None:
            keys = shard_keys(request, num_tokens, self.model, self.world_size, self.settings.instance_id, attempt)
            return [keys[r] for r in self._ranks]
        pages = page_hashes[:num_tokens // self.block_size]
        return [shard_key(request.request_id, self.model, b"", request.salt, rank=r, world_size=self.world_size,
                          instance_id=self.settings.instance_id, page_hashes=pages, page_size=self.block_size,
                          attempt=attempt)
                for r in self._ranks]

    def _owners(self, rid: str, attempt: int | None = None) -> list[str]:
        """The lock owner of each of this runtime's ranks for ``rid``'s lookup ``attempt`` (default: its
        current one)."""
        if attempt is None:
            attempt = self._attempts.get(rid, 0)
        return [lock_owner(rid, self.settings.instance_id + r, attempt) for r in self._ranks]

    def _free_locks(self, rid: str, attempt: int | None = None) -> None:
        if attempt is None or attempt == self._attempts.get(rid):
            self._looked_up.discard(rid)
        for owner in self._owners(rid, attempt):
            self._send_oneway(RequestType.FREE_LOOKUP_LOCKS, [owner])

    def _end_session(self, rid: str) -> None:
        """The request is done with kvstrata before any load was planned: free whatever its LOOKUPs locked."""
        self._free_locks(rid)

    def _send_oneway(self, rt: RequestType, payload: list[Any]) -> None:
        """Fire and forget: a lost lock release costs an eviction delay, never correctness."""
        try:
            self.client.transport.send_oneway(rt, payload)
        except Exception as exc:  # only a closed client raises here
            log.debug("%s for %s not sent: %s", rt.name, payload, exc)

    def close(self) -> None:
        self.client.close()
