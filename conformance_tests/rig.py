"""The conformance rig: one adapter wired to a real server through the recording proxy.

Everything the suite drives goes through the adapter's hooks, exactly as an
engine connector would call them: the engine side comes from
``kvstrata_conformance_harness``, the cache description from
``kvstrata_describe_kv_layout``, the worker from ``kvstrata_create_worker``
(handed a client whose RETRIEVEs the adapter's payload hook builds), and
release, per-layer wait and failure reports from ``kvstrata_poll_released``,
``kvstrata_wait_for_layer`` and ``kvstrata_take_failed``. The server is a real
``kvstrata serve`` child process with the test-only slice hold installed
(``kvstrata.core.testing.slice_hold``): the rig holds a chosen retrieve after a
chosen number of slices, lets it go on, or kills the server while it is held,
which is how the suite catches a transfer in flight by construction.
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

from kvstrata.core.arrival.board import ArrivalBoard, Progress
from kvstrata.core.adapter_api.hookspecs import HarnessSpec, WorkerOptions
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.adapter_api.plugins import Adapter
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.testing.server_process import ServerProcess
from kvstrata.core.testing.slice_hold import SliceHold

from .rules import broken, require
from .wire import RecordingProxy, WireRequest

log = logging.getLogger("kvstrata.conformance")

MODEL = "conformance-model"
_ids = itertools.count()


@dataclass
class Retrieval:
    request_id: str
    prompt: list[int]
    truth: list[bytes]
    blocks: list[list[int]]
    width: int
    submitted_at: float
    released_at: float | None = None


class RigServer:
    """A ``kvstrata serve`` with a slice hold, started on first use: either the one the session's rigs share
    (each registers its own instance id and request ids), or a rig's own, which its test may kill and restart."""

    def __init__(self, l1_bytes: int = 256 << 20, chunk_size: int = 256) -> None:
        self.l1_bytes, self.chunk_size = l1_bytes, chunk_size
        self.server: ServerProcess | None = None
        self.hold: SliceHold | None = None

    def get(self, chunk_size: int) -> tuple[ServerProcess, SliceHold]:
        if chunk_size != self.chunk_size:
            raise ValueError(f"the shared server stores {self.chunk_size}-token chunks, the rig asked {chunk_size}")
        if self.server is None:
            self.hold = SliceHold(tempfile.mkdtemp(prefix="kvstrata-conformance-hold-"))
            self.server = ServerProcess(l1_bytes=self.l1_bytes, chunk_size=self.chunk_size,
                                        slice_hold=self.hold).start()
        return self.server, self.hold

    def restart(self) -> ServerProcess:
        """A fresh server on the same address and with the same hold, after the last one died."""
        self.server = ServerProcess(address=self.server.address, l1_bytes=self.l1_bytes, chunk_size=self.chunk_size,
                                    slice_hold=self.hold).start()
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.hold.open_all()
            self.server.stop()
            self.server = None


_instance_ids = itertools.count(1)


@dataclass
class Rig:
    adapter: Adapter
    spec: HarnessSpec = field(default_factory=HarnessSpec)
    options: WorkerOptions = field(default_factory=lambda: WorkerOptions(layer_wait_timeout=5.0,
                                                                          retrieve_timeout=30.0))
    chunk_size: int = 256
    l1_bytes: int = 192 << 20
    shared: RigServer | None = None
    """The session's shared server; None: this rig starts (and may kill) its own."""

    def __post_init__(self) -> None:
        self.instance_id = next(_instance_ids)
        self.server: ServerProcess | None = None
        self.proxy: RecordingProxy | None = None
        self.engine: Any = None
        self.worker: Any = None
        self.client: Any = None
        self.released: dict[str, float] = {}
        self.failed: dict[str, tuple[list[list[int]], str]] = {}
        self._boards: dict[str, ArrivalBoard] = {}
        self._stored: dict[tuple[int, ...], list[bytes]] = {}
        self.submitted: list[str] = []

    # --- set-up and tear-down -----------------------------------------------------------

    def start(self) -> "Rig":
        self._serving = self.shared or RigServer(self.l1_bytes, self.chunk_size)
        self.server, self.hold = self._serving.get(self.chunk_size)
        self.proxy = RecordingProxy(self.server.address).start()
        self.engine = self.adapter.conformance_engine(self.spec)
        try:
            self.layout = self.adapter.describe_kv_layout(self.engine.kv_caches, self.engine.placement)
        except Exception as exc:
            broken("kv-layout", f"kvstrata_describe_kv_layout raised {type(exc).__name__}: {exc}")
        require(self.layout.num_layers == self.spec.num_layers, "kv-layout",
                f"the engine was built with {self.spec.num_layers} layers, the layout describes "
                f"{self.layout.num_layers}")
        require(len(self.layout.groups) == max(self.spec.kv_groups, 1), "kv-layout",
                f"the engine was built with {self.spec.kv_groups} KV group(s), the layout describes "
                f"{len(self.layout.groups)}")
        self.client = self.adapter.client(self.proxy.address, timeout=10.0)
        self.worker = self.adapter.create_worker(self.client, self.instance_id, self.layout, self.engine.kv_caches,
                                                 self.engine.placement, self.options)
        self.register()
        return self

    def register(self) -> None:
        try:
            self.worker.register()
        except Exception as exc:
            broken("kv-layout", f"the server refused the cache kvstrata_describe_kv_layout described: "
                                f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        for r in list(self.submitted):
            self.hold.open(r)  # nothing of this rig's stays held on a server that outlives it
        for step in (lambda: self.worker and self.worker.close(),
                     lambda: self.shared and self.client and self.client.unregister_kv_cache(self.instance_id),
                     lambda: self.client and self.client.close(),
                     lambda: self.engine and self.engine.close(), lambda: self.proxy and self.proxy.stop()):
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
        """True once the server holds ``r``'s transfer (see ``submit(hold_after_slices=...)``)."""
        try:
            self.hold.wait_held(r.request_id, timeout)
            return True
        except TimeoutError:
            return False

    def resume(self, r: Retrieval) -> None:
        """Let the server go on with ``r``'s held transfer."""
        self.hold.open(r.request_id)

    def kill_server(self) -> None:
        self.server.kill()

    def restart_server(self) -> None:
        """A fresh server on the same address (the proxy reconnects); the cache is registered again."""
        self.server = self._serving.restart()
        self._stored.clear()
        self.register()

    # --- prompts ----------------------------------------------------------------------------

    def prompt(self, num_tokens: int = 512, seed: int | None = None) -> list[int]:
        rng = random.Random(seed if seed is not None else next(_ids) * 7919 + 17)
        return [rng.randrange(1, 32000) for _ in range(num_tokens)]

    def store(self, prompt: list[int]) -> list[bytes]:
        """Prefill ``prompt`` on the engine, keep what it computed as the truth, and STORE it."""
        n = len(prompt)
        blocks = self.engine.allocate(n)
        try:
            self.engine.prefill(prompt, blocks)
            truth = [bytes(self.engine.read_layer(blocks, layer, n)) for layer in range(self.spec.num_layers)]
            reply = self.client.store(CacheKey.for_tokens(f"conf-store-{next(_ids)}", prompt, model=MODEL),
                                      self.instance_id, blocks)
        finally:
            self.engine.free(blocks)
        if reply.get("stored_tokens", 0) + reply.get("skipped_tokens", 0) != n:
            raise RuntimeError(f"STORE of {n} tokens answered {reply}")
        self._stored[tuple(prompt)] = truth
        return truth

    def submit(self, prompt: list[int], width: int, *, hold_reply: bool = False,
               hold_after_slices: int | None = None) -> Retrieval:
        """LOOKUP then retrieve ``prompt`` into freshly cleared blocks through the adapter's worker.

        ``hold_reply``: the proxy holds back the RETRIEVE's reply. ``hold_after_slices``: the server holds
        the transfer once it has published that many slices (0: before the first) until :meth:`resume`.
        """
        truth = self._stored.get(tuple(prompt)) or self.store(prompt)
        n = len(prompt)
        rid = f"conf-{next(_ids)}-{os.getpid()}"
        key = CacheKey.for_tokens(rid, prompt, model=MODEL)
        hit = self.client.lookup(key)
        if hit != n:
            raise RuntimeError(f"LOOKUP of a stored {n}-token prompt hit {hit} tokens")
        blocks = self.engine.allocate(n)
        self.engine.clear(blocks)
        require(self.engine.read_layer(blocks, 0, n) != truth[0], "hooks",
                "the conformance engine's cleared blocks already read as the prompt's KV: read_layer does not "
                "read the blocks it is given, so no byte check could fail")
        if hold_reply:
            self.proxy.hold_replies(rid)
        if hold_after_slices is not None:
            self.hold.hold(rid, after_slices=hold_after_slices)
        r = Retrieval(rid, prompt, truth, blocks, width, time.perf_counter())
        self.submitted.append(rid)
        self.worker.submit_retrieve(rid, key, blocks, layers_per_stage=width)
        return r

    def free(self, r: Retrieval) -> None:
        self.engine.free(r.blocks)

    # --- engine-side hooks -------------------------------------------------------------------

    def poll(self) -> list[str]:
        """One engine step's polls: released requests and failure reports, through the adapter."""
        ids = self.adapter.poll_released(self.worker)
        now = time.perf_counter()
        for rid in ids:
            require(rid not in self.released, "early-release",
                    f"kvstrata_poll_released reported request {rid} a second time; each request goes back to "
                    "the engine exactly once")
            self.released[rid] = now
        self.failed.update(self.adapter.take_failed(self.worker))
        return ids

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
        """Call the adapter's per-layer wait on a helper thread, so a wait that hangs cannot hang the suite."""
        done = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            try:
                self.adapter.wait_for_layer(self.worker, layer)
            except BaseException as exc:  # handed to the caller
                error.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name=f"conformance-wait-{layer}", daemon=True).start()
        return done, error

    def wait_for_layer(self, layer: int, timeout: float) -> tuple[bool, float]:
        """The adapter's per-layer wait, bounded: (returned within ``timeout``, seconds taken)."""
        t0 = time.perf_counter()
        done, error = self.start_wait(layer)
        returned = done.wait(timeout)
        if error:
            raise error[0]
        return returned, time.perf_counter() - t0

    def read(self, r: Retrieval, layer: int) -> bytes:
        return bytes(self.engine.read_layer(r.blocks, layer, len(r.prompt)))

    def check_layer(self, r: Retrieval, layer: int, context: str) -> None:
        got = self.read(r, layer)
        if got != r.truth[layer]:
            diff = sum(1 for a, b in zip(got, r.truth[layer]) if a != b)
            broken("layer-wait", f"request {r.request_id}: layer {layer} read after kvstrata_wait_for_layer is "
                                 f"not the stored KV ({diff} of {len(got)} bytes differ) {context}")

    def settle(self, timeout: float = 30.0) -> None:
        """Poll until the worker has nothing in flight (bounded: a hang is a broken rule)."""
        deadline = time.monotonic() + timeout
        while self.worker.in_flight() and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.002)
        self.poll()
        require(not self.worker.in_flight(), "failure-reported",
                f"retrieves {sorted(self.worker.in_flight())} were still in flight {timeout:.0f}s later: a transfer "
                "that never settles pins its blocks and arrival slot forever")

    # --- what went over the wire ---------------------------------------------------------------

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
