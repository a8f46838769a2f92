"""Layer-major retrieve and first-slice release through a real server, both placements (CPU)."""

import contextlib
import time

import pytest

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess
from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.server_placement import ServerPlacement
from kvstrata.core.engine.choose_placement import make_placement

from kvstrata.conformance_tests.slice_hold import SliceHold

from helpers import (SMALL_32, engine_loop, lookup_into_fresh_blocks, random_prompt, read_every_layer, release_of,
                     store_prompt)

WIDTHS = [1, 2, 3, 8, 32]


@pytest.mark.parametrize("placement", [PLACEMENT_SERVER, PLACEMENT_ENGINE])
def test_every_width_retrieves_byte_exact_into_its_own_range(client, placement):
    tokens = 160
    engine = ReferenceEngine(SMALL_32, num_blocks=(len(WIDTHS) + 2) * 10 + 4, block_size=16)
    worker = make_placement(placement, client, 0, engine.layout, local_regions=engine.regions)
    try:
        worker.register()
        prompt = random_prompt(tokens)
        store_prompt(client, engine, prompt)
        results = {}
        for width in [0] + WIDTHS:
            rid = f"w{width}"
            key, dst = lookup_into_fresh_blocks(client, engine, rid, prompt)  # each width: its own range
            worker.submit_retrieve(rid, key, [dst], layers_per_slice=width)
            engine_loop(worker, rid, SMALL_32.num_layers)
            rec = worker.records[rid]
            assert rec.failure is None and rec.fallback is None, rec
            assert engine.mismatched_layers(prompt, dst, 0, tokens) == [], f"width {width}"
            results[width] = [engine.read_layer(l, dst, 0, tokens) for l in range(SMALL_32.num_layers)]
        for width in WIDTHS:  # the knob changes when bytes arrive, not which
            for layer in range(SMALL_32.num_layers):
                assert results[width][layer].equal(results[0][layer]), (width, layer)
        assert client.server_info()["l1"]["locked_objects"] == 0
    finally:
        worker.close()
        engine.close()


@pytest.mark.parametrize("placement", [PLACEMENT_SERVER, PLACEMENT_ENGINE])
def test_request_is_released_while_its_transfer_is_still_in_flight(placement, tmp_path):
    """The transfer is held after its first slice (test-only slice hold) until the test has seen the release,
    so "released before complete" holds by construction, whatever the machine's speed."""
    tokens = 256
    hold = SliceHold(tmp_path / "hold")
    hold.hold("big", after_slices=1)
    # server placement: the server copies, so the hold is installed in its process; engine placement: here
    with ServerProcess(l1_bytes=64 << 20, chunk_size=64, slice_hold=hold if placement == PLACEMENT_SERVER
                       else None) as srv, (hold.installed() if placement == PLACEMENT_ENGINE
                                           else contextlib.nullcontext()):
        client = CacheClient(srv.address)
        engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 2, block_size=16)
        worker = make_placement(placement, client, 0, engine.layout, local_regions=engine.regions)
        try:
            worker.register()
            prompt = random_prompt(tokens, seed=1)
            store_prompt(client, engine, prompt)
            key, dst = lookup_into_fresh_blocks(client, engine, "big", prompt)
            worker.submit_retrieve("big", key, [dst], layers_per_slice=1)
            hold.wait_held("big")
            at_release = release_of(worker, "big")
            assert at_release == {"transfer_ended": False, "draining": True}
            assert engine.mismatched_layers(prompt, dst, 0, tokens, layers=[0, 1]) == [1]  # only slice 1 is there
            worker.wait_for_layer(0)  # the engine reads layer 0 while the rest is held back
            hold.open("big")
            read_every_layer(worker, SMALL_32.num_layers)
            rec = worker.records["big"]
            assert rec.released_before_complete is True
            assert rec.released_at < rec.completed_at
            assert rec.layer_waits >= 1  # layer 0's, made while the transfer was held
            assert rec.failure is None
            assert engine.mismatched_layers(prompt, dst, 0, tokens) == []
        finally:
            worker.close()
            engine.close()
            client.close()


def test_hybrid_layout_falls_back_to_chunk_major_on_both_sides_and_logs_once(client, caplog):
    import dataclasses
    import logging

    from kvstrata.core.arrival.board import ArrivalBoard

    caplog.set_level(logging.WARNING, logger="kvstrata")
    tokens = 64
    engine = ReferenceEngine(SMALL_32, num_blocks=16, block_size=16)
    hybrid = dataclasses.replace(engine.layout, layer_groups=(tuple(range(16)), tuple(range(16, 32))))
    board = ArrivalBoard.create(1)
    worker = ServerPlacement(client, 0, hybrid)
    try:
        registered = worker.register()
        assert "hybrid" in registered["layer_major_fallback"]  # the server decided at registration, and said so
        prompt = random_prompt(tokens, seed=6)
        blocks = engine.allocate(tokens)
        engine.prefill(prompt, blocks)
        client.store(CacheKey.for_tokens("s", prompt, model="m"), 0, [blocks, blocks])
        engine.clear(blocks)
        # the server, asked directly for layer-major, degrades and says why
        key = CacheKey.for_tokens("direct", prompt, model="m")
        client.lookup(key)
        reply = client.retrieve(key, 0, [blocks, blocks], arrival_board={"name": board.name, "slot": 0, "generation": 1},
                                layers_per_slice=1)
        assert reply["layers_per_slice"] == 0 and "hybrid" in reply["fallback"]
        assert board.read(0, 1).complete
        assert engine.mismatched_layers(prompt, blocks, 0, tokens) == []
        # the worker decides the same before sending, and logs it once
        for rid in ("h1", "h2"):
            key = CacheKey.for_tokens(rid, prompt, model="m")
            client.lookup(key)
            worker.submit_retrieve(rid, key, [blocks, blocks], layers_per_slice=2)
            engine_loop(worker, rid, 32)
            assert "hybrid" in worker.records[rid].fallback
        assert sum("falls back to chunk-major" in r.message for r in caplog.records) == 1
    finally:
        worker.close()
        board.destroy()
        engine.close()


def test_a_layer_major_retrieve_settles_on_the_board_before_its_reply_arrives():
    """The server marks completion on the board before replying: the worker settles on it, frees the slot and
    reports the finished request drained while the reply is still held back (here by the recording proxy)."""
    from kvstrata.conformance_tests.wire import RecordingProxy

    tokens = 512
    with ServerProcess(l1_bytes=64 << 20, chunk_size=256) as srv:
        proxy = RecordingProxy(srv.address).start()
        client = CacheClient(proxy.address)
        engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 2, block_size=16)
        worker = ServerPlacement(client, 0, engine.layout, pool_slots=1)
        try:
            worker.register()
            prompt = random_prompt(tokens, seed=3)
            store_prompt(client, engine, prompt)
            key, dst = lookup_into_fresh_blocks(client, engine, "held", prompt)
            proxy.hold_replies("held")
            worker.submit_retrieve("held", key, [dst], layers_per_slice=4)
            with worker._lock:  # the transfer's future, which outlives the placement's interest in it
                reply = worker._inflight["held"].future
            assert proxy.wait_for(lambda: proxy.reply_held("held"), 20), "the server never answered"
            release_of(worker, "held")
            assert worker.finish_request("held") is None, "not settled although the board said complete"
            assert "held" not in worker.in_flight()  # settled and handed back: nothing of it is in flight
            rec = worker.records["held"]
            assert rec.completed_at is not None and rec.failure is None
            assert worker.pool.in_use() == 0, "the slot was not freed on the board's completion"
            assert engine.mismatched_layers(prompt, dst, 0, tokens) == []
            proxy.release_replies("held")  # the late reply resolves a future nobody tracks any more
            assert reply.result(timeout=30)["retrieved_tokens"] == tokens
            worker.get_finished()
            assert worker.take_failed() == {}
        finally:
            worker.close()
            engine.close()
            client.close()
            proxy.stop()


def test_an_engine_placement_copy_stops_before_its_failure_is_reported(client, tmp_path):
    """Engine placement: once a load has failed (here its layer wait timed out while the copy was held), the
    transfer queue enqueues no further slice of it, and the engine is told to recompute only once what was
    enqueued has run, so a recompute into those blocks cannot be overwritten."""
    tokens = 128
    hold = SliceHold(tmp_path / "hold")
    hold.hold("stall", after_slices=1)
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 2, block_size=16)
    worker = EnginePlacement(client, 7, engine.layout, local_regions=engine.regions,
                             layer_wait_timeout=0.3)
    try:
        with hold.installed():
            worker.register()
            prompt = random_prompt(tokens, seed=3)
            store_prompt(client, engine, prompt, instance_id=7)
            key, dst = lookup_into_fresh_blocks(client, engine, "stall", prompt)
            worker.submit_retrieve("stall", key, [dst], layers_per_slice=1)
            hold.wait_held("stall")
            engine_loop_until_released(worker, "stall")
            worker.wait_for_layer(1)  # never lands while held: the wait gives up and the load fails
            assert worker.records["stall"].failure is not None
            assert worker.take_failed() == {}, "reported while this process's copy could still write"
            hold.open("stall")
            failed = {}
            deadline = time.monotonic() + 60  # only catches a hang: the copy stops at its next slice
            while not failed and time.monotonic() < deadline:
                worker.get_finished()
                failed.update(worker.take_failed())
                time.sleep(0.001)
            assert list(failed) == ["stall"] and failed["stall"][0] == [dst]
        # slice 1 (layer 0) landed before the hold; the queue checks the load before each slice, so nothing
        # after the hold was written
        wrong = engine.mismatched_layers(prompt, dst, 0, tokens)
        assert wrong == list(range(1, SMALL_32.num_layers)), wrong
    finally:
        hold.open_all()
        worker.close()
        engine.close()


def engine_loop_until_released(worker, rid, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rid in worker.get_finished():
            return
        time.sleep(0.0005)
    raise AssertionError(f"{rid} was never released within {timeout:.0f}s")
