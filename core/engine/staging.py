"""Worker-placement STORE: whole blocks copied into a shared staging area the server gathers from.

An engine whose KV cache the server cannot map (vLLM on CPU allocates it as
private memory) still stores through the ordinary STORE request: the worker
copies the blocks to be stored into a small shared-memory staging cache with
the same block geometry, and sends STORE with staging block ids. Chunks go in
windows of whole chunks, so the staging area stays small (a few chunks) however
long the prompt.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey, unpack_tokens, pack_tokens
from kvstrata.core.transfer.layouts import DTYPE_SIZES, PagedKVLayout, Region, blocks_layout, blocks_layout_bytes
from kvstrata.core.shm import Segment
from kvstrata.core.transfer.torch_executor import plane_view

log = logging.getLogger(__name__)


class StagingStore:
    def __init__(self, engine_layout: PagedKVLayout, engine_regions: Sequence[torch.Tensor], *, chunk_size: int,
                 chunks_per_window: int = 4) -> None:
        if chunk_size % engine_layout.block_size:
            raise ValueError(f"the server's chunk size {chunk_size} is not a multiple of the engine's block size "
                             f"{engine_layout.block_size}; kvstrata moves whole blocks, so pick a chunk size that is")
        self.engine_layout = engine_layout
        self.engine_regions = list(engine_regions)
        self.chunk_size = chunk_size
        self.blocks_per_window = chunks_per_window * chunk_size // engine_layout.block_size
        eb = DTYPE_SIZES[engine_layout.dtype]
        geometry = dict(num_layers=engine_layout.num_layers, kv_size=engine_layout.kv_size,
                        num_blocks=self.blocks_per_window, block_size=engine_layout.block_size,
                        num_heads=engine_layout.num_heads, head_size=engine_layout.head_bytes // eb,
                        dtype=engine_layout.dtype)
        size = blocks_layout_bytes(**geometry)
        self.segment = Segment.create("staging", size)
        self.layout = blocks_layout(**geometry, region=Region("shm", size, self.segment.name),
                                    fmt=f"{engine_layout.format}+staging")
        self.regions = [torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=size)]

    def _copy_blocks(self, engine_blocks: Sequence[Sequence[int]]) -> None:
        """Stage each layer's blocks (from its KV group's block list: a hybrid engine cache stages into one
        non-hybrid staging area, slot j holding every layer's j-th block)."""
        group_of = self.engine_layout.group_of_layer()
        for layer in range(self.engine_layout.num_layers):
            for k in range(self.engine_layout.kv_size):
                dst = plane_view(self.regions, self.layout, layer, k)
                src = plane_view(self.engine_regions, self.engine_layout, layer, k)
                for j, b in enumerate(engine_blocks[group_of[layer]]):  # one strided memcpy per block
                    dst[j].copy_(src[b])

    def store(self, client: CacheClient, instance_id: int, key: CacheKey, block_ids: Sequence[Sequence[int]],
              skip_first_n_tokens: int = 0) -> dict[str, int]:
        """STORE ``key``'s tokens (whole blocks) from the engine's ``block_ids`` (one list per KV group),
        window by window."""
        bs = self.engine_layout.block_size
        n = key.num_tokens
        if n % bs:
            raise ValueError(f"a staged STORE moves whole blocks: {n} tokens is not a multiple of {bs}")
        by_pages = key.page_hashes is not None
        if by_pages and key.page_size != bs:
            raise ValueError(f"a staged STORE by page hashes needs the key's page size {key.page_size} to be the "
                             f"cache's block size {bs}")
        tokens = None if by_pages else unpack_tokens(key.tokens)
        window = self.blocks_per_window * bs
        start = (skip_first_n_tokens // self.chunk_size) * self.chunk_size
        totals = {"stored_tokens": 0, "skipped_tokens": start}
        while start < n:
            end = min(start + window, n)
            self._copy_blocks([list(g)[start // bs:end // bs] for g in block_ids])
            ids = [0] * (start // bs) + list(range((end - start) // bs))
            if by_pages:  # the engine's page-hash chain up to the window's end
                window_key = CacheKey(key.request_id, key.model, key.world_size, key.rank, b"", key.salt,
                                      key.page_hashes[:end // bs], bs)
            else:
                window_key = CacheKey(key.request_id, key.model, key.world_size, key.rank,
                                      pack_tokens(tokens[:end]), key.salt)
            reply: dict[str, Any] = client.store(window_key, instance_id, [ids], skip_first_n_tokens=start)
            totals["stored_tokens"] += reply["stored_tokens"]
            totals["skipped_tokens"] += reply["skipped_tokens"] - start
            start = end
        return totals

    def close(self) -> None:
        self.regions.clear()
        self.segment.destroy()
