"""The scheduler-process half of the vLLM connector: lookups, load and store decisions.

Everything here runs on vLLM's scheduler thread, so nothing may block for long:
LOOKUP goes out asynchronously and the request is asked about again next step
(``(None, False)``) until the reply is in, bounded by ``lookup_timeout``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any, Iterable

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey, pack_tokens
from kvstrata.core.wire.protocol import RequestType

from .settings import ConnectorSettings

log = logging.getLogger("kvstrata.adapters.vllm")


def salt_of(request: Any) -> str | None:
    """Requests that must not share KV (a cache salt, a LoRA adapter) get different keys."""
    parts = [p for p in (getattr(request, "cache_salt", None),
                         getattr(getattr(request, "lora_request", None), "lora_name", None)) if p]
    return "|".join(map(str, parts)) or None


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, *, model: str, block_size: int) -> None:
        self.settings = settings
        self.model = model
        self.block_size = block_size
        self.client = CacheClient(settings.server_address, timeout=settings.lookup_timeout)
        self.kv_cache_manager: Any = None
        self.chunk_size: int | None = None
        self._lookups: dict[str, tuple[Future, float]] = {}
        self._hits: dict[str, tuple[int, int]] = {}  # request -> (hit tokens, local prefix tokens)
        self._requests: dict[str, Any] = {}
        self._pending_loads: list[dict[str, Any]] = []
        self._loads_issued: set[str] = set()
        self._released: set[str] = set()
        self._stored: set[str] = set()
        self._unreachable_logged = False
        self._down_until = 0.0

    def _key(self, request: Any, num_tokens: int) -> CacheKey:
        return CacheKey(request.request_id, self.model, 1, 0, pack_tokens(request.prompt_token_ids[:num_tokens]),
                        salt_of(request))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        self._requests[rid] = request
        bs = self.block_size
        # Never load the block holding the last prompt token: vLLM recomputes that token and
        # writes its KV before waiting for the layer, and a page copy would clobber it.
        loadable = ((request.num_prompt_tokens - 1) // bs) * bs
        if loadable <= num_computed_tokens:
            return 0, False
        entry = self._lookups.get(rid)
        if entry is None and time.monotonic() < self._down_until:
            return 0, False  # the server just failed to answer: compute, and try again after the back-off
        if entry is None:
            fut = self.client.transport.submit(RequestType.LOOKUP, [self._key(request, loadable).to_wire()])
            self._lookups[rid] = (fut, time.monotonic())
            return None, False
        fut, started = entry
        if not fut.done():
            if time.monotonic() - started < self.settings.lookup_timeout:
                return None, False
            self._lookups.pop(rid)
            self._end_session(rid)
            self._down_until = time.monotonic() + self.settings.lookup_timeout * 5
            if not self._unreachable_logged:
                self._unreachable_logged = True
                log.warning("kvstrata server %s did not answer LOOKUP within %.1fs; computing the prompt instead "
                            "(logged once until it answers again)", self.settings.server_address,
                            self.settings.lookup_timeout)
            return 0, False
        self._lookups.pop(rid)
        try:
            reply = fut.result()
        except Exception as exc:
            log.warning("LOOKUP for %s failed (%s); computing the prompt instead", rid, exc)
            return 0, False
        self._unreachable_logged = False
        self.chunk_size = int(reply["chunk_size"])
        hit = (min(int(reply["hit_tokens"]), loadable) // bs) * bs
        external = hit - num_computed_tokens
        if external <= 0:
            self._submit(RequestType.FREE_LOOKUP_LOCKS, [rid])
            return 0, False
        self._hits[rid] = (hit, num_computed_tokens)
        log.debug("request %s: %d tokens from kvstrata after %d local", rid, external, num_computed_tokens)
        return external, True

    def update_state_after_alloc(self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens <= 0 or rid not in self._hits or rid in self._loads_issued:
            return
        hit, local = self._hits[rid]
        self._pending_loads.append({
            "request_id": rid, "tokens": pack_tokens(request.prompt_token_ids[:hit]), "salt": salt_of(request),
            "block_ids": [list(g) for g in block_ids], "skip": local,
            "layers_per_stage": self.settings.layers_per_stage,
        })
        self._loads_issued.add(rid)

    def build_step(self, scheduler_output: Any) -> dict[str, Any]:
        loads, self._pending_loads = self._pending_loads, []
        stores = self._stores_for(scheduler_output) if self.settings.store else []
        preempted = [r for r in (getattr(scheduler_output, "preempted_req_ids", None) or ())
                     if r in self._loads_issued]
        return {"loads": loads, "stores": stores, "preempted": preempted}

    def _stores_for(self, scheduler_output: Any) -> list[dict[str, Any]]:
        """Prompts whose last full block is computed by the end of this step."""
        out = []
        bs = self.block_size
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None or rid in self._stored or self.kv_cache_manager is None:
                continue
            if request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            self._stored.add(rid)
            n = (request.num_prompt_tokens // bs) * bs
            hit = self._hits.get(rid, (0, 0))[0]
            chunk = self.chunk_size or bs
            skip = (hit // chunk) * chunk
            if n <= skip:
                continue
            blocks = self.kv_cache_manager.get_block_ids(rid)[0][: n // bs]
            out.append({"request_id": rid, "tokens": pack_tokens(request.prompt_token_ids[:n]),
                        "salt": salt_of(request), "block_ids": list(blocks), "skip": skip})
        return out

    def on_worker_output(self, finished_recving: Iterable[str]) -> None:
        self._released.update(finished_recving)

    def request_finished(self, request: Any) -> bool:
        rid = request.request_id
        delay = rid in self._loads_issued and rid in self._released
        if rid not in self._loads_issued:
            # locks of a load already issued are the worker's to release (RETRIEVE, or FREE after
            # its copy); releasing them here could let a chunk be evicted under a copy in flight
            self._end_session(rid)
        for d in (self._hits, self._requests):
            d.pop(rid, None)
        self._lookups.pop(rid, None)
        self._loads_issued.discard(rid)
        self._released.discard(rid)
        self._stored.discard(rid)
        return delay

    def _end_session(self, rid: str) -> None:
        self._submit(RequestType.END_SESSION, [rid])

    def _submit(self, rt: RequestType, payload: list[Any]) -> None:
        """Fire and forget: a lost lock release costs an eviction delay, never correctness."""
        try:
            self.client.transport.send_oneway(rt, payload)
        except Exception as exc:  # only a closed client raises here
            log.debug("%s for %s not sent: %s", rt.name, payload, exc)

    def close(self) -> None:
        self.client.close()
