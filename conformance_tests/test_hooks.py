"""Rule "hooks" and "kv-layout": the adapter plugs in as the hook specification declares."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest

from kvstrata.core.adapter_api import hookspecs
from kvstrata.core.adapter_api.types import ConformanceDriver, HarnessSpec
from kvstrata.core.transfer.layouts import DTYPE_SIZES
from kvstrata.core.adapter_api.plugins import (
    Adapter,
    EnginePackageMissing,
    HookSignatureError,
    MissingHookError,
    load_adapter,
)

from .rules import broken, require


def test_adapter_loads_with_every_required_hook(adapter_spec: str, adapter_explicit: bool) -> None:
    problem = None
    try:
        adapter = load_adapter(adapter_spec)
    except EnginePackageMissing as exc:
        if adapter_explicit:
            raise
        pytest.skip(str(exc))
    except (MissingHookError, HookSignatureError) as exc:
        problem = str(exc)
    if problem is not None:
        broken("hooks", problem)
    missing = [h for h in hookspecs.REQUIRED_HOOKS if h not in adapter.implementations()]
    require(not missing, "hooks", f"adapter {adapter.name!r} does not implement {missing}")


def test_hook_implementations_match_their_specifications(adapter: Adapter) -> None:
    for hook_name, impls in adapter.implementations().items():
        spec = getattr(adapter.pm.hook, hook_name).spec
        require(spec is not None, "hooks", f"{hook_name} is not a kvstrata hook (typo, or another version's hook?)")
        for impl in impls:
            extra = [a for a in impl.argnames if a not in spec.argnames]
            require(not extra, "hooks",
                    f"{hook_name} implementation takes {extra}, which the specification "
                    f"({', '.join(spec.argnames)}) does not pass")
            require(not impl.hookwrapper and not impl.wrapper, "hooks",
                    f"{hook_name} is implemented as a wrapper; an adapter implements hooks, it does not wrap them")
    source = adapter.source
    if source.origin.startswith("entry point"):
        require(adapter.info.name == source.name, "hooks",
                f"kvstrata_adapter_info names the adapter {adapter.info.name!r} but its entry point is "
                f"{source.name!r}; users select adapters by the entry-point name")


def _protocol_methods() -> dict[str, inspect.Signature]:
    out = {}
    for name, member in vars(ConformanceDriver).items():
        if callable(member) and not name.startswith("_"):
            out[name] = inspect.signature(member)
    return out


def test_conformance_driver_has_the_declared_methods(driver_factory: Callable[[HarnessSpec], Any]) -> None:
    driver = driver_factory(HarnessSpec(num_blocks=64))
    try:
        for attr in ("placement", "runtime"):
            require(hasattr(driver, attr), "hooks", f"the conformance driver has no {attr!r} attribute")
        for name, declared in _protocol_methods().items():
            method = getattr(driver, name, None)
            require(callable(method), "hooks", f"the conformance driver has no method {name}{declared}")
            want = [p.name for p in declared.parameters.values() if p.name != "self"]
            got = [p.name for p in inspect.signature(method).parameters.values()
                   if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            require(got == want, "hooks",
                    f"the conformance driver's {name} takes ({', '.join(got)}), the protocol declares "
                    f"({', '.join(want)}): the suite passes them in that order")
    finally:
        driver.close()


def test_kv_layout_describes_the_engine_and_registers(rig) -> None:
    layout, spec = rig.layout, rig.spec
    require(layout.block_size == spec.block_size, "kv-layout",
            f"block_size {layout.block_size}, the engine has {spec.block_size}")
    # Per-token formats describe kv, heads and head bytes one to one. Formats whose pages have no
    # per-token byte ranges (vLLM's CPU cache stores K transposed) move whole pages as opaque rows
    # and say so with dtype "uint8"; either way a token of a layer must span exactly the engine's bytes.
    want = spec.kv_size * spec.num_heads * spec.head_size * DTYPE_SIZES[spec.dtype]
    have = layout.kv_size * layout.num_heads * layout.head_bytes
    require(have == want, "kv-layout", f"the layout gives a token {have} bytes per layer "
                                       f"(kv {layout.kv_size} x heads {layout.num_heads} x {layout.head_bytes} B), "
                                       f"the engine's {spec.num_heads} heads of {spec.head_size} {spec.dtype} "
                                       f"in {spec.kv_size} planes hold {want}")
    if layout.dtype != "uint8":
        require(layout.kv_size == spec.kv_size, "kv-layout", f"kv_size {layout.kv_size}, the engine has {spec.kv_size}")
        require(layout.num_heads == spec.num_heads, "kv-layout",
                f"num_heads {layout.num_heads}, the engine has {spec.num_heads}")
        require(layout.dtype == spec.dtype, "kv-layout", f"dtype {layout.dtype}, the engine has {spec.dtype}")
    # Registration already happened on a real server (rig.start); it answered with its chunk size.
    require(rig.runtime.transfers.chunk_size == rig.chunk_size, "kv-layout",
            f"the engine side did not record the server's chunk size after REGISTER_KV_CACHE "
            f"({rig.runtime.transfers.chunk_size})")
