"""The adapter driven in TensorRT-LLM 1.2's per-iteration order on a tiny model whose attention reads a
TensorRT-LLM pool, against a real ``kvstrata serve`` process (``harness/executor.py`` says which TensorRT-LLM
code each step follows).

The check that matters: a request whose prefix kvstrata loads computes only its tail, so its tokens and
logits equal a run without the connector only if every layer's loaded KV is exact and was in place before
the layer read it. ``test_the_check_can_fail`` shows a prefix that was not loaded changes the outputs.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch
from kvstrata_testing.trtllm_harness import standin
from kvstrata_testing.trtllm_harness.executor import Executor, LlmRequestState
from kvstrata_testing.trtllm_harness.model import TinyConfig
from kvstrata.core.engine.record import read_record
from kvstrata.core.engine.requests import lock_owner
from kvstrata.conformance_tests.slice_hold import SliceHold

CFG = TinyConfig()
CONNECTOR = standin.KvCacheConnectorConfig("kvstrata.adapters.trtllm.connector", "KvstrataScheduler",
                                           "KvstrataWorker")
MAX_NEW = 4
BOUND = 30.0
"""Generous bound on a wait that only catches hangs."""


def prompts(seed: int, lengths: tuple[int, ...] = (80, 53, 97)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(CFG.vocab) for _ in range(n)] for n in lengths]


def run(ps: list[list[int]], *, first_id: int, **kw: Any) -> dict[int, Any]:
    ex = Executor(CFG, **kw)
    try:
        for i, p in enumerate(ps):
            ex.add_request(first_id + i, p, MAX_NEW)
        done = ex.run()
        assert ex.kv.free_blocks == ex.kv.num_blocks, "blocks leaked"
        return done
    finally:
        ex.shutdown()


def outputs(done: dict[int, Any], first_id: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    return [(done[k].generated, done[k].logits) for k in sorted(done)]


def same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb)), "logits differ"


def events(record: str, name: str) -> list[dict]:
    return [e for e in read_record(record) if e["event"] == name]


@pytest.mark.parametrize("world, overlap, async_load, chunk, per_token", [
    (1, False, False, 1 << 30, False),
    (1, True, False, 1 << 30, False),
    (1, False, True, 1 << 30, False),
    (2, False, False, 1 << 30, False),
    (2, True, True, 32, False),
    (1, False, False, 1 << 30, True),
    (2, True, True, 32, True),
], ids=["sync", "overlap-loop", "async", "tp2-sync", "tp2-overlap-async-chunked", "sync-per-token",
        "tp2-overlap-async-chunked-per-token"])
def test_outputs_equal_a_run_without_the_connector(server, deploy, tmp_path, world: int, overlap: bool,
                                                   async_load: bool, chunk: int, per_token: bool) -> None:
    """``per_token``: kvstrata is told the KV heads per rank (``kv_heads``) and addresses the pool per token
    (HND in a block) instead of moving whole blocks as opaque pages."""
    seed = hash((world, overlap, async_load, chunk, per_token)) & 0xFFFF
    ps = prompts(seed)
    base = run(ps, first_id=1000, world=world, overlap=overlap, chunk_size=chunk)
    heads = {"kv_heads": CFG.num_kv_heads // world} if per_token else {}
    record = deploy(server.address, async_load=async_load, **heads)
    first = run(ps, first_id=2000 + seed * 10, world=world, overlap=overlap, chunk_size=chunk,
                connector=CONNECTOR)
    same(outputs(base, 1000), outputs(first, 0))  # cold: everything computed, then stored
    assert len(events(record, "stored")) == len(ps) * world
    # The last load submitted is held after its first slice until a layer wait ran with it in flight (then it
    # goes on): the forward reads layers that were still loading when their wait began, whoever is faster
    # here. (Only the last: engine placement copies on one thread, so a held load delays the ones after it.)
    hold = SliceHold(tmp_path / "hold")
    warm_ids = [3000 + seed * 10 + i for i in range(len(ps))]
    hold.hold(f"{warm_ids[-1]}", after_slices=1)
    opener = threading.Thread(target=open_once_waited, args=(hold, record, str(warm_ids[-1])), daemon=True)
    opener.start()
    ex = Executor(CFG, world=world, overlap=overlap, chunk_size=chunk, connector=CONNECTOR)  # a fresh engine
    try:
        hold.install()
        matched: list[tuple[int, int]] = []
        real = ex.manager.scheduler.get_num_new_matched_tokens

        def counting(request: Any, num_computed: int) -> tuple[int, bool]:
            n, a = real(request, num_computed)
            matched.append((request.request_id, n))
            return n, a

        ex.manager.scheduler.get_num_new_matched_tokens = counting
        for i, p in enumerate(ps):
            ex.add_request(3000 + seed * 10 + i, p, MAX_NEW)
        warm = ex.run()
        described = {(w.runtime.layout.format, w.runtime.layout.num_heads) for w in ex.manager.workers}
        assert described == ({("trtllm", CFG.num_kv_heads // world)} if per_token else {("trtllm-pages", 1)})
        assert ex.kv.free_blocks == ex.kv.num_blocks
    finally:
        hold.open_all()
        ex.shutdown()
        hold.uninstall()
    same(outputs(base, 1000), outputs(warm, 0))
    # first-chunk matching only, block-aligned, at least one prompt token left to compute
    assert sorted(r for r, _ in matched) == sorted(warm)
    for (rid, n), p in zip(sorted(matched), ps):
        assert n > 0 and n % CFG.tokens_per_block == 0 and n < len(p)
    started = [e for e in events(record, "load_started") if int(e["request_id"]) in warm]
    assert sorted((int(e["request_id"]), e["rank"]) for e in started) == \
        sorted((r, k) for r in warm for k in range(world))  # every rank loads its own shard
    assert all(e["running"] is (not async_load) for e in started)
    covered = {r for e in events(record, "wait_for_layer_load") for r in e["in_flight"]}
    assert str(warm_ids[-1]) in covered, "the held load was never in flight during a layer wait"
    if async_load:
        released = {(int(e["request_id"]), e["rank"]) for e in events(record, "released")}
        assert {(r, k) for r in warm for k in range(world)} <= released
    assert all(isinstance(b, bytes) for b in ex.manager.broadcasts)


def open_once_waited(hold: SliceHold, record: str, rid: str) -> None:
    """Open ``rid``'s hold once a layer wait (any rank) ran with it in flight (bounded: a hang fails the test)."""
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        if any(rid in e.get("in_flight", ()) for e in events(record, "wait_for_layer_load")):
            break
        time.sleep(0.002)
    hold.open(rid)


def test_the_check_can_fail(server, deploy) -> None:
    """A prefix the engine skips without its KV in the pool (what a load that never came would leave) changes
    the outputs: equality in the test above is evidence the loaded bytes were read."""
    ps = prompts(7)
    base = run(ps, first_id=500)
    ex = Executor(CFG)
    try:
        for i, p in enumerate(ps):
            req = ex.add_request(600 + i, p, MAX_NEW)
            req.context_current_position = 32  # as if 32 tokens had been loaded, with nothing in the pool
        skipped = ex.run()
    finally:
        ex.shutdown()
    with pytest.raises(AssertionError):
        same(outputs(base, 500), outputs(skipped, 600))


def test_metadata_reaches_every_rank_as_a_pickled_copy(server, deploy) -> None:
    deploy(server.address)
    ex = Executor(CFG, world=2, connector=CONNECTOR)
    try:
        ex.add_request(4001, prompts(3)[0], 1)
        ex.step()
        metas = [w.get_connector_meta() for w in ex.manager.workers]
        assert metas[0] is not metas[1] and type(metas[0]).__name__ == "KvstrataTrtllmMetadata"
        assert metas[0] == metas[1] and metas[0].scheduled == [4001]
        ex.run()
    finally:
        ex.shutdown()


def _store_prompt(server, deploy, p: list[int], rid: int, world: int = 1) -> str:
    record = deploy(server.address)
    run([p], first_id=rid, connector=CONNECTOR, world=world)
    return record


def test_save_holds_blocks_only_while_the_store_reads_them(server, deploy) -> None:
    p = prompts(11, (70,))[0]
    deploy(server.address)
    ex = Executor(CFG, connector=CONNECTOR)
    gate, entered = threading.Event(), threading.Event()

    def before_store(stores: Any) -> None:
        entered.set()
        assert gate.wait(BOUND), "test gate never opened"

    worker = ex.manager.workers[0]
    worker.before_store = before_store
    try:
        ex.add_request(5001, p, 1)
        for _ in range(3):
            ex.step()
        assert entered.wait(BOUND)
        req = ex.done[5001]
        assert req.state == LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS and 5001 in ex.held
        for _ in range(5):  # get_finished runs every step and never blocks on the held store
            ex.step()
        assert 5001 in ex.held and ex.kv.free_blocks < ex.kv.num_blocks
        gate.set()
        ex.run()
        assert ex.kv.free_blocks == ex.kv.num_blocks
    finally:
        gate.set()
        ex.shutdown()


def test_a_request_nobody_stored_or_loaded_frees_its_blocks_at_once(server, deploy) -> None:
    deploy(server.address, store=False)
    ex = Executor(CFG, connector=CONNECTOR)
    try:
        ex.add_request(5101, prompts(12, (40,))[0], 1)
        ex.run()
        assert not ex.held and ex.kv.free_blocks == ex.kv.num_blocks
    finally:
        ex.shutdown()


def test_abort_while_loading_is_reported_so_no_rank_waits(server, deploy, tmp_path) -> None:
    p = prompts(13, (96,))[0]
    _store_prompt(server, deploy, p, 6001, world=2)  # keys carry the world size
    record = deploy(server.address, async_load=True)
    hold = SliceHold(tmp_path / "hold")
    with hold.installed():
        ex = Executor(CFG, world=2, connector=CONNECTOR)
        try:
            hold.hold("6002", after_slices=1)
            ex.add_request(6002, p, MAX_NEW)
            ex.step()  # matched (n, True): parked, its loads start on both ranks
            for rank in (0, 1):  # each rank's key (and transfer) is its own: owned by instance 0 + rank
                hold.wait_held(lock_owner("6002", rank), BOUND)
            ex.abort(6002)
            for _ in range(3):
                ex.step()
            # cancelled and terminated, but the transfers still hold its blocks: they stay allocated
            assert 6002 in ex.held and ex.kv.free_blocks < ex.kv.num_blocks
            hold.open("6002")
            ex.run()
            assert ex.kv.free_blocks == ex.kv.num_blocks
            assert ex.done[6002].error == "cancelled"
            assert not any(m.loading or m.saving for m in ex.manager.pending + ex.manager.local_finished)
        finally:
            hold.open_all()
            ex.shutdown()
    released = {e["rank"] for e in events(record, "released") if e["request_id"] == "6002"}
    assert released == {0, 1}


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_server_death_mid_load_fails_the_batch_and_nothing_hangs(deploy, tmp_path, async_load: bool) -> None:
    """Server placement (the pool in shared memory), the server held after the first slice and then killed:
    the layer wait gives up within its bound, ``wait_for_save`` raises, the batch's requests fail
    (TensorRT-LLM 1.2 has no recompute path) and the record says so; the engine goes on."""
    from kvstrata.core.shm import create_cache_segment
    from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess

    hold = SliceHold(tmp_path / "hold")
    p = prompts(17, (96,))[0]
    shape = (64, CFG.num_layers, 2, CFG.block_size_elems)
    size = torch.zeros(shape).numel() * 4
    segs = [create_cache_segment("trtllm-harness", size) for _ in range(2)]  # the server checks their proof
    with ServerProcess(l1_bytes=64 << 20, chunk_size=64, slice_hold=hold) as srv:
        try:
            def pools() -> list[torch.Tensor]:
                out = []
                for seg in segs:
                    t = torch.frombuffer(seg.buf, dtype=torch.float32, count=size // 4).view(shape)
                    t.zero_()
                    out.append(t)
                return out

            deploy(srv.address, placement="server")
            run([p], first_id=7001, connector=CONNECTOR, pools=pools()[:1])
            record = deploy(srv.address, placement="server", async_load=async_load, layer_wait_timeout=1.0,
                            retrieve_timeout=5.0)
            ex = Executor(CFG, connector=CONNECTOR, pools=pools()[1:])
            try:
                hold.hold("7002", after_slices=1)
                ex.add_request(7002, p, MAX_NEW)
                ex.add_request(7003, prompts(18, (40,))[0], MAX_NEW)  # a miss: it must still finish
                threading.Thread(target=lambda: (hold.wait_held("7002", BOUND), srv.kill()), daemon=True).start()
                done = ex.run()
            finally:
                hold.open_all()
                ex.shutdown()
        finally:
            for seg in segs:
                seg.destroy()
    assert done[7002].error and "kvstrata could not load the KV of request(s) [7002]" in done[7002].error
    failed = events(record, "trtllm_batch_failed")
    assert failed and failed[0]["request_ids"] == ["7002"] and failed[0]["policy"] == "raise in wait_for_save"
    assert events(record, "load_failed")
    assert len(done[7003].generated) == MAX_NEW or done[7003].error  # never hangs; a shared batch fails with it


def test_a_stalled_engine_placement_copy_fails_its_batch_before_its_report(server, deploy, tmp_path) -> None:
    """Engine placement: the copy of a synchronous load is held after its first slice, so layer 1's wait gives up
    (bounded) while the copy still runs. Its failure is reported to the runtime only once that copy stopped,
    but the forward it was read in must fail now: ``wait_for_save`` raises for it. The blocks stay held until
    the copy stopped; then everything is freed."""
    p = prompts(19, (96,))[0]
    _store_prompt(server, deploy, p, 8001)
    record = deploy(server.address, layer_wait_timeout=1.0)
    hold = SliceHold(tmp_path / "hold")
    with hold.installed():
        ex = Executor(CFG, connector=CONNECTOR)
        try:
            hold.hold("8002", after_slices=1)
            ex.add_request(8002, p, MAX_NEW)
            ex.step()  # matched (n, False): its forward runs now and waits for layer 1 in vain
            req = ex.done[8002]
            assert req.error and "kvstrata could not load the KV of request(s) [8002]" in req.error
            assert 8002 in ex.held and ex.kv.free_blocks < ex.kv.num_blocks  # the copy still holds them
            hold.open("8002")
            ex.run()
            assert ex.kv.free_blocks == ex.kv.num_blocks
        finally:
            hold.open_all()
            ex.shutdown()
    failed = events(record, "trtllm_batch_failed")
    assert [e["request_ids"] for e in failed] == [["8002"]]
    assert events(record, "load_failed")  # reported once the copy stopped
