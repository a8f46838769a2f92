"""The engine placement's one transfer queue: concurrent loads' slices go one load after another."""

import threading
import time


from kvstrata.core.arrival.events import HostCopier, HostEventBackend
from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.transfer_queue import QueuedLoad, slice_order
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.conformance_tests.slice_hold import SliceHold

from helpers import SMALL_32, lookup_into_fresh_blocks, random_prompt, read_every_layer, release_of, store_prompt


def _loads(*slice_counts: int) -> list[QueuedLoad]:
    """Loads with ``n`` one-layer slices each (slice_order reads only their slices, progress and error)."""
    return [QueuedLoad(key=None, block_ids=[], skip_first_n_tokens=0, layers_per_slice=1, gate=None, record=None,
                       reply=None, slices=[(i, 1) for i in range(n)]) for n in slice_counts]


def _walk(loads: list[QueuedLoad], fail_after: dict[int, int] | None = None) -> list[int]:
    order = []
    for load in slice_order(loads):
        i = loads.index(load)
        order.append(i)
        load.next_slice += 1
        if fail_after and fail_after.get(i) == load.next_slice:
            load.error = RuntimeError("failed")
    return order


def test_earliest_released_runs_one_load_after_another():
    assert _walk(_loads(3, 2, 1)) == [0, 0, 0, 1, 1, 2]


def test_a_failed_load_gets_no_further_slice_and_the_others_go_on():
    order = _walk(_loads(3, 3), fail_after={0: 1})
    assert order.count(0) == 1 and order.count(1) == 3


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
        for rid, dst in dsts.items():
            assert engine.mismatched_layers(prompt, dst, 0, tokens) == [], rid
            assert worker.records[rid].failure is None
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
    """Host events whose ``landed`` is the test's word; says whom the transfer queue asked about."""

    def __init__(self) -> None:
        self.completions: list[threading.Event] = []
        self.asked = threading.Condition()
        self.asked_about: list[threading.Event] = []
        self.landing = threading.Event()
        """Set: every slice lands as soon as it is enqueued (the test's teardown)."""

    def land_everything(self) -> None:
        self.landing.set()
        for done in list(self.completions):
            done.set()

    def landed(self, event) -> bool:
        with self.asked:
            self.asked_about.append(event)
            self.asked.notify_all()
        return event is None or event.is_set()

    def engine_copier(self, layout, regions, pool, writable=False):
        return _GatedCopier(layout, list(regions), pool, completions=self.completions, landing=self.landing)

    def wait_asked_about(self, event, after: int, timeout: float = 60.0) -> None:
        """Until the queue asks whether ``event`` landed, later than its ``after``-th question (a hang bound)."""
        with self.asked:
            assert self.asked.wait_for(lambda: event in self.asked_about[after:], timeout), "never asked"


def test_the_queue_enqueues_ahead_of_the_landed_copies_by_its_bound_until_a_layer_wait_hurries_it(client, tmp_path):
    """Engine placement with a bound of three slices' bytes: three one-layer slices are enqueued, the fourth
    only once the first has landed; then an engine's wait for a layer not enqueued yet makes the queue enqueue
    the rest at once, without waiting for more landings, and every layer lands byte-exact."""
    tokens = 64
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 4, block_size=16)
    slice_bytes = engine.layout.kv_size * tokens * engine.layout.token_bytes_per_layer
    backend = _GatedBackend()
    published: list[int] = []  # slices enqueued so far, as the queue tells its observer
    worker = EnginePlacement(client, 13, engine.layout, local_regions=engine.regions,
                             event_backend=backend, enqueue_ahead_bytes=3 * slice_bytes,
                             slice_observer=lambda request_id, n: published.append(n))
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=22)
        store_prompt(client, engine, prompt, instance_id=13)
        key, dst = lookup_into_fresh_blocks(client, engine, "ahead", prompt)
        worker.submit_retrieve("ahead", key, [dst], layers_per_slice=1)
        deadline = time.monotonic() + 60  # only catches a hang
        while len(backend.completions) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        first, asked = backend.completions[0], len(backend.asked_about)
        backend.wait_asked_about(first, asked)  # it waits for room: slice 3 is not enqueued while slice 0 is queued
        assert len(backend.completions) == 3 and published == [0, 1, 2, 3]
        assert worker.get_finished() == []  # recorded is not landed: no release yet
        first.set()
        while len(backend.completions) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        second, asked = backend.completions[1], len(backend.asked_about)
        backend.wait_asked_about(second, asked)
        assert len(backend.completions) == 4
        assert release_of(worker, "ahead")["transfer_ended"] is False
        worker.wait_for_layer(0)
        worker.wait_for_layer(20)  # not enqueued yet: the layer wait hurries the queue and returns once it is
        assert len(backend.completions) >= 21
        for layer in range(SMALL_32.num_layers):
            worker.wait_for_layer(layer)
        assert len(backend.completions) == SMALL_32.num_layers  # with only slice 0 landed
        assert sum(e.is_set() for e in backend.completions) == 1
        for done in backend.completions:
            done.set()
        worker.wait_all()
        assert worker.records["ahead"].failure is None
        assert engine.mismatched_layers(prompt, dst, 0, tokens) == []
    finally:
        backend.land_everything()
        worker.close()
        engine.close()
