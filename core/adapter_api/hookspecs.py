"""The hook specification: what differs between engines, and nothing else.

kvstrata's engine runtime (:mod:`kvstrata.core.engine`) does everything every
engine needs: lookups with bounded waits, load and store decisions, release on
the first slice, per-layer waits, lock release, failures, reconnects, the
record. An *adapter* translates its engine's connector API onto that runtime
(vLLM's ``KVConnectorBase_V1`` -> :mod:`kvstrata.adapters.vllm.connector`) and
answers these hooks, which the runtime calls where the engines differ: how
the engine's KV cache is laid out, which tokens the engine recomputes itself,
whether a layer wait blocks the CPU or orders a stream, how a failed load is
reported, and how request ids map.

Adapters plug in as pluggy plugins: a module (or object) with functions marked
``@hookimpl`` whose names and arguments match the specifications below,
published in the ``kvstrata.adapters`` entry-point group::

    # pyproject.toml of an adapter package
    [project.entry-points."kvstrata.adapters"]
    myengine = "myengine_kvstrata.adapter"

:mod:`kvstrata.core.adapter_api.plugins` loads and validates it, and
``pytest --pyargs kvstrata.conformance_tests --adapter myengine`` checks its
engine-facing classes end to end, through a conformance driver the adapter's
package publishes in the suite's own entry-point group
(``kvstrata.conformance_drivers``, read only by the suite, see
:mod:`kvstrata.conformance_tests.drivers`): nothing here, and nothing an engine
loads, names test code. Rules, checked when the adapter is loaded:

* Every hook in :data:`REQUIRED_HOOKS` is implemented and marked ``@hookimpl``;
  the others have defaults (:mod:`.defaults`, registered last, so an
  adapter's implementation wins).
* An implementation takes any subset of the specification's arguments, by
  name, and no others; a marked function that matches no specification is an
  error.
* Import the engine lazily and name its package in :class:`AdapterInfo`.

Every hook here is ``firstresult``: one answer, from the adapter if it gives
one, else from the default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kvstrata.core.adapter_api.types import AdapterInfo, KVCacheDescription
    from kvstrata.core.arrival.events import EventBackend

PROJECT_NAME = "kvstrata"
ENTRY_POINT_GROUP = "kvstrata.adapters"
"""The entry-point group adapters publish themselves in."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

REQUIRED_HOOKS: tuple[str, ...] = (
    "kvstrata_adapter_info",
    "kvstrata_describe_kv_cache",
)
"""Hooks an adapter must implement itself; the others have defaults in :mod:`.defaults`."""


@hookspec(firstresult=True)
def kvstrata_adapter_info() -> "AdapterInfo":
    """Name the adapter, its engine, the package the engine imports as, and the placements it supports.

    Called by :func:`kvstrata.core.adapter_api.plugins.load_adapter` once,
    right after registering the adapter and before any other hook, so that a
    missing engine package is reported by name with the pip extra that
    installs it. Must not import the engine.
    """


@hookspec(firstresult=True)
def kvstrata_describe_kv_cache(kv_caches: Any, placement: str) -> "KVCacheDescription":
    """Describe the engine's paged KV cache for ``placement`` (``"server"`` or ``"engine"``).

    Called by :meth:`kvstrata.core.engine.worker_runtime.WorkerRuntime.register`,
    on the worker side, once, when the engine hands over its allocated cache
    (vLLM's ``register_kv_caches``), before the cache is registered with the
    server. ``kv_caches`` is exactly what the engine handed over. For
    ``"server"`` the layout's regions must be ones the server can open (shared
    memory, CUDA IPC); raise :class:`~kvstrata.core.adapter_api.types.NotSupported`
    when the cache cannot be described for that placement (a CPU cache in
    private memory): with placement ``auto`` the runtime then uses worker
    placement and logs why. The constructors in
    :mod:`kvstrata.core.transfer.layouts` cover vLLM, SGLang, TensorRT-LLM and
    the reference engine; a hybrid model sets ``layer_groups`` and the runtime
    then loads it chunk-major.
    """


@hookspec(firstresult=True)
def kvstrata_event_backend(device: str) -> "EventBackend":
    """How a layer wait makes the engine wait on ``device``: block the CPU, or order the compute stream.

    Called by ``WorkerRuntime.register`` once, with the device of the
    description :func:`kvstrata_describe_kv_cache` returned. The default
    answers ``cpu`` with the host backend (a slice is usable once the arrival
    count covers it) and refuses any other device, so a GPU adapter must name
    its backend (``kvstrata.native.cuda_events.CudaEventBackend``: the wait
    makes the engine's current stream wait on the layer's event, the CPU
    thread never blocks on the copy).
    """


@hookspec(firstresult=True)
def kvstrata_loadable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's leading tokens kvstrata may load; the engine computes the rest itself.

    Called by :meth:`kvstrata.core.engine.scheduler_runtime.SchedulerRuntime.lookup`
    on the scheduler side for every new request, before its LOOKUP. Must be a
    multiple of ``block_size`` (kvstrata moves whole blocks). The default is
    every whole block. vLLM recomputes the last prompt token and writes its KV
    before the layer wait, so its adapter leaves out the block holding it: a
    page copy would overwrite that token's KV.
    """


@hookspec(firstresult=True)
def kvstrata_request_id(engine_request_id: Any) -> str:
    """kvstrata's request id (used in keys, locks and the record) for the engine's request id.

    Called by both runtimes whenever the engine names a request (lookup,
    allocation, finish, load start). Must be injective and stable for the
    request's life. The default is ``str(engine_request_id)``; the runtimes
    hand the engine back its own ids.
    """


@hookspec(firstresult=True)
def kvstrata_report_load_failure(engine_request_id: Any, block_ids: list[list[int]], reason: str) -> Any:
    """Turn one failed load into what the engine's failure path takes.

    Called by the worker side's runtime on the engine's thread (from
    ``WorkerRuntime.poll`` and ``WorkerRuntime.take_load_failures``) once for
    every load that failed: the server answered with an error or died, a
    layer wait timed out, or the server was unreachable when the load was due.
    The runtime keeps what this returns until the engine takes it with
    ``take_load_failures()``. vLLM's adapter returns the block ids, which
    ``get_block_ids_with_load_errors`` hands vLLM to recompute; an engine that
    fails the request instead (SGLang's load counter) returns what its
    connector needs for that. The default returns a
    :class:`~kvstrata.core.adapter_api.types.LoadFailure`.
    """
