"""vLLM adapter: ``KvstrataConnector``, a KVConnectorBase_V1 with first-slice release.

The connector class needs vLLM (``pip install 'kvstrata[vllm]'``); it is imported
on first access so that the settings and layout helpers load without it.
"""

from typing import Any

__all__ = ["KvstrataConnector", "KvstrataMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
