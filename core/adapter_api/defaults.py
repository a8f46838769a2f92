"""The core's answers to the optional hooks, registered last so that an adapter's own win."""

from __future__ import annotations

from typing import Any

from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.types import LoadFailure
from kvstrata.core.arrival.events import EventBackend, HostEventBackend


def whole_blocks_before_the_last_token(num_prompt_tokens: int, block_size: int) -> int:
    """Loadable tokens for an engine that computes (and writes the KV of) at least the last prompt token
    itself: every whole block except the one holding that token (vLLM, TensorRT-LLM)."""
    return ((num_prompt_tokens - 1) // block_size) * block_size if num_prompt_tokens else 0


class CoreDefaults:
    """Default implementations; :func:`kvstrata.core.adapter_api.plugins.new_plugin_manager` registers one."""

    @hookimpl(trylast=True)
    def kvstrata_event_backend(self, device: str) -> EventBackend:
        if device == "cpu":
            return HostEventBackend()
        raise ValueError(f"the adapter names no event backend for device {device!r}: implement "
                         "kvstrata_event_backend (on CUDA: kvstrata.native.cuda_events.CudaEventBackend)")

    @hookimpl(trylast=True)
    def kvstrata_loadable_tokens(self, num_prompt_tokens: int, block_size: int) -> int:
        return (num_prompt_tokens // block_size) * block_size

    @hookimpl(trylast=True)
    def kvstrata_request_id(self, engine_request_id: Any) -> str:
        return str(engine_request_id)

    @hookimpl(trylast=True)
    def kvstrata_report_load_failure(self, engine_request_id: Any, block_ids: list[list[int]],
                                     reason: str) -> LoadFailure:
        return LoadFailure(engine_request_id, block_ids, reason)
