"""An L2 value reads back as its payload only when it is the object asked for, whole and unaltered."""

import os

import pytest

pytest.importorskip("xxhash", reason="the shared tier's checksum (pip install kvstrata[l2])")

from kvstrata.core.store.l2.value import MissReason, TierKey, TierMiss, decode, encode  # noqa: E402

KEY = TierKey(model="m", world_size=2, rank=1, salt=None, shape=(2, 32, 8, 256), dtype="bfloat16", num_tokens=256,
              chunk_hash=bytes(range(32)))
PAYLOAD = os.urandom(64 << 10)


def miss(expected: TierKey, value: bytes) -> MissReason:
    with pytest.raises(TierMiss) as caught:
        decode(expected, value)
    return caught.value.reason


def test_a_value_reads_back_as_its_payload() -> None:
    assert bytes(decode(KEY, encode(KEY, PAYLOAD))) == PAYLOAD
    assert KEY.name().startswith("kvstrata:v1:" + KEY.chunk_hash.hex())


@pytest.mark.parametrize("field, other", [
    ("model", "m2"), ("world_size", 4), ("rank", 0), ("salt", "tenant-b"), ("shape", (2, 32, 8, 128)),
    ("dtype", "float16"), ("num_tokens", 255), ("chunk_hash", bytes(32)),
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
