"""Transfer plans: which bytes of which L1 objects go to which engine blocks, and in what order.

A retrieve moves a run of chunk objects into the engine's blocks. The
chunk-major plan (the default) hands every object to the executor in one call
covering all layers. The layer-major plan walks the layer axis in slices of
``layers_per_slice`` layers, hands the executor every object's slice, and calls
``on_layer_batch(layer_start, layer_count)`` after each slice so that the caller
can record that slice's completion. An object is ``[kv, layer, token, hidden]``,
so a layer slice is ``kv`` contiguous byte ranges inside it: no change to what is
stored, only to how much of it one step moves.

The plan is pure arithmetic; the executor (``kvstrata.native``) does the copies.
That keeps the planner testable without a GPU and lets the CPU reference and
the CUDA kernel run the very same plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from kvstrata.core.transfer.layouts import PagedKVLayout

log = logging.getLogger(__name__)

OnLayerBatch = Callable[[int, int], None]

SliceObserver = Callable[[str, int], None]
"""Called with (the transfer's name, slices published so far) before a transfer's first slice and after each
one, on the thread that enqueues the slices. It may block: an engine-placement queue with an observer plans its
loads on its own thread, never on the engine's, unless the observer has an ``active()`` that says False (nothing
to tell now). Whoever runs the transfer (the engine placement's queue, the
server) takes one at construction; none by default. An observer that raises fails the transfer, like a failed
copy: the engine is told and recomputes. The test suites inject one to hold a transfer at a chosen slice, so an
in-flight state is observed by construction instead of by racing the copy."""


class ChunkCopy(NamedTuple):
    """Part of one L1 object that lands in the engine's cache.

    A named tuple, not a dataclass: a retrieve builds one per chunk on the way to
    its first copy, and a tuple is built several times faster.
    """

    object_index: int
    """Index into the executor's list of source objects for this transfer."""
    src_token_start: int
    """First token inside the object to move."""
    num_tokens: int
    dst_position: int
    """Sequence position of the first moved token (selects block and offset)."""


@dataclass
class TransferJob:
    """Everything an executor needs besides the bytes themselves."""

    layout: PagedKVLayout
    block_ids: Sequence[Sequence[int]]
    copies: list[ChunkCopy]
    _slots: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.copies)

    def slots(self, copy_index: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, in-block offsets) of every token of one copy, for one KV group. Cached."""
        key = (copy_index, group)
        hit = self._slots.get(key)
        if hit is None:
            c = self.copies[copy_index]
            pos = torch.arange(c.dst_position, c.dst_position + c.num_tokens, dtype=torch.int64)
            table = torch.as_tensor(self.block_ids[group], dtype=torch.int64)
            bs = self.layout.block_size
            hit = (table[pos // bs], pos % bs)
            self._slots[key] = hit
        return hit


class Executor(Protocol):
    """What a native backend provides to run a plan (see ``kvstrata.native``)."""

    def scatter(self, job: TransferJob, layer_start: int, layer_count: int) -> None:
        """Move layers [layer_start, layer_start + layer_count) of every copy into the cache.

        ``layer_count == 0`` means all layers in one launch: the chunk-major path.
        May return before the copy is complete on an asynchronous device; the
        caller records completion in ``on_layer_batch``.
        """

    def gather(self, job: TransferJob) -> None:
        """Move every layer of every copy from the cache into the objects (STORE)."""

    def close(self) -> None:
        """Release what the transfer held (a device executor's table slots); the caller calls it once every
        copy is enqueued, or the transfer was abandoned. Copies already enqueued still complete."""


def plan_copies(object_tokens: Sequence[int], chunk_size: int, first_position: int,
                skip_first_n_tokens: int) -> list[ChunkCopy]:
    """Copies for objects laid end to end from ``first_position``, skipping tokens the engine has.

    ``object_tokens[i]`` is how many tokens object ``i`` holds (``chunk_size`` except
    maybe the last). Tokens before ``skip_first_n_tokens`` are not moved, so a
    partially skipped chunk contributes only its tail.
    """
    copies = []
    position = first_position
    for index, n in enumerate(object_tokens):
        if n <= 0 or n > chunk_size:
            raise ValueError(f"object {index} holds {n} tokens, chunk size is {chunk_size}")
        start = max(skip_first_n_tokens - position, 0)
        if start < n:
            copies.append(ChunkCopy(index, start, n - start, position + start))
        position += n
    return copies


def layer_slices(num_layers: int, layers_per_slice: int) -> list[tuple[int, int]]:
    """(layer_start, layer_count) per slice; the last slice may be shorter."""
    if layers_per_slice <= 0:
        return [(0, num_layers)]
    return [(s, min(layers_per_slice, num_layers - s)) for s in range(0, num_layers, layers_per_slice)]


def enqueue_slice(executor: Executor, job: TransferJob, layers_per_slice: int, index: int,
                  request_id: str = "", observer: SliceObserver | None = None) -> None:
    """Hand the executor slice ``index`` of ``layer_slices(num_layers, layers_per_slice)``.

    For callers that interleave the slices of several transfers (the engine placement's queue); the caller
    records the slice's completion and then calls :func:`slice_published`. ``layers_per_slice == 0`` is the
    chunk-major path: one all-layer launch.
    """
    if index == 0 and observer is not None:
        observer(request_id, 0)
    if layers_per_slice <= 0:
        executor.scatter(job, 0, 0)
    else:
        start = index * layers_per_slice
        executor.scatter(job, start, min(layers_per_slice, job.layout.num_layers - start))


def slice_published(request_id: str, index: int, observer: SliceObserver | None = None) -> None:
    """Slice ``index`` was enqueued and its completion recorded: tell ``observer``."""
    if observer is not None:
        observer(request_id, index + 1)


LayersNeeded = Callable[[int], None]
"""Called before a slice is enqueued with how many leading layers of its objects it reads (the slice's end):
returns once they are in the pool (an object filling from the shared tier), raises if they never will be."""


def run_chunk_major(executor: Executor, job: TransferJob, on_layer_batch: OnLayerBatch | None = None,
                    request_id: str = "", observer: SliceObserver | None = None,
                    layers_needed: LayersNeeded | None = None) -> None:
    """The default path: one all-layer launch. ``on_layer_batch`` sees one batch of every layer."""
    if layers_needed is not None:
        layers_needed(job.layout.num_layers)
    enqueue_slice(executor, job, 0, 0, request_id, observer)
    if on_layer_batch is not None:
        on_layer_batch(0, job.layout.num_layers)
    slice_published(request_id, 0, observer)


def run_layer_major(executor: Executor, job: TransferJob, layers_per_slice: int,
                    on_layer_batch: OnLayerBatch, request_id: str = "", observer: SliceObserver | None = None,
                    layers_needed: LayersNeeded | None = None) -> None:
    """Issue one executor call per layer slice, calling back after each.

    Deliberately narrower than chunk-major: one KV group only (the caller falls
    back to chunk-major for hybrid layouts, see :func:`layer_major_fallback_reason`).
    """
    if layers_per_slice <= 0:
        raise ValueError("run_layer_major needs layers_per_slice > 0; 0 is the chunk-major path")
    for index, (start, count) in enumerate(layer_slices(job.layout.num_layers, layers_per_slice)):
        if layers_needed is not None:
            layers_needed(start + count)
        enqueue_slice(executor, job, layers_per_slice, index, request_id, observer)
        on_layer_batch(start, count)
        slice_published(request_id, index, observer)


def run_transfer(executor: Executor, job: TransferJob, layers_per_slice: int,
                 on_layer_batch: OnLayerBatch | None = None, request_id: str = "",
                 observer: SliceObserver | None = None, layers_needed: LayersNeeded | None = None) -> None:
    """Layer-major when ``layers_per_slice > 0``, else chunk-major. ``request_id`` names the transfer to
    ``observer`` (see :data:`SliceObserver`); nothing else reads it. ``layers_needed``: see
    :data:`LayersNeeded` (None: every object's bytes are in)."""
    if layers_per_slice > 0:
        run_layer_major(executor, job, layers_per_slice, on_layer_batch or (lambda s, c: None), request_id, observer,
                        layers_needed)
    else:
        run_chunk_major(executor, job, on_layer_batch, request_id, observer, layers_needed)


def layer_major_fallback_reason(layout: PagedKVLayout, *, sliceable: bool = True,
                                native_available: bool = True) -> str | None:
    """Why a layer-major request must run chunk-major instead, or None if it need not."""
    if layout.is_hybrid:
        return (f"the cache holds {len(layout.groups)} KV groups (hybrid model); "
                "layer-major staging supports one group")
    if not sliceable:
        return "the retrieve includes objects on a tier that cannot be sliced by layer"
    if not native_available:
        return "the native transfer extension is not available"
    return None


_logged_reasons: set[str] = set()


def log_fallback_once(reason: str) -> None:
    """Log each distinct fallback reason once per process, at WARNING."""
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        log.warning("layer-major retrieve falls back to chunk-major: %s", reason)
