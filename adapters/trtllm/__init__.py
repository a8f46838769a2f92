"""TensorRT-LLM adapter: a KV cache connector (scheduler + worker) for TensorRT-LLM 1.2.x.

The connector classes subclass TensorRT-LLM's own base classes, so importing
them needs TensorRT-LLM (:mod:`.engine_api` says what happens without it); the
settings, layout and hooks modules load without it.
"""

from typing import Any

__all__ = ["KvstrataLoadFailed", "KvstrataScheduler", "KvstrataTrtllmMetadata", "KvstrataWorker"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
