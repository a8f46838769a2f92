"""The adapter against TensorRT-LLM 1.2.x's connector API, as the project's notes list it
(``shared/notes/engine-apis.md``, section TensorRT-LLM), and the import paths of its base classes."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest
from kvstrata_testing.trtllm_harness import standin

# TensorRT-LLM 1.2.x, from the notes: method -> its parameters after self.
WORKER_API = {
    "__init__": ["llm_args"],
    "register_kv_caches": ["kv_cache_tensor"],
    "start_load_kv": ["stream"],
    "wait_for_layer_load": ["layer_idx", "stream"],
    "save_kv_layer": ["layer_idx", "stream"],
    "wait_for_save": ["stream"],
    "get_finished": ["finished_gen_req_ids", "started_loading_req_ids"],
}
SCHEDULER_API = {
    "__init__": ["llm_args"],
    "build_connector_meta": ["scheduler_output"],
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "request_finished": ["request", "cache_block_ids"],
    "update_state_after_alloc": ["request", "block_ids"],
}
PROVIDED = ["bind_connector_meta", "get_connector_meta", "register_forward_pass_callable"]


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("cls_name, api", [("KvstrataWorker", WORKER_API), ("KvstrataScheduler", SCHEDULER_API)])
def test_methods_and_signatures_match_trtllm_1_2(cls_name: str, api: dict[str, list[str]]) -> None:
    from kvstrata.adapters.trtllm import connector

    cls = getattr(connector, cls_name)
    for name, params in api.items():
        assert _params(getattr(cls, name)) == params, f"{cls_name}.{name}{inspect.signature(getattr(cls, name))}"
    assert not getattr(cls, "__abstractmethods__", None), f"{cls_name} leaves {cls.__abstractmethods__} abstract"


def test_standin_declares_exactly_the_1_2_abstract_methods() -> None:
    """The stand-in's base classes require what TensorRT-LLM's do: a method missing from the adapter would make
    it abstract, so the check above would catch it."""
    api = sys.modules["tensorrt_llm._torch.pyexecutor.kv_cache_connector"]
    assert api.KVSTRATA_STANDIN
    assert api.KvCacheConnectorWorker.__abstractmethods__ == set(WORKER_API) - {"__init__"}
    assert api.KvCacheConnectorScheduler.__abstractmethods__ == set(SCHEDULER_API) - {"__init__"}
    for name in PROVIDED:
        assert callable(getattr(api.KvCacheConnectorWorker, name))


def test_subclasses_the_engines_base_classes() -> None:
    from kvstrata.adapters.trtllm import connector

    api = sys.modules["tensorrt_llm._torch.pyexecutor.kv_cache_connector"]
    assert issubclass(connector.KvstrataWorker, api.KvCacheConnectorWorker)
    assert issubclass(connector.KvstrataScheduler, api.KvCacheConnectorScheduler)
    assert connector.BASE_MODULE == "tensorrt_llm._torch.pyexecutor.kv_cache_connector"


def test_base_classes_found_at_the_later_connectors_path() -> None:
    later = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"
    try:
        assert standin.install(connector_path=later)
        connector = importlib.import_module("kvstrata.adapters.trtllm.connector")
        assert connector.BASE_MODULE == later
        assert issubclass(connector.KvstrataWorker, sys.modules[later].KvCacheConnectorWorker)
    finally:
        standin.install()  # back to 1.2's path for the other tests


def test_without_tensorrt_llm_the_import_fails_naming_both_paths() -> None:
    from kvstrata.adapters.trtllm.engine_api import BASE_MODULES, TensorRTLLMNotFound

    try:
        standin.uninstall()
        with pytest.raises(TensorRTLLMNotFound) as caught:
            importlib.import_module("kvstrata.adapters.trtllm.connector")
        for path in BASE_MODULES:
            assert path in str(caught.value)
        assert "examples/trtllm/README.md" in str(caught.value)
        assert "kvstrata.adapters.trtllm.connector" not in sys.modules  # nothing half-defined is left behind
    finally:
        standin.install()


def test_standin_refuses_to_shadow_a_real_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(standin, "real_tensorrt_llm_installed", lambda: True)
    assert standin.install() is False


def test_hooks_load_without_the_engine_and_refuse_server_placement_on_a_private_pool() -> None:
    import torch
    from kvstrata.adapters.trtllm.hooks import describe
    from kvstrata.adapters.trtllm.kv_layout import TrtllmKvPool
    from kvstrata.core.adapter_api.types import NotSupported
    from kvstrata.core.transfer.layouts import LayoutError

    pool = TrtllmKvPool(torch.zeros(8, 3, 2, 4 * 16 * 8), 16)
    d = describe(pool, "engine")
    assert (d.layout.num_layers, d.layout.num_blocks, d.layout.block_size, d.layout.kv_size) == (3, 8, 16, 2)
    assert d.layout.block_stride == 3 * 2 * 4 * 16 * 8 * 4 and d.layout.dtype == "uint8"
    with pytest.raises(NotSupported, match="private memory"):
        describe(pool, "server")
    with pytest.raises(LayoutError, match="tokens_per_block=7"):
        describe(TrtllmKvPool(torch.zeros(8, 3, 2, 4 * 16 * 8), 7), "engine")
    with pytest.raises(LayoutError, match="got a 3-d tensor"):
        describe(TrtllmKvPool(torch.zeros(8, 3, 2), 16), "engine")
