"""Shared-memory rings: requests and replies beside ZMQ for a client on the server's host (CPU, real processes)."""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.wire.protocol import DECLARATIONS, TRANSPORT_REQUESTS, RequestType
from kvstrata.core.wire.rings import Mailbox, RingError, SlotRing
from kvstrata.core.shm import CONTROL_HEADER_BYTES, Segment, SegmentKind, new_segment_name
from kvstrata.core.testing.reference_engine import ReferenceEngine
from kvstrata.core.wire.transport import Client, Deferred, RemoteError, Server, _Peer
from kvstrata.core.engine.server_placement import ServerPlacement

from helpers import SMALL_32, engine_loop, lookup_into_fresh_blocks, random_prompt, store_prompt
from test_transport import handler_of, started_server


@pytest.fixture
def ring_pair():
    reader = SlotRing.create(slots=4, slot_bytes=128, kind=SegmentKind.REPLY_RING)
    writer = SlotRing.attach(reader.ref(), SegmentKind.REPLY_RING)
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
    words = np.frombuffer(reader.segment.buf, dtype=np.uint64, count=CONTROL_HEADER_BYTES // 8 + 1)
    words[CONTROL_HEADER_BYTES // 8] = 0  # the writer's "being rewritten" mark on slot 0
    assert reader.take() == []
    words[CONTROL_HEADER_BYTES // 8] = 1
    del words
    assert reader.take() == [b"first"]


def test_attach_refuses_what_is_not_a_kvstrata_ring_of_that_kind():
    reply = SegmentKind.REPLY_RING
    with pytest.raises(RingError, match="no shared-memory segment"):
        SlotRing.attach({"name": "kvstrata-reply-ring-1-0000abcd", "slots": 4, "slot_bytes": 128}, reply)
    with pytest.raises(RingError, match="multiple of 64"):
        SlotRing.attach({"name": "kvstrata-reply-ring-1-0000abcd", "slots": 4, "slot_bytes": 100}, reply)
    # a segment with a ring's name and size but no header: the server must not write into it
    seg = Segment(new_segment_name("reply-ring"), CONTROL_HEADER_BYTES + 4 * 128, create=True)
    try:
        with pytest.raises(RingError, match="carries no kvstrata control header"):
            SlotRing.attach({"name": seg.name, "slots": 4, "slot_bytes": 128}, reply)
    finally:
        seg.destroy()
    ring = SlotRing.create(slots=4, slot_bytes=128, kind=reply)
    box = Mailbox.create(4, 128)
    try:
        with pytest.raises(RingError, match="has 4 slots of 128 bytes, the request said 2 of 128"):
            SlotRing.attach({"name": ring.name, "slots": 2, "slot_bytes": 128}, reply)
        with pytest.raises(RingError, match="is a reply ring, not a request ring"):
            SlotRing.attach(ring.ref(), SegmentKind.REQUEST_RING)
        with pytest.raises(RingError, match="is a reply ring, not a mailbox"):
            Mailbox.attach(ring.ref())
        with pytest.raises(RingError, match="is a mailbox, not a reply ring"):
            SlotRing.attach(box.ref(), reply)
    finally:
        ring.destroy()
        box.destroy()


def ring_only_client(address: str) -> Client:
    """A client with rings whose I/O thread is parked and whose socket is never drained: only its reply
    ring (and mailbox) can resolve a request."""
    client = Client(address, default_timeout=10)
    assert client.attach_rings()
    client._stop.set()
    client._thread.join(timeout=5)
    client._sock._drain = lambda: None
    return client


def test_a_polling_client_gets_replies_from_the_ring_alone(server):
    client = ring_only_client(server.address)
    try:
        for i in range(20):
            fut = client.submit(RequestType.PING, [])
            deadline = time.monotonic() + 60
            while not fut.done() and time.monotonic() < deadline:
                client._take_replies()
            assert fut.result(timeout=0) == "pong", i
        assert client.reply_ring.taken >= 20
    finally:
        client.close()


def test_error_replies_come_through_the_ring_too(server):
    client = ring_only_client(server.address)
    try:
        fut = client.submit_unchecked(RequestType.LOOKUP, ["not a key"])
        deadline = time.monotonic() + 60
        while not fut.done() and time.monotonic() < deadline:
            client._take_replies()
        with pytest.raises(RemoteError, match="LOOKUP"):
            fut.result(timeout=0)
    finally:
        client.close()


def test_rings_the_server_cannot_map_leave_frames_to_zmq(server, monkeypatch, caplog):
    create = SlotRing.create

    def elsewhere(*a, **kw):  # as if the client ran on another host: the server finds no such segment
        ring = create(*a, **kw)
        ring.segment.unlink()
        return ring

    monkeypatch.setattr(SlotRing, "create", staticmethod(elsewhere))
    client = Client(server.address, default_timeout=10)
    try:
        clients_before = client.call(RequestType.SERVER_INFO)["rings"]["clients"]  # the module shares the server
        with caplog.at_level(logging.WARNING, logger="kvstrata.core.wire.transport"):
            assert not client.attach_rings()
        assert "frames travel over ZMQ only" in caplog.text and "ATTACH_RINGS" in caplog.text
        assert client.reply_ring is None
        assert client.call(RequestType.PING) == "pong"
        assert client.call(RequestType.SERVER_INFO)["rings"]["clients"] == clients_before
    finally:
        client.close()


def test_the_rings_can_be_turned_off(server):
    with Client(server.address, default_timeout=10, rings="none") as client:
        clients_before = client.call(RequestType.SERVER_INFO)["rings"]["clients"]  # the module shares the server
        assert not client.attach_rings()
        assert client.reply_ring is None and client.request_ring is None and client.mailbox is None
        assert client.call(RequestType.SERVER_INFO)["rings"]["clients"] == clients_before


@pytest.mark.parametrize("rings, request_ring, mailbox", [("rings", True, False), ("replies", False, False)])
def test_a_client_attaches_only_the_rings_its_setting_names(server, rings, request_ring, mailbox):
    with Client(server.address, default_timeout=10, rings=rings) as client:
        assert client.attach_rings()
        assert client.reply_ring is not None
        assert (client.request_ring is not None) == request_ring and (client.mailbox is not None) == mailbox
        assert client.call(RequestType.PING) == "pong"


def test_an_unknown_ring_setting_is_refused():
    with pytest.raises(ValueError, match="rings must be one of"):
        Client("ipc:///nonexistent/kvstrata.sock", rings="0")


def test_the_worker_attaches_rings_and_transfers_settle_through_them(server, monkeypatch):
    client = CacheClient(server.address, timeout=20.0)
    engine = ReferenceEngine(SMALL_32, num_blocks=64, block_size=16)
    worker = ServerPlacement(client, 41, engine.layout)  # this module's shared client holds instance 0
    try:
        clients_before = client.server_info()["rings"]["clients"]  # the module shares the server
        worker.register()
        assert client.server_info()["rings"]["clients"] == clients_before + 1
        ring = client.transport.reply_ring
        prompt = random_prompt(160)
        store_prompt(client, engine, prompt, instance_id=41)
        looked_up = {w: lookup_into_fresh_blocks(client, engine, f"w{w}", prompt) for w in (0, 1)}
        # from here only the ring can resolve a reply: no I/O thread, and the engine's polls never drain ZMQ
        client.transport._stop.set()
        client.transport._thread.join(timeout=5)
        monkeypatch.setattr(client.transport._sock, "_drain", lambda: None)
        for width, (key, dst) in looked_up.items():
            rid = f"w{width}"
            worker.submit_retrieve(rid, key, [dst], layers_per_slice=width)
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


def test_engine_placement_attaches_no_rings_unless_asked(server):
    """Engine placement leaves the rings off by default (they did not shorten first-token time there);
    ``shm_rings=True`` still attaches them, and server placement attaches them by default."""
    from kvstrata.core.engine.choose_placement import make_placement
    from kvstrata.core.engine.registration_area import RegistrationArea
    from kvstrata.core.transfer.layouts import PLACEMENT_ENGINE, PLACEMENT_SERVER

    engine = ReferenceEngine(SMALL_32, num_blocks=16, block_size=16)
    area = RegistrationArea(engine.layout, chunk_size=64)
    engine_options = {"local_regions": engine.regions, "registration_layout": area.layout}
    clients, workers = [], []
    try:
        for instance, placement, options, attached in ((42, PLACEMENT_ENGINE, engine_options, False),
                                                       (43, PLACEMENT_ENGINE, {**engine_options, "shm_rings": True},
                                                        True),
                                                       (44, PLACEMENT_SERVER, {}, True)):
            client = CacheClient(server.address, timeout=20.0)
            clients.append(client)
            worker = make_placement(placement, client, instance, engine.layout, **options)
            workers.append(worker)
            worker.register()
            assert (client.transport.reply_ring is not None) == attached, instance
    finally:
        for w in workers:
            w.close()
        for c in clients:
            c.close()
        area.close()
        engine.close()


# --- the request ring: the server serves a request from shared memory, once and in order ----------------


def spin_watching_words(fd: int, max_us: int, *, events: Any = None, words: Any = None) -> bool:
    """A Python stand-in for the extension's spin: True once ``fd`` is readable or a watched word holds its value."""
    import select

    p = select.poll()
    p.register(fd, select.POLLIN)
    deadline = time.monotonic() + max_us / 1e6
    while time.monotonic() < deadline:
        if any(ctypes.c_uint64.from_address(addr).value == value for addr, value in words or ()):
            return True
        if p.poll(0):
            return True
    return False


class Recorder:
    """Handlers that record what they served, in order; RETRIEVE answers at once."""

    def __init__(self) -> None:
        self.served: list[str] = []
        self.lock = threading.Lock()

    def note(self, what: str) -> dict:
        with self.lock:
            self.served.append(what)
        return {"served": what}


@pytest.fixture
def ring_server():
    servers: list[Server] = []

    def start(busy: bool = True) -> tuple[Server, Recorder]:
        rec = Recorder()
        server = Server(f"ipc://{tempfile.mkdtemp(prefix='kvstrata-rings-')}/s", transfer_threads=2)
        for rt, decl in DECLARATIONS.items():
            if rt in TRANSPORT_REQUESTS:
                continue
            if rt == RequestType.PING:
                server.register(rt, lambda: "pong")
            elif rt == RequestType.FREE_LOOKUP_LOCKS:
                server.register(rt, handler_of(rt, lambda request_id, name=rt.name: rec.note(f"{name}:{request_id}")))
            elif rt == RequestType.LOOKUP:
                server.register(rt, lambda key: rec.note(f"LOOKUP:{key['request_id']}"))
            else:
                server.register(rt, handler_of(rt, lambda *a: {}))
        server.start()
        if busy:
            server.enable_busy_poll(spin_watching_words, 50.0)
        servers.append(server)
        return server, rec

    yield start
    for s in servers:
        s.stop()


def key(rid: str, tokens: bytes = b"") -> dict:
    return CacheKey.for_tokens(rid, [1, 2, 3], model="m").to_wire() | {"tokens": tokens}


def test_requests_from_the_ring_are_served_once_and_in_order(ring_server):
    server, rec = ring_server()
    with Client(server.address, default_timeout=10) as client:
        assert client.attach_rings() and client.request_ring is not None
        sent = []
        for i in range(300):  # oneway requests and calls, interleaved
            if i % 3:
                client.send_oneway(RequestType.FREE_LOOKUP_LOCKS, [f"e{i}"])
                sent.append(f"FREE_LOOKUP_LOCKS:e{i}")
            else:
                assert client.call(RequestType.LOOKUP, [key(f"l{i}")]) == {"served": f"LOOKUP:l{i}"}
                sent.append(f"LOOKUP:l{i}")
        assert client.call(RequestType.PING) == "pong"
    assert rec.served == sent  # each once, in the order sent
    assert server.ring_requests > 0, "no request was served from the ring"


def test_many_threads_sending_at_once_keep_each_request_served_once(ring_server):
    server, rec = ring_server()
    with Client(server.address, default_timeout=20) as client:
        assert client.attach_rings()

        def caller(t: int) -> list[str]:
            return [client.call(RequestType.LOOKUP, [key(f"t{t}-{i}")])["served"] for i in range(100)]

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(caller, range(6)))
    assert results == [[f"LOOKUP:t{t}-{i}" for i in range(100)] for t in range(6)]
    assert sorted(rec.served) == sorted(f"LOOKUP:t{t}-{i}" for t in range(6) for i in range(100))


def test_a_request_too_big_for_the_ring_keeps_its_place(ring_server):
    server, rec = ring_server()
    big = b"\0" * (client_ring_capacity() + 8)  # goes over ZMQ only; what follows must not overtake it
    with Client(server.address, default_timeout=10) as client:
        assert client.attach_rings()
        order = []
        for i in range(20):
            if i % 5 == 2:
                client.send_oneway(RequestType.LOOKUP, [key(f"big{i}", big)])
                order.append(f"LOOKUP:big{i}")
            client.send_oneway(RequestType.FREE_LOOKUP_LOCKS, [f"s{i}"])
            order.append(f"FREE_LOOKUP_LOCKS:s{i}")
        assert client.call(RequestType.PING) == "pong"
    assert rec.served == order


def test_without_busy_polling_the_zmq_copy_wakes_the_server_and_nothing_is_served_twice(ring_server):
    server, rec = ring_server(busy=False)
    with Client(server.address, default_timeout=10) as client:
        assert client.attach_rings()
        for i in range(50):
            assert client.call(RequestType.LOOKUP, [key(f"q{i}")])["served"] == f"LOOKUP:q{i}"
    assert rec.served == [f"LOOKUP:q{i}" for i in range(50)]


def client_ring_capacity() -> int:
    from kvstrata.core.wire.rings import REQUEST_SLOT_BYTES, SLOT_HEADER_BYTES

    return REQUEST_SLOT_BYTES - SLOT_HEADER_BYTES


# --- the mailbox: the device announces a transfer's end itself ---------------------------------------------


def test_a_mailbox_slot_is_read_only_once_its_word_holds_a_wanted_id():
    client_side = Mailbox.create(4, 128)
    server_side = Mailbox.attach(client_side.ref())
    words = np.frombuffer(server_side.segment.buf, dtype=np.uint64)
    try:
        assert server_side.fill(2, b"reply for 7")
        assert client_side.scan({7}) == [] and client_side.announced() == set()  # filled, not announced
        words[server_side.word_offset(2) // 8] = 7  # what the GPU stores when the copies end
        assert client_side.scan({8}) == []  # not one this client waits for (an old transfer's word)
        assert client_side.announced() == {7}, "announced, whether or not a scan wanted it"
        assert client_side.scan({7, 8}) == [b"reply for 7"]
        assert client_side.announced() == {7}, "taking a reply leaves its word"
        assert server_side.fill(2, b"reply for 9")  # reused: the word is cleared with the new frame
        assert client_side.scan({7, 9}) == [] and client_side.announced() == set()
        assert not server_side.fill(1, b"x" * 200)  # does not fit a slot
    finally:
        del words
        server_side.close()
        client_side.destroy()


class DeviceStandIn:
    """RETRIEVE as a device target would serve it: fill a mailbox slot, have a "device" thread store the
    request id in it once the test says ``announce``, and report the copies done only once it says ``finish``."""

    def __init__(self) -> None:
        self.server: Server | None = None
        self.announce = threading.Event()
        self.announced = threading.Event()
        self.finish = threading.Event()

    def retrieve(self, *payload: Any) -> Deferred:
        mail = self.server.mailbox_slot()
        assert mail is not None and self.server.mailbox_slot() is None  # one slot per request
        reply = {"retrieved_tokens": 3}
        assert mail.fill(reply)
        words = np.frombuffer(mail.segment.buf, dtype=np.uint64)
        done = threading.Event()
        announce, announced, finish = self.announce, self.announced, self.finish

        def device() -> None:
            assert announce.wait(60)
            words[mail.word_offset // 8] = mail.request_id
            announced.set()
            assert finish.wait(60)
            done.set()

        threading.Thread(target=device, daemon=True).start()
        return Deferred(lambda: reply, done.is_set)

    def next_request(self) -> None:
        self.announce, self.announced, self.finish = threading.Event(), threading.Event(), threading.Event()


def test_a_polling_client_resolves_a_transfer_from_the_mailbox_before_the_server_answers():
    device = DeviceStandIn()
    server = device.server = started_server(device.retrieve, transfer_threads=2)
    server.enable_busy_poll(spin_watching_words, 50.0)
    client = Client(server.address, default_timeout=60)
    try:
        assert client.attach_rings() and client.mailbox is not None
        peer = next(iter(server._peers.values()))
        for i in range(4):  # the last one is not marked as one the mailbox may announce
            device.next_request()
            fut = client.submit(RequestType.RETRIEVE, [key(f"m{i}"), 0, [[0]], None, 0, None, None, 0],
                                mailbox=i < 3)
            device.announce.set()
            assert device.announced.wait(60)
            # the copies are not done, so the server cannot have answered: only the mailbox can resolve it
            deadline = time.monotonic() + 60
            polls = 0
            while not fut.done() and (polls < 50 if i == 3 else time.monotonic() < deadline):
                client.poll()  # reads the mailbox in this thread: the word is already there
                polls += 1
            if i < 3:
                assert fut.done(), "the announced transfer was not resolved from the mailbox"
                assert fut.result() == {"retrieved_tokens": 3}
            else:
                assert not fut.done(), "the mailbox was read for a request not marked for it"
            device.finish.set()
            assert client.wait(fut, timeout=60) == {"retrieved_tokens": 3}  # the server's reply: nothing twice
            deadline = time.monotonic() + 60
            while len(peer.mail_free) != peer.mailbox.slots:  # every slot back once its reply went out
                assert time.monotonic() < deadline, "the mailbox slot never came back"
                time.sleep(0.001)
        assert client.mailbox.taken == 3
    finally:
        client.close()
        server.stop()


def test_a_retired_client_keeps_its_mailbox_mapped_while_a_transfer_holds_a_slot():
    box = Mailbox.create(2, 128)
    replies = SlotRing.create(2, 128, SegmentKind.REPLY_RING)
    peer = _Peer(SlotRing.attach(replies.ref(), SegmentKind.REPLY_RING), None, Mailbox.attach(box.ref()), 1,
                 mail_free=[1])
    try:
        peer.close()  # slot 0 is lent: a device may still write it
        assert peer.retired and not peer.mailbox._closed
        peer.mail_free.append(0)
        peer.close()
        assert peer.mailbox._closed
    finally:
        box.destroy()
        replies.destroy()
