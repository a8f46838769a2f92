"""The reply ring: replies in shared memory for a polling client on the server's host (CPU, real processes)."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from kvstrata.core.client import CacheClient
from kvstrata.core.protocol import RequestType
from kvstrata.core.reply_ring import HEADER_BYTES, ReplyRing, ReplyRingError
from kvstrata.core.shm import Segment, new_segment_name
from kvstrata.core.testing.reference_engine import ReferenceEngine
from kvstrata.core.transport import Client, RemoteError
from kvstrata.core.worker import LayerwiseWorker

from helpers import SMALL_32, engine_loop, lookup_into_fresh_blocks, random_prompt, store_prompt


@pytest.fixture
def ring_pair():
    reader = ReplyRing.create(slots=4, slot_bytes=128)
    writer = ReplyRing.attach(reader.ref())
    yield reader, writer
    writer.close()
    reader.destroy()


def test_frames_come_out_in_order_once(ring_pair):
    reader, writer = ring_pair
    assert reader.take() == []
    for i in range(3):
        assert writer.post(f"reply {i}".encode())
    assert reader.take() == [b"reply 0", b"reply 1", b"reply 2"]
    assert reader.take() == []
    for i in range(3, 9):  # around the ring more than once, read as it goes
        assert writer.post(f"reply {i}".encode())
        assert reader.take() == [f"reply {i}".encode()]


def test_a_frame_larger_than_a_slot_is_left_to_zmq(ring_pair):
    reader, writer = ring_pair
    assert writer.capacity == 128 - 16
    assert not writer.post(b"x" * (writer.capacity + 1))
    assert writer.post(b"x" * writer.capacity)
    assert reader.take() == [b"x" * writer.capacity]


def test_a_lapped_reader_skips_what_was_overwritten_and_keeps_reading(ring_pair):
    reader, writer = ring_pair
    for i in range(10):  # 4 slots: replies 0..5 are overwritten before anyone reads
        writer.post(f"r{i}".encode())
    assert reader.take() == []  # what is left may be overwritten any moment: start after it
    assert reader.skipped == 10
    writer.post(b"r10")
    assert reader.take() == [b"r10"]


def test_a_slot_being_rewritten_is_not_read(ring_pair):
    reader, writer = ring_pair
    writer.post(b"first")
    words = np.frombuffer(reader.segment.buf, dtype=np.uint64, count=HEADER_BYTES // 8 + 1)
    words[HEADER_BYTES // 8] = 0  # the writer's "being rewritten" mark on slot 0
    assert reader.take() == []
    words[HEADER_BYTES // 8] = 1
    del words
    assert reader.take() == [b"first"]


def test_attach_refuses_what_is_not_a_reply_ring():
    with pytest.raises(ReplyRingError, match="not a kvstrata reply ring name"):
        ReplyRing.attach({"name": "some-other-app-segment", "slots": 4, "slot_bytes": 128})
    with pytest.raises(ReplyRingError, match="no shared-memory segment"):
        ReplyRing.attach({"name": "kvstrata-ring-1-0000abcd", "slots": 4, "slot_bytes": 128})
    with pytest.raises(ReplyRingError, match="multiple of 64"):
        ReplyRing.attach({"name": "kvstrata-ring-1-0000abcd", "slots": 4, "slot_bytes": 100})
    # a segment with a ring's name but no ring header: the server must not write into it
    seg = Segment(new_segment_name("ring"), HEADER_BYTES + 4 * 128, create=True)
    try:
        with pytest.raises(ReplyRingError, match="is not a reply ring of 4 slots"):
            ReplyRing.attach({"name": seg.name, "slots": 4, "slot_bytes": 128})
    finally:
        seg.destroy()
    ring = ReplyRing.create(slots=4, slot_bytes=128)
    try:  # a ring of another geometry than declared
        with pytest.raises(ReplyRingError, match="is not a reply ring of 2 slots"):
            ReplyRing.attach({"name": ring.name, "slots": 2, "slot_bytes": 128})
    finally:
        ring.destroy()


def test_a_polling_client_gets_replies_from_the_ring_alone(server):
    client = Client(server.address, default_timeout=10)
    try:
        assert client.attach_reply_ring()
        client._stop.set()  # park the I/O thread, and never drain the socket: only the ring can resolve now
        client._thread.join(timeout=5)
        for i in range(20):
            fut = client.submit(RequestType.PING, [])
            deadline = time.monotonic() + 5
            while not fut.done() and time.monotonic() < deadline:
                client._take_ring()
            assert fut.result(timeout=0) == "pong", i
        assert client.reply_ring.taken >= 20
    finally:
        client.close()


def test_error_replies_come_through_the_ring_too(server):
    client = Client(server.address, default_timeout=10)
    try:
        assert client.attach_reply_ring()
        client._stop.set()
        client._thread.join(timeout=5)
        fut = client.submit_unchecked(RequestType.LOOKUP, ["not a key"])
        deadline = time.monotonic() + 5
        while not fut.done() and time.monotonic() < deadline:
            client._take_ring()
        with pytest.raises(RemoteError, match="LOOKUP"):
            fut.result(timeout=0)
    finally:
        client.close()


def test_a_ring_the_server_cannot_map_leaves_replies_to_zmq(server, monkeypatch, caplog):
    create = ReplyRing.create

    def elsewhere(*a, **kw):  # as if the client ran on another host: the server finds no such segment
        ring = create(*a, **kw)
        ring.segment.unlink()
        return ring

    monkeypatch.setattr(ReplyRing, "create", staticmethod(elsewhere))
    client = Client(server.address, default_timeout=10)
    try:
        with caplog.at_level(logging.WARNING, logger="kvstrata.core.transport"):
            assert not client.attach_reply_ring()
        assert "replies come over ZMQ only" in caplog.text and "ATTACH_REPLY_RING" in caplog.text
        assert client.reply_ring is None
        assert client.call(RequestType.PING) == "pong"
        assert client.call(RequestType.SERVER_INFO)["reply_rings"] == 0
    finally:
        client.close()


def test_the_ring_can_be_turned_off(server, monkeypatch):
    monkeypatch.setenv("KVSTRATA_REPLY_RING", "0")
    with Client(server.address, default_timeout=10) as client:
        assert not client.attach_reply_ring()
        assert client.call(RequestType.SERVER_INFO)["reply_rings"] == 0


def test_the_worker_attaches_a_ring_and_transfers_settle_through_it(server, monkeypatch):
    client = CacheClient(server.address, timeout=20.0)
    engine = ReferenceEngine(SMALL_32, num_blocks=64, block_size=16)
    worker = LayerwiseWorker(client, 0, engine.layout)
    try:
        worker.register()
        assert client.server_info()["reply_rings"] == 1
        ring = client.transport.reply_ring
        prompt = random_prompt(160)
        store_prompt(client, engine, prompt)
        looked_up = {w: lookup_into_fresh_blocks(client, engine, f"w{w}", prompt) for w in (0, 1)}
        # from here only the ring can resolve a reply: no I/O thread, and the engine's polls never drain ZMQ
        client.transport._stop.set()
        client.transport._thread.join(timeout=5)
        monkeypatch.setattr(client.transport._sock, "try_drain", lambda: None)
        for width, (key, dst) in looked_up.items():
            rid = f"w{width}"
            worker.submit_retrieve(rid, key, [dst], layers_per_stage=width)
            engine_loop(worker, rid, SMALL_32.num_layers)
            worker.wait_all()
            rec = worker.records[rid]
            assert rec.failure is None and rec.completed_at is not None, rec
            assert worker.future_of(rid) is None and rid not in worker.in_flight()
            assert engine.mismatched_layers(prompt, dst, 0, 160) == [], width
    finally:
        worker.close()
        client.close()
        engine.close()
    assert ring.segment.name not in os.listdir("/dev/shm"), "the client left its ring behind"
