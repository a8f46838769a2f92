"""LayerArrivalGate: when a request may go back to the engine, and what gates each layer.

Kept apart from any transport so it can be tested with no GPU and no server.
The transfer side calls :meth:`record_slice` as each slice lands (or is
published); the engine thread asks :meth:`release_ready` and, before reading a
layer, :meth:`wait_for_layer`. Both sides share one lock.

The release default is one layer: the first slice lands in a few percent of the
whole transfer's time, so waiting for more only delays the start of compute.
A slice covering N layers costs one wait, not N: the gate remembers which
slices the engine has already waited on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence


class LayerWaitTimeout(TimeoutError):
    """A layer did not arrive within the wait's timeout."""


class TransferFailed(RuntimeError):
    """The transfer feeding this gate failed; the layers it did not deliver never will."""


@dataclass
class _Slice:
    layer_start: int
    layer_count: int
    completion: Any
    waited: bool = False


class LayerArrivalGate:
    def __init__(self, num_layers: int, release_after_layers: int = 1) -> None:
        if num_layers <= 0:
            raise ValueError("num_layers must be positive")
        if release_after_layers < 1:
            raise ValueError("release_after_layers must be at least 1")
        self.num_layers = num_layers
        self.release_after_layers = min(release_after_layers, num_layers)
        self._slices: list[_Slice] = []
        self._slice_of_layer: list[_Slice | None] = [None] * num_layers
        self._contiguous = 0
        self._failed: str | None = None
        self._cond = threading.Condition()
        self._released = threading.Event()

    # --- transfer side ---------------------------------------------------------------

    def record_slice(self, layer_start: int, layer_count: int, completion: Any = None) -> None:
        """Record that layers [layer_start, layer_start + layer_count) landed (or will, per ``completion``)."""
        self.record_slices([(layer_start, layer_count)], [completion])

    def record_slices(self, slices: Sequence[tuple[int, int]], completions: Sequence[Any]) -> None:
        """:meth:`record_slice` for each ``(layer_start, layer_count)`` and its completion, under one lock and with
        one wake-up: a load's later slices are planned together, and 80 of them recorded one by one cost its
        planning more than writing them did. All are checked before any is recorded."""
        if len(slices) != len(completions):
            raise ValueError(f"{len(slices)} slices with {len(completions)} completions")
        for layer_start, layer_count in slices:
            if layer_count <= 0 or layer_start < 0 or layer_start + layer_count > self.num_layers:
                raise ValueError(f"slice [{layer_start}, {layer_start + layer_count}) is outside {self.num_layers} "
                                 "layers")
        with self._cond:
            of_layer = self._slice_of_layer
            for (layer_start, layer_count), completion in zip(slices, completions):
                s = _Slice(layer_start, layer_count, completion)
                self._slices.append(s)
                of_layer[layer_start:layer_start + layer_count] = [s] * layer_count
            while self._contiguous < self.num_layers and of_layer[self._contiguous] is not None:
                self._contiguous += 1
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = reason
            self._cond.notify_all()

    # --- engine side -----------------------------------------------------------------

    def mark_released(self) -> None:
        """The request went back to the engine."""
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    @property
    def arrived_layers(self) -> int:
        """Layers landed counting from layer 0 without a gap."""
        with self._cond:
            return self._contiguous

    @property
    def failure(self) -> str | None:
        with self._cond:
            return self._failed

    @property
    def complete(self) -> bool:
        with self._cond:
            return self._contiguous == self.num_layers

    def release_ready(self, landed: Callable[[Any], bool] | None = None) -> bool:
        """Whether the request may go back to the engine: its first ``release_after_layers`` layers are recorded
        and, if ``landed`` is given, each of their slices' completions says the bytes are in place.

        Recorded is not landed on a GPU: a slice's event is recorded when the copy is enqueued. Releasing
        then would let the engine batch a request whose copies sit behind other loads' in the copy engine,
        and that step would wait for all of them; so the worker asks ``landed`` (``EventBackend.landed``).
        """
        with self._cond:
            if self._contiguous < self.release_after_layers:
                return False
            if landed is None:
                return True
            seen = set()
            for layer in range(self.release_after_layers):
                s = self._slice_of_layer[layer]
                if id(s) not in seen:
                    seen.add(id(s))
                    if not landed(s.completion):
                        return False
            return True

    def wait_for_layer(self, layer: int, timeout: float, *, refresh: Callable[[], None] | None = None,
                       on_completion: Callable[[Any], None] | None = None, poll_interval: float = 0.0005) -> bool:
        """Block until ``layer`` has arrived; then, once per slice, hand its completion to ``on_completion``.

        ``refresh`` is called while waiting for a source that must be polled (the
        cross-process board). Returns True if a completion was handed over, False if this slice was
        already waited on. Raises TransferFailed or LayerWaitTimeout; never blocks
        longer than ``timeout``.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.num_layers})")
        deadline = time.monotonic() + timeout
        while True:
            if refresh is not None:
                refresh()
            with self._cond:
                s = self._slice_of_layer[layer]
                if s is not None:
                    if s.waited:
                        return False
                    s.waited = True
                    completion = s.completion
                    break
                if self._failed is not None:
                    raise TransferFailed(self._failed)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LayerWaitTimeout(
                        f"layer {layer} did not arrive within {timeout:.3f}s "
                        f"({self._contiguous} of {self.num_layers} layers landed)"
                    )
                self._cond.wait(min(remaining, poll_interval) if refresh is not None else remaining)
        if on_completion is not None:
            on_completion(completion)
        return True
