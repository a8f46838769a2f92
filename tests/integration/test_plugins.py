"""The adapter registry: discovery, loading by entry point and module path, and the errors that name the problem."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvstrata.adapters import reference
from kvstrata.adapters.reference.conformance import ReferenceConformanceDriver
from kvstrata.core.adapter_api import hookspecs
from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.plugins import (
    AdapterImportError,
    AdapterNotFound,
    EnginePackageMissing,
    HookResultError,
    HookSignatureError,
    MissingHookError,
    discover,
    load_adapter,
)
from kvstrata.core.adapter_api.types import AdapterInfo, HarnessSpec, KVCacheDescription, LoadFailure
from kvstrata.core.arrival.events import HostEventBackend
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.server_process import ServerProcess


class Complete:
    """Every required hook, delegating to the reference adapter; tests derive broken variants."""

    info = AdapterInfo(name="complete", engine="test engine")

    @hookimpl
    def kvstrata_adapter_info(self) -> AdapterInfo:
        return self.info

    @hookimpl
    def kvstrata_describe_kv_cache(self, kv_caches: Any, placement: str) -> KVCacheDescription:
        return reference.kvstrata_describe_kv_cache(kv_caches, placement)


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
    class NoDescription(Complete):
        kvstrata_describe_kv_cache = None  # type: ignore[assignment]

    with pytest.raises(MissingHookError,
                       match=r"does not implement required hook\(s\): kvstrata_describe_kv_cache"):
        load_adapter(NoDescription())


def test_the_conformance_driver_is_no_hook_and_lives_in_the_suites_own_group() -> None:
    """Test support stays out of what an engine loads: no hook names a driver, a driver marked as one is refused as
    a misspelled hook, and the drivers are published in their own entry-point group, under the adapters' names."""
    from kvstrata.conformance_tests.drivers import DRIVER_GROUP, installed

    assert not any("conformance" in name for name in hookspecs.REQUIRED_HOOKS)
    assert not hasattr(hookspecs, "kvstrata_conformance_driver")

    class OldStyle(Complete):
        @hookimpl
        def kvstrata_conformance_driver(self, spec: Any) -> Any:
            return None

    with pytest.raises(HookSignatureError, match="kvstrata_conformance_driver"):
        load_adapter(OldStyle())
    drivers = installed()
    assert DRIVER_GROUP == "kvstrata.conformance_drivers"
    assert {"reference", "vllm", "trtllm", "sglang"} <= set(drivers) <= set(discover()) | {"blockmajor"}
    assert drivers["reference"].target == "kvstrata.adapters.reference.conformance:ReferenceConformanceDriver"
    assert drivers["reference"].load() is ReferenceConformanceDriver


def test_unmarked_hook_is_reported_as_unmarked() -> None:
    class Unmarked(Complete):
        def kvstrata_describe_kv_cache(self, kv_caches: Any, placement: str) -> Any:  # no @hookimpl
            return reference.kvstrata_describe_kv_cache(kv_caches, placement)

    with pytest.raises(MissingHookError, match=r"kvstrata_describe_kv_cache \(defined but not marked @hookimpl\)"):
        load_adapter(Unmarked())


def test_wrong_argument_names_the_hook_and_the_specification() -> None:
    class Where(Complete):
        @hookimpl
        def kvstrata_describe_kv_cache(self, kv_caches: Any, where: str) -> Any:
            pass

    with pytest.raises(HookSignatureError) as err:
        load_adapter(Where())
    assert "where" in str(err.value)
    assert "kvstrata_describe_kv_cache passes (kv_caches, placement)" in str(err.value)


def test_misspelled_hook_is_an_error_not_ignored() -> None:
    class Typo(Complete):
        @hookimpl
        def kvstrata_loadable_token(self, num_prompt_tokens: int, block_size: int) -> int:
            return 0

    with pytest.raises(HookSignatureError, match="kvstrata_loadable_token"):
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


def test_core_defaults_answer_the_optional_hooks_and_an_adapters_own_win() -> None:
    adapter = load_adapter(Complete())
    for hook in ("kvstrata_event_backend", "kvstrata_loadable_tokens", "kvstrata_request_id",
                 "kvstrata_report_load_failure"):
        assert hook not in adapter.implementations() and getattr(adapter.hook, hook).get_hookimpls(), hook
    assert adapter.loadable_tokens(100, 16) == 96  # every whole block
    assert adapter.request_id(7) == "7"
    assert isinstance(adapter.event_backend("cpu"), HostEventBackend)
    with pytest.raises(ValueError, match=r"no event backend for device 'cuda:0'.*kvstrata_event_backend"):
        adapter.event_backend("cuda:0")
    assert adapter.report_load_failure("r", [[1, 2]], "why") == LoadFailure("r", [[1, 2]], "why")
    vllm_hooks = pytest.importorskip("kvstrata.adapters.vllm.hooks")
    vllm = load_adapter(vllm_hooks, check_engine=False)
    assert vllm.loadable_tokens(96, 16) == 80  # the block holding the last token is vLLM's to compute
    assert vllm.report_load_failure("r", [[1, 2], [5]], "why") == {1, 2, 5}


def test_hook_results_are_checked_naming_the_adapter() -> None:
    class OddLoadable(Complete):
        @hookimpl
        def kvstrata_loadable_tokens(self, num_prompt_tokens: int, block_size: int) -> int:
            return num_prompt_tokens  # not block-aligned

    with pytest.raises(HookResultError, match=r"adapter 'OddLoadable': kvstrata_loadable_tokens\(100, 16\) "
                                              r"returned 100, expected a multiple of 16"):
        load_adapter(OddLoadable()).loadable_tokens(100, 16)

    class LayoutOnly(Complete):
        @hookimpl
        def kvstrata_describe_kv_cache(self, kv_caches: Any, placement: str) -> Any:
            return reference.kvstrata_describe_kv_cache(kv_caches, placement).layout

    driver = ReferenceConformanceDriver(HarnessSpec(num_layers=2, num_blocks=8))
    try:
        with pytest.raises(HookResultError, match="expected a kvstrata.core.adapter_api.types.KVCacheDescription"):
            load_adapter(LayoutOnly()).describe_kv_cache(driver.kv_caches, "server")
    finally:
        driver.close()


def test_the_runtimes_call_every_optional_hook_in_production(tmp_path: Path) -> None:
    """A real server and the reference engine driven through the runtimes: each optional hook is called, and a
    load the server refuses reaches the engine through the failure-report hook."""
    calls: dict[str, list[Any]] = {}

    class Recording(Complete):
        @hookimpl
        def kvstrata_event_backend(self, device: str) -> Any:
            calls.setdefault("event_backend", []).append(device)
            return HostEventBackend()

        @hookimpl
        def kvstrata_loadable_tokens(self, num_prompt_tokens: int, block_size: int) -> int:
            calls.setdefault("loadable_tokens", []).append(num_prompt_tokens)
            return (num_prompt_tokens // block_size) * block_size

        @hookimpl
        def kvstrata_request_id(self, engine_request_id: Any) -> str:
            calls.setdefault("request_id", []).append(engine_request_id)
            return f"engine-{engine_request_id}"

        @hookimpl
        def kvstrata_report_load_failure(self, engine_request_id: Any, block_ids: list[list[int]],
                                         reason: str) -> Any:
            calls.setdefault("report_load_failure", []).append((engine_request_id, reason))
            return LoadFailure(engine_request_id, block_ids, reason)

    adapter = load_adapter(Recording())
    driver = ReferenceConformanceDriver(HarnessSpec(num_layers=4, num_blocks=32), adapter)
    with ServerProcess(l1_bytes=32 << 20, chunk_size=64) as server:
        try:
            driver.start(RuntimeSettings(server.address, layers_per_slice=1, record_path=str(tmp_path / "r.jsonl")))
            prompt = list(range(1, 129))
            blocks = driver.allocate(len(prompt))
            driver.prefill(prompt, blocks)
            driver.store("s", prompt, blocks)
            assert driver.load("bad", prompt, [[31, 32, 33, 34, 35, 36, 37, 38]]) == 128  # block 32 does not exist
            for _ in range(2000):
                failed = driver.poll().failed_blocks
                if failed:
                    break
                driver.runtime.transfers.wait_all(0.01)
            assert failed == {31, 32, 33, 34, 35, 36, 37, 38}
        finally:
            driver.close()
    assert calls["event_backend"] == ["cpu"]
    assert set(calls["loadable_tokens"]) == {128}  # asked on every lookup call, answered or not
    assert "s" in calls["request_id"] and "bad" in calls["request_id"]
    assert [rid for rid, _ in calls["report_load_failure"]] == ["bad"]
    assert "block" in calls["report_load_failure"][0][1]
