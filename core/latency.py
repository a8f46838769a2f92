"""A latency histogram with Prometheus's cumulative buckets, kept without ``prometheus_client`` (which is
imported only when metrics are served)."""

from __future__ import annotations

import threading

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Seconds: a width-1 release is under a millisecond, a 1 GiB transfer about 20 ms, a slow CPU copy seconds."""


class LatencyHistogram:
    """Observations counted per bucket; safe to observe from several threads."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        index = next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
        with self._lock:
            self.sum += seconds
            self.counts[index] += 1

    def buckets(self) -> list[tuple[str, float]]:
        """(upper bound, observations at or below it), cumulative, ending with ``+Inf``."""
        out, running = [], 0
        with self._lock:
            counts = list(self.counts)
        for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], counts):
            running += n
            out.append((bound, running))
        return out
