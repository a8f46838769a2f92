"""Cache keys: which chunks of a token sequence the store holds.

A chunk's key is a rolling hash: the hash of everything before it, the chunk's
own token ids and the model shard (model name, world size, rank, optional
salt). Two requests that share a prefix therefore share the keys of the
prefix's chunks, and a chunk is only ever reused after the exact same prefix.
"""

from __future__ import annotations

import dataclasses

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

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
                   world_size: int = 1, rank: int = 0, salt: str | None = None) -> "CacheKey":
        return cls(request_id, model, world_size, rank, pack_tokens(token_ids), salt)

    @classmethod
    def for_page_hashes(cls, request_id: str, page_hashes: Sequence[str], page_size: int, *, model: str,
                        world_size: int = 1, rank: int = 0, salt: str | None = None) -> "CacheKey":
        return cls(request_id, model, world_size, rank, b"", salt, tuple(page_hashes), page_size)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "CacheKey":
        hashes = d.get("page_hashes")
        return cls(d["request_id"], d["model"], d["world_size"], d["rank"], bytes(d["tokens"]), d.get("salt"),
                   tuple(hashes) if hashes is not None else None, int(d.get("page_size", 0)))

    def to_wire(self) -> dict[str, Any]:
        out = {"request_id": self.request_id, "model": self.model, "world_size": self.world_size,
               "rank": self.rank, "salt": self.salt, "tokens": self.tokens}
        if self.page_hashes is not None:
            out["page_hashes"] = list(self.page_hashes)
            out["page_size"] = self.page_size
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
        return (self.model, self.world_size, self.rank, self.salt, self.page_hashes is None, self.page_size) == \
            (other.model, other.world_size, other.rank, other.salt, other.page_hashes is None, other.page_size)

    def chunk_hashes(self, chunk_size: int, known: tuple["CacheKey", list[bytes]] | None = None) -> list[bytes]:
        """One 16-byte digest per chunk, the last one possibly covering a partial chunk (see iter_chunk_hashes)."""
        return list(self.iter_chunk_hashes(chunk_size, known))

    def iter_chunk_hashes(self, chunk_size: int,
                          known: tuple["CacheKey", list[bytes]] | None = None) -> Iterator[bytes]:
        """The chunk digests one at a time, each computed when asked for.

        A STORE hashes as it goes, so its first chunk's copy starts after one
        digest rather than after the whole prompt's.

        ``known`` is an earlier key with its digests (a LOOKUP's, kept for its
        RETRIEVE). Where this key's tokens start with that key's, the digests of
        their shared whole chunks are equal by construction and are taken from it,
        so only what lies past them is hashed: a retrieve after its lookup hashes
        at most one chunk instead of the whole prompt.
        """
        if self.page_hashes is not None:
            yield from self._page_chunk_hashes(chunk_size)
            return
        check_token_bytes(self.tokens)
        reused: list[bytes] = []
        if known is not None and self.same_shard(known[0]):
            earlier, digests = known
            mine, theirs = self.tokens, earlier.tokens
            if mine == theirs:
                reused = list(digests)  # the same tokens: every digest, a partial last one too
            elif theirs.startswith(mine) or mine.startswith(theirs):
                shared = min(len(mine), len(theirs)) // TOKEN_DTYPE.itemsize
                reused = list(digests[:shared // chunk_size])
        yield from reused
        if reused:
            prev = reused[-1]
        else:
            seed = hashlib.blake2b(digest_size=16)
            seed.update(f"{self.model}\x00{self.world_size}\x00{self.rank}\x00{self.salt or ''}".encode())
            prev = seed.digest()
        data, step = memoryview(self.tokens), chunk_size * TOKEN_DTYPE.itemsize
        for start in range(len(reused) * step, len(data), step):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(data[start:start + step])
            prev = h.digest()
            yield prev

    def _page_chunk_hashes(self, chunk_size: int) -> Iterator[bytes]:
        """A key by page hashes: chunk i's digest is its first and its last page's hash under the shard's seed.

        The last page's hash names the whole prefix up to the chunk's end; the first page's names where the
        chunk starts. Both are needed because an engine may key a tail that starts at any page (SGLang keys
        what lies past its own device hit): by the last page alone, a chunk of pages 3-18 would share its
        digest with a stored partial chunk of pages 16-18 and a hit would load those three pages' bytes into
        pages 3-5. With both, a chunk only ever matches one covering exactly the same pages. Never equal to a
        token-keyed chunk's: the seed says "pages"."""
        if chunk_size % self.page_size:
            raise ValueError(f"the server's chunk size {chunk_size} is not a multiple of the engine's page size "
                             f"{self.page_size}: keys by page hash need whole pages per chunk")
        per_chunk = chunk_size // self.page_size
        seed = hashlib.blake2b(digest_size=16)
        seed.update(f"{self.model}\x00{self.world_size}\x00{self.rank}\x00{self.salt or ''}\x00pages"
                    f"{self.page_size}".encode())
        prefix = seed.digest()
        n = len(self.page_hashes)
        for start in range(0, n, per_chunk):
            h = hashlib.blake2b(prefix, digest_size=16)
            h.update(self.page_hashes[start].encode())
            h.update(b"\x00")
            h.update(self.page_hashes[min(start + per_chunk, n) - 1].encode())
            yield h.digest()
