"""The server's handle on a registered engine KV cache: where its bytes are and how to copy them.

A target wraps a :class:`PagedKVLayout` with the memory behind it and gives the
server an executor for a set of L1 objects plus the completion hooks of its
device. The shared-memory target (CPU engines whose cache lives in shared
memory, such as the reference engine) is here. Other region kinds come from
*target openers* the server is built with: ``kvstrata serve`` passes
``kvstrata.native``'s CUDA IPC opener, so the core never imports native code and
the server runs without CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from kvstrata.core.store.l1_store import StoredObject, object_view
from kvstrata.core.transfer.layouts import PagedKVLayout, LayoutError
from kvstrata.core.transfer.planner import Executor
from kvstrata.core.shm import Segment, proof_matches, read_control_header


@dataclass(frozen=True)
class HostSignal:
    """Store ``value`` (64 bits) at byte ``offset`` of a shared-memory ``segment`` once a transfer's copies end."""

    segment: Segment
    offset: int
    value: int


class Completion(Protocol):
    """The end of one transfer's copies on a device (see :meth:`Target.completion`)."""

    signalled: bool
    """Whether the device itself stores the signals asked of :meth:`Target.completion` once the copies end."""

    def wait(self) -> None:
        """Block until they have; raise the device's error if they failed."""


class _Done:
    """The completion of copies that ran inside the executor's calls (CPU targets)."""

    signalled = False

    def wait(self) -> None:
        return None


DONE = _Done()


class Target(Protocol):
    layout: PagedKVLayout
    device: str
    native_available: bool

    def executor(self, objects: Sequence[StoredObject]) -> Executor:
        """An executor moving between these L1 objects (in the pool given at open) and the cache.

        Objects, not tensor views: a device target needs only their addresses, and
        building a view per chunk costs more than the rest of a retrieve's set-up.
        """

    def open_layer_events(self, handles: list[bytes] | None) -> list[Any] | None:
        """Open the worker's exported per-layer events (cached per handle list)."""

    def record(self, events: Sequence[Any]) -> None:
        """Record ``events`` (the engine's) so that each completes after everything enqueued so far."""

    def wait_for_engine(self, event_handle: bytes | None) -> None:
        """Before a STORE reads the cache: wait for the engine's event, if any."""

    def finish(self) -> None:
        """Block until every copy enqueued so far is complete."""

    def completion(self, signals: Sequence[HostSignal] = ()) -> "Completion":
        """Mark everything enqueued so far, for the transfer that enqueued it: its settle waits for this
        transfer's copies alone, not for what later transfers queued behind them (as finish() would).

        ``signals``: 64-bit words in shared memory the device itself should store once the copies have
        ended (before the mark), so a process polling that memory learns of the end with no host thread
        in between. A target that cannot (the CPU ones: their copies are over already) ignores them, and
        says so in the completion's ``signalled``.
        """

    def close(self) -> None: ...


class ShmTarget:
    """A CPU cache in the engine's shared-memory segments, written directly by the server."""

    device = "cpu"
    native_available = True

    def __init__(self, layout: PagedKVLayout, pool: torch.Tensor, pool_segment: Segment | None = None) -> None:
        """``pool_segment``: the server's own L1 pool, which no region may name (checked by file, not name)."""
        self.layout = layout
        self.pool = pool
        self._segments: list[Segment] = []
        self.regions: list[torch.Tensor] = []
        try:
            for index, r in enumerate(layout.regions):
                if r.kind != "shm":
                    raise LayoutError(f"region kind {r.kind!r} cannot be mixed into a shared-memory target")
                try:
                    seg = Segment.attach(r.name)  # whole: the proof of ownership follows the cache
                except (OSError, ValueError) as exc:
                    raise LayoutError(f"region {index} ({r.name!r}, {r.size} bytes) cannot be opened: {exc}") \
                        from None
                self._segments.append(seg)
                if seg.size < r.size:
                    raise LayoutError(f"region {index} ({r.name}) holds {seg.size} bytes, fewer than the {r.size} "
                                      "its descriptor names")
                if pool_segment is not None and seg.file_id == pool_segment.file_id:
                    raise LayoutError(f"region {index} ({r.name}) is the server's own L1 pool, not an engine cache")
                header = read_control_header(seg)
                if header is not None:
                    raise LayoutError(f"region {index} ({r.name}) is {header[0].a_label}, not an engine cache")
                if not proof_matches(seg, r.size, r.handle.get("proof")):
                    raise LayoutError(f"region {index} ({r.name}): no proof that the registering process owns this "
                                      "memory (an engine cache segment is made with "
                                      "kvstrata.core.shm.create_cache_segment, whose proof the client sends); "
                                      "refused")
                self.regions.append(torch.frombuffer(seg.buf, dtype=torch.uint8, count=r.size))
        except BaseException:
            self.close()
            raise

    def executor(self, objects: Sequence[StoredObject]) -> Executor:
        from kvstrata.core.transfer.torch_executor import TorchExecutor

        return TorchExecutor(self.regions, [object_view(self.pool, o) for o in objects])

    def open_layer_events(self, handles: list[bytes] | None) -> list[Any] | None:
        if handles:
            raise LayoutError("a CPU target takes no per-layer event handles: the arrival board completes slices")
        return None

    def record(self, events: Sequence[Any]) -> None:
        return None

    def wait_for_engine(self, event_handle: bytes | None) -> None:
        if event_handle:
            raise LayoutError("a CPU target takes no event handle")

    def finish(self) -> None:
        return None

    def completion(self, signals: Sequence[HostSignal] = ()) -> "Completion":
        return DONE  # copies ran inside the executor's calls

    def close(self) -> None:
        self.regions.clear()
        for seg in self._segments:
            seg.close()
        self._segments.clear()


TargetOpener = Callable[[PagedKVLayout, torch.Tensor], "Target"]
"""Opens a target for a descriptor whose regions are all of one kind: ``(layout, l1 pool) -> Target``."""


def open_target(layout: PagedKVLayout, pool: torch.Tensor, pool_segment: Segment | None = None,
                openers: Mapping[str, TargetOpener] | None = None) -> Target:
    """The target for a descriptor's memory regions (``pool_segment``: the server's L1 pool, refused as one).

    ``shm`` regions are opened here; any other kind by ``openers[kind]``.
    """
    kinds = {r.kind for r in layout.regions}
    if kinds == {"shm"}:
        return ShmTarget(layout, pool, pool_segment)
    if len(kinds) == 1 and openers and next(iter(kinds)) in openers:
        return openers[next(iter(kinds))](layout, pool)
    known = sorted({"shm", *(openers or {})})
    raise LayoutError(f"unsupported memory region kinds {sorted(kinds)}: this server opens regions of one kind "
                      f"among {known} (kvstrata serve adds 'cuda_ipc' where CUDA is available)")
