"""Cache keys: which chunks of a token sequence the store holds, named the same whichever engine asks.

A chunk's identity rests on one page-hash chain: SHA-256 over each page's token ids (uint32 little-endian, or
int64 after a 0xff tag where a page holds an id past uint32), each page's hash taken over the hash before it,
the chain seeded by the request's cache salt. It is SGLang's storage page-hash chain, so that an engine naming a
prompt by token ids (vLLM, TensorRT-LLM: kvstrata computes the chain, one page per chunk) and SGLang naming it
by the hashes it computed itself (one page per SGLang page) name the same chunk alike wherever the pages agree.

A chunk's digest is its first and last page's hashes under the shard's seed: model name, tensor-parallel world size
and rank, the cache's object form (its KV dtype, or an engine's own page format: set by the server from the
registered cache the request is for) and the chain's page size in tokens. Everything that changes a chunk's bytes
is in it; the engine is not, nor its block size: vLLM (any block size dividing the chunk), TensorRT-LLM and SGLang
with a page of the server's hash page (``--page-hash-tokens``, by default one chunk) share every chunk. SGLang with
another page hashes at another step; its chunks are its own (a miss for the others, never another prompt's bytes).
"""

from __future__ import annotations

import dataclasses

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i8")
MAX_PAGE_HASH_CHARS = 256


def pack_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as int64 little-endian bytes.

    Engines hand over Python lists: ``struct`` packs those faster than numpy
    converts them, which matters on every store and retrieve of a long prompt.
    """
    if isinstance(token_ids, np.ndarray):
        return np.ascontiguousarray(token_ids, dtype=TOKEN_DTYPE).tobytes()
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in the int64 range: {exc}") from None


def check_token_bytes(data: bytes) -> None:
    """Raise ValueError unless ``data`` is a whole number of int64 token ids."""
    if len(data) % TOKEN_DTYPE.itemsize:
        raise ValueError(f"token bytes must be a multiple of {TOKEN_DTYPE.itemsize}, got {len(data)}")


CHAIN_NAMESPACE = b"sglang-cache-namespace-v1"
"""The seed prefix of a salted chain: SGLang's, so that a salted prompt chains the same in kvstrata and SGLang."""
WIDE_PAGE_TAG = b"\xff"
"""Before a page's int64 ids where one of them does not fit uint32: the odd byte count tells the encodings apart."""


def chain_seed(salt: str | None) -> bytes | None:
    """The hash a salted chain starts from (None: an unsalted chain starts from nothing). The salt is hashed
    as SGLang's request namespace with no extra key and the salt as its cache salt."""
    if not salt:  # SGLang takes an empty cache salt for none
        return None
    encoded = salt.encode("utf-8", "surrogatepass")
    seed = hashlib.sha256(CHAIN_NAMESPACE)
    seed.update(b"\x00")  # no extra key
    seed.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return seed.digest()


def page_hash_chain(tokens: bytes, page_size: int, salt: str | None = None) -> Iterator[bytes]:
    """The chain's hash (32 bytes) at the end of each page of ``tokens`` (int64 little-endian ids, as
    :func:`pack_tokens` gives them), the last page possibly partial, one at a time as asked for."""
    ids = np.frombuffer(tokens, dtype=TOKEN_DTYPE)
    prev = chain_seed(salt)
    # Every id fitting uint32 (a real vocabulary) is checked and narrowed once for the whole prompt: per page,
    # the two reductions and the conversion cost more than the page's hash.
    narrow = ids.astype("<u4").tobytes() if not ids.size or (int(ids.min()) >= 0 and int(ids.max()) <= 0xFFFFFFFF) \
        else None
    for start in range(0, len(ids), page_size):
        h = hashlib.sha256(prev) if prev is not None else hashlib.sha256()
        if narrow is not None:
            h.update(narrow[4 * start:4 * (start + page_size)])
        else:
            page = ids[start:start + page_size]
            if int(page.min()) < 0 or int(page.max()) > 0xFFFFFFFF:
                h.update(WIDE_PAGE_TAG)
                h.update(page.tobytes())
            else:
                h.update(page.astype("<u4").tobytes())
        prev = h.digest()
        yield prev


@dataclass(frozen=True)
class CacheKey:
    """The wire form of a key (see ``protocol.CACHE_KEY``) as a typed object."""

    request_id: str
    model: str
    world_size: int
    rank: int
    tokens: bytes
    salt: str | None = None
    page_hashes: tuple[str, ...] | None = None
    """The engine's per-page prefix hashes instead of token ids (``tokens`` is then empty): page i's hash
    covers every token up to the end of page i, so a chunk's key is its first and last pages' hashes."""
    page_size: int = 0
    dtype: str | None = None
    """The cache's object form (``PagedKVLayout.object_form``: its KV dtype, or an engine's own page format),
    part of every digest. The server sets it from the registered cache the request is for, so an engine need
    not send it; None where the key names no cache."""

    def __post_init__(self) -> None:
        if self.page_hashes is not None:
            if self.page_size <= 0:
                raise ValueError("a key by page hashes needs a positive page_size")
            if self.tokens:
                raise ValueError("a key is by token ids or by page hashes, not both")
            if any(not isinstance(h, str) or not h or len(h) > MAX_PAGE_HASH_CHARS for h in self.page_hashes):
                raise ValueError(f"page hashes must be non-empty strings of at most {MAX_PAGE_HASH_CHARS} characters")

    @classmethod
    def for_tokens(cls, request_id: str, token_ids: Sequence[int] | np.ndarray, *, model: str,
                   world_size: int = 1, rank: int = 0, salt: str | None = None,
                   dtype: str | None = None) -> "CacheKey":
        return cls(request_id, model, world_size, rank, pack_tokens(token_ids), salt, dtype=dtype)

    @classmethod
    def for_page_hashes(cls, request_id: str, page_hashes: Sequence[str], page_size: int, *, model: str,
                        world_size: int = 1, rank: int = 0, salt: str | None = None,
                        dtype: str | None = None) -> "CacheKey":
        return cls(request_id, model, world_size, rank, b"", salt, tuple(page_hashes), page_size, dtype)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "CacheKey":
        hashes = d.get("page_hashes")
        return cls(d["request_id"], d["model"], d["world_size"], d["rank"], bytes(d["tokens"]), d.get("salt"),
                   tuple(hashes) if hashes is not None else None, int(d.get("page_size", 0)), d.get("dtype"))

    def to_wire(self) -> dict[str, Any]:
        out = {"request_id": self.request_id, "model": self.model, "world_size": self.world_size,
               "rank": self.rank, "salt": self.salt, "tokens": self.tokens}
        if self.page_hashes is not None:
            out["page_hashes"] = list(self.page_hashes)
            out["page_size"] = self.page_size
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out

    @property
    def num_tokens(self) -> int:
        if self.page_hashes is not None:
            return len(self.page_hashes) * self.page_size
        return len(self.tokens) // TOKEN_DTYPE.itemsize

    def prefix(self, num_tokens: int) -> "CacheKey":
        """This key cut to its first ``num_tokens`` tokens (whole pages, for a key by page hashes)."""
        if self.page_hashes is not None:
            pages = -(-num_tokens // self.page_size)
            return dataclasses.replace(self, page_hashes=self.page_hashes[:pages])
        return dataclasses.replace(self, tokens=self.tokens[:num_tokens * TOKEN_DTYPE.itemsize])

    def same_shard(self, other: "CacheKey") -> bool:
        """Whether both keys hash under the same model shard (model, world size, rank, salt) the same way."""
        return (self.model, self.world_size, self.rank, self.salt, self.page_hashes is None, self.page_size,
                self.dtype) == (other.model, other.world_size, other.rank, other.salt, other.page_hashes is None,
                                other.page_size, other.dtype)

    def chunk_hashes(self, chunk_size: int, known: tuple["CacheKey", list[bytes]] | None = None,
                     hash_page: int = 0) -> list[bytes]:
        """One 16-byte digest per chunk, the last one possibly covering a partial chunk (see iter_chunk_hashes)."""
        return list(self.iter_chunk_hashes(chunk_size, known, hash_page))

    def iter_chunk_hashes(self, chunk_size: int, known: tuple["CacheKey", list[bytes]] | None = None,
                          hash_page: int = 0) -> Iterator[bytes]:
        """The chunk digests one at a time, each computed when asked for.

        A STORE hashes as it goes, so its first chunk's copy starts after one
        digest rather than after the whole prompt's.

        ``hash_page``: tokens per page of the chain a key by token ids is hashed in (0: one page per chunk;
        the server's ``page_hash_tokens``); a key by page hashes comes in the engine's pages.

        ``known`` is an earlier key with its digests (a LOOKUP's, kept for its
        RETRIEVE): where this key's tokens are that key's or a prefix of them, the
        digests are taken from it instead of hashing the prompt again.
        """
        if self.page_hashes is not None:
            yield from self._page_chunk_hashes(chunk_size)
            return
        check_token_bytes(self.tokens)
        if known is not None and self.same_shard(known[0]):
            earlier, digests = known
            mine, theirs = self.tokens, earlier.tokens
            if mine == theirs:
                yield from digests  # the same tokens: every digest, a partial last one too
                return
            if theirs.startswith(mine) and len(mine) // TOKEN_DTYPE.itemsize % chunk_size == 0:
                yield from digests[:len(mine) // TOKEN_DTYPE.itemsize // chunk_size]
                return
        page = hash_page or chunk_size
        if chunk_size % page:
            raise ValueError(f"the hash chain's page of {page} tokens does not divide the chunk size {chunk_size}")
        yield from _chunk_digests(self._shard_seed(page, ""), page_hash_chain(self.tokens, page, self.salt),
                                  chunk_size // page)

    def _shard_seed(self, page_size: int, salt: str) -> bytes:
        """What every digest of this key starts from: the model shard, the cache dtype, the chain's page size
        and (keys by page hash, whose chain the engine seeded) the salt."""
        return f"{self.model}\x00{self.world_size}\x00{self.rank}\x00{self.dtype or ''}\x00" \
               f"{page_size}\x00{salt}".encode("utf-8", "surrogatepass")

    def _page_chunk_hashes(self, chunk_size: int) -> Iterator[bytes]:
        """A key by page hashes: chunk i's digest is its first and its last page's hash under the shard's seed.

        The last page's hash names the whole prefix up to the chunk's end; the first page's names where the
        chunk starts. Both are needed because an engine may key a tail that starts at any page (SGLang keys
        what lies past its own device hit): by the last page alone, a chunk of pages 3-18 would share its
        digest with a stored partial chunk of pages 16-18 and a hit would load those three pages' bytes into
        pages 3-5. With both, a chunk only ever matches one covering exactly the same pages. The engine's hex
        hashes are taken as the chain's bytes where they are SHA-256 hex (SGLang's), so that a page of one
        chunk names the chunk a key by token ids names."""
        if chunk_size % self.page_size:
            raise ValueError(f"the server's chunk size {chunk_size} is not a multiple of the engine's page size "
                             f"{self.page_size}: keys by page hash need whole pages per chunk")
        yield from _chunk_digests(self._shard_seed(self.page_size, self.salt or ""),
                                  map(_page_hash_bytes, self.page_hashes), chunk_size // self.page_size)


def _chunk_digests(seed: bytes, pages: Iterable[bytes], per_chunk: int) -> Iterator[bytes]:
    """One digest per ``per_chunk`` pages of ``pages`` (the chain's hashes, in order), the last chunk possibly
    short: its first and last page's hashes under ``seed``, each part length-prefixed so none can run into the
    next."""
    first = last = b""
    count = 0
    for page in pages:
        first = page if count == 0 else first
        last, count = page, count + 1
        if count == per_chunk:
            yield _digest(seed, first, last)
            count = 0
    if count:
        yield _digest(seed, first, last)


def _digest(seed: bytes, first_page: bytes, last_page: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in (seed, first_page, last_page):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def _page_hash_bytes(page_hash: str) -> bytes:
    """An engine's page hash as the chain's bytes: 64 hex digits are a SHA-256 digest (SGLang's); anything else
    is taken as text, tagged so that it never equals a digest."""
    if len(page_hash) == 64:
        try:
            return bytes.fromhex(page_hash)
        except ValueError:
            pass
    return b"text:" + page_hash.encode("utf-8", "surrogatepass")
