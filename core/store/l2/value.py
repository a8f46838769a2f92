"""One L2 value: a chunk object with the header that proves what it is.

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

import msgpack
import xxhash

MAGIC = b"KVL2"
FORMAT = 1
_HEAD = struct.Struct("<4sHI")
_TAIL = struct.Struct("<QQ")
MAX_KEY_BYTES = 4096


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

    def name(self, namespace: str = "kvstrata") -> str:
        """The store's key for this value: one per object, spread over a cluster by the chunk hash."""
        kv, layers, heads, head_bytes = self.shape
        return (f"{namespace}:v{FORMAT}:{self.chunk_hash.hex()}:{self.dtype}:{kv}x{layers}x{heads}x{head_bytes}"
                f":{self.num_tokens}")

    @property
    def payload_bytes(self) -> int:
        """The object's size: ``kv * layers * heads * head_bytes`` per token."""
        kv, layers, heads, head_bytes = self.shape
        return kv * layers * heads * head_bytes * self.num_tokens

    def to_wire(self) -> dict:
        return {"model": self.model, "world_size": self.world_size, "rank": self.rank, "salt": self.salt,
                "shape": list(self.shape), "dtype": self.dtype, "num_tokens": self.num_tokens,
                "chunk_hash": self.chunk_hash}


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


def _checksum(packed_key: bytes | memoryview, payload: memoryview) -> int:
    """XXH3-64 over the key, the payload's length and the payload."""
    digest = xxhash.xxh3_64()
    digest.update(packed_key)
    digest.update(struct.pack("<Q", len(payload)))
    digest.update(payload)
    return digest.intdigest()


def encode(key: TierKey, payload: bytes | memoryview) -> bytes:
    """The value to store for ``key``'s object."""
    packed_key = msgpack.packb(key.to_wire(), use_bin_type=True)
    if len(packed_key) > MAX_KEY_BYTES:
        raise ValueError(f"an L2 key packs to {len(packed_key)} bytes, more than {MAX_KEY_BYTES}")
    payload = memoryview(payload).cast("B")
    return b"".join((_HEAD.pack(MAGIC, FORMAT, len(packed_key)), packed_key,
                     _TAIL.pack(len(payload), _checksum(packed_key, payload)), payload))


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
    if _checksum(packed_key, payload) != checksum:
        raise TierMiss(MissReason.CHECKSUM, "the checksum does not match the key and payload")
    return payload
