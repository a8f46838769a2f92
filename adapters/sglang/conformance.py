"""The SGLang adapter's conformance driver: ``KvstrataLinker`` itself, called in SGLang's order.

SGLang's scheduler does not run here (the real-engine tests in ``tests/sglang_engine`` run it); instead the
driver builds what SGLang hands the linker, with SGLang's own classes: a real ``MHATokenToKVPool`` (or
``MLATokenToKVPool`` for ``kv_size == 1``) on CPU, a real ``PagedTokenToKVPoolAllocator`` that hands out its
token slots, ``ReqToTokenPool`` and ``CacheInitParams``, ``PoolTransfer`` for every LOOKUP / LOAD / OFFLOAD,
and the linker's own ``LayerWiseLoadCounter``. Calls go in the order SGLang's radix cache and model runner
make them: ``lookup`` (match_prefix), ``load`` (init_load_back), ``start_layer_wise_loading`` before the
forward, ``set_consumer`` + ``wait_until(layer)`` in the attention, ``finish_layer_wise_loading`` after the
forward (here: once the batch's counter entries resolved, so the suite's polls never block), ``offload`` and
``pop_completed_offload`` for a computed prompt, ``cancel_queued_load`` for a request dropped before its
load started. Keys are SGLang's own page-hash chain (``get_storage_hash_str``).

A request counts as released (handed back to the engine) once its batch's layer 0 is resolved: SGLang runs
the forward at once and the attention passes layer 0 then. A batch that did not land reports its blocks as
failed: SGLang aborts those requests.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from kvstrata.core.adapter_api.types import DriverPoll, HarnessSpec, NotSupported
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.store.keys import CacheKey

OFFLOAD_BOUND = 30.0
"""How long the driver waits for an offload to complete before it calls the linker broken (only catches hangs)."""

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MLA_ROPE = 16


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[str]:
    """SGLang's storage page-hash chain of a prompt's whole pages (no extra key, no cache salt)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    whole = len(token_ids) // page_size * page_size
    return list(get_storage_hash_str(list(token_ids[:whole]), None, page_size=page_size)) if whole else []


@dataclass
class _Batch:
    index: int
    request_ids: list[str]
    blocks: set[int]
    released: bool = False
    finished: bool = False
    landed: bool | None = None


@dataclass
class _Pool:
    """SGLang's device KV pool and its allocator, built as SGLang's kv-cache builder does (on CPU)."""

    spec: HarnessSpec
    kvcache: Any = None
    allocator: Any = None
    params: Any = None
    slots_of: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

        s = self.spec
        if s.kv_groups > 1:
            raise NotSupported("the SGLang linker loads the full-attention KV pool only (no hybrid KV groups)")
        if s.dtype not in TORCH_DTYPES:
            raise NotSupported(f"dtype {s.dtype} is not one SGLang's pool is built with here")
        dtype, size = TORCH_DTYPES[s.dtype], s.num_blocks * s.block_size
        if s.kv_size == 2:
            self.kvcache = MHATokenToKVPool(size=size, page_size=s.block_size, dtype=dtype, head_num=s.num_heads,
                                            head_dim=s.head_size, layer_num=s.num_layers, device="cpu",
                                            enable_memory_saver=False)
            self.planes = list(self.kvcache.k_buffer) + list(self.kvcache.v_buffer)
        else:
            if s.num_heads != 1 or s.head_size <= MLA_ROPE:
                raise NotSupported(f"SGLang's MLA pool has one latent head wider than {MLA_ROPE}; the spec asks "
                                   f"{s.num_heads} heads of {s.head_size}")
            self.kvcache = MLATokenToKVPool(size, s.block_size, dtype, s.head_size - MLA_ROPE, MLA_ROPE,
                                            s.num_layers, "cpu", False)
            self.planes = list(self.kvcache.kv_buffer)
        self.allocator = PagedTokenToKVPoolAllocator(size, s.block_size, dtype, "cpu", self.kvcache, False)
        self.params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(8, 8192, "cpu", False),
                                      token_to_kv_pool_allocator=self.allocator, page_size=s.block_size)

    def allocate(self, num_tokens: int) -> list[list[int]]:
        ps = self.spec.block_size
        slots = self.allocator.alloc(-(-num_tokens // ps) * ps)
        if slots is None:
            raise RuntimeError(f"SGLang's allocator is out of pages for {num_tokens} tokens")
        blocks = (slots.view(-1, ps)[:, 0] // ps).tolist()
        for b, page in zip(blocks, slots.view(-1, ps), strict=True):
            self.slots_of[b] = page.clone()
        return [blocks]

    def slots(self, blocks: Sequence[int], num_tokens: int | None = None) -> torch.Tensor:
        out = torch.cat([self.slots_of[b] for b in blocks]) if blocks else torch.empty(0, dtype=torch.int64)
        return out if num_tokens is None else out[:num_tokens]

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        blocks = list(block_ids[0])
        self.allocator.free(self.slots(blocks))
        for b in blocks:
            self.slots_of.pop(b, None)

    def clear(self, block_ids: Sequence[Sequence[int]]) -> None:
        idx = self.slots(list(block_ids[0]))
        for plane in self.planes:
            plane[idx] = 0

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        """Write bytes that depend on (plane, layer, token id, position): what a forward would have written."""
        n = len(token_ids)
        idx = self.slots(list(block_ids[0]), n)
        toks = torch.as_tensor(list(token_ids), dtype=torch.float32)
        pos = torch.arange(n, dtype=torch.float32)
        for p, plane in enumerate(self.planes):
            width = plane.shape[1] * plane.shape[2]
            ramp = torch.arange(width, dtype=torch.float32)
            vals = torch.sin(toks[:, None] * 0.37 + pos[:, None] * 0.011 + ramp[None, :] * 0.05 + p * 1.3)
            plane[idx] = vals.view(n, plane.shape[1], plane.shape[2]).to(plane.dtype)

    def read_layer(self, block_ids: Sequence[Sequence[int]], layer: int, num_tokens: int) -> bytes:
        idx = self.slots(list(block_ids[0]), num_tokens)
        nl = self.spec.num_layers
        parts = [self.planes[layer][idx]] + ([self.planes[nl + layer][idx]] if self.spec.kv_size == 2 else [])
        return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)


class SglangConformanceDriver:
    """``KvstrataLinker`` over a real SGLang pool, driven the way SGLang's scheduler and model runner drive it."""

    def __init__(self, spec: HarnessSpec, adapter: Any = None) -> None:
        """``adapter``: the suite's loaded adapter (unused: the engine side loads its adapter by name, as the
        engine does)."""
        self.spec = spec
        self.placement = spec.placement
        self.pool = _Pool(spec)
        self.linker: Any = None
        self.runtime: Any = None
        self._batches: dict[int, _Batch] = {}
        self._batch_of: dict[str, int] = {}
        self._queued: dict[str, set[int]] = {}
        self._wait_lock = threading.Lock()
        self._state_lock = threading.Lock()

    # --- the cache ----------------------------------------------------------------------------

    def allocate(self, num_tokens: int) -> list[list[int]]:
        return self.pool.allocate(num_tokens)

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        self.pool.free(block_ids)

    def clear(self, block_ids: Sequence[Sequence[int]]) -> None:
        self.pool.clear(block_ids)

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        self.pool.prefill(token_ids, block_ids)

    def read_layer(self, block_ids: Sequence[Sequence[int]], layer: int, num_tokens: int) -> bytes:
        return self.pool.read_layer(block_ids, layer, num_tokens)

    def lookup_key(self, request_id: str, token_ids: Sequence[int], model: str) -> CacheKey:
        """The key the linker stores ``token_ids`` under (the suite's probe LOOKUP): SGLang's page hashes."""
        return CacheKey.for_page_hashes(request_id, page_hashes(token_ids, self.spec.block_size),
                                        self.spec.block_size, model=model)

    # --- the engine side ----------------------------------------------------------------------

    def start(self, settings: RuntimeSettings) -> None:
        from .linker import KvstrataLinker

        extra = {name: getattr(settings, name) for name in RuntimeSettings.FIELDS}
        extra["placement"] = self.placement
        server_args = types.SimpleNamespace(model_path="conformance", served_model_name=None)
        self.linker = KvstrataLinker(server_args, self.pool.params, components=(), extra_config=extra)
        self.runtime = self.linker.runtime

    def store(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        """The radix tree inserted a computed prompt: SGLang offloads its node (page hashes + token slots)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        keys = page_hashes(token_ids, self.spec.block_size)
        slots = self.pool.slots(list(block_ids[0]), len(keys) * self.spec.block_size)
        before = self.linker.num_completed_offloads()
        if not self.linker.offload([PoolTransfer(name=PoolName.KV, device_indices=slots, keys=keys)]):
            raise RuntimeError(f"KvstrataLinker.offload refused the offload of {request_id}")
        deadline = time.monotonic() + OFFLOAD_BOUND
        while self.linker.num_completed_offloads() <= before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the offload of {request_id} did not complete within {OFFLOAD_BOUND:.0f}s")
            time.sleep(0.001)
        if not self.linker.pop_completed_offload():
            raise RuntimeError(f"KvstrataLinker reported the offload of {request_id} failed")

    def load(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> int:
        """match_prefix -> init_load_back -> start_layer_wise_loading, as SGLang's scheduler calls them."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        ps = self.spec.block_size
        keys = page_hashes(token_ids, ps)
        restorable = self.linker.lookup(request_id, [PoolTransfer(name=PoolName.KV, keys=keys)])
        pages = max(restorable, default=0)
        if not pages:
            return 0
        slots = self.pool.slots(list(block_ids[0]), pages * ps)
        if not self.linker.load(request_id, [PoolTransfer(name=PoolName.KV, device_indices=slots,
                                                          keys=keys[:pages])]):
            return 0
        blocks = set(list(block_ids[0])[:pages])
        index = self.linker.start_layer_wise_loading()
        if index < 0:
            raise RuntimeError("start_layer_wise_loading started nothing after load() queued a load")
        with self._state_lock:
            self._batches[index] = _Batch(index, [request_id], blocks)
            self._batch_of[request_id] = index
        return pages * ps

    def _resolved(self, batch: _Batch, layer: int | None = None) -> bool:
        futures = self.linker.layer_done_counter.futures.get(batch.index)
        if futures is None:
            return True
        return all(f.done() for f in futures) if layer is None else futures[layer].done()

    def poll(self) -> DriverPoll:
        released: list[str] = []
        failed: set[int] = set()
        with self._state_lock:
            for batch in list(self._batches.values()):
                if not batch.released and self._resolved(batch, 0):
                    batch.released = True
                    released += batch.request_ids
                if not batch.finished and self._resolved(batch):
                    batch.finished = True  # SGLang's finish_loads, after the forward: returns at once now
                    batch.landed = self.linker.finish_layer_wise_loading(batch.index)
                    if not batch.landed:
                        failed |= batch.blocks
        return DriverPoll(sorted(released), failed)

    def wait_for_layer(self, layer: int) -> None:
        """The attention of ``layer``: SGLang's pool calls ``wait_until`` for the batch of this forward."""
        with self._state_lock:
            active = [b.index for b in self._batches.values() if not b.finished]
        with self._wait_lock:  # set_consumer + wait_until is one forward's pair, not two threads' interleaving
            counter = self.linker.layer_done_counter
            for index in active:
                counter.set_consumer(index)
                counter.wait_until(layer)

    def finish(self, request_id: str) -> None:
        """The request is done or aborted: SGLang's release_request (a queued load is cancelled)."""
        self.linker.cancel_queued_load(request_id)
        with self._state_lock:
            index = self._batch_of.pop(request_id, None)
            batch = self._batches.get(index) if index is not None else None
            if batch is not None and batch.finished:
                del self._batches[index]

    def close(self) -> None:
        if self.linker is not None:
            self.linker.close()
