"""The server's handle on an engine's KV cache that lives on a GPU (``cuda_ipc`` regions).

Implements :class:`kvstrata.core.server.targets.Target`. At registration it opens the
engine's regions from CUDA IPC, pins the server's L1 pool once per process and
builds a :class:`~kvstrata.native.cuda_executor.CudaTransferEngine` with its own
stream; every copy for this engine runs on that stream, from pinned L1 memory.

Events: the worker's per-layer interprocess events arrive as handle bytes with
every retrieve; each is opened once and cached by its bytes (a pool slot's
handles never change). ``record`` records them on a side stream that waits for
the slice; the server raises the arrival count only afterwards.

If the CUDA extension cannot be built, the target still works through the
pure-torch executor and reports ``native_available = False``, so layer-major
requests fall back to chunk-major (logged once) instead of failing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import mmap
import threading
from typing import Any, Sequence

import torch

from kvstrata.core.store.l1_store import StoredObject, object_view
from kvstrata.core.transfer.layouts import LayoutError, PagedKVLayout
from kvstrata.core.transfer.planner import Executor
from kvstrata.core.shm import Segment
from kvstrata.core.server.targets import HostSignal

from . import cuda_ipc
from .cuda_executor import CudaTransferConfig, CudaTransferEngine
from .host_pinning import pin_host_range, unpin_host_range

log = logging.getLogger(__name__)


class CudaIpcTarget:
    def __init__(self, layout: PagedKVLayout, pool: torch.Tensor, config: CudaTransferConfig | None = None) -> None:
        if not torch.cuda.is_available():
            raise LayoutError("the engine registered a CUDA cache but this server sees no CUDA device")
        indices = {cuda_ipc.device_index_for(r.handle) for r in layout.regions}
        if len(indices) != 1:
            raise LayoutError(f"a registered cache must live on one GPU; its regions are on devices {sorted(indices)}")
        self.index = indices.pop()
        self.device = f"cuda:{self.index}"
        self.layout = layout
        self.pool = pool
        # a copy: the server shares one config among its targets, and the fallback below changes the mode
        config = dataclasses.replace(config) if config is not None else CudaTransferConfig()
        self._regions = [cuda_ipc.open_region(r) for r in layout.regions]
        self.native_available = True
        try:
            self.engine = CudaTransferEngine(layout, self._regions, pool, self.index, config)
        except Exception as exc:
            from .cuda_ext import CudaExtensionError

            if not isinstance(exc, CudaExtensionError):
                raise
            log.error("CUDA transfers for this cache use the pure-torch fallback: %s", exc)
            self.native_available = False
            config.mode = "torch"
            self.engine = CudaTransferEngine(layout, self._regions, pool, self.index, config)
        with torch.cuda.device(self.index):
            self._event_stream = torch.cuda.Stream(self.index)
            self._slice_done = torch.cuda.Event()  # re-recorded per slice: a wait takes its latest record
            self._copy_done = torch.cuda.Event()  # the copy stream's end, for completion()
        self._done_events: list[torch.cuda.Event] = []  # completion() events whose transfer has settled
        self._events: dict[bytes, torch.cuda.Event] = {}
        self._event_lists: dict[tuple[bytes, ...], list[torch.cuda.Event]] = {}
        self._events_lock = threading.Lock()
        # the extension's copies only go onto the streams, so the GPU can store the end signals itself; the torch
        # fallback copies from pageable memory, in the call
        self._signals_on = (self.engine.config.mode != "torch"
                            and getattr(self.engine.ext, "signal_host", None) is not None)
        self.signals = 0
        """Host words the GPU was asked to store at transfer ends (server_info's ``gpu_signals``)."""
        self._host_segments: dict[str, int] = {}
        """Device base address of each shared-memory segment the GPU signals into (see completion())."""
        log.info("CUDA target on %s (%s): %s copies, up to %d CTAs per launch", self.device,
                 torch.cuda.get_device_name(self.index), self.engine.config.mode, self.engine.max_ctas)

    @property
    def busy_wait(self) -> Any:
        """The extension's GIL-free poll (for the transport's busy polling), or None without the extension.

        It keeps querying this engine's stream while it spins, so the driver is warm
        when the next transfer's first slice is enqueued (see ``spin_until_readable``).
        """
        ext = self.engine.ext
        spin = getattr(ext, "spin_until_readable", None) if ext is not None else None
        if spin is None:
            return None
        return functools.partial(spin, warm_stream=self.engine.stream.cuda_stream)

    @property
    def stream(self) -> torch.cuda.Stream:
        return self.engine.stream

    def executor(self, objects: Sequence[StoredObject]) -> Executor:
        if self.engine.pool is None:  # the pure-torch fallback copies from tensor views
            return self.engine.executor([object_view(self.pool, o) for o in objects])
        return self.engine.pool_executor([(o.offset, o.num_tokens) for o in objects])

    def _event(self, handle: bytes) -> torch.cuda.Event:
        ev = self._events.get(handle)
        if ev is None:
            if len(handle) != 64:
                raise LayoutError(f"a CUDA IPC event handle is 64 bytes, got {len(handle)}")
            try:
                ev = torch.cuda.Event.from_ipc_handle(self.index, handle)
            except RuntimeError as exc:
                raise LayoutError(f"cannot open the engine's CUDA IPC event: {exc}") from None
            self._events[handle] = ev
        return ev

    def open_layer_events(self, handles: list[bytes] | None) -> list[Any] | None:
        """The opened events for a handle list; each handle is opened once per process."""
        if not handles:
            return None
        key = tuple(handles)
        with self._events_lock:
            hit = self._event_lists.get(key)
            if hit is None:
                hit = [self._event(h) for h in key]
                self._event_lists[key] = hit
            return hit

    def record(self, events: Sequence[Any]) -> None:
        """Record the engine's events after everything enqueued so far, on a side stream.

        Each interprocess event record costs the stream that carries it GPU time,
        more while the engine's stream waits on it (``benchmarks/event_record_cost.py``):
        on the copy stream, a transfer's records would sit between its last copy and
        the server seeing it done. On a side stream that first waits for the copy
        stream, they complete at the same point for the engine and delay nothing the
        server waits for.
        """
        if not events:
            return
        e = self.engine
        with self._events_lock:
            self._slice_done.record(e.stream)
            self._event_stream.wait_event(self._slice_done)
            for event in events:
                event.record(self._event_stream)

    def wait_for_engine(self, event_handle: bytes | None) -> None:
        """STORE: make the copy stream wait (on the GPU) for the engine's event before gathering."""
        if event_handle:
            with self._events_lock:
                ev = self._event(event_handle)
            self.engine.stream.wait_event(ev)

    def finish(self) -> None:
        self.engine.synchronize()

    def completion(self, signals: Sequence[HostSignal] = ()) -> "DeviceCompletion":
        """A mark after everything enqueued so far on both copy streams (see :class:`DeviceCompletion`).

        Each of ``signals`` is stored by the GPU itself (a one-thread kernel writing
        the mapped word) after the copies and before the mark, so the mark's
        completion also means the signals have landed: whoever unmaps a signalled
        segment waits for the mark first. If storing signals fails once (no
        extension, no host registration), it is logged and they stay off.
        """
        e = self.engine
        with self._events_lock:
            done = self._done_events.pop() if self._done_events else None
            if done is None:
                with torch.cuda.device(self.index):
                    done = torch.cuda.Event()
            if e.copy_stream is not None:
                self._copy_done.record(e.copy_stream)
                e.stream.wait_event(self._copy_done)
            signalled = bool(signals) and self._signal(signals)
            done.record(e.stream)
        return DeviceCompletion(self, done, signalled)

    def _signal(self, signals: Sequence[HostSignal]) -> bool:
        if not self._signals_on:
            return False
        ext = self.engine.ext
        try:
            addresses = [self._device_word(s.segment, s.offset) for s in signals]
            for dev, s in zip(addresses, signals):
                ext.signal_host(dev, s.value, self.index, self.engine.stream.cuda_stream)
            self.signals += len(signals)
            return True
        except Exception as exc:
            self._signals_on = False
            log.warning("the GPU no longer signals transfer ends itself (the server's polling thread announces "
                        "them, a little later): %s", exc)
            return False

    def _device_word(self, segment: Segment, offset: int) -> int:
        """The device address of a word in a shared-memory segment, registering the segment on first use."""
        if not segment.address or not 0 <= offset <= segment.size - 8:
            raise ValueError(f"cannot signal at offset {offset} of segment {segment.name}")
        base = self._host_segments.get(segment.name)
        if base is None:
            addr, size = segment.address, -(-segment.size // mmap.PAGESIZE) * mmap.PAGESIZE
            ext = self.engine.ext
            base = pin_host_range(addr, size, self.index, ext, what=f"segment {segment.name}")
            self._host_segments[segment.name] = base

            def unregister(name: str = segment.name) -> None:  # before the segment is unmapped
                self._host_segments.pop(name, None)
                unpin_host_range(addr, size, ext)

            segment.before_close.append(unregister)
        return base + offset

    def _recycle(self, done: torch.cuda.Event) -> None:
        with self._events_lock:
            self._done_events.append(done)

    def close(self) -> None:
        try:
            self.engine.synchronize()
            self._event_stream.synchronize()
        except RuntimeError as exc:  # a dead engine process can leave the context unusable
            log.warning("CUDA target on %s: final synchronize failed: %s", self.device, exc)
        self.engine.close()
        self._event_lists.clear()
        self._events.clear()
        self._regions.clear()


class DeviceCompletion:
    """One transfer's end on the GPU: an event recorded after its copies on both streams.

    :meth:`wait` blocks on this transfer's event alone (not on what later
    transfers queued behind it) and raises a CUDA error as a synchronize would.
    The event goes back to the target's pool once seen complete.
    """

    __slots__ = ("signalled", "_target", "_event", "_seen")

    def __init__(self, target: CudaIpcTarget, event: torch.cuda.Event, signalled: bool = False) -> None:
        self._target = target
        self._event = event
        self.signalled = signalled
        self._seen = False

    def wait(self) -> None:
        if not self._seen:
            self._event.synchronize()
            self._done()

    def _done(self) -> None:
        self._seen = True
        self._target._recycle(self._event)  # re-recorded only by a later completion()
