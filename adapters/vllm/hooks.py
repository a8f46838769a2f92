"""The vLLM adapter's hook implementations (entry point ``vllm`` in ``kvstrata.adapters``).

The connector (:mod:`.connector`) is what vLLM loads; these hooks are the same
engine-specific decisions exposed to the core and to the conformance suite:
how vLLM's ``register_kv_caches`` tensors are addressed, how a request is
released and how a layer is waited for.

The conformance engine builds a KV cache in vLLM's exact CPU format (one
buffer, per-layer ``[blocks, kv_heads, block_size, 2 * head]`` views, pages moved
whole) without running a model. Its buffer lives in shared memory so that the
suite's server-side STOREs can read it; :class:`SharedVllmKVCaches` carries
that segment's name, and :func:`kvstrata_describe_kv_layout` then describes it
for the server placement. A real vLLM cache on CPU is private memory and is
described for the worker placement (see :mod:`.worker_side`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvstrata.core.adapter_api.hookspecs import AdapterInfo, HarnessSpec, NotSupported, WorkerOptions, hookimpl
from kvstrata.core.transfer.layouts import DTYPE_SIZES, PLACEMENT_SERVER, PLACEMENT_WORKER, PagedKVLayout, Region
from kvstrata.core.adapter_api.defaults import (  # noqa: F401  (registered as this adapter's hooks)
    kvstrata_build_retrieve_payload,
    kvstrata_poll_released,
    kvstrata_take_failed,
    kvstrata_wait_for_layer,
    layerwise_worker,
)
from kvstrata.core.shm import Segment

from .kv_layout import cpu_page_layout

NAME = "vllm"


class SharedVllmKVCaches(dict):
    """vLLM's ``dict[layer_name, Tensor]`` whose buffer is a shared-memory segment the server can map."""

    def __init__(self, layers: dict[str, torch.Tensor], segment_name: str, segment_size: int) -> None:
        super().__init__(layers)
        self.segment_name = segment_name
        self.segment_size = segment_size


def describe(kv_caches: dict[str, torch.Tensor], placement: str) -> tuple[PagedKVLayout, list[torch.Tensor]]:
    """The layout of a CPU vLLM cache for a placement, and this process's regions for it."""
    layout, regions = cpu_page_layout(kv_caches)
    if placement == PLACEMENT_WORKER:
        return layout, regions
    if placement != PLACEMENT_SERVER:
        raise ValueError(f"placement must be {PLACEMENT_SERVER!r} or {PLACEMENT_WORKER!r}, got {placement!r}")
    if not isinstance(kv_caches, SharedVllmKVCaches):
        raise ValueError("a CPU vLLM cache is private memory: describe it for the worker placement "
                         "(the server placement needs a cache in shared memory)")
    base = regions[0].data_ptr()
    offsets = tuple(((0, r.data_ptr() - base),) for r in regions)
    shared = PagedKVLayout(**{**layout.__dict__, "offsets": offsets,
                              "regions": (Region("shm", kv_caches.segment_size, kv_caches.segment_name),)})
    return shared, regions


@hookimpl
def kvstrata_adapter_info() -> AdapterInfo:
    return AdapterInfo(name=NAME, engine="vLLM", engine_package="vllm", pip_extra="vllm",
                       description="KVConnectorBase_V1 with first-slice release (kvstrata.adapters.vllm)")


@hookimpl
def kvstrata_describe_kv_layout(kv_caches: Any, placement: str) -> PagedKVLayout:
    return describe(kv_caches, placement)[0]


@hookimpl
def kvstrata_create_worker(client: Any, instance_id: int, layout: PagedKVLayout, kv_caches: Any, placement: str,
                           options: WorkerOptions) -> Any:
    local = describe(kv_caches, PLACEMENT_WORKER)[1] if placement == PLACEMENT_WORKER else None
    return layerwise_worker(client, instance_id, layout, placement, options, local_regions=local)


@hookimpl
def kvstrata_conformance_harness(spec: HarnessSpec) -> "VllmConformanceEngine":
    return VllmConformanceEngine(spec)


class VllmConformanceEngine:
    """A KV cache in vLLM's CPU format, filled with deterministic bytes instead of a model's output."""

    def __init__(self, spec: HarnessSpec) -> None:
        if spec.kv_groups > 1:
            raise NotSupported("the vLLM adapter registers one KV cache group (vLLM turns its hybrid manager off "
                               "for connectors without SupportsHMA)")
        if spec.kv_size != 2:
            raise NotSupported("vLLM's CPU cache keeps K and V in one page; MLA is not built here")
        self.spec = spec
        self.placement = str(spec.extra.get("placement", PLACEMENT_SERVER))
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[spec.dtype]
        es = DTYPE_SIZES[spec.dtype]
        page = spec.num_heads * spec.block_size * 2 * spec.head_size * es
        size = spec.num_layers * spec.num_blocks * page
        self._segment = Segment.create("vllm-conformance", size)
        buf = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=size).view(dtype)
        views = buf.view(spec.num_layers, spec.num_blocks, spec.num_heads, spec.block_size, 2 * spec.head_size)
        self.kv_caches = SharedVllmKVCaches({f"model.layers.{l}.self_attn.attn": views[l]
                                             for l in range(spec.num_layers)}, self._segment.name, size)
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
