"""A transfer that will not come never hangs the engine: failures are logged and reported for recompute."""

import logging
import time

import pytest

from kvstrata.core.client import CacheClient
from kvstrata.core.keys import CacheKey
from kvstrata.core.testing.reference_engine import LLAMA_8B, ReferenceEngine
from kvstrata.core.testing.server_process import ServerProcess
from kvstrata.core.worker import LayerwiseWorker

from helpers import SMALL_32, engine_loop, random_prompt, store_prompt


def test_server_killed_mid_retrieve_reports_failure_and_next_retrieve_works(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="kvstrata")
    tokens = 2048  # 256 MiB: the kill lands long before the CPU copy could finish
    address = f"ipc://{tmp_path}/server.sock"
    engine = ReferenceEngine(LLAMA_8B, num_blocks=2 * tokens // 16 + 2, block_size=16)
    srv = ServerProcess(address=address, l1_bytes=300 << 20, chunk_size=256).start()
    client = CacheClient(address, timeout=5.0)
    worker = LayerwiseWorker(client, 0, engine.layout, layer_wait_timeout=1.0, retrieve_timeout=5.0)
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=3)
        store_prompt(client, engine, prompt)
        key = CacheKey.for_tokens("doomed", prompt, model="m")
        client.lookup(key)
        dst = engine.allocate(tokens)
        worker.submit_retrieve("doomed", key, [dst], layers_per_stage=1)
        while "doomed" not in worker.get_finished():
            pass
        srv.kill()
        start = time.monotonic()
        for layer in range(LLAMA_8B.num_layers):
            worker.wait_for_layer(layer)
        assert time.monotonic() - start < 5.0  # one bounded wait, then the failed retrieve is skipped
        failed = worker.take_failed()
        assert list(failed) == ["doomed"]
        assert failed["doomed"][0] == [dst]
        assert "did not arrive" in failed["doomed"][1]
        assert any("retrieve for request doomed failed" in r.message for r in caplog.records)
        worker.wait_all(timeout=10)
        assert worker.in_flight() == set()

        # a new server at the same address: the worker re-registers and the next retrieve works
        srv = ServerProcess(address=address, l1_bytes=300 << 20, chunk_size=256).start()
        worker.register()
        small = prompt[:512]
        store_prompt(client, engine, small)
        key = CacheKey.for_tokens("after", small, model="m")
        assert client.lookup(key) == 512
        dst2 = engine.allocate(512)
        worker.submit_retrieve("after", key, [dst2], layers_per_stage=1)
        engine_loop(worker, "after", LLAMA_8B.num_layers)
        assert worker.records["after"].failure is None
        assert engine.mismatched_layers(small, dst2, 0, 512) == []
    finally:
        worker.close()
        client.close()
        srv.stop()
        engine.close()


def test_a_slot_never_advanced_times_out_and_is_reported(tmp_path, caplog):
    """No server answers at all: the board never moves; the request still comes back, failed."""
    caplog.set_level(logging.WARNING, logger="kvstrata")
    engine = ReferenceEngine(SMALL_32, num_blocks=8, block_size=16)
    client = CacheClient(f"ipc://{tmp_path}/nobody.sock", timeout=1.0)
    worker = LayerwiseWorker(client, 0, engine.layout, layer_wait_timeout=0.5, retrieve_timeout=1.0)
    try:
        key = CacheKey.for_tokens("orphan", list(range(64)), model="m")
        worker.submit_retrieve("orphan", key, [[0, 1, 2, 3]], layers_per_stage=1)
        start = time.monotonic()
        released = []
        while not released and time.monotonic() - start < 10:
            released = worker.get_finished()
            time.sleep(0.01)
        assert released == ["orphan"]
        assert time.monotonic() - start < 3.0
        assert "retrieve timeout" in worker.take_failed()["orphan"][1]
        assert any("quarantined" in r.message for r in caplog.records)
        assert worker.in_flight() == set()
    finally:
        worker.close()
        client.close()
        engine.close()


def test_exhausted_pool_runs_chunk_major_logs_once_and_stays_correct(client, caplog):
    caplog.set_level(logging.WARNING, logger="kvstrata")
    tokens = 128
    engine = ReferenceEngine(SMALL_32, num_blocks=40, block_size=16)
    worker = LayerwiseWorker(client, 0, engine.layout, pool_slots=1)
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=4)
        store_prompt(client, engine, prompt)
        dsts = {}
        for rid in ("a", "b", "c"):
            key = CacheKey.for_tokens(rid, prompt, model="m")
            client.lookup(key)
            dsts[rid] = engine.allocate(tokens)
            engine.clear(dsts[rid])
            worker.submit_retrieve(rid, key, [dsts[rid]], layers_per_stage=1)
        released = set()
        while released != {"a", "b", "c"}:
            released.update(worker.get_finished())
        for layer in range(SMALL_32.num_layers):
            worker.wait_for_layer(layer)
        worker.wait_all()
        assert worker.records["a"].fallback is None
        assert worker.records["b"].fallback == worker.records["c"].fallback == "arrival pool exhausted"
        assert sum("arrival pool exhausted" in r.message for r in caplog.records) == 1
        for rid, dst in dsts.items():
            assert engine.mismatched_layers(prompt, dst, 0, tokens) == [], rid
        assert worker.take_failed() == {}
        assert worker.pool.in_use() == 0
    finally:
        worker.close()
        engine.close()


def test_server_side_failure_marks_the_board_failed_and_releases(client):
    """A retrieve the server rejects (bad block ids) comes back failed at once, not after a timeout."""
    engine = ReferenceEngine(SMALL_32, num_blocks=8, block_size=16)
    worker = LayerwiseWorker(client, 0, engine.layout, layer_wait_timeout=5.0)
    try:
        worker.register()
        prompt = random_prompt(64, seed=5)
        store_prompt(client, engine, prompt)
        key = CacheKey.for_tokens("bad", prompt, model="m")
        client.lookup(key)
        start = time.monotonic()
        worker.submit_retrieve("bad", key, [[0, 1, 2, 999]], layers_per_stage=1)
        released = []
        while not released:
            released = worker.get_finished()
        assert time.monotonic() - start < 2.0
        reason = worker.take_failed()["bad"][1]
        assert "block ids [999] are outside" in reason
        assert client.server_info()["l1"]["locked_objects"] == 0
    finally:
        worker.close()
        engine.close()
