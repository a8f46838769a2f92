"""SGLang's offloads through :class:`LayerLoader`: the objects are reserved before the forward's writes are
awaited, and a reservation whose offload fails goes back to the pool at once.

The loader needs no SGLang import: these run the real loader thread on the reference engine's cache (worker
placement) against a real server. The wait for SGLang's offload-ready events is the test's own gate, so the
offload is held exactly where SGLang's forward would still be running.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kvstrata.adapters.reference import conformance as reference
from kvstrata.adapters.sglang.loader import LayerLoader
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.layouts import PLACEMENT_ENGINE

LAYERS, BLOCKS, BS = 4, 48, 16
PAGES = 6
BOUND = 60.0
"""Bounds on waits that only catch hangs."""


class NoLoads:
    """SGLang's layer counter, for a loader that only offloads here: a load reaching it fails the test."""

    num_layers = LAYERS

    def reset(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"these tests queue no load, yet the loader called the counter's {name}")


class ForwardGate:
    """Stands for the wait on SGLang's offload-ready events: blocks until the test lets the forward finish."""

    def __init__(self, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.finished = threading.Event()
        self.fail = fail

    def __call__(self, events: Any) -> None:
        self.entered.set()
        assert self.finished.wait(BOUND), "the test never let the forward finish"
        if self.fail:
            raise RuntimeError("the forward that computed these pages failed")


def page_chain(prompt: list[int]) -> list[str]:
    out, prev = [], b""
    for start in range(0, len(prompt), BS):
        prev = hashlib.sha256(prev + repr(prompt[start:start + BS]).encode()).digest()
        out.append(prev.hex())
    return out


@pytest.fixture
def offloading(server: Any, tmp_path: Any, request: Any):
    """(loader, cache, gate) on a fresh runtime: a gate that fails when the test is parametrized so."""
    gate = ForwardGate(fail=getattr(request, "param", False))
    settings = RuntimeSettings(server.address, placement=PLACEMENT_ENGINE, layers_per_slice=1,
                               instance_id=740 + int(gate.fail), record_path=str(tmp_path / "r.jsonl"))
    cache = reference.ReferenceCache(HarnessSpec(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS))
    runtime = WorkerRuntime(load_adapter("reference"), settings, model=f"offload-{gate.fail}")
    runtime.register(cache.kv_caches)
    loader = LayerLoader(runtime, NoLoads(), page_size=BS, wait_for_offload_inputs=gate)
    try:
        yield loader, cache, gate
    finally:
        gate.finished.set()
        loader.close()
        cache.close()


def computed_pages(cache: Any, seed: int) -> tuple[list[int], list[str], torch.Tensor]:
    prompt = [(seed * 131 + 7 * i) % 997 for i in range(PAGES * BS)]
    blocks = cache.allocate(len(prompt))
    cache.prefill(prompt, blocks)
    slots = torch.tensor([b * BS + t for b in blocks[0] for t in range(BS)], dtype=torch.int64)
    return prompt, page_chain(prompt), slots


def free_bytes(client: Any) -> int:
    return int(client.server_info()["l1"]["free_bytes"])


def completed(loader: LayerLoader) -> bool:
    deadline = time.monotonic() + BOUND
    while loader.num_completed_offloads() == 0:
        assert time.monotonic() < deadline, "the offload never completed"
        time.sleep(0.001)
    return loader.pop_completed_offload()


def wait_reserved(client: Any, before: int) -> int:
    """The pool's free bytes once a reservation took some of ``before`` (bounded)."""
    deadline = time.monotonic() + BOUND
    while (now := free_bytes(client)) >= before:
        assert time.monotonic() < deadline, "no objects were reserved while the forward ran"
        time.sleep(0.001)
    return now


def offload_held_at_the_forward(client: Any, loader: LayerLoader, cache: Any, gate: ForwardGate,
                                seed: int) -> tuple[list[str], int]:
    """Offload fresh pages and return (their hashes, the pool's free bytes before) once the offload waits for
    its forward (the gate) with its objects reserved."""
    _, hashes, slots = computed_pages(cache, seed=seed)
    before = free_bytes(client)
    loader.offload(hashes, slots, ready=["forward's event"])
    assert gate.entered.wait(BOUND)
    wait_reserved(client, before)
    return hashes, before


def test_an_offload_reserves_its_objects_while_the_forward_runs_and_stores_into_them(client, offloading):
    loader, cache, gate = offloading
    hashes, _ = offload_held_at_the_forward(client, loader, cache, gate, seed=1)  # the gate still holds it
    assert loader.num_completed_offloads() == 0
    assert client.lookup(CacheKey.for_page_hashes("peek", hashes, BS, model="offload-False")) == 0, \
        "a reservation is not a hit"
    gate.finished.set()
    assert completed(loader) is True
    last = loader.runtime.transfers.last_store
    assert last.reserved_ahead, "the store copied into the reservation made before the forward's writes"
    assert client.lookup(CacheKey.for_page_hashes("peek2", hashes, BS, model="offload-False")) == PAGES * BS


@pytest.mark.parametrize("offloading", [True], indirect=True, ids=["forward-fails"])
def test_an_offload_whose_forward_fails_gives_its_reservation_back_and_stores_nothing(client, offloading):
    loader, cache, gate = offloading
    hashes, before = offload_held_at_the_forward(client, loader, cache, gate, seed=2)
    gate.finished.set()  # the wait raises
    assert completed(loader) is False
    assert free_bytes(client) == before, "the reservation went back with the failed offload, not 4 steps later"
    assert client.lookup(CacheKey.for_page_hashes("peek3", hashes, BS, model="offload-True")) == 0


def test_closing_the_loader_unregisters_removes_its_segment_and_nothing_registers_again(server, client, tmp_path):
    """SGLang's shutdown closes the linker (``release_host_resources``; the linker's ``atexit`` hook as the last
    resort): the loader unregisters its instance and removes its registration area. A second close is a no-op,
    and SGLang's calls after it (its storage threads may still run at exit) never reach the server again."""
    settings = RuntimeSettings(server.address, placement=PLACEMENT_ENGINE, layers_per_slice=1, instance_id=750,
                               record_path=str(tmp_path / "r.jsonl"))
    cache = reference.ReferenceCache(HarnessSpec(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS))
    try:
        runtime = WorkerRuntime(load_adapter("reference"), settings, model="offload-close")
        runtime.register(cache.kv_caches)
        loader = LayerLoader(runtime, NoLoads(), page_size=BS)
        area = Path("/dev/shm") / runtime.registration_area.segment.name
        assert area.exists() and 750 in client.server_info()["instances"]
        _, hashes, slots = computed_pages(cache, seed=3)
        loader.offload(hashes, slots)
        assert completed(loader) is True
        loader.close()
        assert not area.exists(), "the registration area outlived the loader"
        assert 750 not in client.server_info()["instances"], "the instance is still registered"
        loader.close()  # SGLang's close, then the atexit hook: the second finds it done
        assert loader.restorable_pages("after-close", hashes) == 0
        assert loader.queue_load("after-close", hashes, slots) is False
        loader.offload(hashes, slots)
        assert completed(loader) is False
        assert 750 not in client.server_info()["instances"] and not area.exists(), "a call after close registered"
    finally:
        cache.close()
