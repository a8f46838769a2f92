"""Never wrong bytes, even when a load's lookup locks are lost behind its back.

A lock can be lost however careful the protocol is (its holder's lease ran out, a bug, another process), so
the copy itself must not trust it. Each test holds a layer-major load after its first slice, frees its locks
by a test-only path (the store's own method, in this process's server), lets another engine evict and reuse
every unlocked object, then lets the load go on: an engine copying from the pool must fail the load (its
blocks recomputed), never hand over another object's bytes; a server copying pins what it reads, so its load
stays exact.
"""

from __future__ import annotations

import time

import pytest

from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.server_placement import ServerPlacement
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.engine.requests import ChunkLocations
from kvstrata.core.server.cache_server import CacheServer
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.conformance_tests.slice_hold import SliceHold
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType

from helpers import SMALL_32, inprocess_cache_server, random_prompt

TOKENS = 256
"""1 MiB of SMALL_32's KV: the 4 MiB pool holds four prompts."""


@pytest.fixture(scope="module")
def server():
    """A real CacheServer in this process, so a test can reach its store behind the protocol's back."""
    with inprocess_cache_server(4 << 20) as srv:
        yield srv


def flood(address: str, instance: int, seed: int, count: int = 24) -> None:
    """Another engine storing fresh prompts: every unlocked object is evicted and its memory reused."""
    client = CacheClient(address, timeout=30.0)
    engine = ReferenceEngine(SMALL_32, num_blocks=TOKENS // 16, block_size=16)
    try:
        client.register_kv_cache(instance, engine.layout, PLACEMENT_SERVER)
        blocks = engine.allocate(TOKENS)
        for i in range(count):
            prompt = random_prompt(TOKENS, seed=seed + i)
            engine.prefill(prompt, blocks)
            stored = client.store(CacheKey.for_tokens(f"flood-{i}", prompt, model="m"), instance, [blocks])
            assert stored["stored_tokens"] == TOKENS
    finally:
        client.close()
        engine.close()


def held_load(server: CacheServer, tmp_path, placement: str, instance: int, seed: int):
    """Store a prompt, look it up, start a width-1 load held after its first slice, lose its locks, flood the
    pool, let the load go on; returns (engine, worker, prompt, destination blocks, request id)."""
    client = CacheClient(server.address, timeout=30.0)
    engine = ReferenceEngine(SMALL_32, num_blocks=3 * TOKENS // 16, block_size=16)
    client.register_kv_cache(instance + 1, engine.layout, PLACEMENT_SERVER)  # to store the prompt
    prompt = random_prompt(TOKENS, seed=seed)
    src = engine.allocate(TOKENS)
    engine.prefill(prompt, src)
    assert client.store(CacheKey.for_tokens("src", prompt, model="m"), instance + 1, [src])["stored_tokens"] == TOKENS
    if placement == PLACEMENT_ENGINE:
        area = RegistrationArea(engine.layout, chunk_size=64)
        worker = EnginePlacement(client, instance, engine.layout, local_regions=engine.regions,
                                 registration_layout=area.layout)
    else:
        area = None
        worker = ServerPlacement(client, instance, engine.layout, pool_slots=2)
    worker.register()
    key = CacheKey.for_tokens(f"lost@i{instance}", prompt, model="m")
    reply = client.transport.call(RequestType.LOOKUP, [key.to_wire()])
    assert reply["hit_tokens"] == TOKENS
    located = ChunkLocations.from_lookup_reply(reply)
    dst = engine.allocate(TOKENS)
    engine.clear(dst)
    hold = SliceHold(tmp_path / "hold")
    hold.hold("lost", after_slices=1)
    with hold.installed():
        worker.submit_retrieve("lost", key, [dst], layers_per_slice=1, located=located)
        hold.wait_held("lost")  # slice 0 copied; the rest waits
        assert server.store.release_locks(key.request_id) > 0  # the test-only path: the locks are lost
        flood(server.address, instance + 2, seed=seed * 100)
        hold.open("lost")
        deadline = time.monotonic() + 60  # only catches a hang
        while worker.in_flight() and time.monotonic() < deadline:
            worker.get_finished()
            time.sleep(0.001)
        assert not worker.in_flight(), "the load never settled"
    return engine, worker, prompt, dst, client, area


def test_an_engine_copying_from_the_pool_fails_a_load_whose_objects_were_evicted_under_it(server, tmp_path):
    engine, worker, prompt, dst, client, area = held_load(server, tmp_path, PLACEMENT_ENGINE, 300, seed=1)
    try:
        failed = worker.take_failed()
        assert "lost" in failed, "the load must fail, not complete with what it copied"
        blocks, reason = failed["lost"]
        assert blocks == [dst] and "evicted while it copied" in reason
        wrong = engine.mismatched_layers(prompt, dst, 0, TOKENS)
        print(f"\nengine placement, locks lost after slice 0: failed ({reason}); layers that are not the prompt's "
              f"(recomputed by the engine): {len(wrong)} of {SMALL_32.num_layers}")
    finally:
        worker.close()
        client.close()
        area.close()
        engine.close()


def test_a_server_copy_pins_what_it_reads_so_lost_locks_cannot_change_its_bytes(server, tmp_path):
    engine, worker, prompt, dst, client, area = held_load(server, tmp_path, PLACEMENT_SERVER, 310, seed=2)
    try:
        assert worker.take_failed() == {}
        assert engine.mismatched_layers(prompt, dst, 0, TOKENS) == [], "every layer is the prompt's"
        assert server.store.stats()["locked_objects"] == 0, "the pins went with the copy"
    finally:
        worker.close()
        client.close()
        engine.close()
