"""What the scheduler side hands the worker side, and the keys both sides build from it.

A :class:`LoadSpec` or :class:`StoreSpec` crosses from the engine's scheduler
process to its workers inside the engine's own per-step metadata (vLLM pickles
its connector metadata between its processes), so both are plain frozen values.

Every kvstrata key belongs to one tensor-parallel shard: the model, the world
size and the rank are hashed into each chunk's key, so each rank stores and
loads only its own heads. A request's lookup locks on the server are held by a
*lock owner*, the request id namespaced by the rank's registered instance id
(:func:`lock_owner`): each rank's key has its own owner, so one rank freeing its
locks after its copy never unpins a chunk another rank is still copying, and
two engines sharing a server (whose instance ids differ) never free each
other's locks when their request ids collide (TensorRT-LLM numbers requests
from 1 in every engine; vLLM takes ids from its clients). A request the engine
admits again (vLLM re-admits one whose load failed, or that it preempted) is
looked up afresh under a new *attempt* of its owner, so a late release of the
earlier attempt's locks never frees the new one's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Sequence

from kvstrata.core.store.keys import CacheKey, pack_tokens
from kvstrata.core.transfer.block_table import BlockTable


@dataclass(frozen=True)
class PromptRequest:
    """An engine request as the scheduler side sees it."""

    request_id: str
    """kvstrata's id for the request (the adapter's request-id hook maps the engine's id to it)."""
    token_ids: Sequence[int]
    salt: str | None = None
    """Requests that must not share KV (a cache salt, a LoRA adapter) carry different salts."""


@dataclass(frozen=True)
class ChunkLocations:
    """Where a LOOKUP's locked hit lies in the server's L1 pool (its reply's ``located``).

    An engine that copies from the pool itself (engine placement) starts its load from these instead of
    asking RETRIEVE where the chunks are: the lookup locks keep them in place until the worker frees them
    after its copy, and the round trip leaves the path to the first slice. The worker still checks the shape
    against its own cache and every span against the pool it maps.
    """

    pool_name: str
    pool_size: int
    shape: tuple[int, int, int, int]
    """(kv, layers, heads, head_bytes) of every object."""
    objects: tuple[tuple[int, int, int, int, int], ...]
    """(offset, nbytes, tokens, slot, generation) of each locked chunk, in prompt order: the last two name its
    word in the pool's generation table, which must still hold ``generation`` once the copy has ended (see
    :mod:`kvstrata.core.store.l1_store`)."""
    generations_name: str = ""
    """The pool's generation table (a shared-memory segment of ``generations_slots`` 64-bit words)."""
    generations_slots: int = 0

    @classmethod
    def from_lookup_reply(cls, reply: dict[str, Any]) -> "ChunkLocations | None":
        """The locations a LOOKUP reply carries; ``None`` where it carries none (a miss, an older server)."""
        located = reply.get("located")
        if not located:
            return None
        pool = located["pool"]
        generations = pool["generations"]
        return cls(str(pool["name"]), int(pool["size"]),
                   tuple(int(x) for x in located["shape"]),  # type: ignore[arg-type]
                   tuple((int(o), int(n), int(t), int(s), int(g)) for o, n, t, s, g in located["objects"]),
                   str(generations["name"]), int(generations["slots"]))

    @property
    def num_tokens(self) -> int:
        return sum(o[2] for o in self.objects)

    def covering(self, num_tokens: int) -> "ChunkLocations | None":
        """The leading objects that hold exactly the first ``num_tokens`` tokens; ``None`` if no prefix does
        (the load then asks RETRIEVE, which locates the chunks its key names)."""
        total = 0
        for i, row in enumerate(self.objects):
            if total == num_tokens:
                return replace(self, objects=self.objects[:i])
            total += row[2]
        return self if total == num_tokens else None

    def as_retrieve_reply(self) -> dict[str, Any]:
        """The part of a engine-placement RETRIEVE reply these stand for: the pool and the objects."""
        return {"pool": {"name": self.pool_name, "size": self.pool_size,
                         "generations": {"name": self.generations_name, "slots": self.generations_slots}},
                "objects": [list(o) for o in self.objects]}


@dataclass(frozen=True)
class LoadSpec:
    """Load ``tokens``' cached KV into ``block_ids``, from token ``skip`` on, in slices of ``layers_per_slice``."""

    request_id: str
    engine_request_id: Any
    """The engine's own id, which the worker side hands back when the request is released."""
    tokens: bytes
    salt: str | None
    block_ids: BlockTable
    """The engine's blocks, one tuple per KV group (given as any sequence of sequences: made a
    :class:`BlockTable` here, once, and passed on as it is from then on)."""
    skip: int
    layers_per_slice: int
    page_hashes: tuple[str, ...] | None = None
    """An engine that names prompts by its own page-hash chain (SGLang) sets these and leaves ``tokens``
    empty: the key is then :meth:`CacheKey.for_page_hashes`."""
    page_size: int = 0
    located: tuple[ChunkLocations | None, ...] | None = None
    """Per rank, where the LOOKUP found this load's chunks (engine placement copies from there without a
    RETRIEVE); ``None`` for a rank, or for all, whose load must ask RETRIEVE."""
    attempt: int = 0
    """Which lookup of the request this load belongs to (its locks' owner is :func:`lock_owner` of it): 0
    unless the engine admitted the request again after an earlier lookup of it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", BlockTable(self.block_ids))

    @property
    def num_tokens(self) -> int:
        if self.page_hashes is not None:
            return len(self.page_hashes) * self.page_size
        return len(self.tokens) // 8


@dataclass(frozen=True)
class StoreSpec:
    """Store ``tokens``' KV (whole blocks, from token ``skip`` on) out of ``block_ids`` (one tuple per KV group)."""

    request_id: str
    tokens: bytes
    salt: str | None
    block_ids: BlockTable
    """As in :class:`LoadSpec`: made a :class:`BlockTable` here, once."""
    skip: int
    page_hashes: tuple[str, ...] | None = None
    """As in :class:`LoadSpec`: the engine's page-hash chain instead of ``tokens``."""
    page_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", BlockTable(self.block_ids))


_ATTEMPT_SUFFIX = re.compile(r"@a[0-9]+\Z")
_INSTANCE_SUFFIX = re.compile(r"@i[0-9]+\Z")


def lock_owner(request_id: str, instance_id: int, attempt: int = 0) -> str:
    """The id a rank's key carries on the server (its lookup locks' owner): the request id, then ``@i`` and the
    rank's registered instance id (``RuntimeSettings.instance_id`` + rank). Request ids may contain anything;
    the instance id is digits after the last ``@i``, so no two (request, instance) pairs share an owner.

    ``attempt`` > 0 (the engine looked the request up again, see :attr:`LoadSpec.attempt`) goes between them
    as ``@a<attempt>``, so each attempt's locks have an owner of their own. A request id that itself ends like
    an attempt (``x@a5``) gets ``@a0`` too, so :func:`request_of_lock_owner` always gives the request id back."""
    attempt = int(attempt)
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    head = f"{request_id}@a{attempt}" if attempt or _ATTEMPT_SUFFIX.search(request_id) else request_id
    return f"{head}@i{int(instance_id)}"


def request_of_lock_owner(owner: str) -> str:
    """The request id a :func:`lock_owner` string was made from (``owner`` itself if it is not one)."""
    if not _INSTANCE_SUFFIX.search(owner):
        return owner
    head = owner[:owner.rindex("@i")]
    attempt = _ATTEMPT_SUFFIX.search(head)
    return head[:attempt.start()] if attempt else head


def shard_key(request_id: str, model: str, tokens: bytes, salt: str | None, *, rank: int, world_size: int,
              instance_id: int, page_hashes: tuple[str, ...] | None = None, page_size: int = 0,
              attempt: int = 0) -> CacheKey:
    """The key of one rank's shard of a prompt (by its token ids, or by the engine's page hashes if given).
    ``instance_id``: the engine's (``RuntimeSettings.instance_id``); rank ``rank`` registers it plus ``rank``.
    ``attempt``: which lookup of the request the key's locks belong to (:func:`lock_owner`)."""
    return CacheKey(lock_owner(request_id, instance_id + rank, attempt), model, world_size, rank, tokens, salt,
                    page_hashes, page_size)


def shard_keys(request: PromptRequest, num_tokens: int, model: str, world_size: int,
               instance_id: int, attempt: int = 0) -> list[CacheKey]:
    """Every rank's key for the first ``num_tokens`` tokens of ``request`` (rank order)."""
    tokens = pack_tokens(list(request.token_ids[:num_tokens]))
    return [shard_key(request.request_id, model, tokens, request.salt, rank=r, world_size=world_size,
                      instance_id=instance_id, attempt=attempt)
            for r in range(world_size)]
