"""Adapters that each break exactly one conformance rule, the way real adapters have broken it.

Each is the reference adapter with one hook or one engine-facing call changed,
loaded by module path, its driver named beside it
(``--adapter kvstrata_testing.conformance_selftest.broken_adapters:NoLayerWait
--driver kvstrata_testing.conformance_selftest.broken_adapters:NoLayerWait=kvstrata_testing.conformance_selftest.broken_adapters:NoLayerWait.conformance_driver``,
see :func:`driver_option`).
``BROKEN_RULES`` says which rule each breaks and which tests show it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from kvstrata.adapters import reference
from kvstrata.adapters.reference import conformance as reference_driver
from kvstrata.core.adapter_api.hookspecs import hookimpl
from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.adapter_api.types import AdapterInfo, DriverPoll, HarnessSpec, KVCacheDescription
from kvstrata.core.engine.settings import RuntimeSettings


class _ReferenceBased:
    """The reference adapter's hooks as methods, so a subclass can break one of them or its driver."""

    name = "broken"
    driver_class: type = reference_driver.ReferenceConformanceDriver

    @hookimpl
    def kvstrata_adapter_info(self) -> AdapterInfo:
        return AdapterInfo(name=self.name, engine="kvstrata reference engine (deliberately broken)")

    @hookimpl
    def kvstrata_describe_kv_cache(self, kv_caches: Any, placement: str) -> KVCacheDescription:
        return reference.kvstrata_describe_kv_cache(kv_caches, placement)

    @classmethod
    def conformance_driver(cls, spec: HarnessSpec, adapter: Adapter) -> Any:
        """The driver factory the self-test names with ``--driver SPEC=MODULE:<class>.conformance_driver``."""
        return cls.driver_class(spec, adapter=adapter)


# --- rule "retrieve-payload" --------------------------------------------------------------


class _DropsWidth(reference_driver.ReferenceConformanceDriver):
    def start(self, settings: RuntimeSettings) -> None:
        super().start(dataclasses.replace(settings, layers_per_slice=0))


class WidthDropped(_ReferenceBased):
    """Reads the deployer's settings but never passes the slice width on: every load goes out chunk-major."""

    driver_class = _DropsWidth


# --- rule "early-release" -----------------------------------------------------------------


class _ReleasesOnCompletion(reference_driver.ReferenceConformanceDriver):
    def __init__(self, spec: HarnessSpec, adapter: Any = None) -> None:
        super().__init__(spec, adapter=adapter)
        self._pending: set[str] = set()

    def poll(self) -> DriverPoll:
        p = super().poll()
        self._pending.update(p.released)
        done = sorted(r for r in self._pending if r not in self.runtime.in_flight())
        self._pending.difference_update(done)
        return DriverPoll(done, p.failed_blocks)


class ReleasesOnCompletion(_ReferenceBased):
    """Hands a request back only once its whole transfer has finished: the per-layer machinery is inert."""

    driver_class = _ReleasesOnCompletion


# --- rule "layer-wait" --------------------------------------------------------------------


class _NoLayerWait(reference_driver.ReferenceConformanceDriver):
    def wait_for_layer(self, layer: int) -> None:
        return None


class NoLayerWait(_ReferenceBased):
    """Never waits before a layer is read: with early release the engine reads KV still in flight."""

    driver_class = _NoLayerWait


# --- rule "failure-reported" --------------------------------------------------------------


class _SwallowsFailures(reference_driver.ReferenceConformanceDriver):
    def poll(self) -> DriverPoll:
        return DriverPoll(super().poll().released, set())


class SwallowsFailures(_ReferenceBased):
    """Takes the runtime's failure reports and tells the engine nothing."""

    driver_class = _SwallowsFailures


# --- rule "fallback" ----------------------------------------------------------------------


class _IgnoresPoolSlots(reference_driver.ReferenceConformanceDriver):
    def start(self, settings: RuntimeSettings) -> None:
        super().start(dataclasses.replace(settings, pool_slots=16))


class IgnoresPoolSlots(_ReferenceBased):
    """Builds its runtime with a pool size of its own: a retrieve that should find the pool empty does not."""

    driver_class = _IgnoresPoolSlots


# --- rule "kv-layout" ---------------------------------------------------------------------


class LayoutWrongBlockSize(_ReferenceBased):
    """Describes the cache with twice its block size (read from the wrong dimension)."""

    @hookimpl
    def kvstrata_describe_kv_cache(self, kv_caches: Any, placement: str) -> KVCacheDescription:
        described = reference.kvstrata_describe_kv_cache(kv_caches, placement)
        layout = dataclasses.replace(described.layout, block_size=described.layout.block_size * 2)
        return dataclasses.replace(described, layout=layout)


# --- rule "hooks" -------------------------------------------------------------------------


class MissingDescribeHook(_ReferenceBased):
    """Forgot to mark the cache description with @hookimpl, so pluggy never sees it."""

    def kvstrata_describe_kv_cache(self, kv_caches: Any, placement: str) -> KVCacheDescription:  # no @hookimpl
        return reference.kvstrata_describe_kv_cache(kv_caches, placement)


class WrongDescribeSignature(_ReferenceBased):
    """Names the second argument ``where`` where the specification passes ``placement``."""

    @hookimpl
    def kvstrata_describe_kv_cache(self, kv_caches: Any, where: str) -> KVCacheDescription:  # type: ignore[override]
        return reference.kvstrata_describe_kv_cache(kv_caches, where)


class _SwappedReadLayer(reference_driver.ReferenceConformanceDriver):
    def read_layer(self, layer: int, block_ids: Sequence[Sequence[int]], num_tokens: int) -> bytes:  # type: ignore[override]
        return super().read_layer(block_ids, layer, num_tokens)


class SwappedReadLayerArguments(_ReferenceBased):
    """The driver's read_layer takes (layer, block_ids): the same count as declared, in the wrong order."""

    driver_class = _SwappedReadLayer


MODULE = __name__


def adapter_spec(name: str) -> str:
    """The ``--adapter`` value that loads broken adapter ``name``."""
    return f"{MODULE}:{name}"


def driver_option(name: str) -> str:
    """The ``--driver`` value that gives broken adapter ``name`` its driver."""
    return f"{adapter_spec(name)}={MODULE}:{name}.conformance_driver"

BROKEN_RULES: dict[str, tuple[str, str]] = {
    # adapter class: (rule it breaks, pytest -k expression selecting the tests that show it)
    "WidthDropped": ("retrieve-payload", "on_the_wire and layer"),
    "ReleasesOnCompletion": ("early-release", "released_on_first_slice"),
    "NoLayerWait": ("layer-wait", "released_on_first_slice"),
    "SwallowsFailures": ("failure-reported", "killed_mid_transfer"),
    "IgnoresPoolSlots": ("fallback", "exhausted"),
    "LayoutWrongBlockSize": ("kv-layout", "kv_layout"),
    "MissingDescribeHook": ("hooks", "loads"),
    "WrongDescribeSignature": ("hooks", "loads"),
    "SwappedReadLayerArguments": ("hooks", "declared_methods"),
}
