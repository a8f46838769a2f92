"""The TensorRT-LLM adapter's conformance driver: ``KvstrataScheduler`` and ``KvstrataWorker`` themselves,
called in TensorRT-LLM 1.2's order with TensorRT-LLM's objects.

TensorRT-LLM does not run here; its connector base classes, ``SchedulerOutput`` and ``RequestData`` come
from the installed package or, where it is absent, from the test stand-in ``kvstrata_testing.trtllm_harness.standin``
(``tests/kvstrata_testing``, installed by the pytest plugin ``kvstrata_testing.trtllm_harness.pytest_standin``). The driver builds one scheduler and one worker, as TensorRT-LLM
does on rank 0, and hands the worker a pool in TensorRT-LLM's format ``[blocks, layers, 2,
heads*tokens*head]``, in shared memory so the server placement can be checked too (TensorRT-LLM's own pool
is GPU memory: engine placement). The driver matches asynchronously (``async_load: true``): that is the
path where TensorRT-LLM waits for ``get_finished`` to report a load, which the suite's release checks need;
the synchronous path is driven by the harness tests (``tests/trtllm``).

TensorRT-LLM 1.2 has no recompute list: a failed load fails the next batch holding the request
(:class:`~.connector.KvstrataLoadFailed` from ``wait_for_save``). The driver reports as "failed blocks" the
blocks of the requests the worker has marked so (``KvstrataWorker.failed_loads``): what the engine is told.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from kvstrata.core.adapter_api.types import DriverPoll, HarnessSpec, NotSupported
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.shm import create_cache_segment
from kvstrata.core.transfer.layouts import DTYPE_SIZES

from .settings import ENV_VAR

SAVE_BOUND = 30.0
"""How long ``store`` waits for the worker to report the prompt saved (only catches hangs)."""

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _Request:
    """The ``LlmRequest`` surface the connector reads (``request_id``, ``get_tokens``)."""

    def __init__(self, request_id: str, tokens: Sequence[int]) -> None:
        self.request_id = request_id
        self.tokens = list(tokens)

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


class _KvCacheConfig:
    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block


class _LlmArgs:
    """The ``TorchLlmArgs`` fields the connector reads (a real TorchLlmArgs needs a model checkpoint)."""

    def __init__(self, tokens_per_block: int) -> None:
        self.model = "kvstrata-conformance"
        self.tensor_parallel_size = 1
        self.pipeline_parallel_size = 1
        self.kv_cache_config = _KvCacheConfig(tokens_per_block)


class TrtllmConformanceCache:
    """A TensorRT-LLM-format pool in shared memory, filled with deterministic bytes instead of a model's."""

    def __init__(self, spec: HarnessSpec) -> None:
        if spec.kv_groups > 1:
            raise NotSupported("TensorRT-LLM's connector sees one primary pool (no hybrid KV groups)")
        if spec.dtype not in _TORCH:
            raise NotSupported(f"dtype {spec.dtype} is not built here")
        self.spec = spec
        es = DTYPE_SIZES[spec.dtype]
        elems = spec.num_heads * spec.block_size * spec.head_size
        size = spec.num_blocks * spec.num_layers * spec.kv_size * elems * es
        self._segment = create_cache_segment("trtllm-conformance", size)
        raw = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=size)
        self.pool = raw.view(_TORCH[spec.dtype]).view(spec.num_blocks, spec.num_layers, spec.kv_size, elems)
        # The pool is handed over as the tensor alone, as TensorRT-LLM does; the adapter finds it in this process's
        # cache segment, which is what lets the server placement map it.
        self._bytes = raw.view(spec.num_blocks, spec.num_layers, spec.kv_size * elems * es)
        self._free = list(range(spec.num_blocks))

    def allocate(self, num_tokens: int) -> list[list[int]]:
        need = -(-num_tokens // self.spec.block_size)
        if need > len(self._free):
            raise RuntimeError(f"conformance TensorRT-LLM pool out of blocks: {need} needed, {len(self._free)} free")
        blocks, self._free = self._free[:need], self._free[need:]
        return [blocks]

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        self._free.extend(block_ids[0])

    def clear(self, block_ids: Sequence[Sequence[int]]) -> None:
        self._bytes[list(block_ids[0])] = 0

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        bs, width = self.spec.block_size, self._bytes.shape[-1]
        ramp = torch.arange(width, dtype=torch.int64)
        for i, b in enumerate(block_ids[0][: -(-len(token_ids) // bs)]):
            toks = torch.as_tensor(list(token_ids[i * bs:(i + 1) * bs]), dtype=torch.int64)
            seed = int((toks * torch.arange(1, len(toks) + 1)).sum()) + 7 * i
            for layer in range(self.spec.num_layers):
                self._bytes[b, layer] = ((ramp + seed + 31 * layer) % 251).to(torch.uint8)

    def read_layer(self, block_ids: Sequence[Sequence[int]], layer: int, num_tokens: int) -> bytes:
        n = -(-num_tokens // self.spec.block_size)
        return self._bytes[list(block_ids[0][:n]), layer].contiguous().numpy().tobytes()

    def close(self) -> None:
        self.pool = self._bytes = None
        self._segment.destroy()


class TrtllmConformanceDriver(TrtllmConformanceCache):
    """``KvstrataScheduler`` + ``KvstrataWorker`` over a TensorRT-LLM-format pool, driven as TensorRT-LLM does."""

    def __init__(self, spec: HarnessSpec, adapter: Any = None) -> None:
        """``adapter``: the suite's loaded adapter (unused: the engine side loads its adapter by name, as the
        engine does)."""
        super().__init__(spec)
        self.placement = spec.placement
        self.scheduler: Any = None
        self.worker: Any = None
        self.runtime: Any = None
        self._requests: dict[str, _Request] = {}
        self._blocks: dict[str, list[int]] = {}
        self._new_loading: list[str] = []
        self._new_saving: list[str] = []
        self._saved: set[str] = set()

    def start(self, settings: RuntimeSettings) -> None:
        from .connector import KvstrataScheduler, KvstrataWorker

        values = {name: getattr(settings, name) for name in RuntimeSettings.FIELDS}
        values.update(placement=self.placement, async_load=True)
        llm_args = _LlmArgs(self.spec.block_size)
        previous = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = json.dumps(values)  # how a deployer hands TensorRT-LLM's ranks the settings
        try:
            self.scheduler = KvstrataScheduler(llm_args)
            self.worker = KvstrataWorker(llm_args)
        finally:
            if previous is None:
                os.environ.pop(ENV_VAR, None)
            else:
                os.environ[ENV_VAR] = previous
        self.worker.register_kv_caches(self.pool)
        self.runtime = self.worker.runtime

    def _iteration(self, new: Sequence[tuple[_Request, int]] = ()) -> None:
        """``build_connector_meta`` -> ``bind_connector_meta`` -> ``start_load_kv`` -> forward -> ``wait_for_save``."""
        from .engine_api import connector_module

        api = connector_module()
        output = api.SchedulerOutput(new_requests=[
            api.RequestData(r.request_id, list(r.tokens), list(self._blocks[r.request_id]), 0, n) for r, n in new])
        self.worker.bind_connector_meta(self.scheduler.build_connector_meta(output))
        self.worker.start_load_kv(None)
        self.worker.wait_for_save(None)

    # --- the suite's calls -----------------------------------------------------------

    def store(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        request = _Request(request_id, token_ids)
        self._requests[request_id] = request
        self._blocks[request_id] = list(block_ids[0])
        # The driver's prefill stands for TensorRT-LLM computing the whole prompt itself: nothing to load.
        self.scheduler.get_num_new_matched_tokens(request, len(token_ids))
        self.scheduler.update_state_after_alloc(request, list(block_ids[0]))
        self._iteration([(request, len(token_ids))])
        self.finish(request_id)
        deadline = time.monotonic() + SAVE_BOUND
        while request_id not in self._saved:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker never reported {request_id} saved within {SAVE_BOUND:.0f}s")
            self.poll()
            time.sleep(0.001)

    def load(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> int:
        request = _Request(request_id, token_ids)
        self._requests[request_id] = request
        self._blocks[request_id] = list(block_ids[0])
        n, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        if n and not is_async:
            raise AssertionError("the driver deploys async_load: true, and the scheduler matched synchronously")
        self.scheduler.update_state_after_alloc(request, list(block_ids[0]))
        if n:
            self._new_loading.append(request_id)
        self._iteration()  # the parked request is not in this iteration's SchedulerOutput
        return n

    def poll(self) -> DriverPoll:
        loading, self._new_loading = self._new_loading, []
        saving, self._new_saving = self._new_saving, []
        saved, loaded = self.worker.get_finished(saving, loading)
        self._saved.update(saved)
        failed = {b for rid in self.worker.failed_loads for b in self._blocks.get(rid, ())}
        return DriverPoll(sorted(map(str, loaded)), failed)

    def wait_for_layer(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer, None)

    def finish(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if self.scheduler.request_finished(request, list(self._blocks.get(request_id, []))):
            self._new_saving.append(request_id)

    def close(self) -> None:
        for side in (self.worker, self.scheduler):
            if side is not None:
                side.shutdown()
        super().close()
