"""Lookup locks belong to one engine: engines sharing a server never free each other's, whatever their ids.

TensorRT-LLM numbers its requests from 1 in every engine and vLLM takes request ids from its clients, so two
engines on one server do send the same request id. A lock owner is the request id namespaced by the rank's
registered instance id, which the server already requires to differ between engines.

A request the engine admits again (vLLM re-admits one whose load failed, with ``kv_load_failure_policy:
recompute``, or that it preempted) is looked up afresh, under a new attempt of its owner: it gets a load of its
own, and a late release of the earlier attempt's locks never frees the new attempt's.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from typing import Any, Iterator

import pytest
from kvstrata.adapters.reference import conformance as reference
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.engine.requests import lock_owner, request_of_lock_owner
from kvstrata.core.engine.scheduler_runtime import ScheduledRequest, SchedulerRuntime
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.conformance_tests.slice_hold import add_slice_observer, remove_slice_observer

from helpers import scheduler_lookup

BS = 16
MODEL = "lock-owners"
LAYERS = 2
BOUND = 30.0
"""Only catches a hang: every wait below ends as soon as what it waits for has happened."""

TRICKY_IDS = ["7", "", "a@i3", "x@i", "@i12@i", "tp@tp0/2", "x@a5", "x@a", "@a0@i3", "r@a1@i2", "@a", "a@a01"]


@pytest.mark.parametrize("request_id", TRICKY_IDS)
def test_an_owner_names_one_request_of_one_instance_and_gives_the_request_back(request_id: str) -> None:
    owners = {lock_owner(request_id, i) for i in (0, 3, 12, 500)}
    assert len(owners) == 4
    assert all(request_of_lock_owner(o) == request_id for o in owners)
    # "a@i3" on instance 4 and "a" on instance 3 must not meet in "a@i3@i4" vs "a@i3"
    assert lock_owner(request_id + "@i3", 4) != lock_owner(request_id, 3)
    # a first attempt's owner is the plain one: what engines that never look a request up twice always sent
    if not re.search(r"@a[0-9]+$", request_id):
        assert lock_owner(request_id, 3, 0) == f"{request_id}@i3"


def test_every_request_instance_and_attempt_has_its_own_owner_which_gives_the_request_back() -> None:
    made = {}
    for request_id, instance, attempt in itertools.product(TRICKY_IDS, (0, 3, 30), (0, 1, 2, 10)):
        owner = lock_owner(request_id, instance, attempt)
        assert owner.endswith(f"@i{instance}"), owner  # the server reads the instance from the end
        assert request_of_lock_owner(owner) == request_id, (request_id, attempt, owner)
        assert made.setdefault(owner, (request_id, instance, attempt)) == (request_id, instance, attempt), owner
    with pytest.raises(ValueError):
        lock_owner("r", 0, -1)


def test_an_engine_ending_its_request_leaves_the_locks_of_another_engines_request_of_the_same_id(server: Any):
    one = RuntimeSettings(server.address, instance_id=600)
    other = RuntimeSettings(server.address, instance_id=610)
    cache = reference.ReferenceCache(HarnessSpec(num_layers=2, num_blocks=32, block_size=BS))
    worker = WorkerRuntime(load_adapter("reference"), one, model=MODEL)
    schedulers = [SchedulerRuntime(load_adapter("reference"), s, model=MODEL, block_size=BS) for s in (one, other)]
    try:
        worker.register(cache.kv_caches)
        prompt = list(range(300, 300 + 4 * BS))
        blocks = cache.allocate(len(prompt))
        cache.prefill(prompt, blocks)
        first = schedulers[0]
        assert scheduler_lookup(first, "1", prompt) == 0
        first.allocated("1", blocks, 0)
        worker.store(first.plan_step([ScheduledRequest("1", 0, len(prompt))], (), block_ids_of=lambda _: blocks).stores)
        first.finished("1")
        # Both engines now ask for their own request "2": each LOOKUP locks the hit under its own owner.
        assert [scheduler_lookup(s, "2", prompt) for s in schedulers] == [len(prompt), len(prompt)]
        schedulers[0].finished("2")  # the first engine's request ends: it frees its own locks only
        # The release is one-way: a call on the same connection is served after it (one connection's quick
        # requests are served in the order they were sent). Each engine's connection holds its own locks.
        assert schedulers[0].client.free_lookup_locks(lock_owner("2", 600)) == 0, "the first engine's are gone"
        assert schedulers[1].client.free_lookup_locks(lock_owner("2", 610)) > 0, "the other engine's were kept"
    finally:
        for s in schedulers:
            s.close()
        worker.close()
        cache.close()


# --- a request admitted again -----------------------------------------------------------------------------------


@contextlib.contextmanager
def first_load_fails() -> Iterator[list[str]]:
    """Make the first transfer this process copies fail before its first slice (engine placement: the copies run
    here), through a slice observer the test adds to every transfer queue this process builds. Yields the names (lock owners) of the transfers failed."""
    failed: list[str] = []

    def hook(name: str, slices: int) -> None:
        if slices == 0 and not failed:
            failed.append(name)
            raise RuntimeError(f"test: load {name} fails on purpose")

    add_slice_observer(hook)
    try:
        yield failed
    finally:
        remove_slice_observer(hook)


class Engine:
    """One engine's scheduler and worker runtimes over a reference cache, driven as an engine's steps would."""

    def __init__(self, server: Any, placement: str, instance_id: int) -> None:
        self.settings = RuntimeSettings(server.address, layers_per_slice=1, placement=placement,
                                        instance_id=instance_id, layer_wait_timeout=BOUND, retrieve_timeout=BOUND)
        self.cache = reference.ReferenceCache(HarnessSpec(num_layers=LAYERS, num_blocks=64, block_size=BS))
        self.scheduler = SchedulerRuntime(load_adapter("reference"), self.settings, model=MODEL, block_size=BS)
        self.worker = WorkerRuntime(load_adapter("reference"), self.settings, model=MODEL)
        self.worker.register(self.cache.kv_caches)
        assert self.worker.connected

    def store(self, rid: str, prompt: list[int]) -> list[bytes]:
        blocks = self.cache.allocate(len(prompt))
        self.cache.prefill(prompt, blocks)
        assert scheduler_lookup(self.scheduler, rid, prompt) == 0
        self.scheduler.allocated(rid, blocks, 0)
        plan = self.scheduler.plan_step([ScheduledRequest(rid, 0, len(prompt))], (), block_ids_of=lambda _: blocks)
        self.worker.reserve_stores(plan.stores)
        self.worker.store(plan.stores)
        assert not self.scheduler.finished(rid)
        return [self.cache.read_layer(blocks, layer, len(prompt)) for layer in range(LAYERS)]

    def admit(self, rid: str, prompt: list[int]) -> tuple[int, list[list[int]]]:
        """Look ``rid`` up and allocate blocks for its hit (cleared, so a load that did not land shows)."""
        hit = scheduler_lookup(self.scheduler, rid, prompt)
        blocks = self.cache.allocate(len(prompt))
        self.cache.clear(blocks)
        self.scheduler.allocated(rid, blocks, hit)
        return hit, blocks

    def released(self, rid: str) -> None:
        """Poll until the worker side hands ``rid`` back, and tell the scheduler side (bounded)."""
        deadline = time.monotonic() + BOUND
        while True:
            _, released = self.worker.poll()
            if released:
                assert released == {rid}
                self.scheduler.released(released)
                return
            assert time.monotonic() < deadline, f"{rid} was never handed back"
            time.sleep(0.001)

    def finish(self, rid: str) -> None:
        """The request ends: the scheduler side keeps its blocks, and the worker side frees them (bounded)."""
        assert self.scheduler.finished(rid) is True
        finished, deadline = [rid], time.monotonic() + BOUND
        while True:
            freeable, _ = self.worker.poll(finished)
            finished = []
            if rid in freeable:
                return
            assert time.monotonic() < deadline, f"{rid}'s blocks were never freeable"
            time.sleep(0.001)

    def wait_unlocked(self) -> None:
        """Every lookup lock on the server is released (bounded: the worker frees a copy's with a one-way send)."""
        deadline = time.monotonic() + BOUND
        while self.scheduler.client.server_info()["l1"]["locked_objects"]:
            assert time.monotonic() < deadline, "lookup locks were left on the server"
            time.sleep(0.005)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
        self.cache.close()


def test_a_request_admitted_again_after_its_load_failed_is_loaded_again_and_leaves_no_lock(server: Any) -> None:
    """vLLM with ``kv_load_failure_policy: recompute``: a load that failed from its first block sends the request
    back to waiting with nothing computed, and vLLM asks the connector for it again. It must get a load (it
    waited for one forever before) whose data lands, and neither attempt's locks may stay behind."""
    engine = Engine(server, "engine", instance_id=630)
    try:
        prompt = list(range(2000, 2000 + 16 * BS))
        truth = engine.store("again-store", prompt)
        with first_load_fails() as failed:
            hit, _ = engine.admit("again", prompt)
            assert hit == len(prompt)
            first = engine.scheduler.plan_step([], (), block_ids_of=lambda _: [])
            assert [(s.request_id, s.attempt) for s in first.loads] == [("again", 0)]
            engine.worker.start_loads(first.loads)
            engine.released("again")
            assert failed == [lock_owner("again", 630)]
            assert [f for f in engine.worker.take_load_failures() if f], "the failure was not reported"

        hit, blocks = engine.admit("again", prompt)  # vLLM admits it again
        assert hit == len(prompt)
        second = engine.scheduler.plan_step([], (), block_ids_of=lambda _: [])
        assert [(s.request_id, s.attempt) for s in second.loads] == [("again", 1)], "no load for the second attempt"
        engine.worker.start_loads(second.loads)
        engine.released("again")
        for layer in range(LAYERS):
            engine.worker.wait_for_layer(layer)
            assert engine.cache.read_layer(blocks, layer, len(prompt)) == truth[layer]
        assert engine.worker.take_load_failures() == []
        engine.finish("again")
        engine.wait_unlocked()
    finally:
        engine.close()


def test_a_late_release_of_an_earlier_attempts_locks_leaves_the_new_attempts(server: Any) -> None:
    """Server placement: a RETRIEVE needs its key's locks, and releases them once served. The earlier attempt's
    load runs last but one (as a late copy of it would): the new attempt's RETRIEVE still finds its own locks."""
    engine = Engine(server, "server", instance_id=640)
    try:
        prompt = list(range(4000, 4000 + 8 * BS))
        truth = engine.store("late-store", prompt)
        engine.admit("late", prompt)
        early = engine.scheduler.plan_step([], (), block_ids_of=lambda _: [])
        hit, blocks = engine.admit("late", prompt)  # admitted again before the first load ran
        later = engine.scheduler.plan_step([], (), block_ids_of=lambda _: [])
        assert [s.attempt for s in early.loads + later.loads] == [0, 1]

        engine.worker.start_loads(early.loads)  # the earlier attempt's copy, late: its RETRIEVE frees its locks
        engine.released("late")
        engine.worker.start_loads(later.loads)
        engine.released("late")
        assert engine.worker.take_load_failures() == [], "the new attempt lost its locks to the earlier one's release"
        for layer in range(LAYERS):
            engine.worker.wait_for_layer(layer)
            assert engine.cache.read_layer(blocks, layer, hit) == truth[layer]
        engine.finish("late")
        engine.wait_unlocked()
    finally:
        engine.close()


def test_a_hit_admitted_again_before_its_load_was_handed_over_has_its_locks_freed_and_one_load(server: Any) -> None:
    engine = Engine(server, "engine", instance_id=650)
    try:
        prompt = list(range(6000, 6000 + 4 * BS))
        engine.store("unsent-store", prompt)
        engine.admit("unsent", prompt)  # planned, not handed to the worker side yet
        hit, _ = engine.admit("unsent", prompt)
        plan = engine.scheduler.plan_step([], (), block_ids_of=lambda _: [])
        assert [(s.request_id, s.attempt) for s in plan.loads] == [("unsent", 1)]
        # the first attempt's locks were freed (one-way, served before this call on the same connection)
        assert engine.scheduler.client.free_lookup_locks(lock_owner("unsent", 650, 0)) == 0
        engine.worker.start_loads(plan.loads)
        engine.released("unsent")
        engine.finish("unsent")
        engine.wait_unlocked()
    finally:
        engine.close()
