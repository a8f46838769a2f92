"""Find, load and validate engine adapters: the pluggy plugin manager behind kvstrata's adapter registry.

An adapter is found either by its name in the ``kvstrata.adapters`` entry-point
group (``load_adapter("vllm")``: how installed adapters, ours and third
parties', are discovered) or by a module path (``load_adapter("pkg.mod")`` or
``load_adapter("pkg.mod:Plugin")``: for an adapter under development that is
not installed as a distribution yet).

Each loaded adapter gets its own :class:`pluggy.PluginManager`, so the
``firstresult`` hooks answer from that adapter alone however many adapters are
installed. Loading validates, and every failure names the adapter and what is
wrong:

* the hook implementations' signatures, by pluggy (an argument the
  specification does not have) -> :class:`HookSignatureError`;
* a function marked ``@hookimpl`` that matches no specification (a typo) ->
  :class:`HookSignatureError`;
* a required hook that is not implemented, or implemented but not marked ->
  :class:`MissingHookError`;
* the engine package the adapter declares is not importable ->
  :class:`EnginePackageMissing`, naming the package and the pip extra.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any

import pluggy

from kvstrata.core.adapter_api import hookspecs
from kvstrata.core.adapter_api.defaults import CoreDefaults
from kvstrata.core.adapter_api.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, REQUIRED_HOOKS
from kvstrata.core.adapter_api.types import AdapterInfo, KVCacheDescription
from kvstrata.core.arrival.events import EventBackend
from kvstrata.core.transfer.layouts import PagedKVLayout

log = logging.getLogger(__name__)


class AdapterError(RuntimeError):
    """An adapter could not be found, loaded or validated; the message says which and why."""


class AdapterNotFound(AdapterError):
    """No adapter of that name is installed, and it is not an importable module path."""


class AdapterImportError(AdapterError):
    """The adapter's module could not be imported."""


class HookSignatureError(AdapterError):
    """A hook implementation does not match its specification, or matches none."""


class MissingHookError(AdapterError):
    """A required hook is not implemented."""


class EnginePackageMissing(AdapterError):
    """The engine package the adapter drives is not installed."""


class HookResultError(AdapterError):
    """A hook returned something of the wrong kind."""


@dataclass(frozen=True)
class AdapterSource:
    """Where an adapter comes from: an entry point or a module path given directly."""

    name: str
    target: str
    """``module`` or ``module:attribute``."""
    origin: str
    """Human-readable: which entry point of which distribution, or "module path"."""
    extras: tuple[str, ...] = ()

    def load_object(self) -> Any:
        module_name, _, attr = self.target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or "?"
            own = module_name == missing or module_name.startswith(missing + ".")
            if own:
                raise AdapterImportError(
                    f"adapter {self.name!r} ({self.origin}): module {module_name!r} does not exist") from exc
            hint = f"; install it with pip install 'kvstrata[{','.join(self.extras)}]'" if self.extras else ""
            raise AdapterImportError(
                f"adapter {self.name!r} ({self.origin}) could not be imported because module {missing!r} is not "
                f"installed{hint}. (Adapters should import their engine lazily and declare it in "
                f"kvstrata_adapter_info so this is caught by name.)") from exc
        except Exception as exc:
            raise AdapterImportError(
                f"adapter {self.name!r} ({self.origin}): importing {module_name!r} raised "
                f"{type(exc).__name__}: {exc}") from exc
        for part in filter(None, attr.split(".")):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise AdapterImportError(
                    f"adapter {self.name!r} ({self.origin}): {module_name!r} has no attribute {attr!r}") from None
        if inspect.isclass(obj):
            obj = obj()  # a class of hookimpl methods: register an instance
        return obj


def discover() -> dict[str, AdapterSource]:
    """Every adapter installed in this environment, by entry-point name (imports nothing)."""
    found: dict[str, AdapterSource] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        where = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an unknown distribution"
        if ep.name in found:
            log.warning("adapter entry point %r is published twice; using %s, ignoring %s", ep.name,
                        found[ep.name].origin, where)
            continue
        found[ep.name] = AdapterSource(ep.name, ep.value.split("[")[0].strip(),
                                       f"entry point {ep.name!r} in group {ENTRY_POINT_GROUP} of {where}",
                                       tuple(ep.extras))
    return found


def resolve(spec: str) -> AdapterSource:
    """An entry-point name, else a module path (``pkg.mod`` or ``pkg.mod:attr``)."""
    installed = discover()
    if spec in installed:
        return installed[spec]
    module_name = spec.partition(":")[0]
    # A bare name is only ever an entry-point name: "vllm" must not load the engine package itself.
    if (":" in spec or "." in spec) and all(part.isidentifier() for part in module_name.split(".")):
        return AdapterSource(spec, spec, "module path")
    names = ", ".join(sorted(installed)) or "none"
    raise AdapterNotFound(
        f"no adapter named {spec!r}: installed adapters (entry-point group {ENTRY_POINT_GROUP}) are {names}; "
        "give a module path (pkg.module or pkg.module:attribute) to load one that is not installed")


_CORE_PLUGIN_NAME = "kvstrata-core-defaults"


# --- loading --------------------------------------------------------------------------


def new_plugin_manager() -> pluggy.PluginManager:
    """A manager with kvstrata's hook specifications and the core's defaults, and no adapter."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(CoreDefaults(), name=_CORE_PLUGIN_NAME)
    return pm


def load_adapter(spec: str | Any, *, check_engine: bool = True) -> "Adapter":
    """Load and validate one adapter: an entry-point name, a module path, or a plugin object.

    Raises an :class:`AdapterError` subclass naming the adapter and the
    problem. ``check_engine=False`` skips the engine-package check (to list or
    inspect adapters whose engine is not installed).
    """
    if isinstance(spec, str):
        source = resolve(spec)
        plugin = source.load_object()
    else:
        plugin = spec
        label = getattr(plugin, "__name__", None) or type(plugin).__name__
        source = AdapterSource(label, label, "plugin object")
    name = source.name
    pm = new_plugin_manager()
    try:
        pm.register(plugin, name=f"adapter:{name}")
    except pluggy.PluginValidationError as exc:
        raise HookSignatureError(f"adapter {name!r} ({source.origin}): {exc}{_spec_hint(pm, str(exc))}") from None
    except ValueError as exc:
        raise AdapterImportError(f"adapter {name!r} ({source.origin}) could not be registered: {exc}") from exc
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise HookSignatureError(
            f"adapter {name!r} ({source.origin}): {exc} (the hooks are specified in kvstrata.core.adapter_api.hookspecs)") from None
    _check_required(pm, plugin, name, source)
    info = pm.hook.kvstrata_adapter_info()
    if not isinstance(info, AdapterInfo):
        raise HookResultError(f"adapter {name!r}: kvstrata_adapter_info returned {type(info).__name__}, "
                              "expected kvstrata.core.adapter_api.hookspecs.AdapterInfo")
    if check_engine:
        check_engine_package(info, name)
    return Adapter(name=name, info=info, pm=pm, plugin=plugin, source=source)


def _spec_hint(pm: pluggy.PluginManager, message: str) -> str:
    """Name the arguments the specification passes, for a hook named in pluggy's message."""
    for hook_name in dir(pm.hook):
        if hook_name.startswith("kvstrata_") and f"'{hook_name}'" in message:
            spec = getattr(pm.hook, hook_name).spec
            if spec is not None:
                return (f"\n  kvstrata.core.adapter_api.hookspecs.{hook_name} passes ({', '.join(spec.argnames)}); an "
                        "implementation takes any of those, by name, and nothing else")
    return ""


def _check_required(pm: pluggy.PluginManager, plugin: Any, name: str, source: AdapterSource) -> None:
    missing = []
    for hook_name in REQUIRED_HOOKS:
        impls = [i for i in getattr(pm.hook, hook_name).get_hookimpls() if i.plugin is plugin]
        if not impls:
            unmarked = callable(getattr(plugin, hook_name, None))
            missing.append(f"{hook_name} (defined but not marked @hookimpl)" if unmarked else hook_name)
    if missing:
        raise MissingHookError(
            f"adapter {name!r} ({source.origin}) does not implement required hook(s): {', '.join(missing)}. "
            "Every adapter implements kvstrata.core.adapter_api.hookspecs.REQUIRED_HOOKS, each marked with "
            "kvstrata.core.adapter_api.hookspecs.hookimpl")


def check_engine_package(info: AdapterInfo, name: str | None = None) -> None:
    """Raise :class:`EnginePackageMissing` unless the adapter's engine package can be imported."""
    package = info.engine_package
    if not package:
        return
    try:
        found = importlib.util.find_spec(package) is not None
    except (ModuleNotFoundError, ValueError):
        found = False
    if not found:
        raise EnginePackageMissing(
            f"adapter {name or info.name!r} drives {info.engine}, whose package {package!r} (import name) is not "
            f"installed in {sys.prefix}: {info.how_to_install()}")


# --- a loaded adapter -----------------------------------------------------------------


class Adapter:
    """One loaded, validated adapter: typed calls to its hooks, with their results checked."""

    def __init__(self, *, name: str, info: AdapterInfo, pm: pluggy.PluginManager, plugin: Any,
                 source: AdapterSource) -> None:
        self.name = name
        self.info = info
        self.pm = pm
        self.plugin = plugin
        self.source = source

    def __repr__(self) -> str:
        return f"<Adapter {self.name!r} for {self.info.engine} from {self.source.origin}>"

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def implementations(self) -> dict[str, list[pluggy.HookImpl]]:
        """The adapter's own hook implementations (not the core's defaults), by hook name."""
        out: dict[str, list[pluggy.HookImpl]] = {}
        for hook_name in dir(self.pm.hook):
            if not hook_name.startswith("kvstrata_"):
                continue
            impls = [i for i in getattr(self.pm.hook, hook_name).get_hookimpls() if i.plugin is self.plugin]
            if impls:
                out[hook_name] = impls
        return out

    # --- hooks, checked ----------------------------------------------------------------

    def describe_kv_cache(self, kv_caches: Any, placement: str) -> KVCacheDescription:
        described = self.hook.kvstrata_describe_kv_cache(kv_caches=kv_caches, placement=placement)
        if not isinstance(described, KVCacheDescription) or not isinstance(described.layout, PagedKVLayout):
            raise HookResultError(f"adapter {self.name!r}: kvstrata_describe_kv_cache returned "
                                  f"{type(described).__name__}, expected a "
                                  "kvstrata.core.adapter_api.types.KVCacheDescription")
        return described

    def event_backend(self, device: str) -> EventBackend:
        backend = self.hook.kvstrata_event_backend(device=device)
        if not all(callable(getattr(backend, m, None)) for m in ("create_layer_events", "export", "wait")):
            raise HookResultError(f"adapter {self.name!r}: kvstrata_event_backend returned "
                                  f"{type(backend).__name__}, expected a kvstrata.core.arrival.events.EventBackend")
        return backend

    def loadable_tokens(self, num_prompt_tokens: int, block_size: int) -> int:
        n = self.hook.kvstrata_loadable_tokens(num_prompt_tokens=num_prompt_tokens, block_size=block_size)
        if not isinstance(n, int) or n < 0 or n > num_prompt_tokens or n % block_size:
            raise HookResultError(f"adapter {self.name!r}: kvstrata_loadable_tokens({num_prompt_tokens}, "
                                  f"{block_size}) returned {n!r}, expected a multiple of {block_size} in "
                                  f"[0, {num_prompt_tokens}]")
        return n

    def request_id(self, engine_request_id: Any) -> str:
        rid = self.hook.kvstrata_request_id(engine_request_id=engine_request_id)
        if not isinstance(rid, str) or not rid:
            raise HookResultError(f"adapter {self.name!r}: kvstrata_request_id({engine_request_id!r}) returned "
                                  f"{rid!r}, expected a non-empty str")
        return rid

    def report_load_failure(self, engine_request_id: Any, block_ids: list[list[int]], reason: str) -> Any:
        return self.hook.kvstrata_report_load_failure(engine_request_id=engine_request_id, block_ids=block_ids,
                                                      reason=reason)
