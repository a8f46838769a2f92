"""Chunk digests: reusing a lookup's digests must give exactly what hashing from scratch gives."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.core.store.keys import CacheKey

CHUNK = 16


def key(tokens, **kw) -> CacheKey:
    return CacheKey.for_tokens("r", tokens, model=kw.pop("model", "m"), **kw)


@pytest.mark.parametrize("lookup_len,retrieve_len", [
    (64, 64), (70, 70),      # the same tokens, aligned and with a partial last chunk
    (70, 64), (70, 40),      # a retrieve of a prefix of the looked-up prompt (aligned, partial)
    (64, 70), (40, 100),     # a retrieve longer than the lookup
    (5, 3), (0, 32),         # shorter than one chunk; an empty lookup
])
def test_known_digests_equal_fresh_hashes(lookup_len: int, retrieve_len: int) -> None:
    tokens = np.random.default_rng(0).integers(0, 32000, 128)
    looked_up = key(tokens[:lookup_len])
    known = (looked_up, looked_up.chunk_hashes(CHUNK))
    retrieved = key(tokens[:retrieve_len])
    assert retrieved.chunk_hashes(CHUNK, known) == retrieved.chunk_hashes(CHUNK)


def test_known_digests_of_other_tokens_or_shard_are_not_used() -> None:
    tokens = np.arange(64)
    other = tokens.copy()
    other[20] += 1  # differs inside the second chunk
    for earlier in (key(other), key(tokens, model="other"), key(tokens, rank=1), key(tokens, salt="s")):
        known = (earlier, earlier.chunk_hashes(CHUNK))
        assert key(tokens).chunk_hashes(CHUNK, known) == key(tokens).chunk_hashes(CHUNK)
    # and a wrong digest list is really not consulted when the tokens differ
    assert key(tokens).chunk_hashes(CHUNK, (key(other), [b"x" * 16] * 4)) == key(tokens).chunk_hashes(CHUNK)


def test_pack_tokens_matches_numpy_and_refuses_non_integers() -> None:
    from kvstrata.core.store.keys import pack_tokens

    ids = [0, 1, -5, 2**40, 31999]
    assert pack_tokens(ids) == np.asarray(ids, dtype="<i8").tobytes()
    assert pack_tokens(np.asarray(ids[:3], dtype=np.int32)) == np.asarray(ids[:3], dtype="<i8").tobytes()
    with pytest.raises(ValueError, match="token ids must be integers"):
        pack_tokens([1, 2.5])
    with pytest.raises(ValueError, match="int64 range"):
        pack_tokens([2**63])
