"""SGLang adapter: ``KvstrataLinker`` (a ``UnifiedCacheLinker`` that loads layer by layer) and
``KvstrataHiCacheStorage`` (a HiCache storage backend).

Both need SGLang (``pip install 'kvstrata[sglang]'``); they are imported on first access so that the hooks,
the layout and the loader load without it (the GPU tests run where SGLang does not install).
"""

from typing import Any

__all__ = ["KvstrataHiCacheStorage", "KvstrataLinker"]


def __getattr__(name: str) -> Any:
    if name == "KvstrataLinker":
        from .linker import KvstrataLinker

        return KvstrataLinker
    if name == "KvstrataHiCacheStorage":
        from .hicache import KvstrataHiCacheStorage

        return KvstrataHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
