"""An L2 value reads back as its payload only when it is the object asked for, whole and unaltered."""

import os

import pytest

pytest.importorskip("xxhash", reason="the shared tier's checksum (pip install kvstrata[l2])")

from kvstrata.core.store.l2.value import (  # noqa: E402
    VALUE_BYTES,
    MissReason,
    TierKey,
    TierMiss,
    decode,
    encode,
    layer_groups,
)

KEY = TierKey(model="m", world_size=2, rank=1, salt=None, shape=(2, 32, 8, 256), dtype="bfloat16", num_tokens=256,
              chunk_hash=bytes(range(32)), layers=(4, 8))
PAYLOAD = os.urandom(64 << 10)


def miss(expected: TierKey, value: bytes) -> MissReason:
    with pytest.raises(TierMiss) as caught:
        decode(expected, value)
    return caught.value.reason


def test_a_value_reads_back_as_its_payload() -> None:
    assert bytes(decode(KEY, encode(KEY, PAYLOAD))) == PAYLOAD
    assert KEY.name().startswith("kvstrata:v2:" + KEY.chunk_hash.hex())
    assert KEY.name().endswith(":L4-8")


def test_a_value_is_joined_from_parts_as_from_their_concatenation() -> None:
    """The writer hands an object's K and V ranges of a layer group as separate parts, without joining them."""
    k, v = PAYLOAD[:len(PAYLOAD) // 2], PAYLOAD[len(PAYLOAD) // 2:]
    assert encode(KEY, memoryview(k), memoryview(v)) == encode(KEY, PAYLOAD)


@pytest.mark.parametrize("shape, tokens", [((2, 32, 8, 256), 256), ((2, 80, 1, 256), 256), ((2, 61, 8, 256), 32),
                                           ((1, 61, 1, 1152), 64), ((2, 28, 4, 256), 255), ((2, 2, 1, 64), 16)])
def test_layer_groups_cover_every_layer_once_near_the_value_size(shape, tokens) -> None:
    """Groups are consecutive, cover every layer once, differ by at most one layer, and none is more than one
    layer off the value size the store moves best (a whole object smaller than it is one group)."""
    groups = layer_groups(shape, tokens)
    kv, layers, heads, head_bytes = shape
    assert groups[0][0] == 0 and groups[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    sizes = {end - first for first, end in groups}
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    layer_bytes = kv * heads * head_bytes * tokens
    if layers * layer_bytes > VALUE_BYTES:
        assert all(abs((end - first) * layer_bytes - VALUE_BYTES) <= 2 * layer_bytes + VALUE_BYTES // 2
                   for first, end in groups)
    else:
        assert groups == [(0, layers)]
    assert layer_groups(shape, tokens) == groups  # a function of the shape alone: every server groups alike


def test_a_groups_payload_ranges_are_its_layers_of_k_then_v() -> None:
    kv, layers, heads, head_bytes = KEY.shape
    layer = heads * head_bytes * KEY.num_tokens
    assert KEY.payload_ranges() == [(4 * layer, 8 * layer), ((layers + 4) * layer, (layers + 8) * layer)]
    assert sum(b - a for a, b in KEY.payload_ranges()) == KEY.payload_bytes
    assert KEY.object_bytes == kv * layers * layer


@pytest.mark.parametrize("field, other", [
    ("model", "m2"), ("world_size", 4), ("rank", 0), ("salt", "tenant-b"), ("shape", (2, 32, 8, 128)),
    ("dtype", "float16"), ("num_tokens", 255), ("chunk_hash", bytes(32)), ("layers", (8, 12)),
])
def test_the_value_of_any_other_key_is_a_miss(field: str, other) -> None:
    """A value stored under a forged or colliding name, of another model, dtype, shard or layout."""
    import dataclasses

    value = encode(dataclasses.replace(KEY, **{field: other}), PAYLOAD)
    assert miss(KEY, value) is MissReason.OTHER_KEY


def test_a_corrupted_or_cut_value_is_a_miss_naming_why() -> None:
    value = encode(KEY, PAYLOAD)
    flipped = bytearray(value)
    flipped[-100] ^= 0x01  # one bit of the payload
    assert miss(KEY, bytes(flipped)) is MissReason.CHECKSUM
    assert miss(KEY, value[:-1]) is MissReason.LENGTH  # a torn write
    assert miss(KEY, value[:10]) is MissReason.TRUNCATED
    assert miss(KEY, b"") is MissReason.TRUNCATED
    assert miss(KEY, b"GARBAGE!" + value[8:]) is MissReason.NOT_A_VALUE
    newer = bytearray(value)
    newer[4] = 99  # a format this server does not read
    assert miss(KEY, bytes(newer)) is MissReason.UNKNOWN_FORMAT
    header_bit = bytearray(value)
    header_bit[-len(PAYLOAD) - 1] ^= 0x80  # the stored checksum itself
    assert miss(KEY, bytes(header_bit)) is MissReason.CHECKSUM
    longer = bytearray(value)
    longer += b"\0"  # a value with trailing bytes: its length no longer matches its header
    assert miss(KEY, bytes(longer)) is MissReason.LENGTH


def test_a_key_that_does_not_unpack_is_another_key() -> None:
    value = bytearray(encode(KEY, PAYLOAD))
    value[10] = 0xC1  # msgpack's never-used byte, inside the key
    assert miss(KEY, bytes(value)) is MissReason.OTHER_KEY
