"""The server writes only where it should: a mistaken or hostile request is refused and changes nothing.

Each test here is a hole an earlier server had, against a real ``kvstrata serve``:
a RETRIEVE naming a segment that is not an arrival board (the server wrote board
words into it, corrupting a stored prompt), REGISTER_KV_CACHE descriptors that
address memory outside their region or name the server's own pool, and instance
ids any connection could use or unregister.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvstrata.core.arrival.board import NO_PROGRESS, ArrivalBoard
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.shm import Segment
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.core.wire.transport import RemoteError

from helpers import SMALL_32, control_segment_of_unknown_kind, random_prompt

TOKENS = 128


@pytest.fixture
def engine(client):
    eng = ReferenceEngine(SMALL_32, num_blocks=4 * TOKENS // 16 + 4, block_size=16)
    client.register_kv_cache(0, eng.layout, "server")
    yield eng
    eng.close()


def stored(client: CacheClient, engine: ReferenceEngine, seed: int) -> list[int]:
    prompt = random_prompt(TOKENS, seed=seed)
    blocks = engine.allocate(TOKENS)
    engine.prefill(prompt, blocks)
    client.store(CacheKey.for_tokens(f"store-{seed}", prompt, model="m"), 0, [blocks])
    engine.clear(blocks)
    engine.free(blocks)
    return prompt


def reads_back_exact(client: CacheClient, engine: ReferenceEngine, prompt: list[int], rid: str) -> bool:
    key = CacheKey.for_tokens(rid, prompt, model="m")
    assert client.lookup(key) == len(prompt)
    dst = engine.allocate(len(prompt))
    engine.clear(dst)
    try:
        assert client.retrieve(key, 0, [dst])["retrieved_tokens"] == len(prompt)
        return engine.mismatched_layers(prompt, dst, 0, len(prompt)) == []
    finally:
        engine.free(dst)


def board_ref(name: str, slot: int = 0, generation: int = 1) -> dict:
    return {"name": name, "slot": slot, "generation": generation}


def test_a_retrieve_naming_what_is_not_an_arrival_board_is_refused_and_writes_nothing(client, engine):
    prompt = stored(client, engine, seed=11)
    pool = client.server_info()["pool"]["name"]
    retired = control_segment_of_unknown_kind()
    cache_before = engine.regions[0].clone()
    retired_before = bytes(retired.buf)
    try:
        victims = {
            pool: "the server's own L1 pool",
            engine.layout.regions[0].name: "carries no kvstrata control header",
            retired.name: "carries no kvstrata control header",
            "kvstrata-board-0-deadbeef": "no shared-memory segment",
            "../../etc/passwd": "invalid shared-memory segment name",
        }
        for slot in (0, 5, 1000):
            for name, why in victims.items():
                key = CacheKey.for_tokens(f"bad-board-{slot}", prompt, model="m")
                assert client.lookup(key) == TOKENS
                dst = engine.allocate(TOKENS)
                with pytest.raises(RemoteError, match=why.replace("(", r"\(").replace(")", r"\)")):
                    client.retrieve(key, 0, [dst], arrival_board=board_ref(name, slot), layers_per_slice=1)
                engine.free(dst)
            # a refused request frees nothing: its locks stay with their holder, which frees them
            assert client.free_lookup_locks(f"bad-board-{slot}") == 2 * len(victims)  # two chunks a lookup
        # nothing was written: not the engine's cache, not the other control segment, not the stored KV
        assert torch.equal(engine.regions[0], cache_before)
        assert bytes(retired.buf) == retired_before
        assert reads_back_exact(client, engine, prompt, "after-bad-boards")
        assert client.server_info()["l1"]["locked_objects"] == 0
    finally:
        retired.destroy()


def test_a_rejected_retrieve_writes_no_word_on_its_real_board(client, engine):
    """Bad block ids, a slot past the board's end, a generation of 0: each refused, the board untouched."""
    prompt = stored(client, engine, seed=12)
    board = ArrivalBoard.create(2)
    try:
        cases = [
            (dict(block_ids=[[0, 1, 2, 10_000, 4, 5, 6, 7]]), board_ref(board.name, 0, 3), "are outside"),
            (dict(block_ids=None), board_ref(board.name, 2, 3), "slot 2 is not one"),
            (dict(block_ids=None), board_ref(board.name, 1, 0), "generation 0 is not in"),
            (dict(block_ids=None, skip_first_n_tokens=-1), board_ref(board.name, 1, 3),
             r"\(skip_first_n_tokens\) must be int >= 0, got int -1"),
            (dict(block_ids=None, skip_first_n_tokens=TOKENS + 1), board_ref(board.name, 1, 3),
             "skip_first_n_tokens 129"),
        ]
        for i, (kw, ref, why) in enumerate(cases):
            key = CacheKey.for_tokens(f"rejected-{i}", prompt, model="m")
            assert client.lookup(key) == TOKENS
            dst = engine.allocate(TOKENS)
            engine.clear(dst)
            before = engine.regions[0].clone()
            blocks = kw.pop("block_ids") or [dst]
            with pytest.raises(RemoteError, match=why):
                client.retrieve(key, 0, blocks, arrival_board=ref, layers_per_slice=1, **kw)
            assert torch.equal(engine.regions[0], before), f"case {i} wrote into the cache"
            client.free_lookup_locks(f"rejected-{i}")  # a request the protocol refused never reached them
            engine.free(dst)
        assert bytes(board.segment.buf[64:]) == bytes(2 * 64), "a rejected retrieve wrote a board word"
        assert board.read(0, 3) == NO_PROGRESS and board.read(1, 3) == NO_PROGRESS
        assert client.server_info()["l1"]["locked_objects"] == 0
        assert reads_back_exact(client, engine, prompt, "after-rejected")
    finally:
        board.destroy()


def test_register_refuses_descriptors_that_reach_outside_their_region_or_into_the_servers_memory(client, engine):
    prompt = stored(client, engine, seed=13)
    good = engine.layout.to_wire("server")
    pool = client.server_info()["pool"]
    board = ArrivalBoard.create(4)
    other = Segment.create("cache", 4096)
    try:
        def bad(why: str, **changes) -> None:
            d = {**good, **changes}
            with pytest.raises(RemoteError, match=why):
                client.transport.call(RequestType.REGISTER_KV_CACHE, [5, d])

        bad("block_stride must be positive, got -", block_stride=-good["block_stride"])
        bad("token_stride must be positive, got 0", token_stride=0)
        bad("head_stride must be positive", head_stride=-1)
        bad("past region 0", num_blocks=good["num_blocks"] * 4)
        bad("past region 0", offsets=[[[0, o + (1 << 30)] for _, o in per_kv] for per_kv in good["offsets"]])
        bad("is the server's own L1 pool", regions=[{"kind": "shm", "size": 4096, "name": pool["name"]}],
            offsets=[[[0, 0]] * 2] * 32, num_blocks=1, block_size=1)
        bad("is an arrival board, not an engine cache",
            regions=[{"kind": "shm", "size": board.segment.size, "name": board.name}],
            offsets=[[[0, 0]] * 2] * 32, num_blocks=1, block_size=1)
        bad("holds 4096 bytes, fewer than the .* its descriptor names",
            regions=[{"kind": "shm", "size": good["regions"][0]["size"], "name": other.name}])
        # a segment this client did not make as a cache (no proof), or the engine's cache under a wrong proof
        bad("no proof that the registering process owns this memory",
            regions=[{"kind": "shm", "size": 4096, "name": other.name}], offsets=[[[0, 0]] * 2] * 32, num_blocks=1,
            block_size=1)
        forged = {**good["regions"][0], "handle": {"proof": "00" * 32}}
        bad("no proof that the registering process owns this memory", regions=[forged])
        bad("unsupported memory region kinds",
            regions=[{"kind": "dram", "size": good["regions"][0]["size"], "name": other.name}])
        assert 5 not in client.server_info()["instances"]
        assert bytes(board.segment.buf[64:]) == bytes(4 * 64)
        assert reads_back_exact(client, engine, prompt, "after-bad-descriptors")
    finally:
        board.destroy()
        other.destroy()


def test_an_instance_belongs_to_the_connection_that_registered_it(server, client, engine):
    prompt = stored(client, engine, seed=14)
    intruder = CacheClient(server.address, timeout=20.0)
    try:
        key = CacheKey.for_tokens("intruder", prompt, model="m")
        assert intruder.lookup(key) == TOKENS  # lookups are not per instance
        dst = engine.allocate(TOKENS)
        engine.clear(dst)
        before = engine.regions[0].clone()
        for call in (lambda: intruder.retrieve(key, 0, [dst]),
                     lambda: intruder.store(CacheKey.for_tokens("intruder-store", prompt, model="m"), 0, [dst]),
                     lambda: intruder.transport.call(RequestType.UNREGISTER_KV_CACHE, [0])):
            with pytest.raises(RemoteError, match="instance 0 belongs to another connection"):
                call()
        with pytest.raises(RemoteError, match="instance 0 is registered by another connection, which is still"):
            intruder.register_kv_cache(0, engine.layout, "server")
        intruder.transport.call(RequestType.FREE_LOOKUP_LOCKS, ["intruder"])
        assert torch.equal(engine.regions[0], before)
        assert 0 in client.server_info()["instances"]
        assert reads_back_exact(client, engine, prompt, "owner-still-works")
        # another instance id is the intruder's own
        mine = ReferenceEngine(SMALL_32, num_blocks=16, block_size=16)
        try:
            intruder.register_kv_cache(9, mine.layout, "server")
            assert intruder.transport.call(RequestType.UNREGISTER_KV_CACHE, [9]) is True
        finally:
            mine.close()
    finally:
        intruder.close()


def test_a_restarted_engine_takes_its_instance_over_once_the_old_connection_is_gone(server, tmp_path):
    """The engine's process died (its connection with it): a new process registers the same instance id."""
    eng = ReferenceEngine(SMALL_32, num_blocks=16, block_size=16)
    first = CacheClient(server.address, timeout=20.0)
    second = CacheClient(server.address, timeout=20.0)
    try:
        first.register_kv_cache(3, eng.layout, "server")
        first.close()  # the old process's socket goes away
        deadline = time.monotonic() + 60  # ZMQ notices the closed connection soon; the bound only catches a hang
        while True:
            try:
                second.register_kv_cache(3, eng.layout, "server")
                break
            except RemoteError as exc:
                assert "still connected" in str(exc), exc
                assert time.monotonic() < deadline, "the dead connection's instance was never released"
                time.sleep(0.01)
        assert second.transport.call(RequestType.UNREGISTER_KV_CACHE, [3]) is True
    finally:
        second.close()
        eng.close()


def test_unregistering_while_a_transfer_copies_into_the_cache_keeps_the_server_alive(tmp_path):
    """The cache's memory stays mapped until the transfer that writes it has ended (it once was unmapped
    under the copy, and the server died of it)."""
    from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess
    from kvstrata.conformance_tests.slice_hold import SliceHold

    hold = SliceHold(tmp_path / "hold")
    hold.hold("in-flight", after_slices=1)
    with ServerProcess(l1_bytes=32 << 20, chunk_size=64, slice_hold=hold) as srv:
        client = CacheClient(srv.address, timeout=30.0)
        eng = ReferenceEngine(SMALL_32, num_blocks=2 * TOKENS // 16 + 2, block_size=16)
        try:
            client.register_kv_cache(0, eng.layout, "server")
            prompt = stored(client, eng, seed=15)
            key = CacheKey.for_tokens("in-flight", prompt, model="m")
            assert client.lookup(key) == TOKENS
            dst = eng.allocate(TOKENS)
            board = ArrivalBoard.create(1)
            try:
                fut = client.retrieve_async(key, 0, [dst], arrival_board=board_ref(board.name), layers_per_slice=1)
                hold.wait_held("in-flight")
                assert client.unregister_kv_cache(0) is True  # while the transfer is held after its first slice
                hold.open("in-flight")
                assert client.transport.wait(fut, timeout=30)["retrieved_tokens"] == TOKENS
            finally:
                board.destroy()
            assert client.ping() == "pong" and srv.proc.poll() is None
            assert eng.mismatched_layers(prompt, dst, 0, TOKENS) == []
            assert 0 not in client.server_info()["instances"]
        finally:
            client.close()
            eng.close()
