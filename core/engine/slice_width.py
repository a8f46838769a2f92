"""``layers_per_slice: auto``: the slice width chosen per load from what this process measured.

A load of width ``w`` lands its first slice after ``w`` layers' worth of copying, and the engine computes layer 0
while the rest copies: the narrower, the earlier the release. But every slice costs a fixed amount on top of its
bytes (a staging piece's copy-engine job, a scatter launch, an event), so a slice must carry enough bytes for that
cost to stay small: many layers with few KV heads and a short prefix make thin layers. The width chosen is the
narrowest whose per-slice cost stays under :data:`SLICE_COST_SHARE` of the slice's copy time; where even one slice of
every layer could not (a load too small for layer-major to win anything), the load runs chunk-major.

The copy time of a layer comes from the copy rate this process measured on loads that had the copy engine to
themselves (no other load in flight from submit to end), starting from :data:`DEFAULT_COPY_RATE` until one has
been seen; the per-slice cost is a constant measured on the machines in ``benchmarks/results``.
"""

from __future__ import annotations

import math
import threading

AUTO = -1
"""``layers_per_slice`` meaning "choose per load" (``auto`` in a config)."""



def describe(layers_per_slice: int) -> str:
    """A ``layers_per_slice`` setting as a deployer wrote it, for log lines."""
    return "auto" if layers_per_slice == AUTO else str(layers_per_slice)


SLICE_COST_SHARE = 0.05
"""The largest share of a slice's copy time its fixed cost may take."""

SLICE_COST_S = {"cuda": 20e-6, "cpu": 200e-6}
"""Fixed cost of one slice beyond its bytes, by device kind: on a GPU a staging piece and a scatter launch issued
by the copier's native thread; on the CPU a Python call per slice and plane."""

DEFAULT_COPY_RATE = {"cuda": 50e9, "cpu": 5e9}
"""Bytes per second assumed until a load has been measured (a PCIe 5 x16 copy engine; a CPU memcpy)."""

RATE_WEIGHT = 0.25
"""Weight of each new measurement in the running copy rate."""


class SliceWidthModel:
    """Chooses a load's slice width (see the module docstring); shared by the engine's threads."""

    def __init__(self, num_layers: int, layer_bytes_per_token: int, device: str) -> None:
        """``layer_bytes_per_token``: K and V of one token in one layer; ``device``: the cache's (``cpu``,
        ``cuda:N``)."""
        kind = "cpu" if device == "cpu" else "cuda"
        self.num_layers = num_layers
        self.layer_bytes_per_token = layer_bytes_per_token
        self.slice_cost_s = SLICE_COST_S[kind]
        self.copy_rate = DEFAULT_COPY_RATE[kind]
        self.measured_loads = 0
        self._lock = threading.Lock()

    def choose(self, tokens: int) -> int:
        """The width for a load of ``tokens`` tokens: 1 to ``num_layers``, or 0 (chunk-major)."""
        layer_s = tokens * self.layer_bytes_per_token / self.copy_rate
        if layer_s <= 0:
            return 0
        width = max(1, math.ceil(self.slice_cost_s / (SLICE_COST_SHARE * layer_s)))
        return width if width < self.num_layers else 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """A load that had the copy engine to itself moved ``nbytes`` in ``seconds``, submit to end."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            rate = nbytes / seconds
            self.copy_rate = rate if self.measured_loads == 0 else (1 - RATE_WEIGHT) * self.copy_rate + RATE_WEIGHT * rate
            self.measured_loads += 1
