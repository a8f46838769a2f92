"""The connector's settings, read from ``kv_connector_extra_config``.

Kept free of vLLM imports so that the classmethod vLLM calls before any worker
exists (``requires_piecewise_for_cudagraph``) and the tests can read them alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvstrata.core.config import resolve_layers_per_stage

log = logging.getLogger(__name__)

OVERLAP_KEYS = ("layers_per_stage", "layerwise_overlap")


@dataclass(frozen=True)
class ConnectorSettings:
    server_address: str
    layers_per_stage: int
    """0: chunk-major, request released when its transfer completes. N > 0: N layers per
    slice, request released when its first slice lands. Also decides the CUDA graph mode."""
    model_name: str | None
    lookup_timeout: float
    layer_wait_timeout: float
    retrieve_timeout: float
    store: bool
    pool_slots: int
    instance_id: int
    record_path: str | None
    """If set, a JSON-lines record of releases and per-layer waits (observability, tests)."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        overlap = None
        for k in OVERLAP_KEYS:
            if k in extra:
                overlap = extra[k]
                break
        address = extra.get("server_address")
        if not address:
            from kvstrata.core.wire.transport import default_address

            address = default_address()
        return cls(
            server_address=str(address),
            layers_per_stage=resolve_layers_per_stage(overlap, setting="kv_connector_extra_config.layers_per_stage"),
            model_name=extra.get("model_name"),
            lookup_timeout=float(extra.get("lookup_timeout", 2.0)),
            layer_wait_timeout=float(extra.get("layer_wait_timeout", 10.0)),
            retrieve_timeout=float(extra.get("retrieve_timeout", 60.0)),
            store=bool(extra.get("store", True)),
            pool_slots=int(extra.get("pool_slots", 16)),
            instance_id=int(extra.get("instance_id", 0)),
            record_path=extra.get("record_path"),
        )


def requires_piecewise(extra: dict[str, Any] | None) -> bool:
    """True exactly when overlap is on: a FULL CUDA graph replay would skip the per-layer wait."""
    extra = extra or {}
    value = next((extra[k] for k in OVERLAP_KEYS if k in extra), None)
    return resolve_layers_per_stage(value, setting="kv_connector_extra_config.layers_per_stage") > 0
