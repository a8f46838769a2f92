"""Chunk digests: reusing a lookup's digests must give exactly what hashing from scratch gives."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.core.store.keys import CacheKey, pack_tokens, page_hash_chain

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


# --- keys by the engine's page hashes (SGLang's page-hash chain) ---------------------------------------------

def page_key(rid, hashes, page_size=16, **kw):
    return CacheKey.for_page_hashes(rid, hashes, page_size, model="m", **kw)


def test_a_key_by_page_hashes_names_each_chunk_by_its_last_page():
    hashes = [f"page-{i}" for i in range(10)]  # 160 tokens in pages of 16; chunks of 64 = 4 pages
    key = page_key("r", hashes)
    assert key.num_tokens == 160
    digests = key.chunk_hashes(64)
    assert len(digests) == 3  # pages 0-3, 4-7, and the partial 8-9
    shorter = page_key("r2", hashes[:8]).chunk_hashes(64)
    assert shorter == digests[:2]  # a shared prefix of whole chunks shares their digests
    assert page_key("r3", hashes[:9]).chunk_hashes(64)[2] != digests[2]  # a partial chunk: its own last page
    assert CacheKey.from_wire(key.to_wire()) == key


def test_a_tail_keyed_from_another_page_never_matches_a_stored_partial_chunk():
    """SGLang keys the tail past its own device hit, which may start at any page: a chunk of pages 3-6 ends
    where a stored partial chunk of pages 4-6 ends, yet covers other pages, so their digests must differ."""
    hashes = [f"page-{i}" for i in range(7)]  # chunks of 4 pages: stored as 0-3 and the partial 4-6
    stored = page_key("s", hashes).chunk_hashes(64)
    tail = page_key("t", hashes[3:]).chunk_hashes(64)  # 3-6: one chunk, ending at page 6 too
    assert len(stored) == 2 and len(tail) == 1
    assert tail[0] not in stored
    assert page_key("t2", hashes[4:]).chunk_hashes(64) == stored[1:]  # the same pages: the same chunk


def test_page_hash_keys_of_other_pages_or_shards_never_collide():
    hashes = [f"page-{i}" for i in range(4)]
    by_pages = page_key("r", hashes).chunk_hashes(64)
    assert by_pages != CacheKey.for_tokens("r", list(range(64)), model="m").chunk_hashes(64)
    assert by_pages != page_key("r", hashes, rank=1, world_size=2).chunk_hashes(64)
    assert by_pages != page_key("r", hashes, salt="lora").chunk_hashes(64)


def test_bad_page_hash_keys_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="positive page_size"):
        page_key("r", ["a"], page_size=0)
    with pytest.raises(ValueError, match="not both"):
        CacheKey("r", "m", 1, 0, pack_tokens([1]), None, ("a",), 16)
    with pytest.raises(ValueError, match="non-empty strings"):
        page_key("r", ["a", ""])
    with pytest.raises(ValueError, match="chunk size 40 is not a multiple of the engine's page size 16"):
        page_key("r", ["a", "b", "c"]).chunk_hashes(40)


def chain_hex(tokens, page_size, salt=None) -> list[str]:
    return [h.hex() for h in page_hash_chain(pack_tokens(tokens), page_size, salt)]


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_prompt_by_token_ids_and_by_its_page_hash_chain_names_the_same_chunks(salt):
    """vLLM and TensorRT-LLM hand token ids, SGLang its page-hash chain: with a page of one chunk they name the
    same chunks, whole and the partial last one (which SGLang never stores, but the chain covers alike)."""
    tokens = np.random.default_rng(1).integers(0, 150000, 4 * CHUNK + 5).tolist()
    by_tokens = key(tokens, salt=salt, dtype="bfloat16").chunk_hashes(CHUNK)
    by_pages = page_key("s", chain_hex(tokens, CHUNK, salt), CHUNK, dtype="bfloat16").chunk_hashes(CHUNK)
    assert len(by_tokens) == 5 and by_tokens == by_pages


def test_everything_that_changes_the_bytes_changes_the_digest_and_nothing_else_does():
    tokens = list(range(1000, 1000 + 2 * CHUNK))
    base = key(tokens, dtype="bfloat16").chunk_hashes(CHUNK)
    assert key(list(tokens), dtype="bfloat16").chunk_hashes(CHUNK) == base  # another request of the same prompt
    for other in (key(tokens, dtype="float16"), key(tokens, model="m2", dtype="bfloat16"),
                  key(tokens, rank=1, world_size=2, dtype="bfloat16"), key(tokens, salt="s", dtype="bfloat16"),
                  key(tokens, dtype=None)):
        assert set(other.chunk_hashes(CHUNK)).isdisjoint(base), other
    # a chain of smaller pages (SGLang with a page of a quarter chunk) is its own: never another prompt's chunk
    smaller = page_key("s", chain_hex(tokens, CHUNK // 4), CHUNK // 4, dtype="bfloat16").chunk_hashes(CHUNK)
    assert set(smaller).isdisjoint(base)


def test_the_chain_hashes_uint32_ids_and_tags_pages_holding_wider_ones():
    """SGLang's encoding: a page's ids as uint32 little-endian after the hash before it; a page with an id past
    uint32 as int64 after one 0xff byte."""
    import hashlib

    narrow = [1, 2, 3, 70000]
    first = hashlib.sha256(np.array(narrow[:2], "<u4").tobytes()).digest()
    second = hashlib.sha256(first + np.array(narrow[2:], "<u4").tobytes()).digest()
    assert chain_hex(narrow, 2) == [first.hex(), second.hex()]
    wide = [1, 2 ** 33]
    assert chain_hex(wide, 2) == [hashlib.sha256(b"\xff" + np.array(wide, "<i8").tobytes()).hexdigest()]
    # a prompt with one wide page: only that page is tagged, its narrow neighbours are still uint32
    mixed = [1, 2, -3, 4, 5]
    tagged = hashlib.sha256(first + b"\xff" + np.array(mixed[2:4], "<i8").tobytes()).digest()
    last = hashlib.sha256(tagged + np.array(mixed[4:], "<u4").tobytes()).digest()
    assert chain_hex(mixed, 2) == [first.hex(), tagged.hex(), last.hex()]
    assert chain_hex([5] * 3, 2, salt="") == chain_hex([5] * 3, 2)  # an empty salt is none, as in SGLang


def test_with_a_chain_of_smaller_pages_token_ids_name_the_chunks_an_engine_of_that_page_names():
    """A server whose page_hash_tokens is SGLang's page of a quarter chunk: token ids hashed in that chain name
    each chunk as SGLang's hashes of its four pages do, the partial last chunk too; a chain of another page
    names other chunks."""
    page = CHUNK // 4
    tokens = np.random.default_rng(2).integers(0, 150000, 3 * CHUNK + 2 * page).tolist()
    by_tokens = key(tokens, dtype="float16").chunk_hashes(CHUNK, hash_page=page)
    by_pages = page_key("s", chain_hex(tokens, page), page, dtype="float16").chunk_hashes(CHUNK)
    assert len(by_tokens) == 4 and by_tokens == by_pages
    assert set(key(tokens, dtype="float16").chunk_hashes(CHUNK)).isdisjoint(by_tokens)
    with pytest.raises(ValueError, match="page of 5 tokens does not divide the chunk size 16"):
        key(tokens).chunk_hashes(CHUNK, hash_page=5)
