"""The server's Prometheus metrics: what it served, what it holds, how long transfers took.

One :class:`ServerMetrics` per :class:`~kvstrata.core.server.cache_server.CacheServer` (two servers in one
process, as in tests, never share counters). Request outcomes are counted as the handlers return, in plain
counters; the state gauges (L1 use, locks, instances, transfers in
flight) are read from the server when scraped. ``kvstrata serve --metrics-port N`` serves them over HTTP
(``prometheus_client`` is imported only then); ``kvstrata status`` shows the same numbers from SERVER_INFO.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

from kvstrata.core.latency import LatencyHistogram
from kvstrata.core.wire.protocol import RequestType

if TYPE_CHECKING:
    from kvstrata.core.server.cache_server import CacheServer
    from kvstrata.core.store.l2.tier import SharedTier

log = logging.getLogger(__name__)

COUNTERS = {
    "lookup_hit_tokens": "Tokens LOOKUPs found stored",
    "lookup_miss_tokens": "Tokens LOOKUPs asked for and did not find",
    "stored_bytes": "KV bytes STOREd into L1 (chunks already held are skipped)",
    "stored_tokens": "Tokens STOREd into L1",
    "retrieved_bytes": "KV bytes RETRIEVEd into engine caches (engine-placement loads located by their LOOKUP "
                       "send no RETRIEVE: the engine's own stats count them)",
    "retrieved_tokens": "Tokens RETRIEVEd into engine caches (not engine-placement loads located by their LOOKUP)",
}
HISTOGRAMS = {"retrieve_seconds": "RETRIEVE time in the server, to its reply",
              "store_seconds": "STORE time in the server, to its reply"}


class _Collector:
    """The ``prometheus_client`` collector over a :class:`ServerMetrics` (built only when metrics are served)."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        m = self.metrics
        with m._lock:
            counts = dict(m._counts)
            fallbacks = dict(m._fallbacks)
            failures = dict(m._failures)
            hists = {k: (h.buckets(), h.sum) for k, h in m._hists.items()}
        for name, text in COUNTERS.items():
            yield CounterMetricFamily(f"kvstrata_{name}", text, value=counts[name])
        for name, text in HISTOGRAMS.items():
            buckets, total = hists[name]
            yield HistogramMetricFamily(f"kvstrata_{name}", text, buckets=buckets, sum_value=total)
        fam = CounterMetricFamily("kvstrata_fallbacks", "Layer-major retrieves run chunk-major, by reason",
                                  labels=["reason"])
        for reason, n in sorted(fallbacks.items()):
            fam.add_metric([reason], n)
        yield fam
        fam = CounterMetricFamily("kvstrata_failures", "Requests answered with an error, by request and error code",
                                  labels=["request", "code"])
        for (request, code), n in sorted(failures.items()):
            fam.add_metric([request, code], n)
        yield fam
        state = m.server.state()
        l1 = state["l1"]
        yield GaugeMetricFamily("kvstrata_l1_used_bytes", "Bytes of the L1 pool holding chunks",
                                value=l1["capacity_bytes"] - l1["free_bytes"])
        yield GaugeMetricFamily("kvstrata_l1_free_bytes", "Bytes of the L1 pool free", value=l1["free_bytes"])
        yield GaugeMetricFamily("kvstrata_l1_objects", "Chunks held in L1", value=l1["objects"])
        yield CounterMetricFamily("kvstrata_evictions", "Chunks evicted from L1 to make room", value=l1["evictions"])
        yield GaugeMetricFamily("kvstrata_lookup_locked_objects", "Chunks pinned by lookup locks",
                                value=l1["locked_objects"])
        yield GaugeMetricFamily("kvstrata_registered_instances", "Engine caches registered",
                                value=len(state["instances"]))
        yield GaugeMetricFamily("kvstrata_transfers_in_flight", "STOREs and RETRIEVEs copying now",
                                value=sum(i["transfers"] for i in state["instances"]))
        tier = m.server.tier
        if tier is not None:
            yield from _tier_metrics(tier)


def _tier_metrics(tier: "SharedTier") -> Iterator[Any]:
    """The shared tier's families (``kvstrata_l2_*``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    stats = tier.stats()
    for name, key, text in (("asked", "asked", "Chunks past an L1 hit looked for in the shared tier"),
                            ("hits", "fetched", "Chunks read from the shared tier into L1"),
                            ("read_bytes", "fetched_bytes", "Payload bytes read from the shared tier"),
                            ("written", "written", "Chunks written to the shared tier"),
                            ("written_bytes", "written_bytes", "Payload bytes written to the shared tier"),
                            ("write_skipped", "write_skipped", "Chunks not written: the write queue was full"),
                            ("write_failed", "write_failed", "Chunks whose write the tier did not take")):
        yield CounterMetricFamily(f"kvstrata_l2_{name}", text, value=stats.get(key, 0))
    fam = CounterMetricFamily("kvstrata_l2_misses", "Fills from the shared tier cut short, by what ended them",
                              labels=["reason"])
    for key, n in sorted(stats.items()):
        if key.startswith("miss_"):
            fam.add_metric([key[len("miss_"):]], n)
    yield fam
    yield GaugeMetricFamily("kvstrata_l2_write_queue_bytes", "Bytes of chunks waiting to be written to the tier",
                            value=stats.get("write_queue_bytes", 0))
    yield HistogramMetricFamily("kvstrata_l2_fetch_seconds", "One read of a batch of values from the shared tier",
                                buckets=tier.fetch_seconds.buckets(), sum_value=tier.fetch_seconds.sum)
    yield HistogramMetricFamily("kvstrata_l2_write_seconds", "One batch written to the shared tier",
                                buckets=tier.write_seconds.buckets(), sum_value=tier.write_seconds.sum)


class ServerMetrics:
    def __init__(self, server: "CacheServer") -> None:
        self.server = server
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._counts = {name: 0.0 for name in COUNTERS}
        self._hists = {name: LatencyHistogram() for name in HISTOGRAMS}
        self._fallbacks: dict[str, int] = {}
        self._failures: dict[tuple[str, str], int] = {}
        self._http: Any = None

    # --- counting ----------------------------------------------------------------------

    def instrument(self, rt: RequestType, handler: Callable[..., Any]) -> Callable[..., Any]:
        """``handler`` with its outcome counted; same signature (the transport checks it by name)."""

        @functools.wraps(handler)
        def counted(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                result = handler(*args)
            except Exception as exc:
                self._failed(rt, exc)
                raise
            self._served(rt, args, result, time.perf_counter() - started)
            return result

        return counted

    def _failed(self, rt: RequestType, exc: BaseException) -> None:
        key = (rt.name, getattr(exc, "error_code", "error"))
        with self._lock:
            self._failures[key] = self._failures.get(key, 0) + 1

    def _served(self, rt: RequestType, args: tuple[Any, ...], value: Any, seconds: float) -> None:
        if rt == RequestType.LOOKUP:
            hit = int(value["hit_tokens"])
            key = args[0]
            asked = len(key["tokens"]) // 8 or len(key.get("page_hashes") or ()) * int(key.get("page_size", 0))
            self._add(lookup_hit_tokens=hit, lookup_miss_tokens=max(asked - hit, 0))
        elif rt in (RequestType.STORE, RequestType.RETRIEVE):
            what = "stored" if rt == RequestType.STORE else "retrieved"
            tokens = int(value.get(f"{what}_tokens", 0))
            self._add(**{f"{what}_tokens": tokens, f"{what}_bytes": tokens * self.server.token_bytes(args[1])})
            with self._lock:
                self._hists["store_seconds" if rt == RequestType.STORE else "retrieve_seconds"].observe(seconds)
                reason = value.get("fallback") if rt == RequestType.RETRIEVE else None
                if reason:
                    self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1

    def count_committed_store(self, tokens: int, nbytes: int) -> None:
        """An engine-placement STORE's reservation was committed (its engine marked it, or sent COMMIT_STORE)."""
        self._add(stored_tokens=tokens, stored_bytes=nbytes)

    def _add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    # --- reading -----------------------------------------------------------------------

    def totals(self) -> dict[str, float]:
        """The request counters, for SERVER_INFO (``kvstrata status``)."""
        with self._lock:
            return dict(self._counts)

    def serve_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0: any free one); returns the port. Needs
        ``prometheus_client`` (a kvstrata dependency; counting itself needs nothing)."""
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        registry.register(_Collector(self))
        server, _thread = start_http_server(port, addr=host, registry=registry)
        self._http = server
        bound = server.server_address[1]
        log.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
