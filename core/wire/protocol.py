"""The wire protocol: request types and the declared shape of every payload.

The declarations are the single source of truth for both ends. The server checks
each registered handler against them at start-up (so a handler that grew a
parameter without the protocol following fails at registration, not on the
first request), and both ends check every payload against them (so a client and
a server that disagree get an error reply naming the request type instead of a
half-decoded call).

Payloads are positional lists of plain values (int, str, bytes, bool, None,
lists and string-keyed maps of those). Nothing is ever unpickled.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from typing import Any, Callable


class RequestType(enum.IntEnum):
    """Every request a client can send. Values are wire codes: never renumber."""

    PING = 0
    REGISTER_KV_CACHE = 1
    UNREGISTER_KV_CACHE = 2
    LOOKUP = 3
    STORE = 4
    RETRIEVE = 5
    FREE_LOOKUP_LOCKS = 6
    # 7 was END_SESSION, the same request as FREE_LOOKUP_LOCKS under another name: retired, never reuse it.
    SERVER_INFO = 8
    # 9 was ATTACH_RINGS (shared-memory request and reply rings, removed: see docs/decisions.md): never reuse it.
    RESERVE_STORE = 10
    """Engine placement: reserve L1 objects for a prompt's chunks; the engine copies into them itself."""
    COMMIT_STORE = 11
    """Engine placement: the engine's copies into a reservation have landed (commit) or never will (drop)."""


class ProtocolError(ValueError):
    """A payload or handler does not match the protocol declaration."""


# --- value type descriptors -------------------------------------------------------
#
# A type descriptor is a small predicate with a name, so that an error can say
# "item 3 (block_ids) must be list[list[int]], got list[str]".


@dataclass(frozen=True)
class ValueType:
    name: str
    check: Callable[[Any], bool]

    def __str__(self) -> str:
        return self.name


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT = ValueType("int", _is_int)
NONNEG_INT = ValueType("int >= 0", lambda v: _is_int(v) and v >= 0)
STR = ValueType("str", lambda v: isinstance(v, str))
BYTES = ValueType("bytes", lambda v: isinstance(v, (bytes, bytearray)))
BOOL = ValueType("bool", lambda v: isinstance(v, bool))
MAP = ValueType("map", lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v))
ANY = ValueType("any", lambda v: True)


def optional(t: ValueType) -> ValueType:
    return ValueType(f"{t.name} | None", lambda v: v is None or t.check(v))


def list_of(t: ValueType) -> ValueType:
    if t is INT or t is NONNEG_INT:
        # Block-id lists run to thousands of items on every STORE and RETRIEVE, on both
        # ends: checking plain ints at C speed keeps validation off the transfer's
        # critical path. Anything else (bools, int subclasses, junk) takes the exact
        # per-item predicate, so what is accepted is unchanged.
        def check_ints(v: Any) -> bool:
            if not isinstance(v, list):
                return False
            if set(map(type, v)) <= {int}:
                return t is INT or not v or min(v) >= 0
            return all(t.check(x) for x in v)

        return ValueType(f"list[{t.name}]", check_ints)
    if t is BYTES:
        # per-layer event handles: one per layer on every layer-major RETRIEVE
        return ValueType(f"list[{t.name}]", lambda v: isinstance(v, list) and set(map(type, v)) <= {bytes, bytearray})
    return ValueType(f"list[{t.name}]", lambda v: isinstance(v, list) and all(map(t.check, v)))


def map_with(required: dict[str, ValueType], name: str,
             optional_keys: dict[str, ValueType] | None = None) -> ValueType:
    """A string-keyed map that must hold at least ``required`` keys of the given types, and may hold
    ``optional_keys`` (checked when present)."""

    def check(v: Any) -> bool:
        if not MAP.check(v):
            return False
        return all(k in v and t.check(v[k]) for k, t in required.items()) and \
            all(t.check(v[k]) for k, t in (optional_keys or {}).items() if k in v)

    return ValueType(name, check)


# --- payload declarations ----------------------------------------------------------

CACHE_KEY = map_with(
    {
        "request_id": STR,
        "model": STR,
        "world_size": INT,
        "rank": NONNEG_INT,
        "salt": optional(STR),
        "tokens": BYTES,
    },
    "CacheKey{request_id,model,world_size,rank,salt,tokens[,page_hashes,page_size]}",
    optional_keys={"page_hashes": optional(list_of(STR)), "page_size": NONNEG_INT},
)
"""Identifies a request's token sequence and the model shard it belongs to: by its token ids (int64
little-endian ``tokens``), or by the engine's own per-page prefix hashes (``page_hashes``, each covering
every token up to the end of its page of ``page_size`` tokens, as SGLang's page-hash chain does; ``tokens``
is then empty). See :mod:`kvstrata.core.store.keys`."""

BOARD_REF = map_with(
    {"name": STR, "slot": NONNEG_INT, "generation": NONNEG_INT},
    "BoardRef{name,slot,generation}",
)
"""Names one arrival-board slot: the shared-memory segment, the slot index and
the generation the worker stamped on it for this retrieve."""

KV_CACHE_DESCRIPTOR = map_with(
    {"format": STR, "placement": STR, "num_layers": INT, "kv_size": INT},
    "KVCacheDescriptor{format,placement,num_layers,kv_size,...}",
)


@dataclass(frozen=True)
class Item:
    name: str
    type: ValueType


@dataclass(frozen=True)
class Declaration:
    request_type: RequestType
    items: tuple[Item, ...]
    response: ValueType
    blocking: bool
    """Blocking handlers run on the transfer executor, never on the socket loop."""

    @property
    def arity(self) -> int:
        return len(self.items)

    def validate(self, payload: Any) -> None:
        """Raise ProtocolError naming the request type and the first mismatch."""
        rt = self.request_type.name
        if not isinstance(payload, list):
            raise ProtocolError(f"{rt}: payload must be a list of {self.arity} items, got {type(payload).__name__}")
        if len(payload) != self.arity:
            names = ", ".join(i.name for i in self.items)
            raise ProtocolError(
                f"{rt}: payload has {len(payload)} items, the protocol declares {self.arity} ({names})"
            )
        for index, (item, value) in enumerate(zip(self.items, payload)):
            if not item.type.check(value):
                raise ProtocolError(
                    f"{rt}: item {index} ({item.name}) must be {item.type}, got {_describe(value)}"
                )


def _describe(value: Any) -> str:
    if isinstance(value, list):
        inner = sorted({type(v).__name__ for v in value})
        return f"list[{' | '.join(inner) or 'empty'}]"
    if isinstance(value, dict):
        return f"map with keys {sorted(map(str, value))}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{type(value).__name__} {value!r}"  # the value itself: "must be int >= 0, got int -1"
    return type(value).__name__


RETRIEVE_ITEMS = (
    Item("key", CACHE_KEY),
    Item("instance_id", NONNEG_INT),
    Item("block_ids", list_of(list_of(NONNEG_INT))),
    Item("event_handle", optional(BYTES)),
    Item("skip_first_n_tokens", NONNEG_INT),
    Item("arrival_board", optional(BOARD_REF)),
    Item("layer_event_handles", optional(list_of(BYTES))),
    Item("layers_per_slice", NONNEG_INT),
)
"""RETRIEVE is always eight items. A chunk-major retrieve sends ``None, None, 0``
for the last three; never shorten the list, both ends reject a wrong length."""

DECLARATIONS: dict[RequestType, Declaration] = {
    d.request_type: d
    for d in (
        Declaration(RequestType.PING, (), STR, blocking=False),
        Declaration(RequestType.SERVER_INFO, (), MAP, blocking=False),
        Declaration(
            RequestType.REGISTER_KV_CACHE,
            (Item("instance_id", NONNEG_INT), Item("descriptor", KV_CACHE_DESCRIPTOR)),
            MAP,
            blocking=True,
        ),
        Declaration(RequestType.UNREGISTER_KV_CACHE, (Item("instance_id", NONNEG_INT),), BOOL, blocking=True),
        Declaration(RequestType.LOOKUP, (Item("key", CACHE_KEY),), MAP, blocking=False),
        Declaration(
            RequestType.STORE,
            (
                Item("key", CACHE_KEY),
                Item("instance_id", NONNEG_INT),
                Item("block_ids", list_of(list_of(NONNEG_INT))),
                Item("event_handle", optional(BYTES)),
                Item("skip_first_n_tokens", NONNEG_INT),
            ),
            MAP,
            blocking=True,
        ),
        Declaration(RequestType.RETRIEVE, RETRIEVE_ITEMS, MAP, blocking=True),
        Declaration(RequestType.FREE_LOOKUP_LOCKS, (Item("request_id", STR),), INT, blocking=False),
        Declaration(
            RequestType.RESERVE_STORE,
            (Item("key", CACHE_KEY), Item("instance_id", NONNEG_INT), Item("skip_first_n_tokens", NONNEG_INT)),
            MAP,
            blocking=False,
        ),
        Declaration(RequestType.COMMIT_STORE, (Item("reservation", NONNEG_INT), Item("landed", BOOL)), MAP,
                    blocking=False),
    )
}


def declaration(request_type: RequestType) -> Declaration:
    return DECLARATIONS[request_type]


def chunk_major_retrieve_tail() -> tuple[None, None, int]:
    """The last three RETRIEVE items for a retrieve without layer-major staging."""
    return (None, None, 0)


def check_handler_signature(request_type: RequestType, handler: Callable[..., Any]) -> None:
    """Raise ProtocolError unless ``handler`` takes exactly the declared payload items, by name and in order.

    Called when a handler is registered, so a protocol/handler mismatch stops the
    server at start-up naming both sides, instead of failing (or, with two items
    swapped, silently misreading) every request.
    """
    decl = DECLARATIONS[request_type]
    params = [
        p
        for p in inspect.signature(handler).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(handler).parameters.values()):
        raise ProtocolError(
            f"Handler for RequestType.{request_type.name} takes *args; it must take exactly "
            f"{decl.arity} arguments"
        )
    if len(params) != decl.arity:
        raise ProtocolError(
            f"Handler for RequestType.{request_type.name} expects {len(params)} arguments, "
            f"but the protocol declares {decl.arity}: handler signature does not match for "
            f"request type {request_type.name}"
        )
    names = [p.name for p in params]
    declared = [item.name for item in decl.items]
    if names != declared:
        # same count, other names or order: the handler would read one item as another
        raise ProtocolError(
            f"Handler for RequestType.{request_type.name} takes ({', '.join(names)}), but the protocol "
            f"declares the items ({', '.join(declared)}) in that order")

