"""The hook specification every kvstrata engine adapter implements.

kvstrata's core (server, planner, arrival machinery, :class:`~kvstrata.core.engine.layerwise_worker.LayerwiseWorker`)
knows nothing about any engine. An *adapter* is the engine-specific part: it
describes the engine's paged KV cache, builds the RETRIEVE requests, hands
requests back to the engine's scheduler, and makes the engine wait before it
reads a layer that may still be in flight. Every adapter, ours (reference,
vLLM, SGLang, TensorRT-LLM) and third parties', plugs in the same way: a module
(or object) with functions marked ``@hookimpl`` whose names and arguments
match the specifications below, published in the ``kvstrata.adapters``
entry-point group::

    # pyproject.toml of an adapter package
    [project.entry-points."kvstrata.adapters"]
    myengine = "myengine_kvstrata.adapter"

    # myengine_kvstrata/adapter.py
    from kvstrata.core.adapter_api.hookspecs import AdapterInfo, hookimpl

    @hookimpl
    def kvstrata_adapter_info():
        return AdapterInfo(name="myengine", engine="MyEngine", engine_package="myengine",
                           pip_extra="myengine")

:mod:`kvstrata.core.adapter_api.plugins` loads it (``load_adapter("myengine")`` or
``load_adapter("myengine_kvstrata.adapter")``), and ``pytest --pyargs
kvstrata.conformance_tests --adapter myengine`` proves it speaks the protocol.

Rules for implementers, all checked when the adapter is loaded:

* Every hook in :data:`REQUIRED_HOOKS` must be implemented and marked with
  ``@hookimpl`` (an unmarked function of the right name is reported as such).
* A hook implementation may take any subset of the specification's arguments,
  by name (pluggy passes them as keywords), and no others.
* A function marked ``@hookimpl`` whose name matches no specification (a typo,
  a hook from another version) is an error, not silently ignored.
* Import your engine lazily (inside the hooks), and name its import package in
  :class:`AdapterInfo`, so that a machine without the engine gets "engine
  package X is not installed: pip install 'kvstrata[extra]'" rather than an
  ImportError from deep inside your module.

Hooks marked ``firstresult`` want one answer: pluggy stops at the first
implementation that returns something other than ``None``, so such a hook must
never return ``None`` for "done". The others are called on every registered
implementation, which lets an observer plugin (tracing, metrics) sit beside
the adapter.

The engine-side calls follow the worker's four operations (see
:mod:`kvstrata.core.engine.layerwise_worker`): the adapter owns *when* they happen in its
engine's step, the core owns *what* they do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

import pluggy

from kvstrata.core.store.keys import CacheKey

if TYPE_CHECKING:  # only for annotations: keeps this module importable without building anything
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.core.transfer.layouts import PagedKVLayout
    from kvstrata.core.engine.layerwise_worker import LayerwiseWorker

PROJECT_NAME = "kvstrata"
ENTRY_POINT_GROUP = "kvstrata.adapters"
"""The entry-point group adapters publish themselves in."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- values passed through the hooks ------------------------------------------------


@dataclass(frozen=True)
class AdapterInfo:
    """Who an adapter is and what it needs installed.

    ``engine_package`` is the engine's *import* name (``vllm``, ``sglang``,
    ``tensorrt_llm``), checked with :func:`importlib.util.find_spec` when the
    adapter is loaded; ``None`` for an adapter that needs nothing beyond
    kvstrata (the reference adapter). ``pip_extra`` is the kvstrata extra that
    installs it (``vllm`` -> ``pip install 'kvstrata[vllm]'``); an adapter
    shipped outside kvstrata may instead give ``install_hint`` verbatim.
    """

    name: str
    engine: str
    engine_package: str | None = None
    pip_extra: str | None = None
    install_hint: str | None = None
    description: str = ""

    def how_to_install(self) -> str:
        if self.install_hint:
            return self.install_hint
        if self.pip_extra:
            return f"pip install 'kvstrata[{self.pip_extra}]'"
        if self.engine_package:
            return f"pip install {self.engine_package}"
        return "nothing to install"


@dataclass(frozen=True)
class RetrieveRequest:
    """Everything a RETRIEVE carries, as typed values, before it becomes the eight wire items.

    ``arrival_board``, ``layer_event_handles`` and ``layers_per_stage`` are
    ``None, None, 0`` for a chunk-major retrieve; the wire payload keeps all
    eight items either way (see :data:`kvstrata.core.wire.protocol.RETRIEVE_ITEMS`).
    """

    key: CacheKey
    instance_id: int
    block_ids: Sequence[Sequence[int]]
    skip_first_n_tokens: int = 0
    event_handle: bytes | None = None
    arrival_board: dict[str, Any] | None = None
    layer_event_handles: list[bytes] | None = None
    layers_per_stage: int = 0


@dataclass(frozen=True)
class WorkerOptions:
    """The knobs of :class:`~kvstrata.core.engine.layerwise_worker.LayerwiseWorker` an engine deployment sets."""

    pool_slots: int = 8
    release_after_layers: int = 1
    layer_wait_timeout: float = 10.0
    retrieve_timeout: float = 120.0


@dataclass(frozen=True)
class HarnessSpec:
    """The model shape and cache the conformance suite asks an adapter's engine to build.

    ``kv_groups > 1`` asks for a hybrid cache (layers split into that many KV
    groups, each with its own block table); an engine that cannot build one
    raises :class:`NotSupported` and the suite skips the hybrid checks with
    that reason.
    """

    num_layers: int = 32
    kv_size: int = 2
    num_heads: int = 4
    head_size: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16
    num_blocks: int = 192
    kv_groups: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


class NotSupported(Exception):
    """Raised by a conformance engine for a :class:`HarnessSpec` its engine cannot build."""


@runtime_checkable
class ConformanceEngine(Protocol):
    """The engine side the conformance suite drives, as returned by ``kvstrata_conformance_harness``.

    It stands for the adapter's engine: it owns a real paged KV cache in the
    engine's own format (``kv_caches`` is what the engine would hand the
    adapter, e.g. vLLM's ``dict[layer_name, Tensor]``), computes KV for a prompt
    the way the engine's forward pass would, and reads a layer back. The suite
    never trusts it to judge correctness: it reads the prefilled KV as the
    truth, retrieves into freshly cleared blocks and compares what it reads.

    Block ids are per KV group: ``allocate`` returns one list per group (one
    list for a non-hybrid cache), in the shape RETRIEVE's ``block_ids`` takes.
    """

    kv_caches: Any
    placement: str

    def allocate(self, num_tokens: int) -> list[list[int]]:
        """Blocks for ``num_tokens`` tokens, one list per KV group."""
        ...

    def free(self, block_ids: Sequence[Sequence[int]]) -> None:
        ...

    def clear(self, block_ids: Sequence[Sequence[int]]) -> None:
        """Zero the blocks, so that a later read cannot pass on bytes left from before."""
        ...

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        """Write the KV the engine computes for ``token_ids`` into ``block_ids`` (a forward pass)."""
        ...

    def read_layer(self, block_ids: Sequence[Sequence[int]], layer: int, num_tokens: int) -> bytes:
        """The cache's bytes of ``layer`` for positions ``[0, num_tokens)``, in a fixed order."""
        ...

    def close(self) -> None:
        ...


# --- the hooks ------------------------------------------------------------------------

REQUIRED_HOOKS: tuple[str, ...] = (
    "kvstrata_adapter_info",
    "kvstrata_describe_kv_layout",
    "kvstrata_build_retrieve_payload",
    "kvstrata_poll_released",
    "kvstrata_wait_for_layer",
    "kvstrata_take_failed",
    "kvstrata_conformance_harness",
)
"""Hooks an adapter must implement itself. ``kvstrata_create_worker`` is optional:
the core supplies a default (see :mod:`kvstrata.core.adapter_api.plugins`)."""


@hookspec(firstresult=True)
def kvstrata_adapter_info() -> AdapterInfo:
    """Name the adapter, its engine and the package the engine imports as.

    Called by the plugin manager (:func:`kvstrata.core.adapter_api.plugins.load_adapter`)
    once, right after registering the adapter and before any other hook, so
    that a missing engine package is reported by name with the pip extra that
    installs it. Must not import the engine.
    """


@hookspec(firstresult=True)
def kvstrata_describe_kv_layout(kv_caches: Any, placement: str) -> "PagedKVLayout":
    """Describe the engine's paged KV cache so the planner and the copy kernel can address it.

    Called by the adapter's connector when the engine hands over its allocated
    KV cache (vLLM ``register_kv_caches``, TensorRT-LLM ``register_kv_caches``,
    SGLang when the linker is built), before the cache is registered with the
    server (REGISTER_KV_CACHE) and before a worker is built over it; the
    conformance suite calls it with the conformance engine's ``kv_caches``.

    ``kv_caches`` is whatever the engine hands over, unchanged. ``placement``
    is ``"server"`` (the server writes into the cache: shared memory or CUDA
    IPC regions) or ``"worker"`` (this process copies). Return a
    :class:`~kvstrata.core.transfer.layouts.PagedKVLayout` whose regions the server can
    open for that placement; the constructors in :mod:`kvstrata.core.transfer.layouts`
    cover vLLM, SGLang, TensorRT-LLM and the reference engine. A hybrid model
    sets ``layer_groups``; the core then runs its retrieves chunk-major.
    """


@hookspec(firstresult=True)
def kvstrata_create_worker(client: "CacheClient", instance_id: int, layout: "PagedKVLayout", kv_caches: Any,
                           placement: str, options: WorkerOptions) -> "LayerwiseWorker":
    """Build the engine-side runtime for one registered cache (optional; the core has a default).

    Called once per engine worker process by the connector (and by the
    conformance suite) after :func:`kvstrata_describe_kv_layout`. ``client``
    is the adapter-bound client from :meth:`kvstrata.core.adapter_api.plugins.Adapter.client`:
    it builds every RETRIEVE through :func:`kvstrata_build_retrieve_payload`.
    Implement it to choose an event backend (CUDA events on a GPU) or to pass
    ``local_regions`` for worker placement; the default builds a
    :class:`~kvstrata.core.engine.layerwise_worker.LayerwiseWorker` with the host event backend
    and the given options. The caller registers the cache (``worker.register()``).
    """


@hookspec(firstresult=True)
def kvstrata_build_retrieve_payload(request: RetrieveRequest) -> list[Any]:
    """Build the eight RETRIEVE payload items for one retrieve.

    Called by the adapter-bound client every time a retrieve is sent (the
    worker's ``submit_retrieve``, for chunk-major and layer-major alike), and
    by any adapter code that talks to the server itself. The list must match
    :data:`kvstrata.core.wire.protocol.RETRIEVE_ITEMS` exactly: eight items, in
    order, with ``None, None, 0`` as the last three for a chunk-major retrieve
    (never a shorter list: the server rejects a wrong length, so appending the
    layer-major fields only when enabled breaks every chunk-major retrieve).
    Delegate to :func:`kvstrata.core.wire.client.build_retrieve_payload` unless the
    engine needs something it cannot express. The suite checks what actually
    arrives on the server's socket, not what this returns.
    """


@hookspec(firstresult=True)
def kvstrata_poll_released(worker: "LayerwiseWorker") -> list[str]:
    """Release requests to the engine: which ones may go back to its scheduler now.

    Called by the connector's per-step completion poll (vLLM ``get_finished``'s
    ``finished_recving``, TensorRT-LLM ``get_finished``'s loaded ids, SGLang's
    load-counter poll), on the engine's scheduling thread, every step while
    retrieves are in flight. Return each request id exactly once, as soon as
    its first layer slice has landed (``worker.get_finished()`` implements
    that policy) -- not when the whole transfer is done: waiting for the
    transfer makes the per-layer machinery inert. A failed retrieve is returned
    too, so the engine gets the request back; its blocks then come from
    :func:`kvstrata_take_failed`. Map kvstrata request ids to engine ids here.
    """


@hookspec
def kvstrata_wait_for_layer(worker: "LayerwiseWorker", layer: int) -> None:
    """Block until ``layer`` may be read: every released, in-flight retrieve has landed it.

    Called by the connector right before the engine's attention for ``layer``
    reads the KV cache (vLLM ``wait_for_layer_load(layer_name)``, TensorRT-LLM
    ``wait_for_layer_load(layer_idx, stream)``, SGLang's layer-done counter),
    with the engine's layer name already mapped to an index. Must wait on
    every outstanding retrieve that touches the layer, not only the scheduled
    requests' (a released request's blocks are visible to others in the same
    step), must be bounded (``worker.wait_for_layer`` times out, logs and
    reports the blocks failed instead of hanging the model-runner thread), and
    on a GPU must make the engine's compute stream wait rather than the CPU.
    Not firstresult: every implementation is called, in order.
    """


@hookspec(firstresult=True)
def kvstrata_take_failed(worker: "LayerwiseWorker") -> dict[str, tuple[list[list[int]], str]]:
    """Report failed retrieves to the engine: request id -> (block ids, reason), since the last call.

    Called by the connector's failure poll (vLLM ``get_block_ids_with_load_errors``,
    which then recomputes or fails the request by ``kv_load_failure_policy``;
    TensorRT-LLM and SGLang through their load-error paths). A retrieve fails
    when the server answers with an error, dies, or stops advancing a released
    request's layers past the wait timeout. Never swallow these: the engine
    would read KV that never arrived.
    """


@hookspec(firstresult=True)
def kvstrata_conformance_harness(spec: HarnessSpec) -> ConformanceEngine:
    """Build the adapter's engine side for the conformance suite.

    Called by ``kvstrata.conformance_tests`` once per test, with the model
    shape to build. Return a :class:`ConformanceEngine` over a real KV cache in
    the engine's own format (the same format ``kvstrata_describe_kv_layout``
    describes), or raise :class:`NotSupported` for a spec the engine cannot
    build (for example ``kv_groups > 1`` on an engine without hybrid models).
    """
