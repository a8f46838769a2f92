"""What an engine-placement instance registers: a small shared-memory area with the cache's geometry.

In engine placement the engine process does every copy itself (loads from the server's pool, stores into
objects the server reserved), so the server never opens the engine's cache; an engine's cache may even be
memory the server could not map (vLLM on CPU allocates it as private memory; TensorRT-LLM's pool is not
exportable through torch). REGISTER_KV_CACHE still describes a cache the server can open and check, so the
engine registers this area instead: the same (kv, layers, heads, head bytes) as the engine's cache, a few
chunks of blocks, in a shared-memory segment private to the user.
"""

from __future__ import annotations

from kvstrata.core.shm import create_cache_segment
from kvstrata.core.transfer.layouts import DTYPE_SIZES, PagedKVLayout, Region, blocks_layout, blocks_layout_bytes


class RegistrationArea:
    def __init__(self, engine_layout: PagedKVLayout, *, chunk_size: int, chunks: int = 1) -> None:
        if chunk_size % engine_layout.block_size:
            raise ValueError(f"the server's chunk size {chunk_size} is not a multiple of the engine's block size "
                             f"{engine_layout.block_size}; kvstrata moves whole blocks, so pick a chunk size that is")
        eb = DTYPE_SIZES[engine_layout.dtype]
        geometry = dict(num_layers=engine_layout.num_layers, kv_size=engine_layout.kv_size,
                        num_blocks=chunks * chunk_size // engine_layout.block_size,
                        block_size=engine_layout.block_size, num_heads=engine_layout.num_heads,
                        head_size=engine_layout.head_bytes // eb, dtype=engine_layout.dtype)
        size = blocks_layout_bytes(**geometry)
        self.segment = create_cache_segment("registration", size)
        self.layout = blocks_layout(**geometry, region=Region("shm", size, self.segment.name),
                                    fmt=f"{engine_layout.format}+registration")

    def close(self) -> None:
        self.segment.destroy()
