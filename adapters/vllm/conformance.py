"""The vLLM adapter's conformance driver: ``KvstrataConnector`` itself, called in vLLM's order.

vLLM's engine loop does not run here (the real-engine tests in
``tests/vllm_engine`` run it); instead the driver builds what vLLM would hand
the connector, with vLLM's own classes: a real ``VllmConfig`` (from a model
``config.json``, no weights), ``Request``, ``KVCacheBlocks`` of
``KVCacheBlock``, ``SchedulerOutput`` with ``NewRequestData`` /
``CachedRequestData``, and ``KVConnectorOutput``. It builds one connector per
role, as vLLM does in its scheduler and worker processes, and calls them in the
order vLLM's scheduler and model runner do. The block table stands in for
vLLM's KV cache manager (the connector only reads ``get_block_ids`` from it).
The cache is in vLLM's CPU format, in shared memory so the server placement
can be checked too (a real vLLM CPU cache is private memory: engine placement).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from typing import Any, Sequence

import torch

from kvstrata.core.adapter_api.types import DriverPoll, HarnessSpec, NotSupported
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.shm import create_cache_segment
from kvstrata.core.transfer.layouts import DTYPE_SIZES

LOOKUP_BOUND = 30.0
"""How long the driver asks again for a lookup before it calls the connector broken (only catches hangs)."""

_base_configs: dict[tuple, Any] = {}


def _layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def _vllm_config(spec: HarnessSpec, extra: dict[str, Any]) -> Any:
    """A real VllmConfig for the spec's shape with kvstrata's connector configured (built once per shape)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    shape = (spec.num_layers, spec.num_heads, spec.head_size, spec.block_size)
    base = _base_configs.get(shape)
    if base is None:
        model_dir = tempfile.mkdtemp(prefix="kvstrata-vllm-conformance-model-")
        heads = spec.num_heads
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
                       "hidden_size": heads * spec.head_size, "intermediate_size": 2 * heads * spec.head_size,
                       "num_hidden_layers": spec.num_layers, "num_attention_heads": heads,
                       "num_key_value_heads": heads, "max_position_embeddings": 8192,
                       "torch_dtype": "float32"}, f)
        base = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                          block_size=spec.block_size,
                          kv_transfer_config=KVTransferConfig(
                              kv_connector="KvstrataConnector", kv_connector_module_path="kvstrata.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute")).create_engine_config()
        _base_configs[shape] = base
    config = copy.copy(base)
    config.kv_transfer_config = copy.copy(base.kv_transfer_config)
    config.kv_transfer_config.kv_connector_extra_config = dict(extra)
    return config


class _BlockTable:
    """Stands in for vLLM's KV cache manager: the one call the connector makes on it (``get_block_ids``), and
    the ``block_pool`` the base class hands ``bind_gpu_block_pool`` (which kvstrata does not override)."""

    block_pool = None

    def __init__(self) -> None:
        self.blocks: dict[str, tuple[list[int], ...]] = {}

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.blocks[request_id]


class VllmConformanceCache:
    """A KV cache in vLLM's CPU format (in shared memory), filled with deterministic bytes instead of a model's."""

    def __init__(self, spec: HarnessSpec) -> None:
        if spec.kv_groups > 1:
            raise NotSupported("the vLLM adapter registers one KV cache group (vLLM turns its hybrid manager off "
                               "for connectors without SupportsHMA)")
        if spec.kv_size != 2:
            raise NotSupported("vLLM's CPU cache keeps K and V in one page; MLA is not built here")
        self.spec = spec
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[spec.dtype]
        es = DTYPE_SIZES[spec.dtype]
        page = spec.num_heads * spec.block_size * 2 * spec.head_size * es
        size = spec.num_layers * spec.num_blocks * page
        self._segment = create_cache_segment("vllm-conformance", size)
        buf = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=size).view(dtype)
        views = buf.view(spec.num_layers, spec.num_blocks, spec.num_heads, spec.block_size, 2 * spec.head_size)
        # A plain dict, as vLLM hands it over: the adapter finds the buffer in a cache segment of this process.
        self.kv_caches = {f"model.layers.{l}.self_attn.attn": views[l] for l in range(spec.num_layers)}
        self._pages = buf.view(torch.uint8).view(spec.num_layers, spec.num_blocks, page)
        self._free = list(range(1, spec.num_blocks))  # block 0 is vLLM's null block

    def allocate(self, num_tokens: int) -> list[list[int]]:
        need = -(-num_tokens // self.spec.block_size)
        if need > len(self._free):
            raise RuntimeError(f"conformance vLLM cache out of blocks: {need} needed, {len(self._free)} free")
        blocks, self._free = self._free[:need], self._free[need:]
        return [blocks]

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        self._free.extend(block_ids[0])

    def clear(self, block_ids: Sequence[Sequence[int]]) -> None:
        self._pages[:, list(block_ids[0])] = 0

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        """Fill whole pages with bytes that depend on (layer, tokens of the block, position)."""
        bs = self.spec.block_size
        page = self._pages.shape[-1]
        ramp = torch.arange(page, dtype=torch.int64)
        for i, b in enumerate(block_ids[0][: -(-len(token_ids) // bs)]):
            toks = torch.as_tensor(list(token_ids[i * bs:(i + 1) * bs]), dtype=torch.int64)
            seed = int((toks * torch.arange(1, len(toks) + 1)).sum()) + 7 * i
            for layer in range(self.spec.num_layers):
                self._pages[layer, b] = ((ramp + seed + 31 * layer) % 251).to(torch.uint8)

    def read_layer(self, block_ids: Sequence[Sequence[int]], layer: int, num_tokens: int) -> bytes:
        n = -(-num_tokens // self.spec.block_size)
        return self._pages[layer, list(block_ids[0][:n])].contiguous().numpy().tobytes()

    def close(self) -> None:
        self.kv_caches = None
        self._pages = None
        self._segment.destroy()


class VllmConformanceDriver(VllmConformanceCache):
    """Both roles of ``KvstrataConnector`` over a vLLM-format cache, driven the way vLLM drives them."""

    def __init__(self, spec: HarnessSpec, adapter: Any = None) -> None:
        """``adapter``: the suite's loaded adapter (unused: the engine side loads its adapter by name, as the
        engine does)."""
        super().__init__(spec)
        self.placement = spec.placement
        self.scheduler: Any = None
        self.worker: Any = None
        self.runtime: Any = None
        self._table = _BlockTable()
        self._requests: dict[str, Any] = {}
        self._finished: set[str] = set()

    def start(self, settings: RuntimeSettings) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from .connector import KvstrataConnector

        extra = {name: getattr(settings, name) for name in RuntimeSettings.FIELDS}
        extra["placement"] = self.placement
        config = _vllm_config(self.spec, extra)
        self.scheduler = KvstrataConnector(config, KVConnectorRole.SCHEDULER, None)
        self.scheduler.bind_kv_cache_manager(self._table)
        self.worker = KvstrataConnector(config, KVConnectorRole.WORKER, None)
        self.worker.register_kv_caches(self.kv_caches)
        self.runtime = self.worker.worker_runtime

    # --- vLLM's objects --------------------------------------------------------------

    def _request(self, request_id: str, token_ids: Sequence[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(request_id, list(token_ids), SamplingParams(max_tokens=1), None)
        self._requests[request_id] = request
        return request

    def _admit(self, request: Any, block_ids: Sequence[Sequence[int]]) -> int:
        """vLLM's scheduler admitting a waiting request: ask until answered, then allocate."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        deadline = time.monotonic() + LOOKUP_BOUND
        while True:
            n, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
            if n is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"get_num_new_matched_tokens kept answering (None, False) for "
                                   f"{LOOKUP_BOUND:.0f}s: the lookup never completed")
            time.sleep(0.001)
        if n and not is_async:
            raise AssertionError(f"get_num_new_matched_tokens reported {n} tokens synchronously; kvstrata loads "
                                 "asynchronously")
        self._table.blocks[request.request_id] = tuple(list(map(int, g)) for g in block_ids)
        blocks = KVCacheBlocks(tuple(tuple(KVCacheBlock(int(b)) for b in g) for g in block_ids))
        self.scheduler.update_state_after_alloc(request, blocks, n)
        return n

    def _step(self, new: Sequence[tuple[Any, int]] = ()) -> None:
        """One schedule() -> worker forward: ``new`` are (request, tokens scheduled) whose prefill runs now."""
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        new_data = [NewRequestData(r.request_id, r.prompt_token_ids, [], r.sampling_params, None,
                                   self._table.blocks[r.request_id], 0, None) for r, _ in new]
        counts = {r.request_id: n for r, n in new}
        output = SchedulerOutput(new_data, CachedRequestData([], set(), [], {}, [], [], []), counts,
                                 sum(counts.values()), {}, {}, set(), [])
        meta = self.scheduler.build_connector_meta(output)
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        if new:
            self.worker.wait_for_save()

    # --- the suite's calls -----------------------------------------------------------

    def store(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        request = self._request(request_id, token_ids)
        self._admit(request, block_ids)
        self._step([(request, len(token_ids))])
        self.finish(request_id)
        self.poll()

    def load(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> int:
        request = self._request(request_id, token_ids)
        n = self._admit(request, block_ids)
        if n:
            self._step()
        return n

    def poll(self) -> DriverPoll:
        from vllm.v1.outputs import KVConnectorOutput

        finished, self._finished = self._finished, set()
        sending, recving = self.worker.get_finished(finished)
        failed = self.worker.get_block_ids_with_load_errors()
        self.scheduler.update_connector_output(KVConnectorOutput(finished_sending=sending,
                                                                 finished_recving=recving))
        return DriverPoll(sorted(recving or ()), set(failed))

    def wait_for_layer(self, layer: int) -> None:
        self.worker.wait_for_layer_load(_layer_name(layer))

    def finish(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.request_finished(request, list(self._table.blocks.get(request_id, ([],))[0]))
        self._finished.add(request_id)
        self._table.blocks.pop(request_id, None)

    def close(self) -> None:
        for connector in (self.worker, self.scheduler):
            if connector is not None:
                connector.shutdown()
        super().close()
