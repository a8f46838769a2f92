"""The adapter registry: discovery, loading by entry point and module path, and the errors that name the problem."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvstrata.adapters import reference
from kvstrata.core.adapter_api import hookspecs
from kvstrata.core.wire.client import CacheClient, build_retrieve_payload
from kvstrata.core.adapter_api.hookspecs import AdapterInfo, HarnessSpec, RetrieveRequest, WorkerOptions, hookimpl
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.adapter_api.plugins import (
    AdapterCacheClient,
    AdapterImportError,
    AdapterNotFound,
    EnginePackageMissing,
    HookSignatureError,
    MissingHookError,
    default_retrieve_payload,
    discover,
    load_adapter,
)
from kvstrata.core.wire.protocol import ProtocolError, RequestType, declaration
from kvstrata.core.testing.server_process import ServerProcess


class Complete:
    """Every required hook, delegating to the reference adapter; tests derive broken variants."""

    info = AdapterInfo(name="complete", engine="test engine")

    @hookimpl
    def kvstrata_adapter_info(self) -> AdapterInfo:
        return self.info

    @hookimpl
    def kvstrata_describe_kv_layout(self, kv_caches: Any, placement: str) -> Any:
        return reference.kvstrata_describe_kv_layout(kv_caches, placement)

    @hookimpl
    def kvstrata_build_retrieve_payload(self, request: RetrieveRequest) -> list[Any]:
        return default_retrieve_payload(request)

    @hookimpl
    def kvstrata_poll_released(self, worker: Any) -> list[str]:
        return worker.get_finished()

    @hookimpl
    def kvstrata_wait_for_layer(self, worker: Any, layer: int) -> None:
        worker.wait_for_layer(layer)

    @hookimpl
    def kvstrata_take_failed(self, worker: Any) -> dict:
        return worker.take_failed()

    @hookimpl
    def kvstrata_conformance_harness(self, spec: HarnessSpec) -> Any:
        return reference.ReferenceConformanceEngine(spec)


def test_reference_adapter_is_discovered_through_its_entry_point() -> None:
    found = discover()
    assert "reference" in found
    assert found["reference"].target == "kvstrata.adapters.reference"
    assert "entry point 'reference'" in found["reference"].origin


def test_load_by_entry_point_name_and_by_module_path_give_the_same_hooks() -> None:
    by_name = load_adapter("reference")
    by_path = load_adapter("kvstrata.adapters.reference")
    assert by_name.info == by_path.info and by_name.info.name == "reference"
    assert set(by_name.implementations()) == set(by_path.implementations()) >= set(hookspecs.REQUIRED_HOOKS)
    assert by_path.source.origin == "module path"


def test_unknown_adapter_names_what_is_installed() -> None:
    with pytest.raises(AdapterNotFound, match=r"no adapter named 'nosuchengine'.*reference"):
        load_adapter("nosuchengine")


def test_missing_required_hook_is_named() -> None:
    class NoTakeFailed(Complete):
        kvstrata_take_failed = None  # type: ignore[assignment]

    with pytest.raises(MissingHookError, match=r"does not implement required hook\(s\): kvstrata_take_failed"):
        load_adapter(NoTakeFailed())


def test_unmarked_hook_is_reported_as_unmarked() -> None:
    class Unmarked(Complete):
        def kvstrata_poll_released(self, worker: Any) -> list[str]:  # no @hookimpl
            return worker.get_finished()

    with pytest.raises(MissingHookError, match=r"kvstrata_poll_released \(defined but not marked @hookimpl\)"):
        load_adapter(Unmarked())


def test_wrong_argument_names_the_hook_and_the_specification() -> None:
    class LayerName(Complete):
        @hookimpl
        def kvstrata_wait_for_layer(self, worker: Any, layer_name: str) -> None:
            pass

    with pytest.raises(HookSignatureError) as err:
        load_adapter(LayerName())
    assert "layer_name" in str(err.value) and "kvstrata_wait_for_layer passes (worker, layer)" in str(err.value)


def test_misspelled_hook_is_an_error_not_ignored() -> None:
    class Typo(Complete):
        @hookimpl
        def kvstrata_wait_for_layers(self, worker: Any, layer: int) -> None:
            pass

    with pytest.raises(HookSignatureError, match="kvstrata_wait_for_layers"):
        load_adapter(Typo())


def test_missing_engine_package_names_package_and_extra() -> None:
    class NeedsEngine(Complete):
        info = AdapterInfo(name="needs", engine="vLLM", engine_package="kvstrata_test_no_such_engine",
                           pip_extra="vllm")

    with pytest.raises(EnginePackageMissing) as err:
        load_adapter(NeedsEngine())
    message = str(err.value)
    assert "'kvstrata_test_no_such_engine'" in message and "pip install 'kvstrata[vllm]'" in message
    assert load_adapter(NeedsEngine(), check_engine=False).info.engine_package == "kvstrata_test_no_such_engine"


def test_adapter_that_imports_its_engine_eagerly_names_the_missing_module(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "eager_kvstrata_adapter.py").write_text(textwrap.dedent("""
        import kvstrata_test_absent_engine  # the engine, imported at module level
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AdapterImportError, match="module 'kvstrata_test_absent_engine' is not installed"):
        load_adapter("eager_kvstrata_adapter:plugin")
    sys.modules.pop("eager_kvstrata_adapter", None)


def test_core_default_builds_the_worker_when_the_adapter_does_not() -> None:
    adapter = load_adapter(Complete())
    assert "kvstrata_create_worker" not in adapter.implementations()
    assert adapter.hook.kvstrata_create_worker.get_hookimpls(), "the core's default must be registered"


def test_shared_payload_builder_keeps_eight_items_in_both_modes() -> None:
    key = CacheKey.for_tokens("r", [1, 2, 3], model="m")
    chunk = build_retrieve_payload(key, 0, [[1]])
    layer = build_retrieve_payload(key, 0, [[1]], arrival_board={"name": "b", "slot": 0, "generation": 1},
                                   layers_per_stage=2)
    for payload in (chunk, layer):
        declaration(RequestType.RETRIEVE).validate(payload)
    assert chunk[5:] == [None, None, 0]
    assert layer[5:] == [{"name": "b", "slot": 0, "generation": 1}, None, 2]
    request = RetrieveRequest(key, 0, [[1]], layers_per_stage=2, arrival_board=layer[5])
    assert default_retrieve_payload(request) == layer


def test_adapter_client_sends_what_the_payload_hook_builds() -> None:
    """A real server and the reference engine: the retrieve the worker sends is built by the adapter's hook."""
    calls: list[RetrieveRequest] = []

    class Recording(Complete):
        @hookimpl
        def kvstrata_build_retrieve_payload(self, request: RetrieveRequest) -> list[Any]:
            calls.append(request)
            return default_retrieve_payload(request)

    adapter = load_adapter(Recording())
    engine = adapter.conformance_engine(HarnessSpec(num_layers=4, num_blocks=32))
    with ServerProcess(l1_bytes=32 << 20, chunk_size=64) as server:
        client = adapter.client(server.address)
        assert isinstance(client, AdapterCacheClient) and isinstance(client, CacheClient)
        layout = adapter.describe_kv_layout(engine.kv_caches, engine.placement)
        worker = adapter.create_worker(client, 0, layout, engine.kv_caches, engine.placement,
                                       WorkerOptions(retrieve_timeout=20.0))
        try:
            worker.register()
            prompt = list(range(1, 129))
            blocks = engine.allocate(len(prompt))
            engine.prefill(prompt, blocks)
            truth = [engine.read_layer(blocks, layer, len(prompt)) for layer in range(4)]
            client.store(CacheKey.for_tokens("store", prompt, model="m"), 0, blocks)
            dst = engine.allocate(len(prompt))
            engine.clear(dst)
            key = CacheKey.for_tokens("retrieve", prompt, model="m")
            assert client.lookup(key) == len(prompt)
            worker.submit_retrieve("retrieve", key, dst, layers_per_stage=1)
            worker.wait_all(20.0)
            assert [engine.read_layer(dst, layer, len(prompt)) for layer in range(4)] == truth
            assert [(c.key.request_id, c.layers_per_stage) for c in calls] == [("retrieve", 1)]
            assert calls[0].arrival_board is not None
        finally:
            worker.close()
            client.close()
            engine.close()


def test_adapter_client_refuses_a_payload_the_protocol_rejects_naming_the_adapter() -> None:
    class Short(Complete):
        @hookimpl
        def kvstrata_build_retrieve_payload(self, request: RetrieveRequest) -> list[Any]:
            return default_retrieve_payload(request)[:5]

    adapter = load_adapter(Short())
    key = CacheKey.for_tokens("r", [1, 2], model="m")
    with pytest.raises(ProtocolError, match=r"adapter 'Short'.*payload has 5 items, the protocol declares 8"):
        adapter.build_retrieve_payload(RetrieveRequest(key, 0, [[0]]))
