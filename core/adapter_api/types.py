"""The values that pass through kvstrata's hooks (the specifications themselves are in :mod:`.hookspecs`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE, PagedKVLayout

if TYPE_CHECKING:
    import torch

    from kvstrata.core.engine.settings import RuntimeSettings
    from kvstrata.core.engine.worker_runtime import WorkerRuntime

PLACEMENTS = (PLACEMENT_SERVER, PLACEMENT_ENGINE)


@dataclass(frozen=True)
class AdapterInfo:
    """Who an adapter is, what it needs installed, and where its copies may run.

    ``engine_package`` is the engine's *import* name (``vllm``, ``sglang``,
    ``tensorrt_llm``), checked with :func:`importlib.util.find_spec` when the
    adapter is loaded; ``None`` for an adapter that needs nothing beyond
    kvstrata (the reference adapter). ``pip_extra`` is the kvstrata extra that
    installs it (``vllm`` -> ``pip install 'kvstrata[vllm]'``); an adapter
    shipped outside kvstrata may instead give ``install_hint`` verbatim.
    ``placements`` are those the adapter supports; the conformance suite
    checks each one.
    """

    name: str
    engine: str
    engine_package: str | None = None
    pip_extra: str | None = None
    install_hint: str | None = None
    description: str = ""
    placements: tuple[str, ...] = PLACEMENTS

    def __post_init__(self) -> None:
        bad = [p for p in self.placements if p not in PLACEMENTS]
        if bad or not self.placements:
            raise ValueError(f"adapter {self.name!r}: placements must be a non-empty subset of {PLACEMENTS}, "
                             f"got {self.placements}")

    def how_to_install(self) -> str:
        if self.install_hint:
            return self.install_hint
        if self.pip_extra:
            return f"pip install 'kvstrata[{self.pip_extra}]'"
        if self.engine_package:
            return f"pip install {self.engine_package}"
        return "nothing to install"


@dataclass(frozen=True)
class KVCacheDescription:
    """An engine's paged KV cache, as the runtime needs it for one placement.

    ``layout`` is what the server is told (its regions must be ones the server
    can open for server placement: shared memory or CUDA IPC). ``local_regions``
    are this process's tensors over the same cache, which engine placement
    copies into (and STOREs gather from). ``device`` is ``cpu`` or ``cuda:N``.
    """

    layout: PagedKVLayout
    local_regions: Sequence["torch.Tensor"]
    device: str = "cpu"


@dataclass(frozen=True)
class LoadFailure:
    """A load that failed: what the default failure-report hook hands the engine."""

    request_id: Any
    block_ids: list[list[int]]
    reason: str


class NotSupported(Exception):
    """The engine cannot do what was asked: a cache for that placement, a :class:`HarnessSpec` it cannot build."""


@dataclass(frozen=True)
class HarnessSpec:
    """The model shape, cache and placement the conformance suite asks an adapter's engine to build.

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
    placement: str = PLACEMENT_SERVER
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DriverPoll:
    """One engine step's view of kvstrata, from a conformance driver."""

    released: list[str]
    """Requests handed back to the engine's scheduler this step (kvstrata request ids)."""
    failed_blocks: set[int]
    """Blocks the engine was told to recompute this step (flattened over KV groups)."""


@runtime_checkable
class ConformanceDriver(Protocol):
    """An adapter's engine-facing classes, driven by the conformance suite the way the engine calls them.

    Built by the factory an adapter's package publishes in the conformance suite's entry-point group
    ``kvstrata.conformance_drivers`` (:mod:`kvstrata.conformance_tests.drivers`). It owns a real paged KV cache in
    the engine's own format and a real engine side over it (for vLLM: the
    connector class in both roles, fed real vLLM request, block and scheduler
    objects). The suite never trusts it to judge correctness: it reads the
    prefilled KV as the truth, loads into freshly cleared blocks and compares
    what it reads. Block ids are per KV group, in the shape a load takes.
    """

    placement: str
    runtime: "WorkerRuntime"
    """The worker side's runtime, once :meth:`start` has run (the suite reads its state, never drives it)."""

    def start(self, settings: "RuntimeSettings") -> None:
        """Build the engine side with these settings and register the cache, as the engine would at start-up."""
        ...

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

    def store(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> None:
        """The engine finished computing ``token_ids`` into ``block_ids``: store it through the adapter, and
        return once the server has answered."""
        ...

    def load(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> int:
        """A new request for ``token_ids`` whose blocks are ``block_ids``: look it up through the scheduler side
        (asking again until answered), then start its load on the worker side. Returns the tokens it loads."""
        ...

    def poll(self) -> DriverPoll:
        """One engine step's polls of the worker side: released requests and blocks to recompute."""
        ...

    def wait_for_layer(self, layer: int) -> None:
        """What the engine calls right before its attention reads ``layer``."""
        ...

    def finish(self, request_id: str) -> None:
        """The request is done (or aborted): what the engine calls before it frees the blocks."""
        ...

    def close(self) -> None:
        ...

    # Optional: ``lookup_key(request_id, token_ids, model) -> CacheKey``, the key the engine side stores a
    # prompt under, for an engine that keys by its own page hashes (SGLang); the suite probes by token ids
    # without it.
