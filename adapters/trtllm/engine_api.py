"""Where TensorRT-LLM keeps its KV cache connector base classes, and what happens when it is not installed.

TensorRT-LLM 1.2 defines ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker`` in
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``; later releases moved the file to
``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py``. Both are tried, in that order.
When neither imports, :func:`connector_base_classes` raises :class:`TensorRTLLMNotFound` naming both
paths and why each failed: the connector cannot exist without the engine, and silently defining
look-alike base classes would let a deployment think it is running when it is not.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger("kvstrata.adapters.trtllm")

BASE_MODULES = (
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
)
"""The module paths TensorRT-LLM's releases defined the connector base classes in (1.2.x first)."""


class TensorRTLLMNotFound(ImportError):
    """Neither module path of TensorRT-LLM's connector base classes imports."""


def connector_module() -> Any:
    """TensorRT-LLM's connector module (base classes, ``SchedulerOutput``, ``RequestData``), from either path."""
    problems = []
    for path in BASE_MODULES:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            problems.append(f"{path}: {type(exc).__name__}: {exc}")
            continue
        missing = [n for n in ("KvCacheConnectorScheduler", "KvCacheConnectorWorker") if not hasattr(module, n)]
        if missing:
            problems.append(f"{path}: has no {', '.join(missing)}")
            continue
        log.debug("TensorRT-LLM connector base classes from %s", path)
        return module
    raise TensorRTLLMNotFound(
        "kvstrata's TensorRT-LLM connector needs TensorRT-LLM 1.2.x (its KvCacheConnectorScheduler and "
        "KvCacheConnectorWorker base classes), and neither module path imports: " + "; ".join(problems)
        + ". Install TensorRT-LLM from NVIDIA's index (see examples/trtllm/README.md).")


def connector_base_classes() -> tuple[Any, Any, str]:
    """(KvCacheConnectorScheduler, KvCacheConnectorWorker, the module path they came from)."""
    module = connector_module()
    return module.KvCacheConnectorScheduler, module.KvCacheConnectorWorker, module.__name__
