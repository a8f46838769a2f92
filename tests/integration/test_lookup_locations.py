"""Engine placement starts from where the LOOKUP found the chunks: no RETRIEVE round trip before the first copy.

The LOOKUP's reply says where its locked hit lies in the pool (``located``); the scheduler side carries that to
the worker side in the load's metadata (:class:`ChunkLocations`), and the worker checks it against its own
cache and the pool it maps before it copies. These tests drive a real ``kvstrata serve``; the conformance suite
checks on the wire that such a load sends no RETRIEVE, and ``tests/test_tensor_parallel.py`` that each rank
starts from its own rank's locations.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.engine.requests import ChunkLocations
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ReferenceEngine

from helpers import SMALL_32, engine_loop, random_prompt, store_prompt

TOKENS = 160  # with the suite's 64-token chunks: two whole chunks and a partial one
WORKER_ID = 41


@pytest.fixture(scope="module")
def engine(client):
    """One cache for the module: instance 0 (server placement) stores prompts, WORKER_ID loads them itself."""
    engine = ReferenceEngine(SMALL_32, num_blocks=4 * TOKENS // 16 + 2, block_size=16)
    client.register_kv_cache(0, engine.layout, "server")
    yield engine
    client.unregister_kv_cache(0)
    engine.close()


@pytest.fixture
def worker(client, engine):
    area = RegistrationArea(engine.layout, chunk_size=int(client.server_info()["chunk_size"]))
    w = EnginePlacement(client, WORKER_ID, engine.layout, local_regions=engine.regions,
                        registration_layout=area.layout)
    w.register()
    yield w
    w.close()
    client.unregister_kv_cache(WORKER_ID)
    area.close()


def looked_up(client, rid: str, prompt: list[int]) -> tuple[CacheKey, dict]:
    key = CacheKey.for_tokens(rid, prompt, model="m")
    return key, client.transport.wait(client.lookup_async(key))


def test_a_lookup_says_where_its_locked_hit_lies_as_retrieve_would(client, engine, worker):
    prompt = random_prompt(TOKENS, seed=71)
    store_prompt(client, engine, prompt)
    key, reply = looked_up(client, "loc-1", prompt)
    assert reply["hit_tokens"] == TOKENS
    located = ChunkLocations.from_lookup_reply(reply)
    assert located is not None and located.shape == engine.layout.shape_signature()
    assert [row[2] for row in located.objects] == [64, 64, 32]
    dst = engine.allocate(TOKENS)
    retrieved = client.retrieve(key, WORKER_ID, [dst])  # the engine-placement RETRIEVE locates the same objects
    assert located.as_retrieve_reply() == {"pool": retrieved["pool"], "objects": retrieved["objects"]}
    client.free_lookup_locks("loc-1")
    engine.free(dst)
    _, miss = looked_up(client, "loc-miss", random_prompt(TOKENS, seed=72))
    assert miss["hit_tokens"] == 0 and ChunkLocations.from_lookup_reply(miss) is None


def test_covering_keeps_whole_objects_only():
    located = ChunkLocations("pool", 1 << 20, (2, 4, 2, 32),
                             ((0, 100, 64, 3, 7), (512, 100, 64, 4, 8), (1024, 50, 32, 5, 9)), "gens", 16)
    assert located.covering(128).objects == located.objects[:2]
    assert located.covering(160) is located
    assert located.covering(0).objects == ()
    assert located.covering(100) is None, "a load that ends inside a chunk asks RETRIEVE"
    assert located.covering(192) is None, "more tokens than the hit"
    reply = {"hit_tokens": 160, "located": {"pool": {"name": "pool", "size": 1 << 20,
                                                     "generations": {"name": "gens", "slots": 16}},
                                            "shape": [2, 4, 2, 32],
                                            "objects": [list(o) for o in located.objects]}}
    assert ChunkLocations.from_lookup_reply(reply) == located and located.num_tokens == 160
    assert ChunkLocations.from_lookup_reply(reply).covering(100) is None, "no whole-chunk prefix: RETRIEVE locates"
    assert ChunkLocations.from_lookup_reply({"hit_tokens": 0}) is None, "a miss carries no locations"


def test_a_load_located_by_its_lookup_lands_byte_exact_without_a_retrieve(client, engine, worker):
    prompt = random_prompt(TOKENS, seed=73)
    store_prompt(client, engine, prompt)
    key, reply = looked_up(client, "loc-2", prompt)
    retrieves = served_retrieves(client)
    dst = engine.allocate(TOKENS)
    engine.clear(dst)
    worker.submit_retrieve("loc-2", key, [dst], layers_per_slice=4, located=ChunkLocations.from_lookup_reply(reply))
    engine_loop(worker, "loc-2", SMALL_32.num_layers)
    assert engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
    rec = worker.records["loc-2"]
    assert rec.located_by == "lookup" and rec.failure is None
    assert served_retrieves(client) == retrieves, "the server served a RETRIEVE for a load its LOOKUP located"
    wait_for_unlocked(client)  # the worker freed the locks once its copy was done
    engine.free(dst)


def test_locations_that_do_not_fit_this_cache_are_not_used(client, engine, worker, caplog):
    prompt = random_prompt(TOKENS, seed=74)
    store_prompt(client, engine, prompt)
    key, reply = looked_up(client, "loc-3", prompt)
    located = ChunkLocations.from_lookup_reply(reply)
    other_shape = dataclasses.replace(located, shape=(2, 16, 2, 32))
    dst = engine.allocate(TOKENS)
    engine.clear(dst)
    with caplog.at_level("INFO", logger="kvstrata.core.engine.engine_placement"):
        worker.submit_retrieve("loc-3", key, [dst], layers_per_slice=4, located=other_shape)
    assert "do not fit this cache" in caplog.text
    engine_loop(worker, "loc-3", SMALL_32.num_layers)
    assert worker.records["loc-3"].located_by == "retrieve", "the server is asked where the chunks are instead"
    assert engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
    engine.free(dst)


def test_a_location_outside_the_pool_fails_the_load_for_recompute_and_writes_nothing(client, engine, worker):
    prompt = random_prompt(TOKENS, seed=75)
    store_prompt(client, engine, prompt)
    key, reply = looked_up(client, "loc-4", prompt)
    located = ChunkLocations.from_lookup_reply(reply)
    last = located.objects[-1]
    beyond = dataclasses.replace(located, objects=located.objects[:-1] + ((located.pool_size - 512, *last[1:]),))
    dst = engine.allocate(TOKENS)
    engine.clear(dst)
    before = [engine.read_layer(layer, dst, 0, TOKENS).clone() for layer in range(SMALL_32.num_layers)]
    worker.submit_retrieve("loc-4", key, [dst], layers_per_slice=4, located=beyond)
    deadline = time.monotonic() + 60
    while not (failed := worker.take_failed()) and time.monotonic() < deadline:
        worker.get_finished()
        time.sleep(0.001)
    assert set(failed) == {"loc-4"} and "outside" in failed["loc-4"][1], failed
    assert failed["loc-4"][0] == [dst], "every block of the load is reported for recompute"
    assert all(engine.read_layer(layer, dst, 0, TOKENS).equal(before[layer]) for layer in range(SMALL_32.num_layers))
    wait_for_unlocked(client)
    engine.free(dst)


def served_retrieves(client) -> float:
    """Tokens the server's RETRIEVEs reported (a engine-placement RETRIEVE counts the tokens it located)."""
    return client.server_info()["totals"]["retrieved_tokens"]


def wait_for_unlocked(client, timeout: float = 30.0) -> None:
    """The worker's FREE_LOOKUP_LOCKS reached the server: no chunk is locked any more (these tests run one load
    at a time, and each frees the locks it took itself)."""
    deadline = time.monotonic() + timeout
    while client.server_info()["l1"]["locked_objects"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.server_info()["l1"]["locked_objects"] == 0
