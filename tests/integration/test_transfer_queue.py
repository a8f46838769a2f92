"""The engine placement's one transfer queue: concurrent loads' slices go one load after another."""

import contextlib
import threading
import time

import pytest

from kvstrata.core.arrival.events import HostCopier, HostEventBackend
from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.conformance_tests.slice_hold import SliceHold

from helpers import (SMALL_32, lookup_into_fresh_blocks, planning_idle, random_prompt, read_every_layer, release_of,
                     store_prompt)


def test_the_retired_policy_setting_is_ignored_with_a_warning(caplog):
    caplog.set_level("WARNING")
    settings = RuntimeSettings.from_mapping({"server_address": "ipc:///tmp/x", "transfer_queue_policy": "round_robin"},
                                            where="cfg")
    assert not hasattr(settings, "transfer_queue_policy")
    assert any("cfg.transfer_queue_policy='round_robin' is no longer a setting" in r.message for r in caplog.records)


def test_concurrent_loads_reach_the_copier_one_after_another(client, tmp_path):
    """Through a real server: a first load is held before its first slice, so the two loads submitted
    meanwhile reach the queue together; their slices are enqueued one load after the other, and both
    land byte-exact."""
    tokens, width = 64, 8  # 32 layers: four slices per load
    hold = SliceHold(tmp_path / "hold")
    hold.hold("first", after_slices=0)
    engine = ReferenceEngine(SMALL_32, num_blocks=3 * tokens // 16 + 4, block_size=16)
    enqueued: list[str] = []

    def record_then_hold(request_id: str, published: int) -> None:
        if published > 0:
            enqueued.append(request_id)
        hold.on_slice(request_id, published)

    worker = EnginePlacement(client, 11, engine.layout, local_regions=engine.regions, slice_observer=record_then_hold)
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=21)
        store_prompt(client, engine, prompt, instance_id=11)
        dsts = {}
        for rid in ("first", "a", "b"):
            key, dsts[rid] = lookup_into_fresh_blocks(client, engine, rid, prompt)
            worker.submit_retrieve(rid, key, [dsts[rid]], layers_per_slice=width)
            if rid == "first":
                hold.wait_held("first")
        hold.open("first")
        released: set[str] = set()
        deadline = time.monotonic() + 60  # only catches a hang
        while len(released) < 3 and time.monotonic() < deadline:
            released.update(worker.get_finished())
            time.sleep(0.001)
        assert released == {"first", "a", "b"}
        read_every_layer(worker, SMALL_32.num_layers)
        assert enqueued[:4] == ["first"] * 4
        assert enqueued[4:] == ["a"] * 4 + ["b"] * 4
        assert_landed_whole(worker, engine, prompt, dsts)
    finally:
        hold.open_all()
        worker.close()
        engine.close()


class _GatedCopier(HostCopier):
    """The CPU copies, but a slice counts as landed only once the test sets its completion: the state a GPU's
    copy engine is in while slices are still queued, held instead of raced for."""

    def __init__(self, *args, completions: list[threading.Event], landing: threading.Event) -> None:
        super().__init__(*args)
        self.completions = completions
        self.landing = landing

    def mark_slice(self, executor):
        done = threading.Event()
        if self.landing.is_set():
            done.set()
        self.completions.append(done)
        return done

    def finish(self, last_completion) -> None:
        if last_completion is not None:
            assert last_completion.wait(60), "the test never landed the slice the settle thread waits for"


class _GatedBackend(HostEventBackend):
    """Host events whose ``landed`` is the test's word."""

    def __init__(self, copier_class: type["_GatedCopier"] | None = None) -> None:
        """``copier_class``: the gated copier this backend builds (default :class:`_GatedCopier`), kept as
        ``copier`` for the test to read."""
        self.completions: list[threading.Event] = []
        self.landing = threading.Event()
        """Set: every slice lands as soon as it is enqueued (the test's teardown)."""
        self._copier_class = copier_class or _GatedCopier
        self.copier: _GatedCopier | None = None

    def land_everything(self) -> None:
        self.landing.set()
        for done in list(self.completions):
            done.set()

    def landed(self, event) -> bool:
        return event is None or event.is_set()

    def engine_copier(self, layout, regions, pool, writable=False):
        self.copier = self._copier_class(layout, list(regions), pool, completions=self.completions,
                                         landing=self.landing)
        return self.copier


def test_the_queue_plans_every_slice_without_waiting_for_any_to_land(client, tmp_path):
    """Engine placement with no slice landed: the queue still hands every slice of the load to the copier (on a
    GPU a native thread issues them: nothing paces the planning), the load is not released before its first
    slice lands, every layer wait is answered with its slice's completion, and every layer lands byte-exact."""
    tokens = 64
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 4, block_size=16)
    backend = _GatedBackend()
    published: list[int] = []  # slices enqueued so far, as the queue tells its observer
    worker = EnginePlacement(client, 13, engine.layout, local_regions=engine.regions,
                             event_backend=backend, slice_observer=lambda request_id, n: published.append(n))
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=22)
        store_prompt(client, engine, prompt, instance_id=13)
        key, dst = lookup_into_fresh_blocks(client, engine, "ahead", prompt)
        worker.submit_retrieve("ahead", key, [dst], layers_per_slice=1)
        deadline = time.monotonic() + 60  # only catches a hang
        while len(published) < SMALL_32.num_layers + 1:
            assert time.monotonic() < deadline, published
            time.sleep(0.001)
        assert published == list(range(SMALL_32.num_layers + 1))
        assert len(backend.completions) == SMALL_32.num_layers and not any(e.is_set() for e in backend.completions)
        assert worker.get_finished() == []  # recorded is not landed: no release yet
        first = backend.completions[0]
        first.set()
        assert release_of(worker, "ahead")["transfer_ended"] is False
        for layer in range(SMALL_32.num_layers):
            worker.wait_for_layer(layer)
        for done in backend.completions:
            done.set()
        worker.wait_all()
        assert worker.records["ahead"].failure is None
        assert engine.mismatched_layers(prompt, dst, 0, tokens) == []
    finally:
        backend.land_everything()
        worker.close()
        engine.close()


def test_a_load_located_by_its_lookup_is_planned_on_the_engines_thread_at_submit(client):
    """With nothing queued before it and its locations in hand, the load is planned by the thread that submits it
    (on the CPU its copies have run when submit returns); a load that must ask RETRIEVE goes to the enqueue thread."""
    from kvstrata.core.engine.requests import ChunkLocations
    from kvstrata.core.store.keys import CacheKey

    tokens = 64
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 4, block_size=16)
    worker = EnginePlacement(client, 14, engine.layout, local_regions=engine.regions)
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=23)
        store_prompt(client, engine, prompt, instance_id=14)
        key = CacheKey.for_tokens("inline", prompt, model="m")
        reply = client.transport.wait(client.lookup_async(key))
        assert reply["hit_tokens"] == tokens
        dst = engine.allocate(tokens)
        engine.clear(dst)
        worker.submit_retrieve("inline", key, [dst], layers_per_slice=8,
                               located=ChunkLocations.from_lookup_reply(reply))
        record = worker.records["inline"]
        assert record.located_by == "lookup" and record.last_slice_at is not None  # planned before submit returned
        assert engine.mismatched_layers(prompt, dst, 0, tokens) == []
        worker.wait_all()
        assert record.failure is None
    finally:
        worker.close()
        engine.close()


class _ProgramCopier(_GatedCopier):
    """The gated CPU copies, with the programs of a copier whose slices a native thread issues: what each
    ``slice_program`` and each ``enqueue_slices`` call was handed, as (kind, [(layer_start, layer_count)])."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.programs: list[tuple[str, list[tuple[int, int]]]] = []

    def executor(self, spans):
        copier, inner = self, super().executor(spans)

        class Recording:
            def scatter(self, job, layer_start, layer_count):
                copier.programs[-1][1].append((layer_start, layer_count))
                inner.scatter(job, layer_start, layer_count)

            def __getattr__(self, name):
                return getattr(inner, name)

        return Recording()

    @contextlib.contextmanager
    def slice_program(self):
        self.programs.append(("program", []))
        yield

    def enqueue_slices(self, executor, job, slices):
        self.programs.append(("enqueue_slices", []))
        completions = []
        for start, count in slices:
            executor.scatter(job, start, count)
            completions.append(self.mark_slice(executor))
        return completions


@pytest.mark.parametrize("width", [0, 4])
def test_a_copier_that_takes_programs_gets_the_first_layer_alone_and_the_release_waits_for_the_whole_first_slice(
        client, width):
    """Where the copier takes several slices in one program (a GPU's native issuer), the first layer goes alone,
    so the copy engine starts before the rest of a wide first slice is planned (chunk-major's is every layer);
    the rest of the first slice and the later slices follow in one program each. The request is still released
    only once its whole first slice has landed, and every layer lands byte-exact."""
    tokens, layers = 64, SMALL_32.num_layers
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 4, block_size=16)
    backend = _GatedBackend(_ProgramCopier)
    worker = EnginePlacement(client, 15, engine.layout, local_regions=engine.regions, event_backend=backend)
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=24 + width)
        store_prompt(client, engine, prompt, instance_id=15)
        key, dst = lookup_into_fresh_blocks(client, engine, f"programs-{width}", prompt)
        worker.submit_retrieve(f"programs-{width}", key, [dst], layers_per_slice=width)
        first = width or layers
        expected = [("program", [(0, 1)]), ("enqueue_slices", [(1, first - 1)])]
        if first < layers:
            expected.append(("enqueue_slices", [(s, width) for s in range(first, layers, width)]))
        record = worker.records[f"programs-{width}"]
        deadline = time.monotonic() + 60  # only catches a hang
        while record.last_slice_at is None:  # every slice handed to the copier
            assert time.monotonic() < deadline, backend.copier.programs
            time.sleep(0.001)
        assert backend.copier.programs == expected
        lead, first_slice = backend.completions[0], backend.completions[1]
        lead.set()
        assert worker.get_finished() == [], "released on the first layer's copy, before the first slice landed"
        first_slice.set()
        release_of(worker, f"programs-{width}")
        backend.land_everything()
        read_every_layer(worker, layers)
        assert record.failure is None
        assert engine.mismatched_layers(prompt, dst, 0, tokens) == []
    finally:
        backend.land_everything()
        worker.close()
        engine.close()


def assert_landed_whole(worker: EnginePlacement, engine: ReferenceEngine, prompt: list[int],
                        dsts: dict[str, list[int]]) -> None:
    """Every load of ``dsts`` (request id -> destination blocks) settled without failure, its blocks byte-exact."""
    for rid, dst in dsts.items():
        assert worker.records[rid].failure is None, rid
        assert engine.mismatched_layers(prompt, dst, 0, len(prompt)) == [], rid


def submit_located(client, worker: EnginePlacement, engine: ReferenceEngine, rid: str, prompt: list[int],
                   width: int) -> list[int]:
    """What a scheduler and its worker do for a load located by its LOOKUP: LOOKUP the whole prompt (it must hit),
    allocate and poison the destination, submit with the LOOKUP's locations; returns the destination blocks."""
    from kvstrata.core.engine.requests import ChunkLocations
    from kvstrata.core.store.keys import CacheKey

    key = CacheKey.for_tokens(rid, prompt, model="m")
    reply = client.transport.wait(client.lookup_async(key))
    assert reply["hit_tokens"] == len(prompt)
    dst = engine.allocate(len(prompt))
    engine.clear(dst)
    worker.submit_retrieve(rid, key, [dst], layers_per_slice=width, located=ChunkLocations.from_lookup_reply(reply))
    return dst


class _ThreadRecordingCopier(_GatedCopier):
    """The gated CPU copies, noting which thread planned each slice."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.planned_on: list[str] = []

    def mark_slice(self, executor):
        self.planned_on.append(threading.current_thread().name)
        return super().mark_slice(executor)


def test_a_load_submitted_behind_running_copies_is_planned_off_the_engines_thread(client):
    """Two loads located by their LOOKUPs: the first is planned by the engine's thread at submit; the second,
    submitted while the first's copies have not landed, by the enqueue thread (the engine's thread goes back to
    its step); once every copy landed, a third is planned at submit again. All three land byte-exact."""
    tokens, width = 64, 8  # 32 layers: four slices a load
    engine = ReferenceEngine(SMALL_32, num_blocks=3 * tokens // 16 + 4, block_size=16)
    backend = _GatedBackend(_ThreadRecordingCopier)
    worker = EnginePlacement(client, 16, engine.layout, local_regions=engine.regions, event_backend=backend)
    here = threading.current_thread().name
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=26)
        store_prompt(client, engine, prompt, instance_id=16)
        dsts = {}

        def submit(rid: str) -> None:
            dsts[rid] = submit_located(client, worker, engine, rid, prompt, width)

        def planned(n: int) -> list[str]:
            deadline = time.monotonic() + 60  # only catches a hang
            while len(backend.copier.planned_on) < n:
                assert time.monotonic() < deadline, backend.copier.planned_on
                time.sleep(0.001)
            return backend.copier.planned_on[:n]

        submit("first")
        assert planned(4) == [here] * 4
        submit("behind")  # the first's slices are recorded, none landed
        assert planned(8)[4:] == ["kvstrata-transfer-enqueue"] * 4
        backend.land_everything()
        for rid in ("first", "behind"):
            release_of(worker, rid)
        worker.wait_all()
        planning_idle(worker, 60)  # else the enqueue thread, still holding the planning, would take "after"
        submit("after")
        assert planned(12)[8:] == [here] * 4
        worker.wait_all()
        assert_landed_whole(worker, engine, prompt, dsts)
    finally:
        backend.land_everything()
        worker.close()
        engine.close()


class _WaitRecordingCopier(_ThreadRecordingCopier):
    """The gated, thread-recording copies, noting which thread waited for which slice and when, among the plans."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[str, str, int]] = []
        """("plan" or "wait", thread, slice index in the backend's completions) in order."""

    def mark_slice(self, executor):
        done = super().mark_slice(executor)
        self.steps.append(("plan", threading.current_thread().name, len(self.completions) - 1))
        return done

    def finish(self, last_completion) -> None:
        if last_completion is not None:
            self.steps.append(("wait", threading.current_thread().name, self.completions.index(last_completion)))
        super().finish(last_completion)


def test_the_enqueue_thread_plans_a_load_once_the_copies_ahead_of_it_are_down_to_the_lead(client):
    """A load behind running copies is planned by the enqueue thread only once the load planned before it has at
    most ``plan_lead`` of copies left (here 0: all of them): the GPU never holds every queued load's copies at
    once. The wait is for that load's last slice, and the load is planned right after it lands; both land
    byte-exact."""
    tokens, width = 64, 8  # 32 layers: four slices a load
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 4, block_size=16)
    backend = _GatedBackend(_WaitRecordingCopier)
    worker = EnginePlacement(client, 17, engine.layout, local_regions=engine.regions, event_backend=backend)
    enqueue = "kvstrata-transfer-enqueue"
    try:
        worker.register()
        worker._queue.plan_lead = 0.0
        prompt = random_prompt(tokens, seed=27)
        store_prompt(client, engine, prompt, instance_id=17)
        dsts = {rid: submit_located(client, worker, engine, rid, prompt, width) for rid in ("first", "behind")}
        steps = backend.copier.steps
        deadline = time.monotonic() + 60  # only catches a hang
        while ("wait", enqueue, 3) not in steps:
            assert time.monotonic() < deadline, steps
            time.sleep(0.001)
        for done in backend.completions[:3]:  # every slice of the first but its last: still not planned
            done.set()
        release_of(worker, "first")
        assert [s for s in steps if s[0] == "plan"] == [("plan", threading.current_thread().name, i) for i in range(4)]
        backend.completions[3].set()
        while len([s for s in steps if s[0] == "plan"]) < 8:
            assert time.monotonic() < deadline, steps
            time.sleep(0.001)
        enqueue_steps = [s for s in steps if s[1] == enqueue]
        assert enqueue_steps == [("wait", enqueue, 3)] + [("plan", enqueue, i) for i in range(4, 8)]
        backend.land_everything()
        release_of(worker, "behind")
        worker.wait_all()
        assert_landed_whole(worker, engine, prompt, dsts)
    finally:
        backend.land_everything()
        worker.close()
        engine.close()


def test_paced_loads_start_only_once_the_engines_thread_settled_the_load_before(client):
    """``pace_loads``: the second of two loads is not planned when every copy of the first has run and the settle
    thread has resolved it, only once the engine's thread settles the first at its poll (the enqueue thread says
    whom it waits for meanwhile). A preemption wait for a third load settles the second itself, rather than wait
    for a poll that its own wait holds off. All three land byte-exact."""
    tokens, width = 64, 8  # 32 layers: four slices a load
    engine = ReferenceEngine(SMALL_32, num_blocks=4 * tokens // 16 + 4, block_size=16)
    backend = _GatedBackend(_ThreadRecordingCopier)
    worker = EnginePlacement(client, 18, engine.layout, local_regions=engine.regions, event_backend=backend,
                             pace_loads=True)
    queue = worker._queue
    deadline = time.monotonic() + 60  # only catches a hang

    def until(condition, what):
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.001)

    try:
        worker.register()
        prompt = random_prompt(tokens, seed=28)
        store_prompt(client, engine, prompt, instance_id=18)
        dsts = {rid: submit_located(client, worker, engine, rid, prompt, width) for rid in ("first", "behind")}
        until(lambda: queue.waiting_for_engine == "first", "the enqueue thread never waited for the first load")
        backend.land_everything()
        first = worker._inflight["first"].load
        until(first.future.done, "the settle thread never resolved the first load")
        assert first.future.exception() is None
        assert len(backend.copier.planned_on) == 4 and queue.waiting_for_engine == "first"
        assert worker.records["behind"].planned_at is None
        release_of(worker, "first")  # the engine's poll: it settles the first
        until(lambda: len(backend.copier.planned_on) == 8, "the second load was never planned")
        assert backend.copier.planned_on[4:] == ["kvstrata-transfer-enqueue"] * 4
        dsts["third"] = submit_located(client, worker, engine, "third", prompt, width)  # the second not settled yet
        until(lambda: queue.waiting_for_engine == "behind", "the enqueue thread never waited for the second load")
        worker.wait_settled({"third"}, timeout=60)
        assert worker.records["third"].failure is None and worker.records["third"].completed_at is not None
        for rid in ("behind", "third"):
            release_of(worker, rid)
        worker.wait_all()
        assert_landed_whole(worker, engine, prompt, dsts)
    finally:
        backend.land_everything()
        worker.close()
        engine.close()


@pytest.mark.parametrize("placement", ["engine", "server"])
def test_the_pace_loads_setting_reaches_the_engine_placements_queue_and_is_named_where_it_does_not_apply(
        server, placement, caplog):
    """From the deployer's settings through the worker runtime: engine placement's queue paces its loads; server
    placement has no queue of this process's own, and says so rather than ignore the setting silently."""
    from kvstrata.adapters.reference import conformance as reference
    from kvstrata.core.adapter_api.plugins import load_adapter
    from kvstrata.core.adapter_api.types import HarnessSpec
    from kvstrata.core.engine.worker_runtime import WorkerRuntime

    caplog.set_level("WARNING")
    settings = RuntimeSettings(server.address, placement=placement, pace_loads=True,
                               instance_id=940 if placement == "engine" else 950)
    cache = reference.ReferenceCache(HarnessSpec(num_layers=4, num_blocks=16, block_size=16))
    runtime = WorkerRuntime(load_adapter("reference"), settings, model="paced")
    try:
        runtime.register(cache.kv_caches)
        assert runtime.connected
        warned = any("pace_loads applies to engine placement only" in r.message for r in caplog.records)
        if placement == "engine":
            assert runtime.transfers._queue.pace_loads is True and not warned
        else:
            assert not hasattr(runtime.transfers, "_queue") and warned
    finally:
        runtime.close()
        cache.close()
