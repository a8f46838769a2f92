"""Pure-torch scatter and gather: the CPU implementation and the oracle for the CUDA kernel.

Both take the same arguments the CUDA kernel's launch descriptor carries: the
engine-side layer is ``layer_offset + slot`` and the staged side is indexed by
``slot`` alone, with ``staged_layers`` layers in it; ``staged_layers == 0``
means all layers, which reproduces the all-layer addressing exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstrata.core.transfer.layouts import PagedKVLayout
from kvstrata.core.transfer.planner import TransferJob


WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer type a plane's elements are copied as, by element size (their bits move unchanged)."""


def plane_view(regions: Sequence[torch.Tensor], layout: PagedKVLayout, layer: int, plane: int) -> torch.Tensor:
    """The ``[blocks, block_size, heads, head_bytes]`` uint8 view of one layer's K or V plane; for a plane whose
    elements are not side by side (``PagedKVLayout.plane_strides``), ``[blocks, block_size, heads, elements]``
    of an integer type of the element's size (:func:`fitted` views the object's side alike)."""
    r, off = layout.offsets[layer][plane]
    region = regions[r]
    token_stride, element_stride = layout.plane_addressing(plane)
    es = layout.element_size
    # as_strided counts from the start of the storage, and a region may be a view into it
    if element_stride == es:
        return torch.as_strided(region, (layout.num_blocks, layout.block_size, layout.num_heads, layout.head_bytes),
                                (layout.block_stride, token_stride, layout.head_stride, 1),
                                region.storage_offset() + off)
    # elements apart: address them as elements (a same-sized integer), one copy per element, not per byte
    words = region.view(WORDS[es])
    return torch.as_strided(words, (layout.num_blocks, layout.block_size, layout.num_heads, layout.head_bytes // es),
                            (layout.block_stride // es, token_stride // es, layout.head_stride // es,
                             element_stride // es),
                            words.storage_offset() + off // es)


def fitted(rows: torch.Tensor, plane: torch.Tensor) -> torch.Tensor:
    """``rows`` (``[..., head_bytes]`` bytes, the object's side) as ``plane`` (a :func:`plane_view`) holds a
    head: as its elements where the plane addresses elements."""
    return rows.view(plane.dtype) if plane.dtype != rows.dtype else rows


def block_runs(blocks: torch.Tensor, offsets: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Split per-token slots into runs inside one block: (block, first offset, first token, length).

    torch's index kernels move one element at a time, while a slice copy is a
    strided memcpy; a run per block turns a scatter into
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


def layer_span_view(regions: Sequence[torch.Tensor], layout: PagedKVLayout, first: int, count: int,
                    plane: int) -> torch.Tensor | None:
    """``[count, slots, row]`` view of layers [first, +count) of one plane, or None where there is none.

    Exists when token rows are dense and run on across blocks (slot ``b * block_size
    + o`` at ``slot * token_stride``) and the layers' planes sit at one stride in one
    region, as in the reference engine's and vLLM-on-CPU's caches. One copy then
    moves a run of tokens for every layer of a slice at once, where the general
    path copies per layer and per block: on CPU that is the difference between
    Python-loop speed and memcpy speed.
    """
    row = layout.num_heads * layout.head_bytes
    if (layout.is_hybrid or layout.plane_strides or (layout.num_heads > 1 and layout.head_stride != layout.head_bytes)
            or layout.token_stride != row
            or layout.block_stride != layout.block_size * row):
        return None
    places = [layout.offsets[layer][plane] for layer in range(first, first + count)]
    region = places[0][0]
    stride = places[1][1] - places[0][1] if count > 1 else 0
    if any(r != region or off != places[0][1] + i * stride for i, (r, off) in enumerate(places)):
        return None
    base = regions[region]
    return torch.as_strided(base, (count, layout.num_blocks * layout.block_size, row), (stride, row, 1),
                            base.storage_offset() + places[0][1])


def slot_runs(layout: PagedKVLayout, blocks: torch.Tensor, offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive cache slots: (first slot, first token, length), for :func:`layer_span_view`."""
    slots = blocks * layout.block_size + offsets
    n = slots.numel()
    if n == 0:
        return []
    breaks = torch.ones(n, dtype=torch.bool)
    if n > 1:
        breaks[1:] = slots[1:] != slots[:-1] + 1
    starts = torch.nonzero(breaks).flatten().tolist() + [n]
    first = slots.tolist()
    return [(first[s], s, e - s) for s, e in zip(starts[:-1], starts[1:])]


def _spans(staged: torch.Tensor, regions: Sequence[torch.Tensor], layout: PagedKVLayout,
           blocks: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor], first: int, count: int,
           runs: list[tuple[int, int, int]] | None = None):
    """(cache view, staged view, runs) per plane for the dense fast path, or None."""
    views = [layer_span_view(regions, layout, first, count, k) for k in range(layout.kv_size)]
    if any(v is None for v in views):
        return None
    try:  # a view, never a copy: gather writes through it
        planes = [staged[k].view(count, staged.shape[2], -1) for k in range(layout.kv_size)]
    except RuntimeError:
        return None
    if runs is None:
        runs = slot_runs(layout, blocks[0], offsets[0])
    return [(v, planes[k], runs) for k, v in enumerate(views)]


def scatter_staged(staged: torch.Tensor, regions: Sequence[torch.Tensor], layout: PagedKVLayout,
                   blocks: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
                   layer_offset: int = 0, staged_layers: int = 0,
                   runs: list[tuple[int, int, int]] | None = None) -> None:
    """Write ``staged`` (``[kv, S, tokens, heads, head_bytes]``) into the cache.

    ``blocks[g]`` / ``offsets[g]`` give each token's slot for KV group ``g``;
    ``runs`` is their :func:`slot_runs`, when the caller keeps it across slices.
    """
    count = staged_layers or layout.num_layers
    if staged.shape[1] != count:
        raise ValueError(f"staged buffer holds {staged.shape[1]} layers, launch says {count}")
    spans = _spans(staged, regions, layout, blocks, offsets, layer_offset, count, runs)
    if spans is not None:
        for dst, src, runs in spans:
            for slot, tok, n in runs:
                dst[:, slot:slot + n].copy_(src[:, tok:tok + n])
        return
    group = layout.group_of_layer()
    runs = [block_runs(b, o) for b, o in zip(blocks, offsets)]
    for slot in range(count):
        layer = layer_offset + slot
        g = group[layer]
        for k in range(layout.kv_size):
            dst = plane_view(regions, layout, layer, k)
            src = fitted(staged[k, slot], dst)
            for block, off, tok, n in runs[g]:
                dst[block, off:off + n].copy_(src[tok:tok + n])


def gather_staged(out: torch.Tensor, regions: Sequence[torch.Tensor], layout: PagedKVLayout,
                  blocks: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor]) -> None:
    """Read every layer of the given slots into ``out`` (``[kv, layers, tokens, heads, head_bytes]``)."""
    spans = _spans(out, regions, layout, blocks, offsets, 0, layout.num_layers)
    if spans is not None:
        for src, dst, runs in spans:
            for slot, tok, n in runs:
                dst[:, tok:tok + n].copy_(src[:, slot:slot + n])
        return
    group = layout.group_of_layer()
    runs = [block_runs(b, o) for b, o in zip(blocks, offsets)]
    for layer in range(layout.num_layers):
        g = group[layer]
        for k in range(layout.kv_size):
            src = plane_view(regions, layout, layer, k)
            dst = fitted(out[k, layer], src)
            for block, off, tok, n in runs[g]:
                dst[tok:tok + n].copy_(src[block, off:off + n])


class TorchExecutor:
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
        self._runs: dict[int, list[tuple[int, int, int]]] = {}
        self._runs_job: TransferJob | None = None
        self._whole: tuple[int, int, int, int, torch.Tensor] | None = None
        self._whole_job: TransferJob | None = None

    def _slots(self, job: TransferJob, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        pairs = [job.slots(index, g) for g in range(len(job.layout.groups))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _back_to_back(self, job: TransferJob) -> tuple[int, int, int, int, torch.Tensor] | None:
        """(first cache slot, objects, tokens per object, object stride, first object) when one copy
        can serve a slice.

        That is when every copy is a whole object of one size, the objects sit at
        one stride in one storage (the L1 pool holds a prompt's chunks in order) and
        their tokens land in one run of consecutive cache slots. Cached per job.
        """
        if self._whole_job is job:
            return self._whole
        self._whole_job, self._whole = job, None
        copies = job.copies
        if not copies or job.layout.is_hybrid:
            return None
        objs = [self.objects[c.object_index] for c in copies]
        T = objs[0].shape[2]
        if any(c.src_token_start != 0 or c.num_tokens != T or o.shape[2] != T or not o.is_contiguous()
               for c, o in zip(copies, objs)):
            return None
        storage = objs[0].untyped_storage().data_ptr()
        if any(o.untyped_storage().data_ptr() != storage for o in objs):
            return None
        starts = [o.storage_offset() for o in objs]
        stride = starts[1] - starts[0] if len(starts) > 1 else 0
        if any(b - a != stride for a, b in zip(starts, starts[1:])):
            return None
        bs = job.layout.block_size
        slots = torch.cat([b * bs + o for b, o in (job.slots(i, 0) for i in range(len(copies)))])
        first = int(slots[0])
        if not torch.equal(slots, torch.arange(first, first + slots.numel())):
            return None
        self._whole = (first, len(copies), T, stride, objs[0])
        return self._whole

    def _scatter_whole(self, job: TransferJob, layer_start: int, count: int) -> bool:
        """One copy per plane for a slice of every object (see :meth:`_back_to_back`); False if it cannot."""
        whole = self._back_to_back(job)
        if whole is None:
            return False
        first, n, T, stride, obj0 = whole
        lay = job.layout
        views = [layer_span_view(self.regions, lay, layer_start, count, k) for k in range(lay.kv_size)]
        if any(v is None for v in views):
            return False
        row = lay.num_heads * lay.head_bytes
        for k, view in enumerate(views):
            src = torch.as_strided(obj0, (count, n, T, row), (T * row, stride, row, 1),
                                   obj0.storage_offset() + (k * lay.num_layers + layer_start) * T * row)
            view[:, first:first + n * T].view(count, n, T, row).copy_(src)
        return True

    def scatter(self, job: TransferJob, layer_start: int, layer_count: int) -> None:
        if self._scatter_whole(job, layer_start if layer_count else 0, layer_count or job.layout.num_layers):
            return
        for i, c in enumerate(job.copies):
            obj = self.objects[c.object_index]
            tokens = slice(c.src_token_start, c.src_token_start + c.num_tokens)
            if layer_count == 0:
                staged = obj[:, :, tokens]
            else:
                staged = obj[:, layer_start:layer_start + layer_count, tokens]
            blocks, offsets = self._slots(job, i)
            if self._runs_job is not job:  # every slice of a job reuses its copies' runs
                self._runs_job, self._runs = job, {}
            if i not in self._runs:
                self._runs[i] = slot_runs(job.layout, blocks[0], offsets[0])
            scatter_staged(staged, self.regions, job.layout, blocks, offsets,
                           layer_offset=layer_start if layer_count else 0, staged_layers=layer_count,
                           runs=self._runs[i])

    def gather(self, job: TransferJob) -> None:
        for i, c in enumerate(job.copies):
            obj = self.objects[c.object_index]
            tokens = slice(c.src_token_start, c.src_token_start + c.num_tokens)
            blocks, offsets = self._slots(job, i)
            gather_staged(obj[:, :, tokens], self.regions, job.layout, blocks, offsets)

    def close(self) -> None:
        return None  # copies run in the call; nothing is held afterwards

    def synchronize(self) -> None:
        """CPU copies are complete when scatter returns."""
