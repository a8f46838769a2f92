"""The SGLang adapter's hook implementations (entry point ``sglang`` in ``kvstrata.adapters``).

:mod:`.linker` translates SGLang's ``UnifiedCacheLinker`` onto the core's engine runtime (through
:mod:`.loader`); these hooks are where SGLang differs from other engines, and the runtime calls them:

* its cache: per-layer ``[slots, heads, head_dim]`` K and V buffers (one plane for MLA), described by
  :mod:`.kv_layout`. SGLang allocates them in private memory (CPU) or its own CUDA context, so the worker
  copies into them itself: engine placement only;
* SGLang computes only what lies past its hit (the linker's hit is whole pages; SGLang keeps at least one
  token to compute), so every whole block is loadable: the default ``kvstrata_loadable_tokens``;
* a failed load fails SGLang's layer counter, which aborts the request (SGLang 0.5.23 has no recompute
  path for a linker load): the failure report is a :class:`SglangLoadFailure` the linker raises into it;
* SGLang's layer wait (``LayerWiseLoadCounter.wait_until``) blocks the CPU on a per-layer future, so on CUDA
  the layer may only be completed once its copy's event has completed: the event backend's wait
  synchronizes the event (:class:`HostBlockingCudaEventBackend`), it does not just order a stream.

Importing this module does not import SGLang: the GPU tests drive the loader with these hooks on a machine
where SGLang does not install.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.types import (
    AdapterInfo,
    KVCacheDescription,
    NotSupported,
)
from kvstrata.core.arrival.events import EventBackend, HostEventBackend
from kvstrata.core.transfer.layouts import PLACEMENT_ENGINE

from .kv_layout import SglangHostPool, SglangKVBuffers, describe_buffers, describe_host_pool

NAME = "sglang"


@dataclass(frozen=True)
class SglangLoadFailure:
    """One failed load, as the linker hands it to SGLang's counter (``LayerWiseLoadCounter.fail``)."""

    request_id: str
    reason: str


def describe(kv_caches: Any, placement: str) -> KVCacheDescription:
    """SGLang's device pool (the linker's) or its HiCache host pool (the storage backend's)."""
    if isinstance(kv_caches, SglangKVBuffers):
        describe_one = describe_buffers
    elif isinstance(kv_caches, SglangHostPool):
        describe_one = describe_host_pool
    else:
        raise TypeError(f"the SGLang adapter registers SglangKVBuffers or SglangHostPool, got "
                        f"{type(kv_caches).__name__}")
    if placement != PLACEMENT_ENGINE:
        raise NotSupported("SGLang allocates its KV pools in private memory (CPU) or its own CUDA context, which "
                           "the server cannot map: the worker copies (engine placement)")
    layout, regions = describe_one(kv_caches)
    return KVCacheDescription(layout, regions, str(kv_caches.device) if kv_caches.device.type == "cuda" else "cpu")


COPY_EVENT_POLL = 0.0001
COPY_EVENT_BOUND = 60.0
"""The longest a layer wait waits for a copy the GPU has been handed (only catches a stuck copy)."""


def host_blocking_cuda_backend(device: str) -> EventBackend:
    """A CUDA event backend whose layer wait returns only once the layer's copy event has completed."""
    from kvstrata.core.arrival.gate import LayerWaitTimeout
    from kvstrata.native.cuda_events import CudaEventBackend

    class HostBlockingCudaEventBackend(CudaEventBackend):
        """SGLang's counter is completed from the CPU: the bytes must be in place, not merely ordered.

        The wait polls the event (bounded) rather than ``synchronize()`` it: a copy that never runs fails the
        load (LayerWaitTimeout, which the runtime turns into a failure report) instead of hanging the engine.
        """

        name = "cuda-host-blocking"

        def wait(self, event: Any) -> None:
            if event is None:
                return
            deadline = time.monotonic() + COPY_EVENT_BOUND
            while not event.query():
                if time.monotonic() > deadline:
                    raise LayerWaitTimeout(f"a copy enqueued on the GPU did not complete within "
                                           f"{COPY_EVENT_BOUND:.0f}s")
                time.sleep(COPY_EVENT_POLL)

    return HostBlockingCudaEventBackend(device)


@hookimpl
def kvstrata_adapter_info() -> AdapterInfo:
    return AdapterInfo(name=NAME, engine="SGLang", engine_package="sglang", pip_extra="sglang",
                       description="UnifiedCacheLinker with per-layer completion, and a HiCache storage backend "
                                   "(kvstrata.adapters.sglang)",
                       placements=(PLACEMENT_ENGINE,))


@hookimpl
def kvstrata_describe_kv_cache(kv_caches: Any, placement: str) -> KVCacheDescription:
    return describe(kv_caches, placement)


@hookimpl
def kvstrata_event_backend(device: str) -> EventBackend:
    if device == "cpu":
        return HostEventBackend()
    return host_blocking_cuda_backend(device)


@hookimpl
def kvstrata_report_load_failure(engine_request_id: Any, block_ids: list[list[int]], reason: str) -> SglangLoadFailure:
    return SglangLoadFailure(str(engine_request_id), reason)
