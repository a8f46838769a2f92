"""Worker-placement STOREs: the engine copies into objects the server reserved, then commits them."""

import contextlib

import pytest

from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.server_placement import ServerPlacement
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.core.transfer.layouts import PLACEMENT_ENGINE
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.transport import RemoteError

from helpers import SMALL_32, engine_loop, inprocess_cache_server, lookup_into_fresh_blocks, random_prompt

TOKENS = 96  # with the suite's 64-token chunks: one whole chunk and a partial one


@pytest.fixture
def worker(client):
    engine = ReferenceEngine(SMALL_32, num_blocks=4 * TOKENS // 16 + 2, block_size=16)
    info = client.server_info()
    area = RegistrationArea(engine.layout, chunk_size=int(info["chunk_size"]))
    w = EnginePlacement(client, 31, engine.layout, local_regions=engine.regions,
                        registration_layout=area.layout, pool_writable=True)
    w.register()
    yield w, engine
    w.close()
    client.unregister_kv_cache(31)
    area.close()
    engine.close()


@contextlib.contextmanager
def storing_connection(srv, engine, instance_id):
    """A connection of its own to ``srv`` with an engine-placement instance that stores; closed on exit (the
    server then ends the connection)."""
    own = CacheClient(srv.address, timeout=20.0)
    area = RegistrationArea(engine.layout, chunk_size=64)
    w = EnginePlacement(own, instance_id, engine.layout, local_regions=engine.regions,
                        registration_layout=area.layout, pool_writable=True)
    try:
        w.register()
        yield own, w
    finally:
        w.close()
        own.close()
        area.close()


def computed(engine, prompt):
    blocks = engine.allocate(len(prompt))
    engine.prefill(prompt, blocks)
    return blocks


def test_a_committed_store_is_found_and_loads_byte_exact(client, worker):
    w, engine = worker
    prompt = random_prompt(TOKENS, seed=41)
    src = computed(engine, prompt)
    reply = w.store(CacheKey.for_tokens("s1", prompt, model="m"), [src])
    assert reply == {"stored_tokens": TOKENS, "skipped_tokens": 0}
    st = w.last_store  # the store's way through its steps, for benchmarks/transfer.py
    assert st.request_id == "s1" and st.started_at <= st.reserved_at <= st.copied_at <= st.committed_at
    again = w.store(CacheKey.for_tokens("s1b", prompt, model="m"), [src])
    assert again == {"stored_tokens": 0, "skipped_tokens": TOKENS}, "what is stored is skipped"
    key, dst = lookup_into_fresh_blocks(client, engine, "l1", prompt)
    w.submit_retrieve("l1", key, [dst], layers_per_slice=4)
    engine_loop(w, "l1", SMALL_32.num_layers)
    assert engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
    rec = w.records["l1"]  # the load's way to its first slice, for benchmarks/transfer.py
    assert rec.submitted_at <= rec.replied_at and rec.submitted_at <= rec.located_at <= rec.planned_at \
        <= rec.first_slice_at


def test_reserved_objects_are_invisible_until_committed_and_a_dropped_reservation_stores_nothing(client, worker):
    w, engine = worker
    prompt = random_prompt(TOKENS, seed=42)
    key = CacheKey.for_tokens("s2", prompt, model="m")
    free_before = client.server_info()["l1"]["free_bytes"]
    reply = client.reserve_store(key, 31, 0)
    assert [o[2] for o in reply["objects"]] == [64, 32] and reply["skipped_tokens"] == 0
    assert client.lookup(CacheKey.for_tokens("peek", prompt, model="m")) == 0, "a reservation is not a hit"
    assert client.commit_store(reply["reservation"], False) == {"stored_tokens": 0, "stored_bytes": 0}
    assert client.lookup(CacheKey.for_tokens("peek2", prompt, model="m")) == 0
    assert client.server_info()["l1"]["free_bytes"] == free_before, "a dropped reservation frees its objects"
    with pytest.raises(RemoteError, match="no store reservation"):
        client.commit_store(reply["reservation"], True)


def test_a_reservation_is_committed_once_every_object_is_marked_with_its_generation(client, server, worker):
    """The engine marks its objects stored instead of a COMMIT_STORE round trip; the server commits the
    reservation before it answers the next LOOKUP from any connection, and only on marks of these objects."""
    import numpy as np

    from kvstrata.core.shm import Segment

    prompt = random_prompt(TOKENS, seed=50)
    reply = client.reserve_store(CacheKey.for_tokens("s10", prompt, model="m"), 31, 0)
    ref = reply["store_marks"]
    seg = Segment.attach(ref["name"], int(ref["slots"]) * 8)
    other = CacheClient(server.address, timeout=20.0)
    try:
        marks = np.frombuffer(seg.buf, dtype=np.uint64, count=int(ref["slots"]))
        (_, _, _, _, slot0, gen0), (_, _, _, _, slot1, gen1) = reply["objects"]
        marks[slot0] = gen0
        assert other.lookup(CacheKey.for_tokens("peek10", prompt, model="m")) == 0, "one object is still copying"
        marks[slot1] = gen1 + 1
        assert other.lookup(CacheKey.for_tokens("peek10b", prompt, model="m")) == 0, "another object's mark"
        marks[slot1] = gen1
        assert other.lookup(CacheKey.for_tokens("peek10c", prompt, model="m")) == TOKENS
        with pytest.raises(RemoteError, match="no store reservation"):
            client.commit_store(reply["reservation"], False)  # committed: it is no reservation any more
        del marks
    finally:
        other.close()
        seg.close()


def test_a_store_is_found_by_a_lookup_from_another_connection_as_soon_as_it_returns(client, server, worker):
    w, engine = worker
    prompt = random_prompt(TOKENS, seed=51)
    assert w.store(CacheKey.for_tokens("s11", prompt, model="m"), [computed(engine, prompt)]) == \
        {"stored_tokens": TOKENS, "skipped_tokens": 0}
    other = CacheClient(server.address, timeout=20.0)
    try:
        assert other.lookup(CacheKey.for_tokens("peek11", prompt, model="m")) == TOKENS
    finally:
        other.close()


def test_a_store_marked_before_its_connection_ended_is_kept_and_one_not_marked_is_dropped():
    import time

    engine = ReferenceEngine(SMALL_32, num_blocks=4 * TOKENS // 16 + 2, block_size=16)
    kept, lost = random_prompt(TOKENS, seed=52), random_prompt(TOKENS, seed=53)
    with inprocess_cache_server(8 << 20) as srv:
        with storing_connection(srv, engine, 35) as (own, w):  # its end takes its instance and reservations
            free_before = own.server_info()["l1"]["free_bytes"]
            own.reserve_store(CacheKey.for_tokens("s13", lost, model="m"), 35, 0)  # never copied, never marked
            # marked last: no request of this connection comes after to commit it, its end does (or the watcher)
            stored = w.store(CacheKey.for_tokens("s12", kept, model="m"), [computed(engine, kept)])
            assert stored["stored_tokens"] == TOKENS
            free_before -= TOKENS // 64 * engine.layout.object_bytes(64) + engine.layout.object_bytes(TOKENS % 64)
        deadline = time.monotonic() + 60  # the lease watcher notices the disconnect (a bound for hangs only)
        while srv.connections_ended < 1:
            assert time.monotonic() < deadline, "the server never ended the closed connection"
            time.sleep(0.01)
        probe = CacheClient(srv.address, timeout=20.0)
        try:
            assert probe.server_info()["l1"]["free_bytes"] == free_before, "the unmarked reservation is dropped"
            form = engine.layout.object_form()  # no cache is registered any more to tell the server
            assert probe.lookup(CacheKey.for_tokens("peek12", kept, model="m", dtype=form)) == TOKENS
            assert probe.lookup(CacheKey.for_tokens("peek13", lost, model="m", dtype=form)) == 0
        finally:
            probe.close()
            engine.close()


def test_the_lease_watcher_commits_a_marked_store_no_request_has_looked_at():
    """The shared tier is offered a store at its commit, and a connection's reservation share is freed then: a
    marked store must not wait for a LOOKUP that may never come."""
    import time

    engine = ReferenceEngine(SMALL_32, num_blocks=4 * TOKENS // 16 + 2, block_size=16)
    prompt = random_prompt(TOKENS, seed=54)
    try:
        with inprocess_cache_server(8 << 20) as srv, storing_connection(srv, engine, 36) as (own, w):
            w.store(CacheKey.for_tokens("s14", prompt, model="m"), [computed(engine, prompt)])
            deadline = time.monotonic() + 60  # the watcher's turn comes every second at most; a bound for hangs
            while srv.store.stats()["locked_objects"]:  # a reserved object is locked until its commit
                assert time.monotonic() < deadline, "the marked store was never committed"
                time.sleep(0.01)
            assert own.lookup(CacheKey.for_tokens("peek14", prompt, model="m")) == TOKENS
    finally:
        engine.close()


def test_a_failed_copy_drops_the_reservation(client, worker):
    w, engine = worker
    prompt = random_prompt(TOKENS, seed=43)
    src = computed(engine, prompt)

    class Broken(Exception):
        pass

    def failing_gather(spans, block_ids):
        raise Broken("the copy failed")

    copier = w._copier_for(client.server_info()["pool"])
    copier.gather = failing_gather  # the failure path: the copy itself raises
    try:
        with pytest.raises(Broken):
            w.store(CacheKey.for_tokens("s3", prompt, model="m"), [src])
    finally:
        del copier.gather
    assert client.lookup(CacheKey.for_tokens("peek3", prompt, model="m")) == 0, "nothing half-written is kept"


def test_reservations_are_refused_for_server_placement_and_other_connections(client, server, worker):
    prompt = random_prompt(TOKENS, seed=44)
    key = CacheKey.for_tokens("s4", prompt, model="m")
    engine = ReferenceEngine(SMALL_32, num_blocks=8, block_size=16)
    server_side = ServerPlacement(client, 32, engine.layout)
    try:
        server_side.register()
        with pytest.raises(RemoteError, match="server placement"):
            client.reserve_store(key, 32, 0)
        reply = client.reserve_store(key, 31, 0)
        other = CacheClient(server.address, timeout=20.0)
        try:
            with pytest.raises(RemoteError, match="belongs to another connection"):
                other.commit_store(reply["reservation"], True)
        finally:
            other.close()
        assert client.commit_store(reply["reservation"], False)["stored_tokens"] == 0
    finally:
        server_side.close()
        client.unregister_kv_cache(32)
        engine.close()


def test_unregistering_the_instance_drops_its_reservations(client):
    engine = ReferenceEngine(SMALL_32, num_blocks=8, block_size=16)
    area = RegistrationArea(engine.layout, chunk_size=int(client.server_info()["chunk_size"]))
    w = EnginePlacement(client, 33, engine.layout, local_regions=engine.regions,
                        registration_layout=area.layout, pool_writable=True)
    try:
        w.register()
        prompt = random_prompt(TOKENS, seed=45)
        reply = client.reserve_store(CacheKey.for_tokens("s5", prompt, model="m"), 33, 0)
        client.unregister_kv_cache(33)
        with pytest.raises(RemoteError, match="no store reservation"):
            client.commit_store(reply["reservation"], True)
        assert client.lookup(CacheKey.for_tokens("peek5", prompt, model="m")) == 0
    finally:
        w.close()
        area.close()
        engine.close()


def test_a_store_larger_than_the_pool_keeps_the_chunks_that_fit_from_the_prompt_start():
    """RESERVE_STORE reserves chunk after chunk until the pool is full; the reply says so, and what was
    reserved stores (and later loads) like any reservation."""
    from kvstrata.server_process import ServerProcess

    engine = ReferenceEngine(SMALL_32, num_blocks=4 * TOKENS // 16 + 2, block_size=16)
    chunk_bytes = engine.layout.object_bytes(64)
    with ServerProcess(l1_bytes=2 * chunk_bytes, chunk_size=64, extra_args=["--max-reserved-fraction", "1"]) as small:
        client = CacheClient(small.address, timeout=20.0)
        area = RegistrationArea(engine.layout, chunk_size=64)
        w = EnginePlacement(client, 34, engine.layout, local_regions=engine.regions,
                            registration_layout=area.layout, pool_writable=True)
        try:
            w.register()
            prompt = random_prompt(3 * 64, seed=46)
            src = computed(engine, prompt)
            key = CacheKey.for_tokens("s6", prompt, model="m")
            reply = client.reserve_store(key, 34, 0)
            assert [o[3] for o in reply["objects"]] == [0, 64], "the first two chunks fit, in prompt order"
            assert "L1 pool full" in reply["full"], reply["full"]
            client.commit_store(reply["reservation"], False)
            assert w.store(CacheKey.for_tokens("s6b", prompt, model="m"), [src]) == \
                {"stored_tokens": 128, "skipped_tokens": 0}
            dst_key, dst = lookup_into_fresh_blocks(client, engine, "l6", prompt[:128])
            w.submit_retrieve("l6", dst_key, [dst], layers_per_slice=4)
            engine_loop(w, "l6", SMALL_32.num_layers)
            assert engine.mismatched_layers(prompt[:128], dst, 0, 128) == []
        finally:
            w.close()
            client.close()
            area.close()
            engine.close()



def test_a_store_reserved_ahead_of_the_forward_copies_into_that_reservation(client, worker):
    """An engine with a step API reserves before the forward (the round trip overlaps it), stores after."""
    w, engine = worker
    prompt = random_prompt(TOKENS, seed=47)
    key = CacheKey.for_tokens("s7", prompt, model="m")
    ahead = w.reserve_store(key)
    src = computed(engine, prompt)  # the forward that computes the blocks, while the reservation is made
    assert client.lookup(CacheKey.for_tokens("peek7", prompt, model="m")) == 0, "a reservation is not a hit"
    assert w.store(key, [src], reservation=ahead) == {"stored_tokens": TOKENS, "skipped_tokens": 0}
    assert w.last_store.reserved_ahead
    dst_key, dst = lookup_into_fresh_blocks(client, engine, "l7", prompt)
    w.submit_retrieve("l7", dst_key, [dst], layers_per_slice=2)
    engine_loop(w, "l7", SMALL_32.num_layers)
    assert engine.mismatched_layers(prompt, dst, 0, TOKENS) == []


def test_a_reservation_no_store_uses_is_given_back(client, worker):
    w, engine = worker
    prompt = random_prompt(TOKENS, seed=48)
    free_before = client.server_info()["l1"]["free_bytes"]
    w.drop_reservation(w.reserve_store(CacheKey.for_tokens("s8", prompt, model="m")))
    assert client.server_info()["l1"]["free_bytes"] == free_before
    src = computed(engine, prompt)
    assert w.store(CacheKey.for_tokens("s8b", prompt, model="m"), [src]) == \
        {"stored_tokens": TOKENS, "skipped_tokens": 0}, "nothing of the dropped reservation is left"


def test_block_ids_that_do_not_fit_refuse_a_store_reserved_ahead_and_give_its_objects_back(client, worker):
    w, engine = worker
    prompt = random_prompt(TOKENS, seed=49)
    key = CacheKey.for_tokens("s9", prompt, model="m")
    free_before = client.server_info()["l1"]["free_bytes"]
    ahead = w.reserve_store(key)
    with pytest.raises(ValueError):
        w.store(key, [[engine.layout.num_blocks + 5] * (TOKENS // 16)], reservation=ahead)
    assert client.server_info()["l1"]["free_bytes"] == free_before
    assert client.lookup(CacheKey.for_tokens("peek9", prompt, model="m")) == 0


def test_the_runtime_stores_into_the_reservations_it_made_before_the_forward(server, client, tmp_path):
    """``WorkerRuntime.reserve_stores`` at step start, ``store`` after the forward: the store uses the
    reservation; one made again for the same request replaces the first, and ``close`` gives back the rest."""
    from kvstrata.adapters.reference import conformance as reference
    from kvstrata.core.adapter_api.plugins import load_adapter
    from kvstrata.core.adapter_api.types import HarnessSpec
    from kvstrata.core.engine.requests import StoreSpec, lock_owner
    from kvstrata.core.engine.settings import RuntimeSettings
    from kvstrata.core.engine.worker_runtime import UNUSED_RESERVATION_STEPS, WorkerRuntime
    from kvstrata.core.store.keys import pack_tokens

    settings = RuntimeSettings(server.address, placement=PLACEMENT_ENGINE, instance_id=720,
                               record_path=str(tmp_path / "r.jsonl"))
    cache = reference.ReferenceCache(HarnessSpec(num_layers=4, num_blocks=48, block_size=16))
    runtime = WorkerRuntime(load_adapter("reference"), settings, model="ahead")
    try:
        runtime.register(cache.kv_caches)
        free_before = client.server_info()["l1"]["free_bytes"]
        prompt = random_prompt(TOKENS, seed=50)
        src = cache.allocate(len(prompt))
        spec = StoreSpec("s10", pack_tokens(prompt), None,
                         (tuple(src[0]),), 0)
        runtime.reserve_stores([spec])
        cache.prefill(prompt, src)  # the forward
        runtime.store([spec])
        last = runtime.transfers.last_store
        assert last.reserved_ahead and last.request_id == lock_owner("s10", 720)
        assert client.lookup(CacheKey.for_tokens("peek10", prompt, model="ahead")) == TOKENS
        stored = client.server_info()["l1"]["free_bytes"]
        other = StoreSpec("s11", pack_tokens(random_prompt(TOKENS, seed=51)), None, (tuple(src[0]),), 0)
        runtime.reserve_stores([other])
        runtime.reserve_stores([other])  # planned again: the first reservation goes back, the second holds it
        assert runtime._reservations["s11"].reply.result(timeout=20)["objects"]
        assert client.server_info()["l1"]["free_bytes"] == stored - (free_before - stored), "one reservation held"
        for _ in range(UNUSED_RESERVATION_STEPS):  # steps that never store it (its forward raised, say)
            runtime.reserve_stores([])
        assert "s11" in runtime._reservations
        runtime.reserve_stores([])
        assert "s11" not in runtime._reservations
        assert client.server_info()["l1"]["free_bytes"] == stored, "an unused reservation is given back in time"
        runtime.store([other])  # a late store reserves again
        assert not runtime.transfers.last_store.reserved_ahead
        held = client.server_info()["l1"]["free_bytes"]
        third = StoreSpec("s12", pack_tokens(random_prompt(TOKENS, seed=52)), None, (tuple(src[0]),), 0)
        runtime.reserve_stores([third])  # left for close
        assert runtime._reservations["s12"].reply.result(timeout=20)["objects"]
        assert client.server_info()["l1"]["free_bytes"] < held
    finally:
        runtime.close()
        cache.close()
    assert client.server_info()["l1"]["free_bytes"] == held, "close gave back the reservation no store used"
