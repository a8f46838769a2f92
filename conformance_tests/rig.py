"""The conformance rig: one adapter's engine-facing classes wired to a real server through the recording proxy.

Everything the suite drives goes through the adapter, exactly as its engine
would call it: the adapter's conformance driver (:mod:`.drivers`) *is* the
adapter's engine side (for vLLM: ``KvstrataConnector`` in both roles, fed real
vLLM objects), built over a real cache in the engine's format, in one of the
placements the adapter declares. The rig gives it a server address (the
recording proxy's), a record path and timeouts, and then only calls the
driver: store, load, poll, wait for a layer, finish. It judges what reaches
the server's socket (the proxy), what lands in the engine's cache (bytes read
back), what the engine was told (releases, blocks to recompute) and what the
runtime recorded (its JSON-lines record).

The server is a real ``kvstrata serve`` child with the test-only slice hold
(:mod:`kvstrata.conformance_tests.slice_hold`) installed; the same hold is installed
in this process for engine placement, where the engine side copies itself. The
rig holds a chosen load after a chosen number of slices, lets it go on, or
kills the server while it is held: that is how the suite catches a transfer in
flight by construction.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.arrival.board import ArrivalBoard, Progress
from kvstrata.core.engine.record import read_record
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.store.keys import CacheKey
from kvstrata.conformance_tests.slice_hold import HeldServerProcess
from kvstrata.conformance_tests.slice_hold import SliceHold
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType

from .rules import broken, require
from .wire import RecordingProxy, WireRequest

log = logging.getLogger("kvstrata.conformance")

MODEL = "conformance-model"
_ids = itertools.count()
_instance_ids = itertools.count(1)


@dataclass
class Retrieval:
    request_id: str
    prompt: list[int]
    truth: list[bytes]
    """Each layer's bytes for the ``loaded`` tokens, as the engine computed them."""
    blocks: list[list[int]]
    loaded: int
    submitted_at: float
    released_at: float | None = None


class RigServer:
    """A ``kvstrata serve`` with the session's slice hold, started on first use: either the one the session's
    rigs share (each registers its own instance id and request ids), or a rig's own, which its test may kill
    and restart."""

    def __init__(self, hold: SliceHold, l1_bytes: int = 256 << 20, chunk_size: int = 256) -> None:
        self.hold, self.l1_bytes, self.chunk_size = hold, l1_bytes, chunk_size
        self.server: HeldServerProcess | None = None

    def get(self, chunk_size: int) -> HeldServerProcess:
        if chunk_size != self.chunk_size:
            raise ValueError(f"the shared server stores {self.chunk_size}-token chunks, the rig asked {chunk_size}")
        if self.server is None:
            self.server = HeldServerProcess(l1_bytes=self.l1_bytes, chunk_size=self.chunk_size,
                                        slice_hold=self.hold).start()
        return self.server

    def restart(self) -> HeldServerProcess:
        """A fresh server on the same address and with the same hold, after the last one died."""
        self.server = HeldServerProcess(address=self.server.address, l1_bytes=self.l1_bytes, chunk_size=self.chunk_size,
                                    slice_hold=self.hold).start()
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@dataclass
class Rig:
    adapter: Adapter
    make_driver: Callable[[HarnessSpec], Any]
    """Builds the adapter's conformance driver for a spec (:func:`.drivers.make_driver`)."""
    hold: SliceHold
    spec: HarnessSpec = field(default_factory=HarnessSpec)
    width: int = 1
    """The slice width the engine side is deployed with (``layers_per_slice``; 0: chunk-major)."""
    pool_slots: int = 8
    layer_wait_timeout: float = 5.0
    retrieve_timeout: float = 30.0
    chunk_size: int = 256
    l1_bytes: int = 192 << 20
    shared: RigServer | None = None
    """The session's shared server; None: this rig starts (and may kill) its own."""

    def __post_init__(self) -> None:
        self.instance_id = next(_instance_ids)
        self.placement = self.spec.placement
        self.server: HeldServerProcess | None = None
        self.proxy: RecordingProxy | None = None
        self.driver: Any = None
        self.client: CacheClient | None = None
        self.released: dict[str, float] = {}
        self.failed_blocks: set[int] = set()
        self._boards: dict[str, ArrivalBoard] = {}
        self._stored: dict[tuple[int, ...], tuple[int, list[bytes]]] = {}
        self.submitted: list[str] = []
        self.record_path = os.path.join(tempfile.mkdtemp(prefix="kvstrata-conformance-record-"), "record.jsonl")

    # --- set-up and tear-down -----------------------------------------------------------

    def start(self) -> "Rig":
        self._serving = self.shared or RigServer(self.hold, self.l1_bytes, self.chunk_size)
        self.server = self._serving.get(self.chunk_size)
        self.proxy = RecordingProxy(self.server.address).start()
        self.client = CacheClient(self.proxy.address, timeout=10.0)
        self.driver = self.make_driver(self.spec)
        self.settings = RuntimeSettings(
            server_address=self.proxy.address, layers_per_slice=self.width, placement=self.placement,
            model_name=MODEL, lookup_timeout=10.0, layer_wait_timeout=self.layer_wait_timeout,
            retrieve_timeout=self.retrieve_timeout, pool_slots=self.pool_slots, instance_id=self.instance_id,
            record_path=self.record_path)
        try:
            self.driver.start(self.settings)
        except Exception as exc:
            broken("kv-layout", f"the engine side could not register its cache ({self.placement} placement): "
                                f"{type(exc).__name__}: {exc}")
        self.runtime = self.driver.runtime
        require(self.runtime is not None and self.runtime.connected, "kv-layout",
                f"the engine side did not register its cache with the server ({self.placement} placement)")
        self.layout = self.runtime.layout
        require(self.runtime.placement == self.placement, "kv-layout",
                f"the engine side was deployed with placement {self.placement!r} and registered "
                f"{self.runtime.placement!r}")
        require(self.layout.num_layers == self.spec.num_layers, "kv-layout",
                f"the engine was built with {self.spec.num_layers} layers, the layout describes "
                f"{self.layout.num_layers}")
        require(self.layout.block_size == self.spec.block_size, "kv-layout",
                f"the engine was built with {self.spec.block_size}-token blocks, the layout describes "
                f"{self.layout.block_size}")
        require(len(self.layout.groups) == max(self.spec.kv_groups, 1), "kv-layout",
                f"the engine was built with {self.spec.kv_groups} KV group(s), the layout describes "
                f"{len(self.layout.groups)}")
        return self

    def close(self) -> None:
        for r in list(self.submitted):
            self.hold.open(r)  # nothing of this rig's stays held on a server that outlives it
        for step in (lambda: self.driver and self.driver.close(),
                     lambda: self.client and self.client.close(), lambda: self.proxy and self.proxy.stop()):
            try:
                step()
            except Exception as exc:  # tear-down must go on; the test result is already decided
                log.warning("conformance rig tear-down: %s: %s", type(exc).__name__, exc)
        for board in self._boards.values():
            board.close()
        if self.shared is None and getattr(self, "_serving", None) is not None:
            self._serving.stop()

    # --- the server process ---------------------------------------------------------------

    def wait_held(self, r: Retrieval, timeout: float = 20.0) -> bool:
        """True once ``r``'s transfer is held (see ``submit(hold_after_slices=...)``)."""
        try:
            self.hold.wait_held(r.request_id, timeout)
            return True
        except TimeoutError:
            return False

    def resume(self, r: Retrieval) -> None:
        """Let ``r``'s held transfer go on."""
        self.hold.open(r.request_id)

    def kill_server(self) -> None:
        self.server.kill()

    def restart_server(self) -> None:
        """A fresh server on the same address (the proxy and the engine side reconnect)."""
        self.server = self._serving.restart()
        self._stored.clear()

    # --- prompts ----------------------------------------------------------------------------

    def prompt(self, num_tokens: int = 512, seed: int | None = None) -> list[int]:
        rng = random.Random(seed if seed is not None else next(_ids) * 7919 + 17)
        return [rng.randrange(1, 32000) for _ in range(num_tokens)]

    def loadable(self, num_tokens: int) -> int:
        return self.adapter.loadable_tokens(num_tokens, self.spec.block_size)

    def store(self, prompt: list[int]) -> tuple[int, list[bytes]]:
        """Prefill ``prompt`` on the engine and store it through the adapter: (tokens a load of it can get, the
        truth: each layer's bytes for them, as the engine computed them).

        A load gets the prompt's loadable tokens (``kvstrata_loadable_tokens``) as far as whole stored chunks
        cover them, which a LOOKUP of the loadable prefix tells.
        """
        n = len(prompt)
        k = self.loadable(n)
        blocks = self.driver.allocate(n)
        rid = f"conf-store-{next(_ids)}-{os.getpid()}"
        try:
            self.driver.prefill(prompt, blocks)
            self.driver.store(rid, prompt, blocks)
            probe = self._probe_key(f"{rid}-probe", prompt[:k])
            try:
                hit = self.client.lookup(probe)
            finally:
                self.client.free_lookup_locks(probe.request_id)
            if hit < (k // self.chunk_size) * self.chunk_size or hit == 0:
                stored = [e for e in self.record() if e.get("request_id") == rid]
                raise RuntimeError(f"the adapter stored a {n}-token prompt, and a LOOKUP of its {k} loadable tokens "
                                   f"hit {hit}; the engine side recorded {stored}")
            truth = [bytes(self.driver.read_layer(blocks, layer, hit)) for layer in range(self.spec.num_layers)]
        finally:
            self.driver.free(blocks)
        self._stored[tuple(prompt)] = (hit, truth)
        return hit, truth

    def _probe_key(self, request_id: str, tokens: list[int]) -> CacheKey:
        """The key the engine side stores ``tokens`` under: by token ids, unless the driver says otherwise
        (an engine that keys by its own page hashes, SGLang's, gives ``lookup_key``)."""
        lookup_key = getattr(self.driver, "lookup_key", None)
        if lookup_key is not None:
            return lookup_key(request_id, tokens, MODEL)
        return CacheKey.for_tokens(request_id, tokens, model=MODEL)

    def submit(self, prompt: list[int], *, hold_reply: bool = False,
               hold_after_slices: int | None = None) -> Retrieval:
        """A new request for a stored ``prompt``, into freshly cleared blocks, through the adapter's engine side.

        ``hold_reply``: the proxy holds back the RETRIEVE's reply (in engine placement the copy then cannot
        start: the reply says where the chunks are). ``hold_after_slices``: the transfer is held once that many
        slices are published (0: before the first) until :meth:`resume`.
        """
        hit, truth = self._stored.get(tuple(prompt)) or self.store(prompt)
        n = len(prompt)
        rid = f"conf-{next(_ids)}-{os.getpid()}"
        blocks = self.driver.allocate(n)
        self.driver.clear(blocks)
        require(self.driver.read_layer(blocks, 0, hit) != truth[0], "hooks",
                "the conformance driver's cleared blocks already read as the prompt's KV: read_layer does not "
                "read the blocks it is given, so no byte check could fail")
        if hold_reply:
            self.proxy.hold_replies(rid)
        if hold_after_slices is not None:
            self.hold.hold(rid, after_slices=hold_after_slices)
        self.submitted.append(rid)
        started = time.perf_counter()
        loaded = self.driver.load(rid, prompt, blocks)
        require(loaded == hit, "hooks",
                f"the engine side loads {loaded} tokens of a stored {n}-token prompt; the server holds {hit} of "
                f"its {self.loadable(n)} loadable tokens (kvstrata_loadable_tokens)")
        return Retrieval(rid, prompt, truth, blocks, loaded, started)

    def free(self, r: Retrieval) -> None:
        """The request is done: the engine side is told (``finish``), then its blocks go back."""
        self.driver.finish(r.request_id)
        self.poll()
        self.driver.free(r.blocks)

    # --- engine-side calls -------------------------------------------------------------------

    def poll(self) -> list[str]:
        """One engine step's polls, through the adapter: released requests and blocks to recompute."""
        p = self.driver.poll()
        now = time.perf_counter()
        for rid in p.released:
            require(rid not in self.released, "early-release",
                    f"the engine side released request {rid} a second time; each request goes back to the "
                    "engine exactly once")
            self.released[rid] = now
        self.failed_blocks |= set(p.failed_blocks)
        return list(p.released)

    def wait_released(self, r: Retrieval, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while r.request_id not in self.released and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.0005)
        if r.request_id in self.released:
            r.released_at = self.released[r.request_id]
            return True
        return False

    def start_wait(self, layer: int) -> tuple[threading.Event, list[BaseException]]:
        """Call the engine side's per-layer wait on a helper thread, so a wait that hangs cannot hang the suite."""
        done = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            try:
                self.driver.wait_for_layer(layer)
            except BaseException as exc:  # handed to the caller
                error.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name=f"conformance-wait-{layer}", daemon=True).start()
        return done, error

    def wait_for_layer(self, layer: int, timeout: float) -> tuple[bool, float]:
        """The engine side's per-layer wait, bounded: (returned within ``timeout``, seconds taken)."""
        t0 = time.perf_counter()
        done, error = self.start_wait(layer)
        returned = done.wait(timeout)
        if error:
            raise error[0]
        return returned, time.perf_counter() - t0

    def read(self, r: Retrieval, layer: int) -> bytes:
        return bytes(self.driver.read_layer(r.blocks, layer, r.loaded))

    def check_layer(self, r: Retrieval, layer: int, context: str) -> None:
        got = self.read(r, layer)
        if got != r.truth[layer]:
            diff = sum(1 for a, b in zip(got, r.truth[layer]) if a != b)
            broken("layer-wait", f"request {r.request_id}: layer {layer} read after the engine side's layer wait "
                                 f"is not the stored KV ({diff} of {len(got)} bytes differ) {context}")

    def settle(self, timeout: float = 30.0) -> None:
        """Poll until the engine side has nothing in flight (bounded: a hang is a broken rule)."""
        deadline = time.monotonic() + timeout
        while self.runtime.in_flight() and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.002)
        self.poll()
        require(not self.runtime.in_flight(), "failure-reported",
                f"loads {sorted(self.runtime.in_flight())} were still in flight {timeout:.0f}s later: a transfer "
                "that never settles pins its blocks and arrival slot forever")

    # --- what the engine side recorded and sent ---------------------------------------------

    def record(self) -> list[dict[str, Any]]:
        return list(read_record(self.record_path)) if os.path.exists(self.record_path) else []

    def failures(self) -> dict[str, str]:
        """Request id -> reason, for every load the runtime recorded as failed."""
        return {e["request_id"]: e["reason"] for e in self.record() if e["event"] == "load_failed"}

    def loads_started(self, r: Retrieval) -> list[dict[str, Any]]:
        """The runtime's ``load_started`` events for ``r`` (one per load it started)."""
        return [e for e in self.record() if e["event"] == "load_started" and e["request_id"] == r.request_id]

    def fallbacks(self, r: Retrieval) -> list[str]:
        """The fallback reasons the runtime recorded for ``r`` when it settled."""
        return [e["fallback"] for e in self.record()
                if e["event"] == "settled" and e["request_id"] == r.request_id and e.get("fallback")]

    def retrieves_on_wire(self, r: Retrieval | None = None) -> list[WireRequest]:
        return self.proxy.requests(RequestType.RETRIEVE, key_request_id=r.request_id if r else None)

    def board_progress(self, r: Retrieval) -> Progress | None:
        """The arrival-board progress of ``r``, read from the board its RETRIEVE named on the wire."""
        sent = self.retrieves_on_wire(r)
        if not sent or not isinstance(sent[-1].payload, list) or len(sent[-1].payload) < 6:
            return None
        ref = sent[-1].payload[5]
        if not isinstance(ref, dict) or "name" not in ref:
            return None
        board = self._boards.get(ref["name"])
        if board is None:
            board = self._boards[ref["name"]] = ArrivalBoard.attach(ref["name"])
        return board.read(ref["slot"], ref["generation"])
