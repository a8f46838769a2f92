"""Hook implementations most adapters share, ready to re-export.

Release, per-layer wait, failure reports and the RETRIEVE payload are the
core's policy; an adapter's own part is *when* its engine calls them. An
adapter whose engine needs nothing special imports these into its module
(pluggy registers a module's marked attributes, imported or not)::

    from kvstrata.core.adapter_api.defaults import (  # noqa: F401  (registered as hooks)
        kvstrata_build_retrieve_payload, kvstrata_poll_released, kvstrata_take_failed, kvstrata_wait_for_layer)

and writes only the engine-specific hooks (info, layout, harness).
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstrata.core.adapter_api.hookspecs import RetrieveRequest, WorkerOptions, hookimpl
from kvstrata.core.transfer.layouts import PagedKVLayout


@hookimpl
def kvstrata_build_retrieve_payload(request: RetrieveRequest) -> list[Any]:
    from kvstrata.core.adapter_api.plugins import default_retrieve_payload

    return default_retrieve_payload(request)


@hookimpl
def kvstrata_poll_released(worker: Any) -> list[str]:
    # The specification's policy: back to the engine once the first slice landed (or the
    # retrieve failed); the worker keeps collecting the draining transfer afterwards.
    return worker.get_finished()


@hookimpl
def kvstrata_wait_for_layer(worker: Any, layer: int) -> None:
    worker.wait_for_layer(layer)


@hookimpl
def kvstrata_take_failed(worker: Any) -> dict[str, tuple[list[list[int]], str]]:
    return worker.take_failed()


def layerwise_worker(client: Any, instance_id: int, layout: PagedKVLayout, placement: str, options: WorkerOptions,
                     local_regions: Sequence[Any] | None = None, **kwargs: Any) -> Any:
    """A LayerwiseWorker with the deployment's options: what ``kvstrata_create_worker`` usually returns."""
    from kvstrata.core.engine.layerwise_worker import LayerwiseWorker

    return LayerwiseWorker(client, instance_id, layout, placement=placement, local_regions=local_regions,
                           pool_slots=options.pool_slots, release_after_layers=options.release_after_layers,
                           layer_wait_timeout=options.layer_wait_timeout, retrieve_timeout=options.retrieve_timeout,
                           **kwargs)
