"""The worker-process half of the vLLM connector: registration, retrieves, per-layer waits, stores.

vLLM calls into this from its model-runner thread. Every wait is bounded; a
transfer that fails turns into block ids vLLM recomputes, never into a hang.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Iterable

import torch

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_WORKER
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.transfer.staging import StagingStore
from kvstrata.core.engine.layerwise_worker import LayerwiseWorker

from .kv_layout import cpu_page_layout, cuda_layout, layer_index
from .settings import ConnectorSettings

log = logging.getLogger("kvstrata.adapters.vllm")

RECONNECT_INTERVAL = 10.0


class EventRecord:
    """An optional JSON-lines log of what the connector did, for operators and tests."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", buffering=1) if path else None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"event": event, "t": time.monotonic(), "pid": os.getpid(), **fields})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, *, model: str, block_size: int, rank: int = 0) -> None:
        self.settings = settings
        self.model = model
        self.block_size = block_size
        self.rank = rank
        self.client = CacheClient(settings.server_address, timeout=settings.retrieve_timeout)
        self.record = EventRecord(settings.record_path)
        self.worker: LayerwiseWorker | None = None
        self.staging: StagingStore | None = None
        self._layer_of: dict[str, int] = {}
        self._released: set[str] = set()
        self._finished_unreleased: set[str] = set()
        self._load_errors: set[int] = set()
        self._unloadable: set[str] = set()
        self._cuda = False
        self._next_connect = 0.0

    # --- registration ------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's cache; connect now if the server answers, else serve without it and retry."""
        self._layer_of = {name: layer_index(name) for name in kv_caches}
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda":
            self._layout, self._cuda_buffer = cuda_layout(kv_caches)
            self._cuda = True
            self._device = str(first.device)
        else:
            self._layout, self._regions = cpu_page_layout(kv_caches)
        if not self._connect():
            log.warning("kvstrata server %s is not reachable; vLLM computes every prompt until it is "
                        "(retrying every %.0fs)", self.settings.server_address, RECONNECT_INTERVAL)

    def _connect(self) -> bool:
        """Build the transfer runtime and register with the server; False (and retry later) if it is down."""
        if self.worker is not None:
            return True
        now = time.monotonic()
        if now < self._next_connect:
            return False
        self._next_connect = now + RECONNECT_INTERVAL
        s = self.settings
        common = dict(pool_slots=s.pool_slots, layer_wait_timeout=s.layer_wait_timeout,
                      retrieve_timeout=s.retrieve_timeout)
        try:
            if self._cuda:
                from kvstrata.native.cuda_events import CudaEventBackend

                worker = LayerwiseWorker(self.client, s.instance_id, self._layout, placement=PLACEMENT_SERVER,
                                         event_backend=CudaEventBackend(self._device), **common)
            else:
                chunk = int(self.client.transport.call(RequestType.SERVER_INFO, [], timeout=s.lookup_timeout)
                            ["chunk_size"])
                self.staging = self.staging or StagingStore(self._layout, self._regions, chunk_size=chunk)
                worker = LayerwiseWorker(self.client, s.instance_id, self._layout, placement=PLACEMENT_WORKER,
                                         local_regions=self._regions, registration_layout=self.staging.layout,
                                         **common)
            worker.register()
        except Exception as exc:
            log.debug("connecting to kvstrata at %s failed: %s", s.server_address, exc)
            return False
        self.worker = worker
        log.info("registered %d vLLM layers (%s, %d blocks of %d tokens) with kvstrata at %s",
                 self._layout.num_layers, self._layout.format, self._layout.num_blocks, self._layout.block_size,
                 s.server_address)
        return True

    # --- loads -------------------------------------------------------------------------

    def _key(self, spec: dict[str, Any]) -> CacheKey:
        return CacheKey(spec["request_id"], self.model, 1, 0, spec["tokens"], spec.get("salt"))

    def start_loads(self, loads: Iterable[dict[str, Any]]) -> None:
        loads = list(loads)
        if loads and not self._connect():
            for spec in loads:  # the server went away after the lookup: recompute these
                self._unloadable.add(spec["request_id"])
                self._load_errors.update(b for g in spec["block_ids"] for b in g)
                self.record.write("load_failed", request_id=spec["request_id"], reason="server not reachable")
            return
        for spec in loads:
            self.worker.submit_retrieve(spec["request_id"], self._key(spec), spec["block_ids"],
                                        skip_first_n_tokens=spec["skip"], layers_per_stage=spec["layers_per_stage"])
            self.record.write("load_started", request_id=spec["request_id"], tokens=len(spec["tokens"]) // 8,
                              skip=spec["skip"], layers_per_stage=spec["layers_per_stage"])

    def wait_for_layer(self, layer_name: str) -> None:
        if self.worker is None:
            return
        layer = self._layer_of[layer_name]
        if not self.record.enabled:
            self.worker.wait_for_layer(layer)
            return
        inflight = self.worker.draining()
        self.worker.wait_for_layer(layer)
        self.record.write("wait_for_layer_load", layer=layer, in_flight=sorted(inflight))

    def handle_preemptions(self, request_ids: list[str]) -> None:
        if self.worker is not None:
            self.worker.wait_settled(set(request_ids))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        unloadable, self._unloadable = self._unloadable, set()
        w = self.worker
        if w is None:
            return None, unloadable or None
        recving = set(w.get_finished()) | unloadable
        for rid in recving:
            rec = w.records.get(rid)
            self.record.write("released", request_id=rid,
                              released_before_complete=bool(rec and rec.released_before_complete),
                              failure=rec.failure if rec else None)
        self._released |= recving - self._finished_unreleased
        self._finished_unreleased -= recving
        sending: set[str] = set()
        for rid in finished_req_ids:
            state = w.finish_request(rid)
            if state == "recving":
                self._finished_unreleased.add(rid)  # vLLM frees its blocks on our finished_recving
            if rid in self._released:
                # the scheduler kept this request's blocks (request_finished returned True):
                # hand them back now, or once the transfer stops writing them
                if state is None:
                    sending.add(rid)
                    self._released.discard(rid)
        drained = w.take_drained()
        sending |= drained
        self._released -= drained
        for rid, (blocks, reason) in w.take_failed().items():
            self._load_errors.update(b for g in blocks for b in g)
            self.record.write("load_failed", request_id=rid, reason=reason)
            if "not registered" in reason:
                self._reregister()
        for rid, rec in list(w.records.items()):
            if rec.completed_at is not None or rec.failure is not None:
                self.record.write("settled", request_id=rid, layer_waits=rec.layer_waits, failure=rec.failure,
                                  released_before_complete=rec.released_before_complete,
                                  release_ms=None if rec.released_at is None
                                  else (rec.released_at - rec.submitted_at) * 1e3,
                                  complete_ms=None if rec.completed_at is None
                                  else (rec.completed_at - rec.submitted_at) * 1e3)
                del w.records[rid]
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def _reregister(self) -> None:
        try:
            self.worker.register()
        except Exception as exc:
            log.warning("re-registering with kvstrata at %s failed: %s", self.settings.server_address, exc)

    # --- stores ------------------------------------------------------------------------

    def store(self, stores: Iterable[dict[str, Any]]) -> None:
        """STORE freshly computed prompts. A failed store is logged; serving goes on."""
        if not self._connect():
            return
        for spec in stores:
            key = self._key(spec)
            try:
                if self._cuda:
                    torch.cuda.current_stream().synchronize()  # the forward's writes must have landed
                    reply = self.client.store(key, self.settings.instance_id, [spec["block_ids"]],
                                              skip_first_n_tokens=spec["skip"])
                else:
                    reply = self.staging.store(self.client, self.settings.instance_id, key, spec["block_ids"],
                                               skip_first_n_tokens=spec["skip"])
                self.record.write("stored", request_id=spec["request_id"], **reply)
            except Exception as exc:
                log.warning("STORE of %s failed (%s); the prompt stays uncached", spec["request_id"], exc)
                self.record.write("store_failed", request_id=spec["request_id"], reason=str(exc))
                if "not registered" in str(exc):
                    self._reregister()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.wait_all(timeout=self.settings.layer_wait_timeout)
            self.worker.close()
        if self.staging is not None:
            self.staging.close()
        self.client.close()
        self.record.close()
