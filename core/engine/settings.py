"""The engine runtime's settings, read the same way for every engine."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping

from kvstrata.core.engine.slice_width import AUTO
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE

log = logging.getLogger(__name__)

MAX_LAYERS_PER_SLICE = 1 << 16


def resolve_layers_per_slice(value: Any, *, setting: str = "layers_per_slice") -> int:
    """The slice width a deployer asked for: 0 = off (chunk-major), N > 0 = N layers per slice, ``auto``
    (:data:`~kvstrata.core.engine.slice_width.AUTO`) = chosen per load (:mod:`kvstrata.core.engine.slice_width`).

    Accepts what a deployer plausibly writes in JSON or a CLI: an int, a bool
    (true = one layer per slice) or a decimal string ("8", " 2 ", "true",
    "false"). Anything else (negative, float, "eight", a list) logs a warning
    and reads as off: a typo must not stop an engine from starting.

    This one value drives both the width sent with every RETRIEVE and the CUDA
    graph declaration, so the two can never disagree.
    """
    if value is None:
        return 0
    if isinstance(value, bool):
        return 1 if value else 0
    if isinstance(value, int):
        width = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "yes", "on"):
            return 1
        if text in ("false", "no", "off", ""):
            return 0
        if text == "auto":
            return AUTO
        if not text.isdigit():
            log.warning("%s=%r is not an int, bool, \"auto\" or decimal string; layer-major overlap stays off", setting,
                        value)
            return 0
        width = int(text)
    else:
        log.warning("%s=%r (%s) is not an int, bool or decimal string; layer-major overlap stays off",
                    setting, value, type(value).__name__)
        return 0
    if width < 0 or width > MAX_LAYERS_PER_SLICE:
        log.warning("%s=%r is out of range [0, %d]; layer-major overlap stays off", setting, value,
                    MAX_LAYERS_PER_SLICE)
        return 0
    return width


PLACEMENT_AUTO = "auto"

ENGINE_INSTANCE_BASE = 1 << 20
"""Instance ids derived from an engine's identity (:func:`engine_instance_id`) start here, above the small ids
deployers and tests choose by hand."""
ENGINE_INSTANCE_STRIDE = 1 << 8
"""Derived instance ids are multiples of this apart: room for that many tensor-parallel ranks (``id + rank``)."""
ENGINE_INSTANCE_SLOTS = ((1 << 31) - ENGINE_INSTANCE_BASE) // ENGINE_INSTANCE_STRIDE
"""How many derived instance ids there are (all below 2**31): two engines share one with odds 1 in this."""


def engine_instance_id(engine_key: str) -> int:
    """The instance id of an engine that did not configure one, from a string unique to that engine which all
    of its processes see (vLLM: ``kv_transfer_config.engine_id``): its scheduler and every worker agree on
    it (their lock owners embed it), while two engines on one server get different ones. Non-negative, at
    least :data:`ENGINE_INSTANCE_BASE`, with :data:`ENGINE_INSTANCE_STRIDE` ids of room for ``+ rank``."""
    digest = hashlib.sha256(engine_key.encode("utf-8", "surrogatepass")).digest()
    slot = int.from_bytes(digest[:8], "big") % ENGINE_INSTANCE_SLOTS
    return ENGINE_INSTANCE_BASE + slot * ENGINE_INSTANCE_STRIDE


@dataclass(frozen=True)
class RuntimeSettings:
    """What a deployer sets for an engine's kvstrata runtime, read the same way for every engine.

    Engines hand these over in their own config (vLLM's ``kv_connector_extra_config``, SGLang's
    ``linker_extra_config``); :meth:`from_mapping` reads any of them and names the engine's setting
    in every error, so a typo is reported where the deployer wrote it.
    """

    server_address: str
    layers_per_slice: int = 0
    """The slice width: 0 = chunk-major (a request goes back when its transfer completes), N > 0 = N
    layers per slice (a request goes back when its first slice has landed), ``auto`` (:data:`AUTO`) = chosen
    per load from what this process measured (:mod:`kvstrata.core.engine.slice_width`). Off unless set, so
    turning kvstrata on never changes an engine's CUDA graph mode by itself."""
    placement: str = PLACEMENT_AUTO
    """Who runs the copies: ``server`` (the server writes the engine's cache: shared memory or CUDA
    IPC), ``engine`` (this process copies between its cache and the server's L1 pool) or ``auto``:
    engine placement for a GPU cache (faster under the engine's compute, see benchmarks/ttft.py), server
    placement for a CPU cache the server can open, engine placement otherwise."""
    pace_loads: bool = False
    """Engine placement: start a load's copies only once the engine has seen the load before it complete (at
    its poll), as chunk-major served one request after another does. Concurrent requests then go back about
    one per engine step instead of together into one large step; the copy engine idles while the engine's
    thread is busy in its step. Off: each load starts as soon as the copies ahead of it are nearly done."""
    model_name: str | None = None
    lookup_timeout: float = 2.0
    layer_wait_timeout: float = 10.0
    retrieve_timeout: float = 60.0
    store: bool = True
    pool_slots: int = 16
    instance_id: int = 0
    """The cache's id on the server; tensor-parallel rank r registers ``instance_id + r``. Two engines on one
    server need different ones: an engine adapter that knows a string unique to its engine derives it from that
    unless it is set (:meth:`from_mapping`'s ``engine_key``, :func:`engine_instance_id`); 0 otherwise."""
    record_path: str | None = None
    """A JSON-lines record of loads, releases, per-layer waits, failures and stores (operators, tests)."""
    curve_server_key: str | None = None
    """The server's public key file (``NAME.key``), to connect with CURVE: a server on tcp:// requires it,
    with ``curve_client_key`` (see :mod:`kvstrata.core.wire.curve`)."""
    curve_client_key: str | None = None
    """This engine's secret key file (``NAME.key_secret``, mode 0600), whose public key the server authorizes."""

    FIELDS: ClassVar[tuple[str, ...]] = ()
    """Every setting's name, in declaration order (filled from the fields below the class)."""
    ALIASES = {"layers_per_stage": "layers_per_slice", "layerwise_overlap": "layers_per_slice"}
    """Old setting names that still work, each with a deprecation warning naming the new one."""
    RETIRED = {"transfer_queue_policy": "concurrent loads' slices go one load after another (round-robin order "
                                        "was slower, see docs/decisions.md)"}
    """Settings that no longer exist: accepted with a warning saying why, so an old config still starts."""

    @classmethod
    def from_mapping(cls, extra: Mapping[str, Any] | None, *, where: str = "extra config",
                     engine_key: str | None = None) -> "RuntimeSettings":
        """Settings from an engine's JSON config; an unknown key or a bad value raises ValueError naming it.

        ``engine_key``: a string unique to this engine that all its processes see (vLLM's
        ``kv_transfer_config.engine_id``); without an ``instance_id`` in the config, the instance id is
        :func:`engine_instance_id` of it. A configured ``instance_id`` is kept.
        """
        values = dict(extra or {})
        for alias, name in cls.ALIASES.items():
            if alias in values:
                if name in values:
                    raise ValueError(f"{where}: give {name!r} or its alias {alias!r}, not both")
                log.warning("%s.%s is deprecated: it is now called %s", where, alias, name)
                values[name] = values.pop(alias)
        for name, why in cls.RETIRED.items():
            if name in values:
                log.warning("%s.%s=%r is no longer a setting and is ignored: %s", where, name, values.pop(name), why)
        unknown = sorted(set(values) - set(cls.FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown kvstrata setting(s) {unknown}; known: {', '.join(cls.FIELDS)}")
        if not values.get("server_address"):
            from kvstrata.core.wire.transport import default_address

            values["server_address"] = default_address()
        values["layers_per_slice"] = resolve_layers_per_slice(values.get("layers_per_slice"),
                                                              setting=f"{where}.layers_per_slice")
        placement = values.get("placement", PLACEMENT_AUTO)
        if placement == "worker":
            log.warning("%s.placement='worker' is deprecated: it is now called %r", where, PLACEMENT_ENGINE)
            placement = values["placement"] = PLACEMENT_ENGINE
        if placement not in (PLACEMENT_AUTO, PLACEMENT_SERVER, PLACEMENT_ENGINE):
            raise ValueError(f"{where}.placement must be {PLACEMENT_AUTO!r}, {PLACEMENT_SERVER!r} or "
                             f"{PLACEMENT_ENGINE!r}, got {placement!r}")
        try:
            for name in ("lookup_timeout", "layer_wait_timeout", "retrieve_timeout"):
                if name in values:
                    values[name] = float(values[name])
                    if values[name] <= 0:
                        raise ValueError(f"must be positive, got {values[name]}")
            for name in ("pool_slots", "instance_id"):
                if name in values:
                    if isinstance(values[name], bool) or int(values[name]) != values[name]:
                        raise ValueError(f"must be an integer, got {values[name]!r}")
                    values[name] = int(values[name])
            if values.get("instance_id", 0) < 0:
                name = "instance_id"
                raise ValueError(f"must be >= 0, got {values[name]}")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}.{name}: {exc}") from None
        for name in ("store", "pace_loads"):
            if name in values and not isinstance(values[name], bool):
                raise ValueError(f"{where}.{name} must be true or false, got {values[name]!r}")
        for name in ("curve_server_key", "curve_client_key"):
            if values.get(name) is not None and (not isinstance(values[name], str) or not values[name]):
                raise ValueError(f"{where}.{name} must be a key file's path, got {values[name]!r}")
        if bool(values.get("curve_server_key")) != bool(values.get("curve_client_key")):
            raise ValueError(f"{where}: CURVE needs both curve_server_key (the server's NAME.key) and "
                             "curve_client_key (this engine's NAME.key_secret)")
        if "instance_id" not in values and engine_key:
            values["instance_id"] = engine_instance_id(engine_key)
        return cls(**values)

    def client_options(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~kvstrata.core.wire.client.CacheClient` these settings give (CURVE)."""
        return {"curve_server_key": self.curve_server_key, "curve_client_key": self.curve_client_key}


RuntimeSettings.FIELDS = tuple(f.name for f in fields(RuntimeSettings))
