"""SGLang through the engine runtime: lookups, their locks and the back-off are the ``SchedulerRuntime``'s.

SGLang's linker must answer a lookup at once, names prompts by its page-hash chain and runs one scheduler per
tensor-parallel rank; the scheduler runtime serves each with a public method any engine may use
(``lookup_pages``, ``wait_for_lookups``, ``rank``, ``backing_off``). These tests drive those methods against
a real server, then :class:`LayerLoader` (what ``KvstrataLinker`` runs) on SGLang-shaped CPU buffers with the
SGLang adapter's hooks: a load by page hashes puts back the offloaded bytes layer by layer, and every path
(probe, load, refusal, cancel) leaves no lookup lock on the server. No SGLang import is needed.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future
from typing import Any, Iterator

import pytest
import torch
from kvstrata.adapters.sglang import hooks as sglang_hooks
from kvstrata.adapters.sglang.kv_layout import SglangKVBuffers
from kvstrata.adapters.sglang.loader import LayerLoader
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.scheduler_runtime import SchedulerRuntime
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime

PAGE, LAYERS, HEADS, HEAD = 16, 3, 2, 8
PAGES = 8
SRC = list(range(1, 1 + PAGES))
DST = list(range(1 + PAGES, 1 + 2 * PAGES))
BOUND = 60.0
"""Bounds on waits that only catch hangs."""


class Counter:
    """SGLang's ``LayerWiseLoadCounter`` (its names and meaning): one future per layer per producer index."""

    def __init__(self) -> None:
        self.num_layers = LAYERS
        self.futures: dict[int, list[Future]] = {}
        self.index = -1

    def update_producer(self) -> int:
        self.index += 1
        self.futures[self.index] = [Future() for _ in range(LAYERS)]
        return self.index

    def complete(self, index: int, layer: int) -> None:
        self.futures[index][layer].set_result(None)

    def fail(self, index: int, error: BaseException) -> None:
        for f in self.futures.get(index, ()):
            if not f.done():
                f.set_exception(error)

    def finish(self, index: int) -> bool:
        landed = all(f.exception(timeout=BOUND) is None for f in self.futures.get(index, ()))
        self.futures.pop(index, None)
        return landed

    def reset(self) -> None:
        self.futures.clear()


def chain(seed: str, n: int = PAGES) -> list[str]:
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + str(i).encode()).digest()
        out.append(prev.hex())
    return out


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def buffers() -> SglangKVBuffers:
    n = (1 + 2 * PAGES) * PAGE
    def planes() -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(n, HEADS, HEAD, dtype=torch.bfloat16) for _ in range(LAYERS))

    return SglangKVBuffers(planes(), planes(), PAGE)


def settings(server: Any, tmp_path: Any, instance_id: int, **extra: Any) -> RuntimeSettings:
    return RuntimeSettings.from_mapping({"server_address": server.address, "placement": "engine",
                                         "layers_per_slice": 1, "instance_id": instance_id,
                                         "record_path": str(tmp_path / f"record-{instance_id}.jsonl"), **extra},
                                        where="test")


def locked_objects(client: Any) -> int:
    return int(client.server_info()["l1"]["locked_objects"])


def wait_unlocked(client: Any) -> None:
    """Lock releases are one-way messages: wait (bounded) until the server has taken them."""
    deadline = time.monotonic() + BOUND
    while locked_objects(client):
        assert time.monotonic() < deadline, "a lookup lock was never released"
        time.sleep(0.002)


def worker(server: Any, tmp_path: Any, instance_id: int, *, rank: int = 0, world_size: int = 1,
           **extra: Any) -> tuple[WorkerRuntime, SglangKVBuffers]:
    kv = buffers()
    s = settings(server, tmp_path, instance_id, **extra)
    runtime = WorkerRuntime(load_adapter(sglang_hooks, check_engine=False), s, model="sglang-runtime", rank=rank,
                            world_size=world_size)
    runtime.register(kv)
    assert runtime.connected
    return runtime, kv


def fill(kv: SglangKVBuffers, pages: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = slots(pages)
    for t in kv.planes():
        t[idx] = torch.randn(len(idx), HEADS, HEAD, generator=g).to(t.dtype)
    return [t[idx].clone() for t in kv.planes()]


def run_load(runtime: WorkerRuntime, spec: Any) -> None:
    """What the loader thread does with a planned load: start it, wait until it is released, wait on every
    layer, let it settle (each bounded)."""
    runtime.start_loads([spec])
    deadline = time.monotonic() + BOUND
    while spec.request_id not in runtime.poll()[1]:
        assert time.monotonic() < deadline, "the load was never released"
        time.sleep(0.001)
    for layer in range(LAYERS):
        runtime.wait_for_layer(layer)
    while spec.request_id in runtime.in_flight():
        assert time.monotonic() < deadline, "the load never settled"
        runtime.poll()
        time.sleep(0.001)
    runtime.poll([spec.request_id])
    assert runtime.take_load_failures() == []


def offloaded(loader: LayerLoader, hashes: list[str], pages: list[int]) -> bool:
    loader.offload(hashes, slots(pages))
    deadline = time.monotonic() + BOUND
    while loader.num_completed_offloads() == 0:
        assert time.monotonic() < deadline, "the offload never completed"
        time.sleep(0.001)
    return loader.pop_completed_offload()


@pytest.fixture
def linker(server: Any, client: Any, tmp_path: Any) -> Iterator[tuple[LayerLoader, SglangKVBuffers, Counter]]:
    """The loader ``KvstrataLinker`` runs, on a fresh registered runtime; no lookup lock outlives a test."""
    runtime, kv = worker(server, tmp_path, instance_id=790)  # unregistered again at the end of each test
    counter = Counter()
    loader = LayerLoader(runtime, counter, page_size=PAGE)
    try:
        yield loader, kv, counter
        loader.drain()
        wait_unlocked(client)
    finally:
        loader.close()


# --- the scheduler runtime's methods -----------------------------------------------------------------


def test_a_lookup_by_page_hashes_answered_at_once_plans_a_load_that_puts_the_bytes_back(server, client, tmp_path):
    runtime, kv = worker(server, tmp_path, instance_id=780)
    scheduler = SchedulerRuntime(runtime.adapter, runtime.settings, model="sglang-runtime", block_size=PAGE)
    try:
        truth = fill(kv, SRC, seed=1)
        hashes = chain("plan")
        loader = LayerLoader(runtime, Counter(), page_size=PAGE)  # its offload stores the pages
        assert offloaded(loader, hashes, SRC) is True
        assert scheduler.lookup_pages("r1", hashes) is None  # the LOOKUP is out: ask again
        scheduler.wait_for_lookups(["r1"])
        assert scheduler.lookup_pages("r1", hashes) == PAGES * PAGE
        assert locked_objects(client) > 0, "the hit is locked for its load"
        scheduler.allocated("r1", [list(DST)], PAGES * PAGE)
        (spec,) = scheduler.plan_step((), (), lambda _: ()).loads
        assert spec.tokens == b"" and spec.page_hashes == tuple(hashes) and spec.page_size == PAGE
        assert spec.located is not None and spec.located[0] is not None, "the load starts from where LOOKUP found it"
        run_load(runtime, spec)
        idx = slots(DST)
        assert all(torch.equal(t[idx], want) for t, want in zip(kv.planes(), truth, strict=True))
        assert scheduler.finished("r1") is False
        wait_unlocked(client)  # the worker side freed the load's locks once it had copied
        loader.close()
    finally:
        scheduler.close()
        runtime.close()


def test_a_scheduler_of_one_rank_looks_up_and_locates_that_ranks_shard_alone(server, client, tmp_path):
    """SGLang runs a scheduler per TP rank: rank 1's scheduler loads what rank 1 stored, though rank 0 stored
    nothing (a scheduler of every rank sees a miss: the hit is what every rank's shard holds)."""
    runtime, kv = worker(server, tmp_path, instance_id=782, rank=1, world_size=2)
    one = SchedulerRuntime(runtime.adapter, runtime.settings, model="sglang-runtime", block_size=PAGE, world_size=2,
                           rank=1)
    every = SchedulerRuntime(runtime.adapter, runtime.settings, model="sglang-runtime", block_size=PAGE,
                             world_size=2)
    try:
        fill(kv, SRC, seed=2)
        hashes = chain("rank")
        loader = LayerLoader(runtime, Counter(), page_size=PAGE)
        assert offloaded(loader, hashes, SRC) is True
        for scheduler, rid, want in ((every, "r2-every", 0), (one, "r2", PAGES * PAGE)):
            assert scheduler.lookup_pages(rid, hashes) is None
            scheduler.wait_for_lookups([rid])
            assert scheduler.lookup_pages(rid, hashes) == want
        one.allocated("r2", [list(DST)], PAGES * PAGE)
        (spec,) = one.plan_step((), (), lambda _: ()).loads
        assert spec.located is not None and spec.located[0] is None and spec.located[1] is not None
        truth = [t[slots(SRC)].clone() for t in kv.planes()]
        run_load(runtime, spec)
        assert all(torch.equal(t[slots(DST)], want) for t, want in zip(kv.planes(), truth, strict=True))
        every.finished("r2-every")
        one.finished("r2")
        wait_unlocked(client)
        loader.close()
    finally:
        one.close()
        every.close()
        runtime.close()
    with pytest.raises(ValueError, match="rank 2"):
        SchedulerRuntime(runtime.adapter, runtime.settings, model="m", block_size=PAGE, world_size=2, rank=2)


def test_a_server_that_does_not_answer_is_waited_for_once_then_left_alone(tmp_path):
    """The back-off is the runtime's: after one LOOKUP went unanswered for ``lookup_timeout``, lookups answer 0
    at once (no LOOKUP, no wait) and ``backing_off`` says so, for five timeouts."""
    s = RuntimeSettings.from_mapping({"server_address": f"ipc://{tmp_path}/nobody.sock", "lookup_timeout": 1.0},
                                     where="test")
    scheduler = SchedulerRuntime(load_adapter(sglang_hooks, check_engine=False), s, model="m", block_size=PAGE)
    try:
        hashes = chain("down")
        assert not scheduler.backing_off
        started = time.monotonic()
        assert scheduler.lookup_pages("d1", hashes) is None
        scheduler.wait_for_lookups(["d1"])
        assert time.monotonic() - started >= s.lookup_timeout
        assert scheduler.lookup_pages("d1", hashes) == 0
        assert scheduler.backing_off
        assert scheduler.lookup_pages("d2", hashes) == 0, "during the back-off a lookup answers at once"
        scheduler.wait_for_lookups(["d2"])  # nothing is in flight: returns at once
    finally:
        scheduler.close()


# --- the SGLang loader on them ------------------------------------------------------------------------


def test_the_loader_loads_offloaded_pages_layer_by_layer_and_leaves_no_lock(linker, client):
    loader, kv, counter = linker
    truth = fill(kv, SRC, seed=3)
    hashes = chain("load")
    assert offloaded(loader, hashes, SRC) is True
    assert offloaded(loader, hashes, SRC) is True, "pages the server holds are an offload done"
    assert loader.restorable_pages("p1", hashes) == PAGES
    wait_unlocked(client)  # the probe's locks go at once
    assert loader.restorable_pages("p1", hashes + chain("not stored", 2)) == PAGES
    wait_unlocked(client)
    assert loader.queue_load("p1", hashes, slots(DST)) is True
    assert locked_objects(client) > 0, "a queued load holds its chunks"
    index = loader.start()
    assert index >= 0 and loader.start() == -1
    assert loader.finish(index) is True
    idx = slots(DST)
    assert all(torch.equal(t[idx], want) for t, want in zip(kv.planes(), truth, strict=True))
    loader.drain()
    wait_unlocked(client)
    # the request is forgotten once its load settled: it may be loaded again, from its first lock attempt
    assert loader.queue_load("p1", hashes, slots(DST)) is True
    assert loader.finish(loader.start()) is True


def test_a_refused_load_and_a_cancelled_load_free_their_locks(linker, client):
    loader, kv, _ = linker
    fill(kv, SRC, seed=4)
    hashes = chain("refuse")
    assert offloaded(loader, hashes, SRC) is True
    more = hashes + chain("missing", 2)
    assert loader.queue_load("p2", more, slots(DST + [2 * PAGES - 1, 2 * PAGES])) is False
    wait_unlocked(client)
    assert loader.queue_load("p3", hashes, slots(DST)) is True
    assert locked_objects(client) > 0
    assert loader.cancel("p3") is True and loader.cancel("p3") is False
    wait_unlocked(client)
    assert loader.start() == -1, "a cancelled load never starts"
