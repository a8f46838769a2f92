"""Engine-placement loads and stores on a GPU (engine placement): the engine process copies between the
server's L1 pool and its own cache.

The engine maps the server's pool and registers it for DMA once, at registration; a STORE copies into
objects the server reserved and commits them once the copies landed (the fixture stores that way); each load's
copies run on the engine's own streams in its CUDA context, a slice's event is recorded in
the engine process, the request goes back on its first slice, and a layer wait orders the engine's stream
on that event. The cache is vLLM-shaped (one buffer, LBNHC views) and needs no CUDA IPC export. Driven
through the core's WorkerRuntime with the vLLM adapter's hooks (vLLM does not install on the GPU machine).
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from kvstrata.adapters.vllm import hooks as vllm_hooks
from kvstrata.adapters.vllm.kv_layout import layer_index
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.requests import ChunkLocations, LoadSpec, StoreSpec, lock_owner
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.store.keys import CacheKey, pack_tokens
from kvstrata.conformance_tests.slice_hold import SliceHold
from kvstrata.core.wire.client import CacheClient

from helpers import planning_idle
from test_gpu_vllm_worker import BS, vllm_gpu_cache

N_BLOCKS = 64  # 1024 tokens


def wait_released(side: WorkerRuntime, rid: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while rid not in side.poll(set())[1]:
        assert time.monotonic() < deadline, f"{rid} was never released"
        time.sleep(0.0005)


def transfer_threads_state(side: WorkerRuntime, rid: str) -> str:
    """What a load whose failure report never came was doing: whether it is in flight, its record, and where the
    queue's threads stand (a report was once lost when the placement read the load's future twice and the copy
    stopped in between; ``tests/integration/test_failures.py`` holds that interleaving on CPU)."""
    import sys
    import threading
    import traceback

    frames = sys._current_frames()
    stacks = [f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
              for t in threading.enumerate() if t.name.startswith("kvstrata-transfer") and t.ident in frames]
    return (f"in flight {rid in side.transfers.in_flight()}, draining {rid in side.transfers.draining()}; "
            f"record {side.transfers.records.get(rid)}\n"
            + "\n".join(stacks))


def read_all(layers: dict[str, torch.Tensor], blocks: list[int]) -> dict[str, torch.Tensor]:
    return {name: t[blocks].clone() for name, t in layers.items()}


@pytest.fixture(scope="module")
def engine(gpu_server, tmp_path_factory):
    buf, layers = vllm_gpu_cache("LBNHC")
    buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device="cuda"))
    record = tmp_path_factory.mktemp("engine-placement") / "record.jsonl"
    settings = RuntimeSettings.from_mapping({
        "server_address": gpu_server.address, "layers_per_slice": 1, "record_path": str(record),
        "instance_id": 60, "placement": "engine"}, where="kv_connector_extra_config")
    side = WorkerRuntime(load_adapter(vllm_hooks, check_engine=False), settings, model="vllm-gpu-engine-placement")
    side.register(layers)
    n = N_BLOCKS * BS
    tokens = [random.Random(5).randrange(1, 30000) for _ in range(n)]
    src = list(range(1, 1 + N_BLOCKS))
    side.store([StoreSpec("s", pack_tokens(tokens), None, (tuple(src),), 0)])
    truth = read_all(layers, src)
    yield side, layers, tokens, truth, record
    side.close()


@pytest.fixture(scope="module")
def scheduler(gpu_server):
    """The scheduler side's connection, open for the module as an engine's is for its life: the lookup locks it
    takes are its own, and the server frees them once it is gone (so a load whose RETRIEVE came after the close
    would find them freed, depending on when the server noticed)."""
    client = CacheClient(gpu_server.address)
    yield client
    client.close()


def load(side: WorkerRuntime, scheduler: CacheClient, rid: str, tokens: list[int], dst: list[int], width: int,
         locate: str = "lookup") -> ChunkLocations:
    """The scheduler side's LOOKUP (it locks the chunks for the request), then the worker side's load, which
    starts from where the LOOKUP found the chunks (``locate="retrieve"``: asks RETRIEVE, as without them).
    Returns where the LOOKUP found them."""
    key = CacheKey(lock_owner(rid, side.instance_id), side.model, 1, 0, pack_tokens(tokens), None)
    reply = scheduler.transport.wait(scheduler.lookup_async(key))
    assert reply["hit_tokens"] == len(tokens)
    found = ChunkLocations.from_lookup_reply(reply)
    located = (found,) if locate == "lookup" else None
    side.start_loads([LoadSpec(rid, rid, pack_tokens(tokens), None, (tuple(dst),), 0, width, located=located)])
    assert side.transfers.records[rid].located_by == locate
    return found


def back_to_back(found: ChunkLocations) -> bool:
    """Whether the LOOKUP's objects are of one size and lie back to back in the pool: then a load located by it
    copies its first layer before it is planned (``RetrieveRecord.first_layer_ahead``)."""
    objects = found.objects  # (offset, bytes, tokens, slot, generation)
    return len({o[2] for o in objects}) == 1 and all(b[0] - a[0] == a[1] for a, b in zip(objects, objects[1:]))


def test_the_prompt_was_stored_by_the_engines_own_copies(engine, gpu_server) -> None:
    side, layers, tokens, truth, record = engine
    stored = [e for e in map(json.loads, record.read_text().splitlines()) if e.get("event") == "stored"]
    assert stored and stored[0]["stored_tokens"] == len(tokens) and stored[0]["skipped_tokens"] == 0, stored
    # every load below compares with ``truth``: what this store put in L1 is what they read back


def test_registered_for_engine_placement_without_an_ipc_export(engine, gpu_server) -> None:
    side, layers, tokens, _, _ = engine
    assert side.connected and side.placement == "engine"
    assert {r.kind for r in side.layout.regions} == {"local"}, side.layout.regions
    copier = side.transfers._copier
    assert type(copier).__name__ == "CudaLocalCopier" and copier.register_s > 0
    print(f"\nL1 pool ({copier.engine.pool.numel() >> 20} MiB) registered for DMA in {copier.register_s:.3f} s")
    probe = CacheClient(gpu_server.address)
    try:
        key = CacheKey("probe-ee", "vllm-gpu-engine-placement", 1, 0, pack_tokens(tokens), None, dtype=side.layout.dtype)
        assert probe.lookup(key) == len(tokens)
        probe.free_lookup_locks("probe-ee")
    finally:
        probe.close()


@pytest.mark.parametrize("locate", ["lookup", "retrieve"])
@pytest.mark.parametrize("width", [0, 1, 2, 3, 8, 32])
def test_every_width_lands_byte_exact_in_the_engines_cache(engine, scheduler, width: int, locate: str) -> None:
    side, layers, tokens, truth, _ = engine
    dst = list(range(100, 100 + N_BLOCKS))
    random.Random(width).shuffle(dst)
    for t in layers.values():
        t[dst] = 0
    rid = f"ee-w{width}-{locate}"
    planning_idle(side.transfers, 30)  # a load copies its first layer ahead only when planned at submit
    found = load(side, scheduler, rid, tokens, dst, width, locate)
    record = side.transfers.records[rid]
    wait_released(side, rid)
    for name in layers:  # vLLM's wait_for_layer_load before each layer: the engine's stream waits
        side.wait_for_layer(layer_index(name))
    torch.cuda.current_stream().synchronize()
    for name, t in layers.items():
        assert torch.equal(t[dst].view(torch.int16), truth[name].view(torch.int16)), (width, name)
    side.transfers.wait_all(30)
    side.poll(set())
    assert side.take_load_failures() == []
    assert record.first_layer_ahead == (locate == "lookup" and back_to_back(found)), record


def test_the_first_layer_goes_ahead_of_the_plan_and_a_submit_that_fails_gives_its_staging_back(
        engine, scheduler) -> None:
    """A load located by its LOOKUP copies its first layer into staging before it is planned. One whose submit
    then fails (a block id outside the cache) is reported for recompute and gives that staging back: the loads
    and the store after it, planned while the GPU may still be copying it, are byte-exact."""
    side, layers, tokens, truth, _ = engine
    bad = [10_000] + list(range(65, 65 + N_BLOCKS - 1))  # the first block id is not in the cache (300 blocks)
    planning_idle(side.transfers, 30)  # a load copies its first layer ahead only when planned at submit
    key = CacheKey(lock_owner("ee-ahead-bad", side.instance_id), side.model, 1, 0, pack_tokens(tokens), None)
    found = ChunkLocations.from_lookup_reply(scheduler.transport.wait(scheduler.lookup_async(key)))
    assert back_to_back(found), f"the fixture's store left its objects apart in a fresh pool: {found.objects}"
    side.start_loads([LoadSpec("ee-ahead-bad", "ee-ahead-bad", pack_tokens(tokens), None, (tuple(bad),), 0, 1,
                               located=(found,))])
    bad_record = side.transfers.records["ee-ahead-bad"]  # taken off the records once its failure is reported
    deadline = time.monotonic() + 30
    failures: list = []
    while not failures and time.monotonic() < deadline:
        side.poll(set())
        failures = side.take_load_failures()
        time.sleep(0.001)
    assert failures == [set(bad)], failures
    assert bad_record.first_layer_ahead is False and bad_record.failure, bad_record
    # three loads back to back, each submitted while the one before may still copy, and a store among them
    dsts = [list(range(65 + N_BLOCKS * i, 65 + N_BLOCKS * (i + 1))) for i in range(3)]  # blocks 1-64 hold truth
    for i, dst in enumerate(dsts):
        random.Random(i).shuffle(dst)
        for t in layers.values():
            t[dst] = 0
    records = []
    for i, dst in enumerate(dsts):
        load(side, scheduler, f"ee-ahead-{i}", tokens, dst, 1)
        records.append(side.transfers.records[f"ee-ahead-{i}"])
        if i == 1:
            other = [random.Random(9).randrange(1, 30000) for _ in range(N_BLOCKS * BS)]
            side.store([StoreSpec("s-between", pack_tokens(other), None, (tuple(range(1, 1 + N_BLOCKS)),), 0)])
    wanted, released = {f"ee-ahead-{i}" for i in range(3)}, set()
    deadline = time.monotonic() + 30
    while not wanted <= released:  # a poll hands back whatever was released since the last one
        assert time.monotonic() < deadline, f"never released: {wanted - released}"
        released |= set(side.poll(set())[1])
        time.sleep(0.0005)
    for name in layers:
        side.wait_for_layer(layer_index(name))
    torch.cuda.current_stream().synchronize()
    for i, dst in enumerate(dsts):
        for name, t in layers.items():
            assert torch.equal(t[dst].view(torch.int16), truth[name].view(torch.int16)), (i, name)
    side.transfers.wait_all(30)
    side.poll(set())
    assert side.take_load_failures() == []
    # the first goes ahead (nothing copies before it); one submitted while the one before still copied is planned
    # by the enqueue thread, without its first layer ahead
    assert records[0].first_layer_ahead, records[0]
    # a load's times count from the engine's call, the first layer's early copy included
    assert all(r.submitted_at < r.first_layer_handed_at < r.planned_at for r in records if r.first_layer_ahead), records
    assert all(r.submitted_at < r.planned_at for r in records), records
    # what the store between the loads copied is what blocks 1-64 held: the fixture's truth
    dst = list(range(236, 236 + N_BLOCKS))
    load(side, scheduler, "ee-ahead-stored", other, dst, 0)
    wait_released(side, "ee-ahead-stored")
    for name in layers:
        side.wait_for_layer(layer_index(name))
    torch.cuda.current_stream().synchronize()
    for name, t in layers.items():
        assert torch.equal(t[dst].view(torch.int16), truth[name].view(torch.int16)), name
    side.transfers.wait_all(30)
    side.poll(set())
    assert side.take_load_failures() == []


def test_released_on_the_first_slice_and_later_layers_wait_on_the_engines_stream(engine, scheduler,
                                                                                 tmp_path) -> None:
    side, layers, tokens, truth, record = engine
    dst = list(range(200, 200 + N_BLOCKS))
    for t in layers.values():
        t[dst] = 0
    hold = SliceHold(tmp_path / "hold")
    hold.hold("ee-held", after_slices=1)
    names = sorted(layers, key=layer_index)
    with hold.installed():
        load(side, scheduler, "ee-held", tokens, dst, 1)
        hold.wait_held("ee-held", 30)
        wait_released(side, "ee-held")  # the first slice is enqueued, the rest is held back
        assert "ee-held" in side.transfers.draining()
        side.wait_for_layer(0)  # orders the current stream on layer 0's event; the CPU does not block
        torch.cuda.current_stream().synchronize()
        assert torch.equal(layers[names[0]][dst].view(torch.int16), truth[names[0]].view(torch.int16))
        hold.open("ee-held")
        for name in names[1:]:
            side.wait_for_layer(layer_index(name))
        torch.cuda.current_stream().synchronize()
    for name in names:
        assert torch.equal(layers[name][dst].view(torch.int16), truth[name].view(torch.int16)), name
    side.transfers.wait_all(30)
    side.poll(set())
    events = [json.loads(line) for line in record.read_text().splitlines()]
    released = [e for e in events if e["event"] == "released" and e["request_id"] == "ee-held"]
    assert released and released[0]["released_before_complete"] is True and released[0]["failure"] is None


def test_a_load_that_stops_after_release_is_reported_for_recompute(engine, gpu_server, scheduler, tmp_path) -> None:
    """The copy stops after its first slice (held) past the layer-wait bound: the engine's wait returns, and once
    the copy has stopped the load's blocks come back through the failure report (vLLM's: block ids)."""
    _, layers, tokens, _, _ = engine
    settings = RuntimeSettings.from_mapping({
        "server_address": gpu_server.address, "layers_per_slice": 1, "instance_id": 61, "placement": "engine",
        "layer_wait_timeout": 0.5}, where="kv_connector_extra_config")
    side = WorkerRuntime(load_adapter(vllm_hooks, check_engine=False), settings, model="vllm-gpu-engine-placement")
    hold = SliceHold(tmp_path / "hold")
    hold.hold("ee-stalled", after_slices=1)
    dst = list(range(20, 20 + N_BLOCKS))
    try:
        side.register(layers)
        with hold.installed():
            load(side, scheduler, "ee-stalled", tokens, dst, 1)
            wait_released(side, "ee-stalled")
            t0 = time.monotonic()
            side.wait_for_layer(1)  # never lands while held: bounded, and the load is failed
            assert time.monotonic() - t0 < 10
            # reported only once this process's copy has stopped (it is held, so not yet)
            assert side.take_load_failures() == []
            hold.open("ee-stalled")
            failures: list = []
            deadline = time.monotonic() + 30
            while not failures and time.monotonic() < deadline:
                side.poll(set())
                failures = side.take_load_failures()
                time.sleep(0.001)  # as an engine, which polls once a step
            assert failures == [set(dst)], (failures, transfer_threads_state(side, "ee-stalled"))
        side.transfers.wait_all(30)
    finally:
        hold.open_all()
        side.close()
