"""The TensorRT-LLM adapter on a GPU, in the same harness as tests/trtllm, shaped like TensorRT-LLM on CUDA:

* the KV pool is allocated by ``cudaMalloc`` outside torch's caching allocator (``harness/cuda_pool.py``),
  as TensorRT-LLM's KV cache manager does, so torch cannot export it by CUDA IPC: the adapter describes it
  for the engine-placement engine placement only (placement ``auto`` falls back to it, logged);
* the forward runs on a non-default stream (every connector call gets that stream);
* decode-only batches replay a CUDA graph captured at warm-up, before the connector's hooks exist.

Outputs (tokens and logits) must be byte-identical to the same harness without the connector. TensorRT-LLM
itself is not installed (it cannot be); its connector module is kvstrata's stand-in, the kvstrata side is real.
Nothing here touches CUDA at import time (tests/gpu/conftest.py skips it without a device).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kvstrata_testing.trtllm_harness import standin
from kvstrata.adapters.trtllm.settings import ENV_VAR
from kvstrata.core.engine.record import read_record
from kvstrata.core.engine.requests import lock_owner
from kvstrata.conformance_tests.slice_hold import SliceHold

MAX_NEW = 4
BOUND = 60.0
NUM_BLOCKS = 64
SCRATCH = NUM_BLOCKS - 1
"""Written by the decode graph's warm-up and capture; never given to a request."""
CONNECTOR = standin.KvCacheConnectorConfig("kvstrata.adapters.trtllm.connector", "KvstrataScheduler",
                                           "KvstrataWorker")


@pytest.fixture(scope="module", autouse=True)
def trtllm_standin() -> Iterator[None]:
    installed = standin.install()
    yield
    if installed:
        standin.uninstall()


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    from kvstrata_testing.trtllm_harness.model import TinyConfig

    rng = random.Random(seed)
    return [[rng.randrange(TinyConfig().vocab) for _ in range(n)] for n in lengths]


def warm_up(ex: Any) -> None:
    """TensorRT-LLM's warm-up: capture the decode graph (before any connector hook is registered)."""
    from kvstrata_testing.trtllm_harness.decode_graph import DecodeGraph

    ex.kv._free.remove(SCRATCH)
    ex.decode_graph = DecodeGraph(ex.model, ex.cfg, SCRATCH, ex.device)


def run(ps: list[list[int]], first_id: int, *, world: int = 1, connector: Any = None,
        hold_last: tuple[SliceHold, str, str, str] | None = None) -> tuple[dict[int, Any], list[str]]:
    """One engine over cudaMalloc'ed pools, every call on a non-default stream. Returns (done, placements)."""
    from kvstrata_testing.trtllm_harness.cuda_pool import CudaMallocPool
    from kvstrata_testing.trtllm_harness.executor import Executor
    from kvstrata_testing.trtllm_harness.model import TinyConfig

    cfg = TinyConfig()
    before = torch.cuda.memory_allocated()
    pools = [CudaMallocPool((NUM_BLOCKS, cfg.num_layers, 2, cfg.block_size_elems // world)) for _ in range(world)]
    assert torch.cuda.memory_allocated() == before, "the pool must not come from torch's caching allocator"
    stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):
            assert torch.cuda.current_stream() != torch.cuda.default_stream()
            ex = Executor(cfg, world=world, num_blocks=NUM_BLOCKS, device="cuda",
                          pools=[p.tensor for p in pools], connector=connector, warmup=warm_up)
            try:
                for i, p in enumerate(ps):
                    ex.add_request(first_id + i, p, MAX_NEW)
                if hold_last is not None:
                    threading.Thread(target=_open_once_waited, args=hold_last, daemon=True).start()
                done = ex.run(timeout=BOUND * 3)
                assert ex.kv.free_blocks == NUM_BLOCKS - 1, "blocks leaked"
                placements = [w.runtime.placement for w in ex.manager.workers] if ex.manager else []
            finally:
                ex.shutdown()
        torch.cuda.synchronize()
        return done, placements
    finally:
        for p in pools:
            p.free()


def _open_once_waited(hold: SliceHold, record: str, rid: str, hold_name: str) -> None:
    """Open the hold ``hold_name`` once a layer wait ran with request ``rid`` in flight (bounded)."""
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        if any(e["event"] == "wait_for_layer_load" and rid in e.get("in_flight", ())
               for e in read_record(record)):
            break
        time.sleep(0.002)
    hold.open(hold_name)


def same(a: dict[int, Any], b: dict[int, Any]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip((a[k] for k in sorted(a)), (b[k] for k in sorted(b))):
        assert ra.error is None and rb.error is None, (ra.error, rb.error)
        assert ra.generated == rb.generated
        assert len(ra.logits) == len(rb.logits) == MAX_NEW
        for x, y in zip(ra.logits, rb.logits):
            assert x.numpy().tobytes() == y.numpy().tobytes(), "logits differ in their bytes"


def deploy(monkeypatch: pytest.MonkeyPatch, address: str, tmp_path: Any, **values: Any) -> str:
    record = str(tmp_path / f"record-{len(list(tmp_path.iterdir()))}.jsonl")
    monkeypatch.setenv(ENV_VAR, json.dumps({"server_address": address, "layers_per_slice": 1,
                                            "record_path": record, "placement": "auto", **values}))
    return record


@pytest.mark.parametrize("world, async_load, lengths", [
    (1, False, (80, 53, 97)),
    (2, False, (80, 53, 97)),
    (1, True, (90,)),
], ids=["sync", "tp2-sync", "async"])
def test_gpu_outputs_byte_exact(gpu_server, monkeypatch, tmp_path, world: int, async_load: bool,
                                lengths: tuple[int, ...]) -> None:
    seed = world * 100 + int(async_load) * 10 + len(lengths)
    ps = prompts(seed, lengths)
    base, _ = run(ps, 1000 + seed * 10, world=world)
    deploy(monkeypatch, gpu_server.address, tmp_path, async_load=async_load)
    cold, placements = run(ps, 2000 + seed * 10, world=world, connector=CONNECTOR)
    assert placements == ["engine"] * world  # auto: server placement refused for a cudaMalloc'ed pool
    same(base, cold)
    record = deploy(monkeypatch, gpu_server.address, tmp_path, async_load=async_load)
    warm_ids = [3000 + seed * 10 + i for i in range(len(ps))]
    # The last load (rank 0's shard) is held after its first slice until a layer wait ran with it in flight:
    # the forward's stream then really waits on layers still copying. (Only the last: each rank copies on one
    # thread, so a held load would delay the ones queued after it.)
    hold = SliceHold(tmp_path / "hold")
    rid = str(warm_ids[-1])
    hold_name = lock_owner(rid, 0)  # rank 0's key: its lock owner (instance 0 + rank 0), not rank 1's
    hold.hold(hold_name, after_slices=1)
    with hold.installed():
        try:
            warm, _ = run(ps, warm_ids[0], world=world, connector=CONNECTOR, hold_last=(hold, record, rid, hold_name))
        finally:
            hold.open_all()
    same(base, warm)
    events = list(read_record(record))
    started = [e for e in events if e["event"] == "load_started"]
    assert sorted((int(e["request_id"]), e["rank"]) for e in started) == \
        sorted((r, k) for r in warm_ids for k in range(world))
    assert all(e["running"] is (not async_load) for e in started)
    covered = {r for e in events if e["event"] == "wait_for_layer_load" for r in e["in_flight"]}
    assert str(warm_ids[-1]) in covered
    assert not [e for e in events if e["event"] in ("load_failed", "trtllm_batch_failed")]
