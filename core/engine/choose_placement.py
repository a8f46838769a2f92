"""Which placement copies an engine's cache, decided once at registration, and the one factory that builds it.

:func:`choose_placement` reads the deployer's ``placement`` setting and the adapter's description hooks:
``auto`` picks engine placement for a GPU cache (the engine's own copies, which its compute does not
time-slice the way a server process's kernels are: ``benchmarks/ttft.py``), server placement for a CPU cache
the server can open, engine placement otherwise. :func:`make_placement` is the only place that maps a
placement's name to its class; nothing else in the runtime asks which placement it has.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.adapter_api.types import KVCacheDescription, NotSupported
from kvstrata.core.arrival.events import EventBackend
from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.placement import Placement
from kvstrata.core.engine.server_placement import ServerPlacement
from kvstrata.core.engine.settings import PLACEMENT_AUTO, RuntimeSettings
from kvstrata.core.transfer.layouts import PLACEMENT_ENGINE, PLACEMENT_SERVER, PagedKVLayout
from kvstrata.core.transfer.planner import SliceObserver
from kvstrata.core.wire.client import CacheClient

log = logging.getLogger(__name__)

PLACEMENTS: dict[str, type[Placement]] = {PLACEMENT_SERVER: ServerPlacement, PLACEMENT_ENGINE: EnginePlacement}


def choose_placement(adapter: Adapter, wanted: str, kv_caches: Any) -> tuple[str, KVCacheDescription]:
    """The placement for this cache and the adapter's description of the cache for it.

    ``wanted``: the deployer's setting (``auto``, or a placement the adapter must support)."""
    supported = adapter.info.placements
    if wanted != PLACEMENT_AUTO:
        if wanted not in supported:
            raise ValueError(f"placement {wanted!r}: adapter {adapter.name!r} supports {supported}")
        return wanted, adapter.describe_kv_cache(kv_caches, wanted)
    reasons = []
    if PLACEMENT_ENGINE in supported:
        # A GPU cache: the engine's own copies, which its compute does not time-slice the way a server
        # process's kernels are (benchmarks/ttft.py). A CPU cache: the server's copies, if it can open it.
        try:
            described = adapter.describe_kv_cache(kv_caches, PLACEMENT_ENGINE)
        except NotSupported as exc:
            reasons.append(f"{PLACEMENT_ENGINE}: {exc}")
        else:
            if described.device.startswith("cuda"):
                log.info("kvstrata placement %s (placement auto: a %s cache is loaded and stored by this "
                         "process's own copies)", PLACEMENT_ENGINE, described.device)
                return PLACEMENT_ENGINE, described
    for placement in (PLACEMENT_SERVER, PLACEMENT_ENGINE):
        if placement not in supported:
            continue
        try:
            described = adapter.describe_kv_cache(kv_caches, placement)
        except NotSupported as exc:
            if not any(r.startswith(f"{placement}:") for r in reasons):
                reasons.append(f"{placement}: {exc}")
            continue
        if reasons:
            log.info("kvstrata placement %s (placement auto; %s)", placement, "; ".join(reasons))
        return placement, described
    raise NotSupported(f"adapter {adapter.name!r} cannot describe this cache for any placement: "
                       + "; ".join(reasons))


def make_placement(name: str, client: CacheClient, instance_id: int, layout: PagedKVLayout, *,
                   event_backend: EventBackend | None = None, local_regions: Sequence[torch.Tensor] | None = None,
                   registration_layout: PagedKVLayout | None = None, own_registration_area: bool = False,
                   setup_timeout: float | None = None, pool_slots: int = RuntimeSettings.pool_slots,
                   release_after_layers: int = 1,
                   layer_wait_timeout: float = RuntimeSettings.layer_wait_timeout,
                   retrieve_timeout: float = RuntimeSettings.retrieve_timeout,
                   pool_writable: bool = False,
                   slice_observer: SliceObserver | None = None, pace_loads: bool = False) -> Placement:
    """The placement called ``name`` for one registered cache (not registered yet: call its ``register``).

    Each option goes to the placement it concerns and the other ignores it: ``pool_slots`` (arrival slots) to
    server placement; ``local_regions``, ``own_registration_area``, ``setup_timeout``,
    ``pool_writable``, ``slice_observer`` and ``pace_loads`` to engine
    placement (see :class:`ServerPlacement` and :class:`EnginePlacement`)."""
    cls = PLACEMENTS.get(name)
    if cls is None:
        raise ValueError(f"placement must be one of {', '.join(map(repr, PLACEMENTS))}, got {name!r}")
    common = dict(event_backend=event_backend, release_after_layers=release_after_layers,
                  layer_wait_timeout=layer_wait_timeout, retrieve_timeout=retrieve_timeout,
                  registration_layout=registration_layout)
    if cls is ServerPlacement:
        return ServerPlacement(client, instance_id, layout, pool_slots=pool_slots, **common)
    return EnginePlacement(client, instance_id, layout, local_regions=local_regions,
                           own_registration_area=own_registration_area, setup_timeout=setup_timeout,
                           pool_writable=pool_writable, slice_observer=slice_observer, pace_loads=pace_loads,
                           **common)
