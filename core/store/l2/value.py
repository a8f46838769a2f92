"""One L2 value: one layer group of a chunk object, with the header that proves what it is.

A chunk object is stored as several values, each holding a group of consecutive layers (both K and V of them),
sized near :data:`VALUE_BYTES`: the store moves values of a few MiB fastest, and a reader that fetches the
first layer group of every chunk before the second has the first layers of a whole prefix early. The grouping
is a function of the object's shape and token count alone (:func:`layer_groups`), so every server reads the
values any other wrote.

A value is read by a server that did not write it, maybe of another version, maybe after a failover, a partial
write or an operator's mistake. So a value carries its whole identity and a checksum in the same bytes as its
payload (one key per object, never a header key beside a data key that eviction could split), and a read that
does not check out is a miss with a reason, never bytes handed to an engine.

Layout (little-endian)::

    magic "KVL2" | format u16 | key length u32 | key (msgpack map) | payload length u64 | checksum u64 | payload

The checksum is xxHash's XXH3-64 over the key, the payload length and the payload: a torn header or a torn
payload fails it alike. Nothing read is unpickled: the key is msgpack of plain values.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Sequence

import msgpack
import xxhash

MAGIC = b"KVL2"
FORMAT = 2
_HEAD = struct.Struct("<4sHI")
_TAIL = struct.Struct("<QQ")
MAX_KEY_BYTES = 4096
VALUE_BYTES = 4 << 20
"""The payload size a layer group is made near (never more than one layer's K and V over, never less than one
layer): part of the format, since readers and writers must group alike."""


def layer_groups(shape: tuple[int, int, int, int], num_tokens: int) -> list[tuple[int, int]]:
    """The layer groups ``[(first, end), ...]`` an object of ``shape`` and ``num_tokens`` is stored as: as few
    as keep each near :data:`VALUE_BYTES`, of equal size to within one layer."""
    kv, layers, heads, head_bytes = shape
    layer_bytes = kv * heads * head_bytes * num_tokens
    groups = min(layers, max(1, round(layers * layer_bytes / VALUE_BYTES)))
    return [(i * layers // groups, (i + 1) * layers // groups) for i in range(groups)]


@dataclass(frozen=True)
class TierKey:
    """Everything that must match for an L2 value to stand for an L1 object."""

    model: str
    world_size: int
    rank: int
    salt: str | None
    shape: tuple[int, int, int, int]
    """(kv, layers, heads, head_bytes) of the object (``StoredObject.shape_signature``)."""
    dtype: str
    num_tokens: int
    chunk_hash: bytes
    """The L1 digest: the rolling hash of the chunk and everything before it."""
    layers: tuple[int, int]
    """The layer group ``[first, end)`` this value holds (one of :func:`layer_groups`)."""

    def name(self, namespace: str = "kvstrata") -> str:
        """The store's key for this value: one per layer group of an object, spread over a cluster by the
        chunk hash and the group."""
        kv, layers, heads, head_bytes = self.shape
        first, end = self.layers
        return (f"{namespace}:v{FORMAT}:{self.chunk_hash.hex()}:{self.dtype}:{kv}x{layers}x{heads}x{head_bytes}"
                f":{self.num_tokens}:L{first}-{end}")

    @property
    def payload_bytes(self) -> int:
        """The value's payload: ``kv * heads * head_bytes`` per token and layer of its group."""
        kv, _, heads, head_bytes = self.shape
        first, end = self.layers
        return kv * (end - first) * heads * head_bytes * self.num_tokens

    @property
    def object_bytes(self) -> int:
        """The whole object's size (every layer group)."""
        kv, layers, heads, head_bytes = self.shape
        return kv * layers * heads * head_bytes * self.num_tokens

    def payload_ranges(self) -> list[tuple[int, int]]:
        """Where the payload's bytes lie in the object (``[kv, layer, token, head, head_bytes]``), in the
        payload's order: the group's layers of K, then of V."""
        kv, layers, heads, head_bytes = self.shape
        layer_bytes = heads * head_bytes * self.num_tokens
        first, end = self.layers
        return [((k * layers + first) * layer_bytes, (k * layers + end) * layer_bytes) for k in range(kv)]

    def to_wire(self) -> dict:
        return {"model": self.model, "world_size": self.world_size, "rank": self.rank, "salt": self.salt,
                "shape": list(self.shape), "dtype": self.dtype, "num_tokens": self.num_tokens,
                "chunk_hash": self.chunk_hash, "layers": list(self.layers)}


class MissReason(str, enum.Enum):
    """Why a value read from the tier is not used (counted per reason)."""

    TRUNCATED = "truncated"
    NOT_A_VALUE = "not_a_value"
    UNKNOWN_FORMAT = "unknown_format"
    OTHER_KEY = "other_key"
    LENGTH = "length"
    CHECKSUM = "checksum"


class TierMiss(Exception):
    def __init__(self, reason: MissReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason

    @classmethod
    def other(cls, detail: str) -> "TierMiss":
        return cls(MissReason.OTHER_KEY, detail)

    @classmethod
    def checksum(cls) -> "TierMiss":
        return cls(MissReason.CHECKSUM, "the checksum does not match the key and payload")


def _checksum(packed_key: bytes | memoryview, parts: Sequence[memoryview]) -> int:
    """XXH3-64 over the key, the payload's length and the payload (given in parts)."""
    digest = xxhash.xxh3_64()
    digest.update(packed_key)
    digest.update(struct.pack("<Q", sum(len(p) for p in parts)))
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def encode(key: TierKey, *payload: bytes | memoryview) -> bytes:
    """The value to store for ``key``'s layer group, whose payload is the concatenation of ``payload``'s
    parts (an object's K and V ranges, :meth:`TierKey.payload_ranges`, need no copy to be joined first)."""
    packed_key = _packed(key)
    parts = [memoryview(p).cast("B") for p in payload]
    return b"".join((_HEAD.pack(MAGIC, FORMAT, len(packed_key)), packed_key,
                     _TAIL.pack(sum(len(p) for p in parts), _checksum(packed_key, parts)), *parts))


def _packed(key: TierKey) -> bytes:
    packed_key = msgpack.packb(key.to_wire(), use_bin_type=True)
    if len(packed_key) > MAX_KEY_BYTES:
        raise ValueError(f"an L2 key packs to {len(packed_key)} bytes, more than {MAX_KEY_BYTES}")
    return packed_key


def expected_header(key: TierKey) -> bytes:
    """The bytes before the payload of ``key``'s value, its checksum (the last 8) zero: what a reader compares
    a value's header with before it lets any payload byte in."""
    packed_key = _packed(key)
    return _HEAD.pack(MAGIC, FORMAT, len(packed_key)) + packed_key + _TAIL.pack(key.payload_bytes, 0)


def payload_checksum_of(header: bytes | memoryview, parts: Sequence[memoryview]) -> bool:
    """Whether the checksum in a value's ``header`` (one :func:`expected_header` matched but for it) is that of
    its key and the payload now in ``parts``."""
    header = memoryview(header).cast("B")
    key_len = _HEAD.unpack_from(header)[2]
    packed_key = header[_HEAD.size:_HEAD.size + key_len]
    _, checksum = _TAIL.unpack_from(header, _HEAD.size + key_len)
    return _checksum(packed_key, parts) == checksum


def decode(expected: TierKey, value: bytes | memoryview) -> memoryview:
    """The payload of ``value`` if it is ``expected``'s object, whole and unaltered; else :class:`TierMiss`."""
    data = memoryview(value).cast("B")
    if len(data) < _HEAD.size:
        raise TierMiss(MissReason.TRUNCATED, f"{len(data)} bytes, shorter than the header")
    magic, fmt, key_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise TierMiss(MissReason.NOT_A_VALUE, f"starts with {bytes(magic)!r}, not {MAGIC!r}")
    if fmt != FORMAT:
        raise TierMiss(MissReason.UNKNOWN_FORMAT, f"format {fmt}, this server reads {FORMAT}")
    key_end = _HEAD.size + key_len
    if key_len > MAX_KEY_BYTES or len(data) < key_end + _TAIL.size:
        raise TierMiss(MissReason.TRUNCATED, f"{len(data)} bytes, shorter than a {key_len}-byte key and the tail")
    packed_key = data[_HEAD.size:key_end]
    try:
        found = msgpack.unpackb(packed_key, raw=False, strict_map_key=True, max_str_len=MAX_KEY_BYTES,
                                max_bin_len=MAX_KEY_BYTES, max_array_len=16, max_map_len=16)
    except Exception:  # noqa: BLE001 - a key that does not even unpack is another key all the same
        found = None
    if found != expected.to_wire():
        raise TierMiss(MissReason.OTHER_KEY, f"holds {found!r}, not {expected.to_wire()!r}")
    payload_len, checksum = _TAIL.unpack_from(data, key_end)
    payload = data[key_end + _TAIL.size:]
    if len(payload) != payload_len:
        raise TierMiss(MissReason.LENGTH, f"payload of {len(payload)} bytes, its header says {payload_len}")
    if _checksum(packed_key, [payload]) != checksum:
        raise TierMiss.checksum()
    return payload
