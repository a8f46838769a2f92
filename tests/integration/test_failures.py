"""A transfer that will not come never hangs the engine: failures are logged and reported for recompute."""

import logging
import time
from concurrent.futures import Future

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess
from kvstrata.conformance_tests.slice_hold import SliceHold
from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.server_placement import ServerPlacement

from helpers import SMALL_32, engine_loop, random_prompt, release_of, store_prompt

NEVER = 600.0
"""A timeout no test waits out: a release that comes before it cannot have come from that timeout."""


def test_server_killed_mid_retrieve_reports_failure_and_next_retrieve_works(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="kvstrata")
    tokens = 256
    address = f"ipc://{tmp_path}/server.sock"
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 2, block_size=16)
    hold = SliceHold(tmp_path / "hold")
    hold.hold("doomed", after_slices=1)  # the kill lands while the transfer is held after its first slice
    srv = ServerProcess(address=address, l1_bytes=64 << 20, chunk_size=64, slice_hold=hold).start()
    client = CacheClient(address, timeout=5.0)
    # the layer wait (1 s, from the release) fails it before the retrieve timeout (4 s, from the submit) would
    worker = ServerPlacement(client, 0, engine.layout, layer_wait_timeout=1.0, retrieve_timeout=4.0)
    try:
        worker.register()
        prompt = random_prompt(tokens, seed=3)
        store_prompt(client, engine, prompt)
        key = CacheKey.for_tokens("doomed", prompt, model="m")
        client.lookup(key)
        dst = engine.allocate(tokens)
        worker.submit_retrieve("doomed", key, [dst], layers_per_slice=1)
        hold.wait_held("doomed")
        release_of(worker, "doomed")
        srv.kill()
        for layer in range(SMALL_32.num_layers):
            worker.wait_for_layer(layer)
        failed = worker.take_failed()
        assert list(failed) == ["doomed"]
        assert failed["doomed"][0] == [dst]
        # one bounded wait, on the first layer that never came; every later layer skips the failed retrieve
        assert failed["doomed"][1].startswith("layer 1: layer 1 did not arrive"), failed["doomed"][1]
        assert engine.mismatched_layers(prompt, dst, 0, tokens, layers=[0]) == []
        assert any("retrieve for request doomed failed" in r.message for r in caplog.records)
        worker.wait_all(timeout=60)
        assert worker.in_flight() == set()

        # a new server at the same address: the worker re-registers and the next retrieve works
        srv = ServerProcess(address=address, l1_bytes=64 << 20, chunk_size=64).start()
        worker.register()
        small = prompt[:128]
        store_prompt(client, engine, small)
        key = CacheKey.for_tokens("after", small, model="m")
        assert client.lookup(key) == 128
        dst2 = engine.allocate(128)
        worker.submit_retrieve("after", key, [dst2], layers_per_slice=1)
        engine_loop(worker, "after", SMALL_32.num_layers)
        assert worker.records["after"].failure is None
        assert engine.mismatched_layers(small, dst2, 0, 128) == []
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
    worker = ServerPlacement(client, 0, engine.layout, layer_wait_timeout=0.5, retrieve_timeout=1.0)
    try:
        key = CacheKey.for_tokens("orphan", list(range(64)), model="m")
        worker.submit_retrieve("orphan", key, [[0, 1, 2, 3]], layers_per_slice=1)
        release_of(worker, "orphan")
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
    worker = ServerPlacement(client, 0, engine.layout, pool_slots=1)
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
            worker.submit_retrieve(rid, key, [dsts[rid]], layers_per_slice=1)
        for rid in ("a", "b", "c"):
            release_of(worker, rid)
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
    """A retrieve the server rejects (bad block ids) comes back failed at once, not after a timeout: the
    worker's timeouts are longer than the release is waited for."""
    engine = ReferenceEngine(SMALL_32, num_blocks=8, block_size=16)
    worker = ServerPlacement(client, 0, engine.layout, layer_wait_timeout=NEVER, retrieve_timeout=NEVER)
    try:
        worker.register()
        prompt = random_prompt(64, seed=5)
        store_prompt(client, engine, prompt)
        key = CacheKey.for_tokens("bad", prompt, model="m")
        client.lookup(key)
        worker.submit_retrieve("bad", key, [[0, 1, 2, 999]], layers_per_slice=1)
        release_of(worker, "bad", timeout=60.0)
        reason = worker.take_failed()["bad"][1]
        assert "block ids [999] are outside" in reason
        assert client.server_info()["l1"]["locked_objects"] == 0
    finally:
        worker.close()
        engine.close()


class _ResolvedRightAfterTheFirstLook(Future):
    """A load's future that the transfer queue's settle thread resolves (failed) right after the engine's thread
    first looked at it: an interleaving a GPU run once hit, held here instead of raced for."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self._exc = exc
        self._looked = False

    def done(self) -> bool:
        was_done = super().done()
        if not self._looked:
            self._looked = True
            self.set_exception(self._exc)
        return was_done


def test_an_engine_placement_failure_is_reported_when_its_copy_stops_while_the_engine_looks(client, tmp_path):
    """The layer wait fails a held engine-placement load; its report waits until the copy has stopped. The copy
    stopping just as the engine's poll looks at the load must not lose the report (it used to: the future was
    read twice, once to report and once to settle, and a copy that stopped in between settled unreported)."""
    tokens = 128
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * tokens // 16 + 2, block_size=16)
    worker = EnginePlacement(client, 12, engine.layout, local_regions=engine.regions,
                             layer_wait_timeout=0.5, retrieve_timeout=NEVER)
    hold = SliceHold(tmp_path / "hold")
    hold.hold("stalled", after_slices=1)
    try:
        with hold.installed():
            worker.register()
            prompt = random_prompt(tokens, seed=6)
            store_prompt(client, engine, prompt, instance_id=12)
            key = CacheKey.for_tokens("stalled", prompt, model="m")
            assert client.lookup(key) == tokens
            dst = engine.allocate(tokens)
            worker.submit_retrieve("stalled", key, [dst], layers_per_slice=1)
            hold.wait_held("stalled")
            release_of(worker, "stalled")
            worker.wait_for_layer(1)  # never lands while held: the bounded wait fails the load
            assert worker.take_failed() == {}  # its copy is held, not stopped: not reported yet
            inflight = worker._inflight["stalled"]
            assert inflight.report_pending
            inflight.future = _ResolvedRightAfterTheFirstLook(RuntimeError("copy stopped"))
            failed: dict = {}
            deadline = time.monotonic() + 60  # only catches a hang
            while not failed and time.monotonic() < deadline:
                worker.get_finished()
                failed = worker.take_failed()
            assert list(failed) == ["stalled"] and failed["stalled"][0] == [dst], failed
            assert failed["stalled"][1].startswith("layer 1: layer 1 did not arrive"), failed["stalled"][1]
            hold.open("stalled")
        worker.wait_all(timeout=60)
        assert worker.in_flight() == set()
    finally:
        hold.open_all()
        worker.close()
        engine.close()
