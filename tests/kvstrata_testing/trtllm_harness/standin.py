"""Stand-ins for the parts of TensorRT-LLM 1.2 the connector touches, under TensorRT-LLM's module names.

TensorRT-LLM cannot be installed on these machines (the PyPI package is a stub that downloads from
NVIDIA's index; the real one pins torch 2.9 and imports compiled bindings at import time). The adapter
imports its base classes from ``tensorrt_llm._torch.pyexecutor.kv_cache_connector`` exactly as it would
with TensorRT-LLM installed, so a test process registers these modules under those names first
(:func:`install`). They are written from TensorRT-LLM's public sources at commit
3277953654b9b2863dae4f1cb81856b172837db4 (``SOURCE``), without its code: same class names, method names,
signatures and abstract methods, and each class names the file, lines and definition it follows (lines
at ``SOURCE``, unless another commit is named where SOURCE's copy of that file could not be read).

:func:`install` refuses to shadow a real TensorRT-LLM and marks every module it makes
(``KVSTRATA_STANDIN = True``), so nothing can mistake it for the engine.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SOURCE = "NVIDIA/TensorRT-LLM@3277953654b9b2863dae4f1cb81856b172837db4"
CONNECTOR_FILE = "tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py"

_rank = threading.local()


def set_rank(rank: int) -> None:
    """The harness runs every simulated rank in one process: it says which rank is being built or called."""
    _rank.value = rank


def mpi_rank() -> int:
    """Follows ``tensorrt_llm/_utils.py:526-533 (mpi_rank)`` (the MPI world rank of this process); lines at
    commit ed53795b33fc139493f762a1c6c53f691cf52d38, as SOURCE's copy of _utils.py is not stored."""
    return getattr(_rank, "value", 0)


@dataclass
class RequestData:
    """Follows ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py:59-70 (RequestData)`` (one in-flight
    request in a SchedulerOutput)."""

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    """Follows ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py:75-81 (SchedulerOutput)`` (what
    ``build_connector_meta`` receives)."""

    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


class KvCacheConnectorWorker(ABC):
    """Follows ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py:84-174 (KvCacheConnectorWorker)``:
    constructor, metadata binding, the optional ``register_forward_pass_callable`` and the six abstract
    methods, with TensorRT-LLM's signatures."""

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        self._metadata = None
        super().__init__()

    def bind_connector_meta(self, metadata: object):
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self):
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable:
        """Optional in TensorRT-LLM 1.2 (returns None by default)."""

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor):
        ...

    @abstractmethod
    def start_load_kv(self, stream):
        ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream):
        ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream):
        ...

    @abstractmethod
    def wait_for_save(self, stream):
        ...

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        ...


class KvCacheConnectorScheduler(ABC):
    """Follows ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py:177-235 (KvCacheConnectorScheduler)``:
    constructor and four abstract methods."""

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]):
        ...


@dataclass
class KvCacheConfig:
    """Follows ``KvCacheConfig`` in tensorrt_llm/llmapi/llm_args.py (only ``tokens_per_block``, default 32)."""

    tokens_per_block: int = 32


@dataclass
class KvCacheConnectorConfig:
    """Follows ``KvCacheConnectorConfig`` in tensorrt_llm/llmapi/llm_args.py: three strings."""

    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str


@dataclass
class TorchLlmArgs:
    """Follows the fields of ``TorchLlmArgs`` (tensorrt_llm/llmapi/llm_args.py) the connector reads."""

    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    kv_connector_config: KvCacheConnectorConfig | None = None


def real_tensorrt_llm_installed() -> bool:
    if "tensorrt_llm" in sys.modules:
        return not getattr(sys.modules["tensorrt_llm"], "KVSTRATA_STANDIN", False)
    try:
        return importlib.util.find_spec("tensorrt_llm") is not None
    except (ImportError, ValueError):
        return False


def _module(name: str, package: bool, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, f"kvstrata's TensorRT-LLM stand-in for {name} (see {__name__})")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        mod.__path__ = []
    mod.KVSTRATA_STANDIN = True
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def install(*, connector_path: str = "tensorrt_llm._torch.pyexecutor.kv_cache_connector") -> bool:
    """Register the stand-in modules (this process only); False, and nothing done, if TensorRT-LLM is real.

    ``connector_path``: where the base classes live (TensorRT-LLM 1.2's path by default; the later
    ``...pyexecutor.connectors.kv_cache_connector`` to check the adapter finds them there too).
    """
    if real_tensorrt_llm_installed():
        return False
    uninstall()
    connector = {"KvCacheConnectorWorker": KvCacheConnectorWorker,
                 "KvCacheConnectorScheduler": KvCacheConnectorScheduler,
                 "SchedulerOutput": SchedulerOutput, "RequestData": RequestData}
    parts = connector_path.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        sys.modules.setdefault(name, _module(name, True))
    sys.modules[connector_path] = _module(connector_path, False, **connector)
    sys.modules["tensorrt_llm._utils"] = _module("tensorrt_llm._utils", False, mpi_rank=mpi_rank)
    sys.modules["tensorrt_llm.llmapi"] = _module("tensorrt_llm.llmapi", True)
    sys.modules["tensorrt_llm.llmapi.llm_args"] = _module(
        "tensorrt_llm.llmapi.llm_args", False, KvCacheConfig=KvCacheConfig,
        KvCacheConnectorConfig=KvCacheConnectorConfig, TorchLlmArgs=TorchLlmArgs)
    for name in list(sys.modules):
        if name.startswith("kvstrata.adapters.trtllm.connector"):
            del sys.modules[name]  # bind the connector to these base classes on its next import
    return True


def uninstall() -> None:
    """Remove every stand-in module (and the connector module bound to them)."""
    for name in list(sys.modules):
        if (name == "tensorrt_llm" or name.startswith("tensorrt_llm.")) and \
                getattr(sys.modules[name], "KVSTRATA_STANDIN", False) or name == "kvstrata.adapters.trtllm.connector":
            del sys.modules[name]
