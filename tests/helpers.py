"""Shared test plumbing: an engine registered with a server, a prompt stored, the engine loop."""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.wire.transport import Client
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ModelShape, ReferenceEngine
from kvstrata.core.engine.placement import Placement
from kvstrata.core.transfer import planner

if TYPE_CHECKING:
    from kvstrata.core.engine.engine_placement import EnginePlacement
    from kvstrata.core.server.cache_server import CacheServer
    from kvstrata.core.shm import Segment

SMALL_32 = ModelShape(num_layers=32, kv_size=2, num_heads=2, head_size=16, dtype="bfloat16")

T = 64
"""Tokens per L1 object in the copy-plan tests."""


def uneven_job(layout, n_obj: int, skip: int) -> tuple[list[int], planner.TransferJob]:
    """Objects of T tokens but a short last one, back to back; the first ``skip`` tokens not copied."""
    tokens = [T] * (n_obj - 1) + [T // 2 + 3]
    copies = planner.plan_copies(tokens, T, 0, skip)
    return tokens, planner.TransferJob(layout, [list(range(n_obj * T // 16 + 1))], copies)


class RecordingNative:
    """Stands in for the native issuer thread only (``kvstrata.native.load_issuer``'s ``ext.LoadIssuer``): keeps
    each submitted program's words, for tests that check what is planned, not how it is issued."""

    def __init__(self, device: int) -> None:
        self.programs: list[np.ndarray] = []

    def submit(self, address: int, n_words: int) -> None:
        import ctypes
        self.programs.append(np.frombuffer((ctypes.c_int64 * n_words).from_address(address), dtype=np.int64).copy())


def store_prompt(client: CacheClient, engine: ReferenceEngine, prompt: list[int], instance_id: int = 0) -> None:
    blocks = engine.allocate(len(prompt))
    engine.prefill(prompt, blocks)
    client.store(CacheKey.for_tokens("store", prompt, model="m"), instance_id, [blocks])
    engine.clear(blocks)
    engine.free(blocks)


def lookup_into_fresh_blocks(client: CacheClient, engine: ReferenceEngine, request_id: str,
                             prompt: list[int]) -> tuple[CacheKey, list[int]]:
    """What precedes a retrieve: LOOKUP the whole prompt (it must hit), then allocate and poison its destination."""
    key = CacheKey.for_tokens(request_id, prompt, model="m")
    assert client.lookup(key) == len(prompt)
    dst = engine.allocate(len(prompt))
    engine.clear(dst)
    return key, dst


_released_elsewhere: "weakref.WeakKeyDictionary[Placement, dict[str, dict]]" = weakref.WeakKeyDictionary()
"""Requests a get_finished() call reported while release_of() waited for another one."""


def release_of(worker: Placement, request_id: str, timeout: float = 60.0) -> dict:
    """Poll get_finished until ``request_id`` is released; what was true at that moment (transfer still
    running? in the draining set?). The bound only catches a hang."""
    import time

    seen = _released_elsewhere.setdefault(worker, {})
    deadline = time.monotonic() + timeout
    while request_id not in seen:
        for r in worker.get_finished():
            draining = r in worker.draining()  # released and its transfer not ended
            seen[r] = {"transfer_ended": not draining, "draining": draining}
        if request_id in seen:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{request_id} was never released")
        time.sleep(0.0005)
    return seen.pop(request_id)


def planning_idle(worker: "EnginePlacement", timeout: float) -> None:
    """Wait (bounded) until no thread plans a load in ``worker``'s transfer queue: the enqueue thread lets go of the
    planning a moment after its last load (which may be after that load completed), and a load submitted while it
    holds it is left to it. Woken only for a load handed to it, it does not take the planning again."""
    planning = worker._queue._planning
    assert planning.acquire(timeout=timeout), "a load's planning never ended"
    planning.release()


def read_every_layer(worker: Placement, num_layers: int) -> None:
    """What an engine does after the release: wait before reading each layer, then let the transfer settle."""
    for layer in range(num_layers):
        worker.wait_for_layer(layer)
    worker.wait_all()


def engine_loop(worker: Placement, request_id: str, num_layers: int, timeout: float = 60.0) -> dict:
    """Poll get_finished until released, then wait before reading each layer (see :func:`release_of`)."""
    at_release = release_of(worker, request_id, timeout)
    read_every_layer(worker, num_layers)
    return at_release


def random_prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()


def scheduler_lookup(scheduler, rid: str, prompt: list[int]) -> int:
    """A ``SchedulerRuntime.lookup`` asked again each step until every rank answered (bounded: catches a hang)."""
    import time

    deadline = time.monotonic() + 30
    while (n := scheduler.lookup(rid, prompt, 0)) is None:
        assert time.monotonic() < deadline, "the lookup never completed"
        time.sleep(0.001)
    return n


@contextlib.contextmanager
def inprocess_cache_server(l1_bytes: int, chunk_size: int = 64) -> Iterator["CacheServer"]:
    """A real CacheServer (real ZMQ socket, real shared-memory pool) in this process, on a private IPC path."""
    from kvstrata.core.server.cache_server import CacheServer, ServerConfig

    directory = tempfile.mkdtemp(prefix="kvstrata-inprocess-")
    os.chmod(directory, 0o700)
    srv = CacheServer(ServerConfig(address=f"ipc://{directory}/server.sock", l1_bytes=l1_bytes,
                                   chunk_size=chunk_size))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def control_segment_of_unknown_kind(slots: int = 4, slot_bytes: int = 128) -> "Segment":
    """A segment with a well-formed kvstrata control header whose kind no longer exists (2, the retired request
    ring): the server must refuse it wherever a request names a control segment, and write nothing into it."""
    import ctypes

    from kvstrata.core.shm import CONTROL_HEADER_BYTES, CONTROL_MAGIC, CONTROL_VERSION, Segment

    seg = Segment.create("retired-kind", CONTROL_HEADER_BYTES + slots * slot_bytes)
    words = (ctypes.c_uint64 * 4).from_buffer(seg._mmap)
    words[1] = CONTROL_VERSION | (2 << 32)
    words[2], words[3] = slots, slot_bytes
    words[0] = CONTROL_MAGIC
    del words
    return seg


# --- probing the server's own checks: what a client that skips its validation sends --------------------------


def submit_unchecked(transport: Client, request_type: RequestType | int, payload: object) -> Future:
    """Send a request of any type with any payload, without the client's validation, and return the future for
    its reply: how the tests reach the server's checks with what a well-behaved client would refuse to send."""
    fut: Future = Future()
    transport._send_request(request_type, payload, fut)
    return fut


def send_raw(transport: Client, frame: bytes) -> None:
    """Send ``frame`` as it is, on ``transport``'s socket (a reply matching none of its futures is dropped)."""
    with transport._send_lock:
        transport._check_open()
        transport._sock.send([frame])
    transport._resolve_inbox()
