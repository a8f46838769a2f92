"""The CUDA event backend: interprocess events say a layer slice's bytes are on the GPU.

Worker side. Each arrival-pool slot owns one interprocess event per layer,
created once and exported once (64-byte handles sent as bytes with every
retrieve that uses the slot). The server opens them once, records a slice's
events on its copy stream right after enqueuing the slice, and only then raises
the slot's board count: an event that was never recorded reports complete, so
the count is what makes an event safe to wait on (see ``core/arrival_board``).

``wait`` makes the engine's current stream wait for the event on the GPU; it
never blocks the CPU, so the engine keeps enqueuing work for later layers while
earlier ones are still landing.
"""

from __future__ import annotations

from typing import Any

import torch


def _device_index(device: str | int | torch.device) -> int:
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise ValueError(f"CudaEventBackend needs a CUDA device, got {device!r}")
    return d.index if d.index is not None else torch.cuda.current_device()


class CudaEventBackend:
    name = "cuda"

    def __init__(self, device: str | int | torch.device = "cuda", *, transfer_config: Any = None) -> None:
        """``transfer_config``: the ``CudaTransferConfig`` of this process's own copies (engine placement);
        None: ``CudaLocalCopier``'s default."""
        if not torch.cuda.is_available():
            raise RuntimeError("CudaEventBackend needs a CUDA device; torch.cuda.is_available() is False")
        self.transfer_config = transfer_config
        self.index = _device_index(device)
        self.device = f"cuda:{self.index}"
        self._store_event: torch.cuda.Event | None = None
        self._store_handle = b""

    def create_layer_events(self, count: int) -> list[Any]:
        """``count`` interprocess events (timing disabled, as CUDA IPC requires)."""
        with torch.cuda.device(self.index):
            return [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True) for _ in range(count)]

    def export(self, events: list[Any]) -> list[bytes] | None:
        with torch.cuda.device(self.index):
            return [bytes(e.ipc_handle()) for e in events]

    def wait(self, event: Any) -> None:
        """Make the engine's current stream wait for ``event``; returns at once."""
        if event is None:
            return
        torch.cuda.current_stream(self.index).wait_event(event)

    def landed(self, event: Any) -> bool:
        """Whether ``event`` completed (``cudaEventQuery``; an event never recorded reports complete, which is
        why the board count, raised only after recording, comes first)."""
        return event is None or event.query()

    def wait_for_engine_writes(self) -> None:
        """Block until the engine's current stream has run what it queued (a STORE reads the cache next)."""
        torch.cuda.current_stream(self.index).synchronize()

    def engine_copier(self, layout: Any, regions: Any, pool: torch.Tensor, writable: bool = False) -> Any:
        """Engine placement on this GPU: the engine's own copies (see ``CudaLocalCopier``)."""
        from kvstrata.native.cuda_executor import CudaLocalCopier

        return CudaLocalCopier(layout, regions, pool, self.index, self.transfer_config, writable=writable)

    def store_event_handle(self, stream: torch.cuda.Stream | None = None) -> bytes:
        """Record this backend's STORE event on ``stream`` (default: current) and return its handle.

        The server makes its copy stream wait on it before gathering, so a STORE
        reads the KV only after the engine's forward pass wrote it. One event is
        reused for every store and exported once: the server caches opened
        events by handle, and re-recording only ever makes a later wait stricter.
        """
        with torch.cuda.device(self.index):
            if self._store_event is None:
                self._store_event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                self._store_event.record(stream or torch.cuda.current_stream(self.index))
                self._store_handle = bytes(self._store_event.ipc_handle())
            else:
                self._store_event.record(stream or torch.cuda.current_stream(self.index))
            return self._store_handle


def event_backend_for(device: str) -> Any:
    """What a GPU adapter's ``kvstrata_event_backend`` answers: the host backend for ``cpu``, CUDA events for
    ``cuda:N``. Engines differ in their caches, not in how a layer's copy says it landed."""
    if device == "cpu":
        from kvstrata.core.arrival.events import HostEventBackend

        return HostEventBackend()
    return CudaEventBackend(device)

