"""Pure-torch scatter and gather: the CPU implementation and the oracle for the CUDA kernel.

Both take the same arguments the CUDA kernel's launch descriptor carries: the
engine-side layer is ``layer_offset + slot`` and the staged side is indexed by
``slot`` alone, with ``staged_layers`` layers in it; ``staged_layers == 0``
means all layers, which reproduces the all-layer addressing exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstrata.core.layouts import PagedKVLayout
from kvstrata.core.planner import TransferJob


def plane_view(regions: Sequence[torch.Tensor], layout: PagedKVLayout, layer: int, plane: int) -> torch.Tensor:
    """The ``[blocks, block_size, heads, head_bytes]`` uint8 view of one layer's K or V plane."""
    r, off = layout.offsets[layer][plane]
    region = regions[r]
    return torch.as_strided(
        region,
        (layout.num_blocks, layout.block_size, layout.num_heads, layout.head_bytes),
        (layout.block_stride, layout.token_stride, layout.head_stride, 1),
        # as_strided counts from the start of the storage, and a region may be a view into it
        region.storage_offset() + off,
    )


def block_runs(blocks: torch.Tensor, offsets: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Split per-token slots into runs inside one block: (block, first offset, first token, length).

    torch's index kernels move one element at a time (about 1 GB/s here), while
    a slice copy is a strided memcpy; a run per block turns a scatter into
    tokens / block_size slice copies per layer and plane.
    """
    n = blocks.numel()
    if n == 0:
        return []
    breaks = torch.ones(n, dtype=torch.bool)
    if n > 1:
        breaks[1:] = (blocks[1:] != blocks[:-1]) | (offsets[1:] != offsets[:-1] + 1)
    starts = torch.nonzero(breaks).flatten().tolist() + [n]
    b, o = blocks.tolist(), offsets.tolist()
    return [(b[s], o[s], s, e - s) for s, e in zip(starts[:-1], starts[1:])]


def scatter_staged(staged: torch.Tensor, regions: Sequence[torch.Tensor], layout: PagedKVLayout,
                   blocks: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
                   layer_offset: int = 0, staged_layers: int = 0) -> None:
    """Write ``staged`` (``[kv, S, tokens, heads, head_bytes]``) into the cache.

    ``blocks[g]`` / ``offsets[g]`` give each token's slot for KV group ``g``.
    """
    count = staged_layers or layout.num_layers
    if staged.shape[1] != count:
        raise ValueError(f"staged buffer holds {staged.shape[1]} layers, launch says {count}")
    group = layout.group_of_layer()
    runs = [block_runs(b, o) for b, o in zip(blocks, offsets)]
    for slot in range(count):
        layer = layer_offset + slot
        g = group[layer]
        for k in range(layout.kv_size):
            dst, src = plane_view(regions, layout, layer, k), staged[k, slot]
            for block, off, tok, n in runs[g]:
                dst[block, off:off + n].copy_(src[tok:tok + n])


def gather_staged(out: torch.Tensor, regions: Sequence[torch.Tensor], layout: PagedKVLayout,
                  blocks: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor]) -> None:
    """Read every layer of the given slots into ``out`` (``[kv, layers, tokens, heads, head_bytes]``)."""
    group = layout.group_of_layer()
    runs = [block_runs(b, o) for b, o in zip(blocks, offsets)]
    for layer in range(layout.num_layers):
        g = group[layer]
        for k in range(layout.kv_size):
            src, dst = plane_view(regions, layout, layer, k), out[k, layer]
            for block, off, tok, n in runs[g]:
                dst[tok:tok + n].copy_(src[block, off:off + n])


class ReferenceExecutor:
    """Runs transfer plans with torch on CPU tensors.

    ``objects[i]`` is the ``[kv, layers, tokens, heads, head_bytes]`` uint8 view of
    source object ``i`` (for a gather, the destination). There is no staging
    buffer: a layer slice of an object is already a strided view of exactly the
    staged shape, so the staged-addressing arithmetic is exercised unchanged.
    """

    name = "torch-reference"

    def __init__(self, regions: Sequence[torch.Tensor], objects: Sequence[torch.Tensor]) -> None:
        self.regions = list(regions)
        self.objects = list(objects)

    def _slots(self, job: TransferJob, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        pairs = [job.slots(index, g) for g in range(len(job.layout.groups))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def scatter(self, job: TransferJob, layer_start: int, layer_count: int) -> None:
        for i, c in enumerate(job.copies):
            obj = self.objects[c.object_index]
            tokens = slice(c.src_token_start, c.src_token_start + c.num_tokens)
            if layer_count == 0:
                staged = obj[:, :, tokens]
            else:
                staged = obj[:, layer_start:layer_start + layer_count, tokens]
            blocks, offsets = self._slots(job, i)
            scatter_staged(staged, self.regions, job.layout, blocks, offsets,
                           layer_offset=layer_start if layer_count else 0, staged_layers=layer_count)

    def gather(self, job: TransferJob) -> None:
        for i, c in enumerate(job.copies):
            obj = self.objects[c.object_index]
            tokens = slice(c.src_token_start, c.src_token_start + c.num_tokens)
            blocks, offsets = self._slots(job, i)
            gather_staged(obj[:, :, tokens], self.regions, job.layout, blocks, offsets)

    def synchronize(self) -> None:
        """CPU copies are complete when scatter returns."""
