"""Where the suite finds an adapter's conformance driver: its own entry-point group, read by nothing else.

A conformance driver builds an adapter's engine-facing classes over a real cache, for the suite to drive
(:class:`~kvstrata.core.adapter_api.types.ConformanceDriver`). It is test support, so it is not an adapter
hook: an engine loading the adapter never imports it. An adapter's package publishes it under the adapter's
own entry-point name, in the group :data:`DRIVER_GROUP`, as ``module:factory``::

    [project.entry-points."kvstrata.adapters"]
    myengine = "myengine_kvstrata.adapter"

    [project.entry-points."kvstrata.conformance_drivers"]
    myengine = "myengine_kvstrata.conformance:MyEngineDriver"

``factory(spec, adapter)`` gets the :class:`~kvstrata.core.adapter_api.types.HarnessSpec` to build and the
suite's loaded :class:`~kvstrata.core.adapter_api.plugins.Adapter`, and returns the driver (or raises
``NotSupported`` for a spec its engine cannot build). The driver's module may import the adapter; the adapter
never imports it.

An adapter given by module path (not installed yet) names its driver on the command line:
``--driver ADAPTER=module:factory`` (repeatable), or ``KVSTRATA_CONFORMANCE_DRIVER`` (comma-separated).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any, Callable

from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.adapter_api.types import HarnessSpec

DRIVER_GROUP = "kvstrata.conformance_drivers"
"""The entry-point group conformance drivers publish themselves in (name: the adapter's entry-point name)."""
ENV_VAR = "KVSTRATA_CONFORMANCE_DRIVER"

DriverFactory = Callable[[HarnessSpec, Adapter], Any]


class DriverNotFound(LookupError):
    """No conformance driver is registered for the adapter; the message says how to register one."""


@dataclass(frozen=True)
class DriverSource:
    adapter: str
    """The adapter spec (entry-point name or module path) this driver drives."""
    target: str
    """``module:factory`` (the factory may be a dotted attribute path)."""
    origin: str

    def load(self) -> DriverFactory:
        module_name, _, attr = self.target.partition(":")
        if not attr:
            raise DriverNotFound(f"conformance driver for adapter {self.adapter!r} ({self.origin}): "
                                 f"{self.target!r} is not module:factory")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise DriverNotFound(f"conformance driver for adapter {self.adapter!r} ({self.origin}): {self.target!r} "
                                 "is not callable")
        return obj


def parse_given(values: list[str]) -> dict[str, DriverSource]:
    """``ADAPTER=module:factory`` items (each value may hold several, comma-separated) -> sources by adapter."""
    out: dict[str, DriverSource] = {}
    for value in values:
        for item in filter(None, (v.strip() for v in value.split(","))):
            adapter, sep, target = item.partition("=")
            if not sep or not adapter.strip() or not target.strip():
                raise ValueError(f"--driver / ${ENV_VAR} takes ADAPTER=module:factory, got {item!r}")
            out[adapter.strip()] = DriverSource(adapter.strip(), target.strip(), "given on the command line")
    return out


def installed() -> dict[str, DriverSource]:
    """Every conformance driver installed in this environment, by adapter name (imports nothing)."""
    found: dict[str, DriverSource] = {}
    for ep in importlib.metadata.entry_points(group=DRIVER_GROUP):
        dist = getattr(ep, "dist", None)
        where = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an unknown distribution"
        found.setdefault(ep.name, DriverSource(ep.name, ep.value.strip(),
                                               f"entry point {ep.name!r} in group {DRIVER_GROUP} of {where}"))
    return found


def find(adapter_spec: str, given: list[str] | None = None) -> DriverSource:
    """The driver for the adapter selected as ``adapter_spec``: one given explicitly, else the installed one."""
    explicit = parse_given(list(given or []) + [os.environ.get(ENV_VAR, "")])
    if adapter_spec in explicit:
        return explicit[adapter_spec]
    published = installed()
    if adapter_spec in published:
        return published[adapter_spec]
    raise DriverNotFound(
        f"adapter {adapter_spec!r} has no conformance driver: publish one in entry-point group {DRIVER_GROUP} under "
        f"the adapter's entry-point name (name = \"module:factory\"), or name it with "
        f"--driver {adapter_spec}=module:factory (installed drivers: {', '.join(sorted(published)) or 'none'})")


def make_driver(source: DriverSource, adapter: Adapter) -> Callable[[HarnessSpec], Any]:
    """A builder of drivers for ``adapter`` from ``source`` (the factory is imported here, once)."""
    factory = source.load()

    def build(spec: HarnessSpec) -> Any:
        driver = factory(spec, adapter)
        if driver is None:
            raise DriverNotFound(f"conformance driver {source.target!r} for adapter {source.adapter!r} returned None")
        return driver

    return build
