"""Adapters that each break exactly one conformance rule, the way real adapters have broken it.

Each is the reference adapter with one hook changed, loaded by module path
(``--adapter kvstrata.conformance_tests.selftest.broken_adapters:NoLayerWait``).
``BROKEN_RULES`` says which rule each breaks and which tests show it.
"""

from __future__ import annotations

from typing import Any

from kvstrata.adapters import reference
from kvstrata.core.adapter_api.hookspecs import AdapterInfo, HarnessSpec, RetrieveRequest, WorkerOptions, hookimpl


class _ReferenceBased:
    """The reference adapter's hooks as methods, so a subclass can break one of them."""

    name = "broken"

    @hookimpl
    def kvstrata_adapter_info(self) -> AdapterInfo:
        return AdapterInfo(name=self.name, engine="kvstrata reference engine (deliberately broken)")

    @hookimpl
    def kvstrata_describe_kv_layout(self, kv_caches: Any, placement: str) -> Any:
        return reference.kvstrata_describe_kv_layout(kv_caches, placement)

    @hookimpl
    def kvstrata_create_worker(self, client: Any, instance_id: int, layout: Any, kv_caches: Any, placement: str,
                               options: WorkerOptions) -> Any:
        return reference.kvstrata_create_worker(client, instance_id, layout, kv_caches, placement, options)

    @hookimpl
    def kvstrata_build_retrieve_payload(self, request: RetrieveRequest) -> list[Any]:
        return reference.kvstrata_build_retrieve_payload(request)

    @hookimpl
    def kvstrata_poll_released(self, worker: Any) -> list[str]:
        return reference.kvstrata_poll_released(worker)

    @hookimpl
    def kvstrata_wait_for_layer(self, worker: Any, layer: int) -> None:
        reference.kvstrata_wait_for_layer(worker, layer)

    @hookimpl
    def kvstrata_take_failed(self, worker: Any) -> dict[str, Any]:
        return reference.kvstrata_take_failed(worker)

    @hookimpl
    def kvstrata_conformance_harness(self, spec: HarnessSpec) -> Any:
        return reference.kvstrata_conformance_harness(spec)


class ShortChunkMajorPayload(_ReferenceBased):
    """Appends the three layer-major fields only when layer-major is on: chunk-major RETRIEVEs have 5 items."""

    @hookimpl
    def kvstrata_build_retrieve_payload(self, request: RetrieveRequest) -> list[Any]:
        payload = reference.kvstrata_build_retrieve_payload(request)
        return payload if request.layers_per_stage else payload[:5]


class WidthDropped(_ReferenceBased):
    """Sends the arrival board but never the slice width: well-typed, so only the wire check can tell."""

    @hookimpl
    def kvstrata_build_retrieve_payload(self, request: RetrieveRequest) -> list[Any]:
        payload = reference.kvstrata_build_retrieve_payload(request)
        payload[7] = 0
        return payload


class ReleasesOnCompletion(_ReferenceBased):
    """Hands a request back only once its whole transfer has finished: the per-layer machinery is inert."""

    def __init__(self) -> None:
        self._pending: set[str] = set()

    @hookimpl
    def kvstrata_poll_released(self, worker: Any) -> list[str]:
        self._pending.update(worker.get_finished())
        done = []
        for rid in sorted(self._pending):
            future = worker.future_of(rid)
            if future is None or future.done():
                done.append(rid)
        self._pending.difference_update(done)
        return done


class NoLayerWait(_ReferenceBased):
    """Never waits before a layer is read: with early release the engine reads KV still in flight."""

    @hookimpl
    def kvstrata_wait_for_layer(self, worker: Any, layer: int) -> None:
        return None


class SwallowsFailures(_ReferenceBased):
    """Drains the worker's failures and tells the engine nothing."""

    @hookimpl
    def kvstrata_take_failed(self, worker: Any) -> dict[str, Any]:
        worker.take_failed()
        return {}


class MissingWaitHook(_ReferenceBased):
    """Forgot to mark the per-layer wait with @hookimpl, so pluggy never sees it."""

    def kvstrata_wait_for_layer(self, worker: Any, layer: int) -> None:  # no @hookimpl: the bug
        reference.kvstrata_wait_for_layer(worker, layer)


class WrongWaitSignature(_ReferenceBased):
    """Takes the engine's layer *name* where the specification passes the layer index."""

    @hookimpl
    def kvstrata_wait_for_layer(self, worker: Any, layer_name: str) -> None:  # type: ignore[override]
        reference.kvstrata_wait_for_layer(worker, int(layer_name.rsplit(".", 1)[-1]))


MODULE = __name__

BROKEN_RULES: dict[str, tuple[str, str]] = {
    # adapter class: (rule it breaks, pytest -k expression selecting the tests that show it)
    "ShortChunkMajorPayload": ("retrieve-payload", "payload_hook or on_the_wire"),
    "WidthDropped": ("retrieve-payload", "on_the_wire and layer"),
    "ReleasesOnCompletion": ("early-release", "released_on_first_slice"),
    "NoLayerWait": ("layer-wait", "released_on_first_slice"),
    "SwallowsFailures": ("failure-reported", "killed_mid_transfer"),
    "MissingWaitHook": ("hooks", "loads"),
    "WrongWaitSignature": ("hooks", "loads"),
}
