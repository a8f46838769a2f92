"""The worker placement's one transfer queue: the policy decides the order of concurrent loads' slices."""

import time

import pytest

from kvstrata.core.engine.layerwise_worker import LayerwiseWorker
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.transfer_queue import (POLICY_EARLIEST_RELEASED, POLICY_ROUND_ROBIN, QueuedLoad,
                                                 slice_order)
from kvstrata.core.testing.reference_engine import ReferenceEngine
from kvstrata.core.testing.slice_hold import SliceHold
from kvstrata.core.transfer import planner
from kvstrata.core.transfer.layouts import PLACEMENT_WORKER

from helpers import SMALL_32, lookup_into_fresh_blocks, random_prompt, read_every_layer, store_prompt


def _loads(*slice_counts: int) -> list[QueuedLoad]:
    """Loads with ``n`` one-layer slices each (slice_order reads only their slices, progress and error)."""
    return [QueuedLoad(key=None, block_ids=[], skip_first_n_tokens=0, layers_per_stage=1, gate=None, record=None,
                       reply=None, slices=[(i, 1) for i in range(n)]) for n in slice_counts]


def _walk(loads: list[QueuedLoad], policy: str, fail_after: dict[int, int] | None = None) -> list[int]:
    order = []
    for load in slice_order(loads, policy):
        i = loads.index(load)
        order.append(i)
        load.next_slice += 1
        if fail_after and fail_after.get(i) == load.next_slice:
            load.error = RuntimeError("failed")
    return order


def test_earliest_released_runs_one_load_after_another():
    assert _walk(_loads(3, 2, 1), POLICY_EARLIEST_RELEASED) == [0, 0, 0, 1, 1, 2]


def test_round_robin_takes_one_slice_of_each_load_in_turn():
    assert _walk(_loads(3, 1, 2), POLICY_ROUND_ROBIN) == [0, 1, 2, 0, 2, 0]


@pytest.mark.parametrize("policy", [POLICY_EARLIEST_RELEASED, POLICY_ROUND_ROBIN])
def test_a_failed_load_gets_no_further_slice_and_the_others_go_on(policy):
    order = _walk(_loads(3, 3), policy, fail_after={0: 1})
    assert order.count(0) == 1 and order.count(1) == 3


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="transfer_queue_policy must be one of earliest_released, round_robin"):
        RuntimeSettings.from_mapping({"transfer_queue_policy": "lifo"})
    with pytest.raises(ValueError, match="unknown transfer queue policy 'lifo'"):
        list(slice_order(_loads(1), "lifo"))


@pytest.mark.parametrize("policy", [POLICY_EARLIEST_RELEASED, POLICY_ROUND_ROBIN])
def test_concurrent_loads_reach_the_copier_in_policy_order(client, tmp_path, policy):
    """Through a real server: a first load is held before its first slice, so the two loads submitted
    meanwhile reach the queue together; the order their slices are enqueued in is the policy's, and both
    land byte-exact."""
    tokens, width = 64, 8  # 32 layers: four slices per load
    hold = SliceHold(tmp_path / "hold")
    hold.hold("first", after_slices=0)
    engine = ReferenceEngine(SMALL_32, num_blocks=3 * tokens // 16 + 4, block_size=16)
    worker = LayerwiseWorker(client, 11, engine.layout, placement=PLACEMENT_WORKER, local_regions=engine.regions,
                             transfer_queue_policy=policy)
    enqueued: list[str] = []
    try:
        with hold.installed():
            held_hook = planner._slice_hook

            def recording_hook(request_id: str, published: int) -> None:
                if published > 0:
                    enqueued.append(request_id)
                held_hook(request_id, published)

            planner._slice_hook = recording_hook  # test-only hook: record, then let the hold decide
            try:
                worker.register()
                prompt = random_prompt(tokens, seed=21)
                store_prompt(client, engine, prompt, instance_id=11)
                dsts = {}
                for rid in ("first", "a", "b"):
                    key, dsts[rid] = lookup_into_fresh_blocks(client, engine, rid, prompt)
                    worker.submit_retrieve(rid, key, [dsts[rid]], layers_per_stage=width)
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
            finally:
                planner._slice_hook = held_hook  # so the hold uninstalls its own
        assert enqueued[:4] == ["first"] * 4
        expected = ["a"] * 4 + ["b"] * 4 if policy == POLICY_EARLIEST_RELEASED else ["a", "b"] * 4
        assert enqueued[4:] == expected
        for rid, dst in dsts.items():
            assert engine.mismatched_layers(prompt, dst, 0, tokens) == [], rid
            assert worker.records[rid].failure is None
    finally:
        hold.open_all()
        worker.close()
        engine.close()
