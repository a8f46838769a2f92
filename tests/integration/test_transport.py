"""The transport's threading: shared sockets, server threads taking turns, the blocking-handler cap.

These run the real ZMQ transport over a private IPC socket with small handlers
written here, so what is checked is the transport itself: replies reach the
right futures when many threads send at once, PING stays answered while every
transfer slot is busy, and blocking requests beyond the cap wait their turn
instead of being dropped.
"""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

from kvstrata.core.store.keys import CacheKey
from kvstrata.core.wire.protocol import DECLARATIONS, RequestType
from kvstrata.core.wire.transport import Client, RemoteError, Server

KEY = CacheKey.for_tokens("r", [1, 2, 3], model="m").to_wire()


def handler_of(rt: RequestType, fn: Any) -> Any:
    """A handler taking exactly ``rt``'s declared items, by name (the server checks them at registration)."""
    names = ", ".join(item.name for item in DECLARATIONS[rt].items)
    scope: dict[str, Any] = {"fn": fn}
    exec(f"def handler({names}):\n    return fn({names})", scope)
    return scope["handler"]


class SlowTransfers:
    """RETRIEVE waits ``delay`` (or, with ``gated``, until the test opens its instance's gate) and reports
    how many ran at once; everything else answers at once."""

    def __init__(self, delay: float = 0.0, gated: bool = False) -> None:
        self.delay = delay
        self.gated = gated
        self.gates: dict[int, threading.Event] = {}
        self.running = 0
        self.most_at_once = 0
        self.started: list[int] = []
        self.cond = threading.Condition()

    def gate(self, instance_id: int) -> threading.Event:
        with self.cond:
            return self.gates.setdefault(instance_id, threading.Event())

    def wait_until(self, predicate: Any, timeout: float = 60.0) -> None:
        """Block until ``predicate()`` holds (bounded: only catches a hang)."""
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), "the transfers never reached the expected state"

    def retrieve(self, key: dict, instance_id: int, *rest: Any) -> dict:
        with self.cond:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.started.append(instance_id)
            self.cond.notify_all()
        if self.gated:
            assert self.gate(instance_id).wait(60), f"transfer {instance_id} was never let go"
        else:
            time.sleep(self.delay)
        with self.cond:
            self.running -= 1
            self.cond.notify_all()
        return {"instance_id": instance_id}


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[Server] = []

    def start(transfer_threads: int, transfers: SlowTransfers, **server_args: Any) -> Server:
        address = f"ipc://{tempfile.mkdtemp(prefix='kvstrata-transport-')}/s"
        server = Server(address, transfer_threads=transfer_threads, **server_args)
        for rt, decl in DECLARATIONS.items():
            if rt == RequestType.PING:
                server.register(rt, lambda: "pong")
            elif rt == RequestType.RETRIEVE:
                server.register(rt, handler_of(rt, transfers.retrieve))
            elif rt == RequestType.LOOKUP:
                server.register(rt, lambda key: {"request_id": key["request_id"]})
            else:
                server.register(rt, handler_of(rt, lambda *a: {}))
        server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


def retrieve_payload(instance_id: int) -> list[Any]:
    return [KEY, instance_id, [[0]], None, 0, None, None, 0]


def test_blocking_requests_beyond_the_cap_queue_while_ping_is_answered(serve: Any) -> None:
    transfers = SlowTransfers(gated=True)
    server = serve(1, transfers)
    with Client(server.address, default_timeout=60) as client:
        futures = [client.submit(RequestType.RETRIEVE, retrieve_payload(i)) for i in range(3)]
        transfers.wait_until(lambda: transfers.running == 1)
        for _ in range(5):  # answered although the one transfer slot is busy and two wait
            assert client.call(RequestType.PING, timeout=60) == "pong"
        for i in range(3):  # each queued transfer starts only once the one before it has ended
            assert transfers.started == list(range(i + 1)) and not futures[i].done()
            transfers.gate(i).set()
            assert client.wait(futures[i])["instance_id"] == i
            if i < 2:
                transfers.wait_until(lambda: len(transfers.started) == i + 2)
    assert transfers.most_at_once == 1


def test_transfer_slots_run_in_parallel_up_to_the_cap(serve: Any) -> None:
    transfers = SlowTransfers(gated=True)
    server = serve(3, transfers)
    with Client(server.address, default_timeout=60) as client:
        futures = [client.submit(RequestType.RETRIEVE, retrieve_payload(i)) for i in range(6)]
        transfers.wait_until(lambda: transfers.running == 3)  # three at once, while three wait
        assert client.call(RequestType.PING, timeout=60) == "pong"
        assert len(transfers.started) == 3
        for i in range(6):
            transfers.gate(i).set()
        assert sorted(client.wait(f)["instance_id"] for f in futures) == list(range(6))
    assert transfers.most_at_once == 3


def test_many_threads_share_one_client_without_losing_replies(serve: Any) -> None:
    server = serve(2, SlowTransfers(delay=0.0))
    with Client(server.address, default_timeout=20) as client:

        def caller(t: int) -> list[str]:
            out = []
            for i in range(150):
                rid = f"t{t}-{i}"
                key = dict(KEY, request_id=rid)
                out.append(client.call(RequestType.LOOKUP, [key])["request_id"])
            return out

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(caller, range(8)))
    assert results == [[f"t{t}-{i}" for i in range(150)] for t in range(8)]
    assert server.requests_served == 8 * 150


def test_a_failing_handler_answers_an_error_and_the_server_keeps_serving(serve: Any) -> None:
    transfers = SlowTransfers(delay=0.0)

    def boom(key: dict, instance_id: int, *rest: Any) -> dict:
        raise ValueError(f"instance {instance_id} exploded")

    transfers.retrieve = boom  # type: ignore[method-assign]
    server = serve(1, transfers)
    with Client(server.address, default_timeout=5) as client:
        with pytest.raises(RemoteError, match="RETRIEVE: instance 7 exploded"):
            client.call(RequestType.RETRIEVE, retrieve_payload(7))
        assert client.call(RequestType.PING) == "pong"
    assert server.requests_rejected == 1


def test_server_refuses_zero_transfer_threads() -> None:
    with pytest.raises(ValueError, match="transfer_threads must be at least 1"):
        Server(f"ipc://{tempfile.mkdtemp()}/s", transfer_threads=0)


def test_a_polling_caller_resolves_replies_itself(serve: Any) -> None:
    server = serve(1, SlowTransfers(delay=0.0))
    client = Client(server.address, default_timeout=5)
    try:
        client._stop.set()  # park the I/O thread: only the caller's poll() can resolve replies now
        client._thread.join(timeout=5)
        assert not client._thread.is_alive()
        fut = client.submit(RequestType.PING, [])
        deadline = time.monotonic() + 60
        while not fut.done() and time.monotonic() < deadline:
            client.poll()
            time.sleep(0.001)
        assert fut.result(timeout=0) == "pong"
    finally:
        client.close()


def python_busy_wait(fd: int, max_us: int) -> bool:
    """A Python stand-in for the extension's GIL-free poll: True once ``fd`` is readable, else False after
    max_us."""
    import select

    p = select.poll()
    p.register(fd, select.POLLIN)
    deadline = time.monotonic() + max_us / 1e6
    while time.monotonic() < deadline:
        if p.poll(0):
            return True
    return False


def test_busy_polling_serves_every_request(serve: Any) -> None:
    """The busy-poll path (on a GPU the extension's GIL-free poll) with a Python poll standing in for it."""
    calls = {"n": 0}

    def busy_wait(fd: int, max_us: int) -> bool:
        calls["n"] += 1
        return python_busy_wait(fd, max_us)

    transfers = SlowTransfers(delay=0.01)
    server = serve(2, transfers)
    server.enable_busy_poll(busy_wait, 5.0)
    with Client(server.address, default_timeout=10) as client:
        futures = [client.submit(RequestType.RETRIEVE, retrieve_payload(i)) for i in range(6)]
        lookups = [client.call(RequestType.LOOKUP, [dict(KEY, request_id=f"l{i}")])["request_id"] for i in range(50)]
        assert sorted(client.wait(f)["instance_id"] for f in futures) == list(range(6))
    assert lookups == [f"l{i}" for i in range(50)]
    assert calls["n"] > 0
    with pytest.raises(ValueError, match="window_ms must be >= 0"):
        server.enable_busy_poll(busy_wait, -1)


class DeviceTransfers:
    """RETRIEVE as a device target runs it: the handler enqueues (at once) and waits until its copy is done
    ``delay`` later, then answers ``instance_id``, or fails from 100 up."""

    def __init__(self, delay: float, together: tuple[int, ...] = (), side_by_side: tuple[int, ...] = ()) -> None:
        self.delay = delay
        self.together = together  # these instance ids finish at one moment (the first one's end)
        self._together_end: float | None = None
        self.side_by_side = side_by_side  # these are done only once all of them have started
        self.started: list[int] = []
        self.settled: list[int] = []
        self._cond = threading.Condition()

    def retrieve(self, key: dict, instance_id: int, *rest: Any) -> dict:
        with self._cond:
            self.started.append(instance_id)
            self._cond.notify_all()
        end = time.monotonic() + self.delay
        if instance_id in self.together:
            if self._together_end is None:
                self._together_end = end
            end = self._together_end
        if instance_id in self.side_by_side:
            with self._cond:
                assert self._cond.wait_for(lambda: set(self.side_by_side) <= set(self.started), 60), \
                    f"transfers {self.side_by_side} never ran side by side"
        time.sleep(max(0.0, end - time.monotonic()))
        self.settled.append(instance_id)
        if instance_id >= 100:
            raise RuntimeError(f"copy {instance_id} failed on the device")
        return {"instance_id": instance_id}


def test_a_failed_transfer_is_answered_with_its_error_and_others_are_served(serve: Any) -> None:
    """A transfer's failure is its reply's error; PINGs are answered while transfers copy, and a queued
    transfer runs once a slot is free."""
    transfers = DeviceTransfers(delay=0.05)
    server = serve(1, transfers)
    server.enable_busy_poll(python_busy_wait, 5.0)
    with Client(server.address, default_timeout=10) as client:
        futures = [client.submit(RequestType.RETRIEVE, retrieve_payload(i)) for i in (1, 102, 3)]
        pings = [client.call(RequestType.PING, [], timeout=5) for _ in range(5)]  # answered meanwhile
        assert client.wait(futures[0])["instance_id"] == 1
        with pytest.raises(RemoteError, match="RETRIEVE: copy 102 failed on the device"):
            client.wait(futures[1])
        assert client.wait(futures[2])["instance_id"] == 3
    assert pings == ["pong"] * 5
    assert transfers.settled == [1, 102, 3]  # one slot: each ran after the previous one ended
    assert server.requests_rejected == 1


def test_every_queued_transfer_starts_when_settled_ones_free_their_slots(serve: Any) -> None:
    """Two transfers settle together and free two slots: both queued transfers start then and run side by
    side, rather than the second waiting for the first to settle (transfers 2 and 3 are done only once both
    have started, so run one after the other they would never finish)."""
    transfers = DeviceTransfers(delay=0.1, together=(0, 1), side_by_side=(2, 3))
    server = serve(2, transfers)
    with Client(server.address, default_timeout=60) as client:
        futures = [client.submit(RequestType.RETRIEVE, retrieve_payload(i)) for i in range(4)]
        assert sorted(client.wait(f)["instance_id"] for f in futures) == [0, 1, 2, 3]
    assert sorted(transfers.settled[2:]) == [2, 3]


def test_the_leader_serves_quick_requests_without_handing_over(serve: Any) -> None:
    """PING and LOOKUP are answered by the thread holding the turn: one thread serves a burst of them."""
    seen: set[str] = set()
    server = serve(2, SlowTransfers(delay=0.0))
    server._handlers[RequestType.PING] = lambda: seen.add(threading.current_thread().name) or "pong"
    with Client(server.address, default_timeout=10) as client:
        for _ in range(50):
            assert client.call(RequestType.PING) == "pong"
    assert len(seen) == 1, f"quick requests were served by {sorted(seen)}: the turn changed hands"
