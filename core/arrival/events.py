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

from typing import Any, Protocol


class EventBackend(Protocol):
    name: str
    device: str

    def create_layer_events(self, count: int) -> list[Any]:
        """Completion objects for ``count`` layers, built once per pool slot."""

    def export(self, events: list[Any]) -> list[bytes] | None:
        """Wire handles for the server, made once per slot (None: the board alone completes)."""

    def wait(self, event: Any) -> None:
        """Make the engine's current stream wait for ``event`` (after the board covered it)."""

    def wait_for_engine_writes(self) -> None:
        """Block until what the engine has queued so far has written its cache (a STORE is about to read it)."""


class HostEventBackend:
    name = "host"
    device = "cpu"

    def create_layer_events(self, count: int) -> list[Any]:
        return [None] * count

    def export(self, events: list[Any]) -> list[bytes] | None:
        return None

    def wait(self, event: Any) -> None:
        return None

    def wait_for_engine_writes(self) -> None:
        return None  # a CPU engine's forward has returned, so its writes are done
