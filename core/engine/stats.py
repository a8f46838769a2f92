"""Engine-side numbers: how soon loads went back to the engine, how long it waited per layer, what failed.

The worker runtime keeps one :class:`RuntimeStats` and hands out what accumulated since the last call
(:meth:`WorkerRuntime.take_stats`), the shape engines' stats mechanisms expect (vLLM's KV connector stats
are collected per interval and summed across workers). For an engine without such a mechanism,
:class:`RuntimeStatsCollector` exports the running totals under Prometheus names (``kvstrata_engine_*``) in
whatever registry the engine serves.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterator

COUNTS = ("loads_started", "loads_released", "loads_released_before_complete", "loads_failed", "layer_waits",
          "stores", "stores_failed")
SECONDS = ("release_seconds", "layer_wait_seconds")


@dataclass
class RuntimeStats:
    loads_started: int = 0
    loads_released: int = 0
    loads_released_before_complete: int = 0
    """Released on their first slice while the rest still copied: the overlap the design is for."""
    loads_failed: int = 0
    """Reported to the engine to recompute (or fail the request)."""
    layer_waits: int = 0
    stores: int = 0
    stores_failed: int = 0
    release_seconds: float = 0.0
    """Summed over released loads: submit to release."""
    layer_wait_seconds: float = 0.0
    """Summed over the engine's layer waits: time its thread spent in them."""

    def add(self, other: "RuntimeStats") -> "RuntimeStats":
        return RuntimeStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RuntimeStats":
        return cls(**{f.name: data.get(f.name, 0) for f in fields(cls)})

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))

    def summary(self) -> dict[str, float]:
        """Counts, and the means a log line wants (ms)."""
        out: dict[str, float] = {name: getattr(self, name) for name in COUNTS}
        out["mean_release_ms"] = 1e3 * self.release_seconds / self.loads_released if self.loads_released else 0.0
        out["mean_layer_wait_ms"] = 1e3 * self.layer_wait_seconds / self.layer_waits if self.layer_waits else 0.0
        return out


class StatsAccumulator:
    """The runtime's side: thread-safe adds, a running total, and the interval since the last take."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = RuntimeStats()
        self._interval = RuntimeStats()

    def bump(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.total, name, getattr(self.total, name) + delta)
                setattr(self._interval, name, getattr(self._interval, name) + delta)

    def take_interval(self) -> RuntimeStats:
        with self._lock:
            out, self._interval = self._interval, RuntimeStats()
            return out


class RuntimeStatsCollector:
    """A ``prometheus_client`` collector of one runtime's running totals (register it in the engine's registry)."""

    def __init__(self, stats: StatsAccumulator, labels: dict[str, str] | None = None) -> None:
        self.stats = stats
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        total = self.stats.total
        names = sorted(self.labels)
        for name in COUNTS + SECONDS:
            family = CounterMetricFamily(f"kvstrata_engine_{name}", f"kvstrata engine runtime: {name.replace('_', ' ')}",
                                         labels=names)
            family.add_metric([self.labels[n] for n in names], getattr(total, name))
            yield family
