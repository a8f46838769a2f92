"""The reference engine: a minimal paged KV cache in shared memory and the loop an engine runs.

It stands in for an inference engine in tests, the conformance suite, the
quick start and the CPU benchmark. "Prefill" writes KV that is a pure function
of (token id, position, layer, K/V plane, byte), so after a retrieve into any
blocks every byte can be checked against what the engine would have computed.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from kvstrata.core.transfer.layouts import PagedKVLayout, Region, blocks_layout, blocks_layout_bytes, DTYPE_SIZES
from kvstrata.core.shm import create_cache_segment
from kvstrata.core.transfer.torch_executor import gather_staged, plane_view, scatter_staged


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = 32
    kv_size: int = 2
    num_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"

    @property
    def head_bytes(self) -> int:
        return self.head_size * DTYPE_SIZES[self.dtype]

    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_size * self.num_heads * self.head_bytes


LLAMA_8B = ModelShape(32, 2, 8, 128, "bfloat16")


def synthetic_kv(tokens: torch.Tensor, positions: torch.Tensor, layer: int, plane: int, shape: ModelShape) -> torch.Tensor:
    """``[tokens, heads, head_bytes]`` uint8: what "prefill" computes for these tokens in one layer/plane."""
    width = shape.num_heads * shape.head_bytes
    base = ((tokens.to(torch.int64) * 131 + positions.to(torch.int64) * 7 + layer * 31 + plane * 17) % 251)
    vals = base.to(torch.int16)[:, None] + (torch.arange(width, dtype=torch.int16) % 251)[None, :]
    vals = torch.where(vals >= 251, vals - 251, vals)  # == (base + byte) % 251, in int16 for speed
    return vals.to(torch.uint8).view(-1, shape.num_heads, shape.head_bytes)


class ReferenceEngine:
    """A paged KV cache of ``num_blocks`` blocks in one private shared-memory segment."""

    def __init__(self, shape: ModelShape = LLAMA_8B, *, num_blocks: int = 256, block_size: int = 16) -> None:
        self.shape = shape
        self.block_size = block_size
        size = blocks_layout_bytes(num_layers=shape.num_layers, kv_size=shape.kv_size, num_blocks=num_blocks,
                                   block_size=block_size, num_heads=shape.num_heads, head_size=shape.head_size,
                                   dtype=shape.dtype)
        self.segment = create_cache_segment("engine", size)
        self.layout: PagedKVLayout = blocks_layout(
            num_layers=shape.num_layers, kv_size=shape.kv_size, num_blocks=num_blocks, block_size=block_size,
            num_heads=shape.num_heads, head_size=shape.head_size, dtype=shape.dtype,
            region=Region("shm", size, self.segment.name))
        self.regions = [torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=size)]
        self._free = list(range(num_blocks))
        self._lock = threading.Lock()
        self._ids = itertools.count()

    # --- blocks ----------------------------------------------------------------------

    def allocate(self, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.block_size)
        with self._lock:
            if need > len(self._free):
                raise RuntimeError(f"reference engine out of blocks: {need} needed, {len(self._free)} free")
            blocks, self._free = self._free[:need], self._free[need:]
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(blocks)

    def clear(self, blocks: Sequence[int]) -> None:
        """Zero blocks, so a later check cannot pass on bytes left from before."""
        for layer in range(self.shape.num_layers):
            for k in range(self.shape.kv_size):
                plane_view(self.regions, self.layout, layer, k)[list(blocks)] = 0

    # --- "compute" and checks --------------------------------------------------------

    def _slots(self, blocks: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end, dtype=torch.int64)
        return torch.as_tensor(list(blocks), dtype=torch.int64)[pos // self.block_size], pos % self.block_size

    def prefill(self, token_ids: Sequence[int], blocks: Sequence[int], start: int = 0) -> None:
        """Write the synthetic KV of tokens [start, len) into ``blocks`` (what a forward pass does)."""
        tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)
        end = len(tokens)
        b, o = self._slots(blocks, start, end)
        pos = torch.arange(start, end)
        staged = torch.stack([
            torch.stack([synthetic_kv(tokens[start:end], pos, l, k, self.shape) for l in range(self.shape.num_layers)])
            for k in range(self.shape.kv_size)])
        scatter_staged(staged, self.regions, self.layout, [b], [o])

    def read_layer(self, layer: int, blocks: Sequence[int], start: int, end: int) -> torch.Tensor:
        """``[kv, tokens, heads, head_bytes]`` of one layer for positions [start, end)."""
        b, o = self._slots(blocks, start, end)
        return torch.stack([plane_view(self.regions, self.layout, layer, k)[b, o] for k in range(self.shape.kv_size)])

    def expected_layer(self, token_ids: Sequence[int], layer: int, start: int, end: int) -> torch.Tensor:
        tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)[start:end]
        pos = torch.arange(start, end)
        return torch.stack([synthetic_kv(tokens, pos, layer, k, self.shape) for k in range(self.shape.kv_size)])

    def mismatched_layers(self, token_ids: Sequence[int], blocks: Sequence[int], start: int, end: int,
                          layers: Sequence[int] | None = None) -> list[int]:
        """Layers (of ``layers``, default all) whose bytes for positions [start, end) differ from what prefill
        would write."""
        return [l for l in (range(self.shape.num_layers) if layers is None else layers)
                if not torch.equal(self.read_layer(l, blocks, start, end), self.expected_layer(token_ids, l, start, end))]

    def gather(self, blocks: Sequence[int], start: int, end: int) -> torch.Tensor:
        b, o = self._slots(blocks, start, end)
        out = torch.empty(self.layout.object_shape(end - start), dtype=torch.uint8)
        gather_staged(out, self.regions, self.layout, [b], [o])
        return out

    def close(self) -> None:
        self.regions.clear()
        self.segment.destroy()
