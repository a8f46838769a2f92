"""STORE then RETRIEVE through a real server (in this process, or a child where a test needs its own), byte for
byte (CPU, chunk-major)."""

import pytest
import torch

from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ModelShape, ReferenceEngine
from kvstrata.core.wire.transport import RemoteError

CHUNK = 64  # the `server` fixture's chunk size
SMALL = ModelShape(num_layers=4, num_heads=2, head_size=16, dtype="bfloat16")


@pytest.fixture(scope="module")
def server(inprocess_server):
    """These handler tests run against an in-process server (tests/conftest.py): no process to start."""
    return inprocess_server


def make_engine(client, shape, num_blocks=64, block_size=16, instance_id=0):
    engine = ReferenceEngine(shape, num_blocks=num_blocks, block_size=block_size)
    client.register_kv_cache(instance_id, engine.layout, "server")
    return engine


def store_prompt(client, engine, prompt, rid="store"):
    blocks = engine.allocate(len(prompt))
    engine.prefill(prompt, blocks)
    reply = client.store(CacheKey.for_tokens(rid, prompt, model="m"), 0, [blocks])
    engine.clear(blocks)
    engine.free(blocks)
    return reply


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv_size", [2, 1], ids=["kv2", "mla"])
def test_store_then_retrieve_into_other_blocks_is_byte_exact(client, dtype, kv_size):
    shape = ModelShape(num_layers=4, kv_size=kv_size, num_heads=2, head_size=16, dtype=dtype)
    engine = make_engine(client, shape)
    try:
        prompt = torch.randint(0, 1000, (200,)).tolist()  # 3 full chunks + a partial one
        assert store_prompt(client, engine, prompt)["stored_tokens"] == 200
        key = CacheKey.for_tokens("r1", prompt, model="m")
        assert client.lookup(key) == 200
        dst = engine.allocate(200)
        reply = client.retrieve(key, 0, [dst])
        assert reply["retrieved_tokens"] == 200
        assert engine.mismatched_layers(prompt, dst, 0, 200) == []
    finally:
        engine.close()


def test_retrieve_with_skip_first_n_tokens_leaves_those_tokens_alone(client):
    shape = ModelShape(num_layers=3, num_heads=2, head_size=8, dtype="bfloat16")
    engine = make_engine(client, shape)
    try:
        prompt = torch.randint(0, 1000, (192,)).tolist()
        store_prompt(client, engine, prompt)
        key = CacheKey.for_tokens("r", prompt, model="m")
        assert client.lookup(key) == 192
        dst = engine.allocate(192)
        skip = 80  # not chunk-aligned on purpose: chunk 1 contributes only its tail
        engine.prefill([0] * 192, dst)  # sentinel content, must survive below `skip`
        reply = client.retrieve(key, 0, [dst], skip_first_n_tokens=skip)
        assert reply["retrieved_tokens"] == 192 - skip
        assert engine.mismatched_layers(prompt, dst, skip, 192) == []
        assert engine.mismatched_layers([0] * 192, dst, 0, skip) == []
    finally:
        engine.close()


def test_partial_hit_on_a_prompt_sharing_a_prefix(client):
    shape = ModelShape(num_layers=2, num_heads=2, head_size=8, dtype="float32")
    engine = make_engine(client, shape)
    try:
        prompt = torch.randint(0, 1000, (256,)).tolist()
        store_prompt(client, engine, prompt)
        other = prompt[:150] + torch.randint(0, 1000, (100,)).tolist()
        key = CacheKey.for_tokens("r", other, model="m")
        hit = client.lookup(key)
        assert hit == 128  # two whole shared chunks; chunk 2 differs after token 150
        dst = engine.allocate(hit)
        client.retrieve(CacheKey.for_tokens("r", other[:hit], model="m"), 0, [dst])
        assert engine.mismatched_layers(other, dst, 0, hit) == []
        # a different model name or salt never hits
        assert client.lookup(CacheKey.for_tokens("r2", prompt, model="other")) == 0
        assert client.lookup(CacheKey.for_tokens("r3", prompt, model="m", salt="tenant-b")) == 0
        client.free_lookup_locks("r")
    finally:
        engine.close()


def _locked(client):
    return client.server_info()["l1"]["locked_objects"]


@pytest.mark.parametrize("release", ["retrieve", "free_lookup_locks"])
def test_lookup_locks_are_released(client, release):
    shape = ModelShape(num_layers=2, num_heads=1, head_size=8, dtype="float32")
    engine = make_engine(client, shape)
    try:
        prompt = list(range(1000, 1128))  # tokens no other test of the module stores
        store_prompt(client, engine, prompt)
        key = CacheKey.for_tokens("locker", prompt, model="m")
        assert client.lookup(key) == 128
        assert _locked(client) == 2
        if release == "retrieve":
            client.retrieve(key, 0, [engine.allocate(128)])
        else:
            assert client.free_lookup_locks("locker") == 2
        assert _locked(client) == 0
    finally:
        engine.close()


def test_retrieve_without_lookup_is_refused_and_a_refused_retrieve_frees_nothing(client):
    shape = ModelShape(num_layers=2, num_heads=1, head_size=8, dtype="float32")
    engine = make_engine(client, shape)
    try:
        prompt = list(range(2000, 2064))  # tokens no other test of the module stores
        store_prompt(client, engine, prompt)
        with pytest.raises(RemoteError, match="RETRIEVE: .*not locked for request"):
            client.retrieve(CacheKey.for_tokens("nolookup", prompt, model="m"), 0, [[0, 1, 2, 3]])
        key = CacheKey.for_tokens("bad-blocks", prompt, model="m")
        client.lookup(key)
        with pytest.raises(RemoteError, match=r"block ids \[9999\] are outside"):
            client.retrieve(key, 0, [[9999, 1, 2, 3]])
        with pytest.raises(RemoteError, match="instance 7 is not registered"):
            client.retrieve(key, 7, [[0]])
        assert _locked(client) == 1, "a refused request changes nothing: the locks stay with their holder"
        assert client.free_lookup_locks("bad-blocks") == 1  # who frees them (the runtime does after a failure)
        assert _locked(client) == 0
    finally:
        engine.close()


def test_eviction_under_a_full_pool_keeps_locked_chunks(server):
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess

    shape = ModelShape(num_layers=2, num_heads=1, head_size=64, dtype="float32")  # 1 KiB/token
    obj = 64 * shape.kv_bytes_per_token()  # 128 KiB per chunk
    with ServerProcess(l1_bytes=4 * obj, chunk_size=64) as small:
        client = CacheClient(small.address)
        engine = make_engine(client, shape)
        try:
            prompts = [[p * 1000 + i for i in range(64)] for p in range(6)]
            store_prompt(client, engine, prompts[0])
            assert client.lookup(CacheKey.for_tokens("holder", prompts[0], model="m")) == 64  # lock it
            for p in prompts[1:]:
                store_prompt(client, engine, p)  # pool holds 4: evicts LRU unlocked ones
            stats = client.server_info()["l1"]
            assert stats["evictions"] >= 2
            # the locked chunk survived; the oldest unlocked ones did not
            assert client.lookup(CacheKey.for_tokens("probe0", prompts[0], model="m")) == 64
            assert client.lookup(CacheKey.for_tokens("probe1", prompts[1], model="m")) == 0
            dst = engine.allocate(64)
            client.retrieve(CacheKey.for_tokens("holder", prompts[0], model="m"), 0, [dst])
            assert engine.mismatched_layers(prompts[0], dst, 0, 64) == []
        finally:
            engine.close()
            client.close()


def test_full_pool_of_locked_chunks_rejects_store_and_keeps_serving():
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess

    shape = ModelShape(num_layers=2, num_heads=1, head_size=64, dtype="float32")
    obj = 64 * shape.kv_bytes_per_token()
    with ServerProcess(l1_bytes=2 * obj, chunk_size=64) as small:
        client = CacheClient(small.address)
        engine = make_engine(client, shape)
        try:
            a, b, c = ([p * 1000 + i for i in range(64)] for p in range(3))
            store_prompt(client, engine, a)
            store_prompt(client, engine, b)
            client.lookup(CacheKey.for_tokens("ha", a, model="m"))
            client.lookup(CacheKey.for_tokens("hb", b, model="m"))
            with pytest.raises(RemoteError, match="STORE: L1 pool full"):
                store_prompt(client, engine, c)
            assert client.ping() == "pong"
            dst = engine.allocate(64)
            client.retrieve(CacheKey.for_tokens("ha", a, model="m"), 0, [dst])
            assert engine.mismatched_layers(a, dst, 0, 64) == []  # nothing was corrupted
        finally:
            engine.close()
            client.close()


def test_a_store_larger_than_the_pool_keeps_the_chunks_that_fit_and_says_it_was_full():
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess

    shape = ModelShape(num_layers=2, num_heads=1, head_size=64, dtype="float32")
    with ServerProcess(l1_bytes=2 * 64 * shape.kv_bytes_per_token(), chunk_size=64) as small:
        client = CacheClient(small.address)
        engine = make_engine(client, shape)
        try:
            prompt = list(range(7000, 7000 + 3 * 64))
            with pytest.raises(RemoteError, match="STORE: L1 pool full"):
                store_prompt(client, engine, prompt)
            assert client.lookup(CacheKey.for_tokens("hit", prompt, model="m")) == 128, "the first two chunks"
            dst = engine.allocate(128)
            client.retrieve(CacheKey.for_tokens("hit", prompt[:128], model="m"), 0, [dst])
            assert engine.mismatched_layers(prompt, dst, 0, 128) == []
        finally:
            engine.close()
            client.close()


def test_store_skips_chunks_already_stored(client):
    shape = ModelShape(num_layers=2, num_heads=1, head_size=8, dtype="float32")
    engine = make_engine(client, shape)
    try:
        prompt = list(range(3000, 3128))  # tokens no other test of the module stores
        assert store_prompt(client, engine, prompt)["stored_tokens"] == 128
        longer = prompt + list(range(500, 564))
        reply = store_prompt(client, engine, longer)
        assert reply == {"stored_tokens": 64, "skipped_tokens": 128, "in_progress_tokens": 0}
    finally:
        engine.close()


def test_ping_and_lookup_are_answered_while_a_long_transfer_runs(tmp_path):
    """Blocking handlers run on transfer threads: a retrieve held mid-transfer (test-only slice hold) must
    not stall the socket loop."""
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess
    from kvstrata.conformance_tests.slice_hold import SliceHold

    tokens = 128
    hold = SliceHold(tmp_path / "hold")
    hold.hold("slow", after_slices=0)  # chunk-major: held before its one copy
    with ServerProcess(l1_bytes=32 << 20, chunk_size=64, slice_hold=hold) as srv:
        client = CacheClient(srv.address)
        engine = make_engine(client, SMALL, num_blocks=2 * tokens // 16 + 2)
        try:
            prompt = list(range(tokens))
            store_prompt(client, engine, prompt)
            key = CacheKey.for_tokens("slow", prompt, model="m")
            client.lookup(key)
            dst = engine.allocate(tokens)
            fut = client.retrieve_async(key, 0, [dst])
            hold.wait_held("slow")
            assert client.ping() == "pong"
            assert client.lookup(CacheKey.for_tokens("other", [1, 2, 3], model="m")) == 0
            assert not fut.done(), "the held retrieve answered before it was let go"
            hold.open("slow")
            assert client.transport.wait(fut)["retrieved_tokens"] == tokens
            assert engine.mismatched_layers(prompt, dst, 0, tokens) == []
        finally:
            engine.close()
            client.close()


def test_a_prompt_keyed_by_the_engines_page_hashes_stores_hits_and_retrieves_exact(client):
    """SGLang hands over per-page prefix hashes, not token ids: the key says so, the protocol declares it."""
    engine = make_engine(client, SMALL, instance_id=0)
    try:
        prompt = list(range(7, 7 + 192))
        hashes = [f"sha256-{i:04d}" for i in range(192 // 16)]  # the engine's chain, one per 16-token page
        blocks = engine.allocate(192)
        engine.prefill(prompt, blocks)
        reply = client.store(CacheKey.for_page_hashes("pages-store", hashes, 16, model="m"), 0, [blocks])
        assert reply["stored_tokens"] == 192
        engine.clear(blocks)
        # a request sharing the first 8 pages (two whole chunks) hits them; the full prompt hits everything
        assert client.lookup(CacheKey.for_page_hashes("pages-part", hashes[:8] + ["other"] * 4, 16, model="m")) == 128
        client.free_lookup_locks("pages-part")
        key = CacheKey.for_page_hashes("pages-load", hashes, 16, model="m")
        assert client.lookup(key) == 192
        dst = engine.allocate(192)
        engine.clear(dst)
        client.retrieve(key, 0, [dst])
        assert engine.mismatched_layers(prompt, dst, 0, 192) == []
        # the same tokens keyed by token ids are another key: no hit
        assert client.lookup(CacheKey.for_tokens("pages-tokens", prompt, model="m")) == 0
        client.free_lookup_locks("pages-tokens")
        # a page size that does not divide the chunk size is refused by name, and the server goes on
        with pytest.raises(RemoteError, match="not a multiple of the engine's page size 48"):
            client.lookup(CacheKey.for_page_hashes("pages-bad", hashes[:4], 48, model="m"))
        assert client.ping() == "pong"
    finally:
        client.unregister_kv_cache(0)
        engine.close()


def test_a_prompt_cached_in_one_dtype_is_a_miss_for_a_cache_of_another(client):
    """bfloat16 and float16 hold the same bytes per head, so only the key can tell them apart: the server puts
    the dtype of the cache a request names into every digest. A key naming no cache takes the one dtype the
    registered caches share; where they differ, it must say which."""
    from kvstrata.core.engine.requests import lock_owner

    bf16 = make_engine(client, SMALL, instance_id=0)
    fp16 = make_engine(client, ModelShape(num_layers=4, num_heads=2, head_size=16, dtype="float16"), instance_id=1)
    try:
        prompt = torch.randint(0, 1000, (128,)).tolist()
        assert store_prompt(client, bf16, prompt, rid="dtype-store")["stored_tokens"] == 128
        assert client.lookup(CacheKey.for_tokens(lock_owner("dtype-1", 1), prompt, model="m")) == 0
        assert client.lookup(CacheKey.for_tokens(lock_owner("dtype-0", 0), prompt, model="m")) == 128
        assert client.lookup(CacheKey.for_tokens("dtype-b", prompt, model="m", dtype="bfloat16")) == 128
        assert client.lookup(CacheKey.for_tokens("dtype-f", prompt, model="m", dtype="float16")) == 0
        with pytest.raises(RemoteError, match=r"names no registered cache .* \['bfloat16', 'float16'\]: say which"):
            client.lookup(CacheKey.for_tokens("dtype-none", prompt, model="m"))
        with pytest.raises(RemoteError, match="the key says dtype 'float16', the cache of instance 0 holds"):
            client.lookup(CacheKey.for_tokens(lock_owner("dtype-lie", 0), prompt, model="m", dtype="float16"))
        for owner in (lock_owner("dtype-0", 0), "dtype-b"):
            client.free_lookup_locks(owner)
    finally:
        for instance_id, engine in ((0, bf16), (1, fp16)):
            client.unregister_kv_cache(instance_id)
            engine.close()


def test_an_engines_own_page_format_is_a_miss_for_any_other_packing(client):
    """A cache whose pages move as opaque rows (vLLM's CPU pages, TensorRT-LLM's blocks: formats named
    ``...-pages``) holds that engine's packing, not kvstrata's per-token form: its chunks are keyed by the format,
    so a per-token cache of the same model, shape and dtype, or another packing, misses them instead of reading
    those bytes; the same format hits."""
    import dataclasses

    from kvstrata.core.engine.requests import lock_owner

    per_token = make_engine(client, SMALL, instance_id=0)
    pages = ReferenceEngine(SMALL, num_blocks=64, block_size=16)
    other = ReferenceEngine(SMALL, num_blocks=64, block_size=16)
    client.register_kv_cache(1, dataclasses.replace(pages.layout, format="reference-vec-pages"), "server")
    client.register_kv_cache(2, dataclasses.replace(other.layout, format="reference-amx-pages"), "server")
    try:
        prompt = torch.randint(0, 1000, (128,)).tolist()
        blocks = pages.allocate(len(prompt))
        pages.prefill(prompt, blocks)
        assert client.store(CacheKey.for_tokens("pages-store", prompt, model="m"), 1, [blocks])["stored_tokens"] == 128
        assert client.lookup(CacheKey.for_tokens(lock_owner("pages-0", 0), prompt, model="m")) == 0
        assert client.lookup(CacheKey.for_tokens(lock_owner("pages-2", 2), prompt, model="m")) == 0
        assert client.lookup(CacheKey.for_tokens(lock_owner("pages-1", 1), prompt, model="m")) == 128
        client.free_lookup_locks(lock_owner("pages-1", 1))
    finally:
        for instance_id, engine in ((0, per_token), (1, pages), (2, other)):
            client.unregister_kv_cache(instance_id)
            engine.close()
