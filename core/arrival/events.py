"""Event backends: how a worker learns that a layer slice's bytes are usable.

The transfer context exposes its backend as the public ``event_backend``
property and its device as ``device``; nothing reaches into private names.

* :class:`HostEventBackend` (CPU): no events. A slice is usable once the
  arrival count covers it, because a CPU copy is complete when the server
  publishes the count.
* ``CudaEventBackend`` (``kvstrata.native.cuda_events``, chosen by an adapter's event-backend hook): one interprocess CUDA
  event per layer, exported once per pool slot and sent as bytes; the worker
  makes its compute stream wait on the event instead of blocking the CPU.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from kvstrata.core.transfer.layouts import PagedKVLayout
    from kvstrata.core.transfer.planner import Executor


class LocalCopier(Protocol):
    """Engine placement: this process copies from the server's L1 pool (mapped read-only) into its cache."""

    def executor(self, spans: Sequence[tuple[int, int]]) -> "Executor":
        """An executor for one retrieve's objects, given as (byte offset in the pool, tokens) as the server
        located them (addresses by arithmetic: no per-object tensor on the way to the first copy)."""

    def slice_program(self) -> ContextManager[Any]:
        """The queue plans each slice inside this: where a slice's GPU work is issued by a native thread, it is
        handed over in one call on exit (on the CPU the copies run in the calls)."""

    def mark_slice(self, executor: "Executor") -> Any:
        """Inside the slice's program, right after the slice was enqueued: what a layer wait waits on for it (None: it has landed already)."""

    def finish(self, last_completion: Any) -> None:
        """Block the calling (transfer) thread until the slice ``last_completion`` marks has run, and with it
        every slice enqueued before it (then the locks may go). None: nothing is pending."""

    # Optional (a copier whose slices are issued by a native thread):
    #   def enqueue_slices(self, executor, job, slices: Sequence[tuple[int, int]]) -> list[Any]
    # plans every (layer_start, layer_count) slice of a load at once and hands them over as one program; returns
    # each slice's completion, as mark_slice would. The queue then plans a load's first layer alone (issued at
    # once), the rest of its first slice in one call and every later slice in another, instead of a program per
    # slice; ``slices`` need not start at layer 0 nor cover every layer. Without it, the queue goes slice by slice
    # (on the CPU a slice's copies run in its call, and a failure between slices stops the rest).

    def gather(self, spans: Sequence[tuple[int, int, int]], block_ids: Sequence[Sequence[int]]) -> Any:
        """STORE: copy the cache's blocks into reserved pool objects given as (byte offset, tokens, first
        position), after what the engine has queued so far (its forward's writes), without making the engine
        wait; returns what :meth:`finish` waits on. On an error nothing it enqueued is still running."""

    def close(self) -> None:
        ...


class EventBackend(Protocol):
    name: str
    device: str

    def create_layer_events(self, count: int) -> list[Any]:
        """Completion objects for ``count`` layers, built once per pool slot."""

    def export(self, events: list[Any]) -> list[bytes] | None:
        """Wire handles for the server, made once per slot (None: the board alone completes)."""

    def wait(self, event: Any) -> None:
        """Make the engine's current stream wait for ``event`` (after the board covered it)."""

    def landed(self, event: Any) -> bool:
        """Whether the copy ``event`` marks has run (never blocks): a request is released on a landed slice."""

    def wait_for_engine_writes(self) -> None:
        """Block until what the engine has queued so far has written its cache (a STORE is about to read it)."""

    def engine_copier(self, layout: "PagedKVLayout", regions: Sequence["torch.Tensor"],
                     pool: "torch.Tensor", writable: bool = False) -> LocalCopier:
        """Engine placement, once per mapping of the server's pool (at registration): the copies into
        ``regions`` (this process's cache) from ``pool``, and with ``writable`` (stores) back into it; on a GPU
        this is where the pool is registered for DMA."""


class HostEventBackend:
    name = "host"
    device = "cpu"

    def create_layer_events(self, count: int) -> list[Any]:
        return [None] * count

    def export(self, events: list[Any]) -> list[bytes] | None:
        return None

    def wait(self, event: Any) -> None:
        return None

    def landed(self, event: Any) -> bool:
        return True  # a CPU copy has run when its slice is published

    def wait_for_engine_writes(self) -> None:
        return None  # a CPU engine's forward has returned, so its writes are done

    def engine_copier(self, layout: "PagedKVLayout", regions: Sequence["torch.Tensor"],
                     pool: "torch.Tensor", writable: bool = False) -> LocalCopier:
        return HostCopier(layout, list(regions), pool)


class HostCopier:
    """CPU copies with the pure-torch executor: a slice has landed when its call returns."""

    def __init__(self, layout: "PagedKVLayout", regions: list["torch.Tensor"], pool: "torch.Tensor") -> None:
        self.layout = layout
        self.regions = regions
        self.pool = pool

    def executor(self, spans: Sequence[tuple[int, int]]) -> "Executor":
        from kvstrata.core.transfer.torch_executor import TorchExecutor

        from kvstrata.core.store.l1_store import span_view

        signature = self.layout.shape_signature()
        objects = [span_view(self.pool, signature, offset, tokens) for offset, tokens in spans]
        return TorchExecutor(self.regions, objects)

    def slice_program(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def mark_slice(self, executor: "Executor") -> Any:
        return None

    def finish(self, last_completion: Any) -> None:
        return None

    def gather(self, spans: Sequence[tuple[int, int, int]], block_ids: Sequence[Sequence[int]]) -> Any:
        from kvstrata.core.store.l1_store import span_view
        from kvstrata.core.transfer.planner import ChunkCopy, TransferJob
        from kvstrata.core.transfer.torch_executor import TorchExecutor

        signature = self.layout.shape_signature()
        objects = [span_view(self.pool, signature, offset, tokens) for offset, tokens, _ in spans]
        job = TransferJob(self.layout, block_ids, [ChunkCopy(i, 0, tokens, position)
                                                   for i, (_, tokens, position) in enumerate(spans)])
        TorchExecutor(self.regions, objects).gather(job)
        return None

    def close(self) -> None:
        self.regions = []
        self.pool = None
