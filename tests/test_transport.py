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
from kvstrata.core.wire.protocol import DECLARATIONS, TRANSPORT_REQUESTS, RequestType
from kvstrata.core.wire.transport import Client, Deferred, RemoteError, Server

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
            if rt in TRANSPORT_REQUESTS:
                continue
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


def python_busy_wait(fd: int, max_us: int, done: Any = None) -> bool:
    """A Python stand-in for the extension's GIL-free poll: True once ``fd`` is readable (or ``done()``),
    else False after max_us."""
    import select

    p = select.poll()
    p.register(fd, select.POLLIN)
    deadline = time.monotonic() + max_us / 1e6
    while time.monotonic() < deadline:
        if p.poll(0) or (done is not None and done()):
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
    """RETRIEVE as a device target runs it: the handler returns at once with a Deferred that is ready
    ``delay`` later (a copy on a device); settling it answers ``instance_id``, or fails from 100 up."""

    def __init__(self, delay: float, together: tuple[int, ...] = (), side_by_side: tuple[int, ...] = ()) -> None:
        self.delay = delay
        self.together = together  # these instance ids finish at one moment (the first one's end)
        self._together_end: float | None = None
        self.side_by_side = side_by_side  # these are ready only once all of them have started
        self.started: list[int] = []
        self.settled: list[int] = []
        self.spans: dict[int, list[float]] = {}  # instance_id -> [handler started, settled]
        self.settled_early: list[int] = []  # settle() called before the device was done: it had to wait

    def retrieve(self, key: dict, instance_id: int, *rest: Any) -> Deferred:
        self.started.append(instance_id)
        self.spans[instance_id] = [time.monotonic()]
        end = time.monotonic() + self.delay
        if instance_id in self.together:
            if self._together_end is None:
                self._together_end = end
            end = self._together_end

        def settle() -> dict:
            if time.monotonic() < end:
                self.settled_early.append(instance_id)
            time.sleep(max(0.0, end - time.monotonic()))  # what waiting on the device does if called early
            self.settled.append(instance_id)
            self.spans[instance_id].append(time.monotonic())
            if instance_id >= 100:
                raise RuntimeError(f"copy {instance_id} failed on the device")
            return {"instance_id": instance_id}

        if instance_id in self.side_by_side:
            return Deferred(settle, lambda: set(self.side_by_side) <= set(self.started))
        return Deferred(settle, lambda: time.monotonic() >= end)


def test_deferred_replies_are_settled_by_the_polling_thread_and_free_the_handler(serve: Any) -> None:
    """With busy polling, a deferred transfer's thread is free at once; the leader answers when it is ready,
    failures included, and a queued transfer runs when a settled one frees its slot."""
    transfers = DeviceTransfers(delay=0.05)
    server = serve(1, transfers)
    server.enable_busy_poll(python_busy_wait, 5.0)
    with Client(server.address, default_timeout=10) as client:
        t = time.monotonic()
        futures = [client.submit(RequestType.RETRIEVE, retrieve_payload(i)) for i in (1, 102, 3)]
        pings = [client.call(RequestType.PING, [], timeout=5) for _ in range(5)]  # answered meanwhile
        assert client.wait(futures[0])["instance_id"] == 1
        with pytest.raises(RemoteError, match="RETRIEVE: copy 102 failed on the device"):
            client.wait(futures[1])
        assert client.wait(futures[2])["instance_id"] == 3
        elapsed = time.monotonic() - t
    assert pings == ["pong"] * 5
    assert transfers.settled == [1, 102, 3]  # one slot: each ran after the previous one settled
    assert elapsed >= 0.15
    # the polling thread settled each once ready: no thread sat in settle() waiting for the device
    assert transfers.settled_early == []
    assert server.requests_rejected == 1


def test_the_busy_wait_watches_deferred_handles_as_the_cuda_spin_is_called(serve: Any) -> None:
    """Deferreds with wait handles are watched by the busy-wait function itself, called the way the server's
    CUDA target provides it (a partial with warm_stream, events by keyword); handles here name flags."""
    import functools

    flags: dict[int, threading.Event] = {}
    watched: list[list[int]] = []

    def spin(fd: int, max_us: int, warm_stream: int = 0, events: list[int] | None = None) -> bool:
        if events:
            watched.append(list(events))
            for h in events:  # the device finishes a copy only once the spin watches its event
                flags[h].set()
        return python_busy_wait(fd, max_us, lambda: any(flags[h].is_set() for h in events or ()))

    def retrieve(key: dict, instance_id: int, *rest: Any) -> Deferred:
        flag = flags[instance_id + 1] = threading.Event()
        return Deferred(lambda: {"instance_id": instance_id}, flag.is_set, instance_id + 1)

    server = serve(2, SlowTransfers(0))
    server.register(RequestType.RETRIEVE, handler_of(RequestType.RETRIEVE, retrieve))
    server.enable_busy_poll(functools.partial(spin, warm_stream=1234), 5.0)
    with Client(server.address, default_timeout=10) as client:
        futures = [client.submit(RequestType.RETRIEVE, retrieve_payload(i)) for i in (5, 6)]
        assert sorted(client.wait(f)["instance_id"] for f in futures) == [5, 6]
    assert any(set(w) <= {6, 7} and w for w in watched)


def test_every_queued_transfer_starts_when_settled_ones_free_their_slots(serve: Any) -> None:
    """Two transfers settle together and free two slots: both queued transfers start then and run side by
    side, rather than the second waiting for the first to settle (transfers 2 and 3 are done only once both
    have started, so run one after the other they would never finish)."""
    transfers = DeviceTransfers(delay=0.1, together=(0, 1), side_by_side=(2, 3))
    server = serve(2, transfers)
    server.enable_busy_poll(python_busy_wait, 5.0)
    with Client(server.address, default_timeout=60) as client:
        futures = [client.submit(RequestType.RETRIEVE, retrieve_payload(i)) for i in range(4)]
        assert sorted(client.wait(f)["instance_id"] for f in futures) == [0, 1, 2, 3]
    assert sorted(transfers.settled[2:]) == [2, 3]


def test_a_transfer_whose_event_fails_is_answered_with_its_error_and_watching_resumes(serve: Any,
                                                                                     caplog: Any) -> None:
    """A failed device transfer makes the busy-wait function raise while it watches that event (the CUDA
    spin's event query throws): the failed transfer is answered with its error, a healthy one beside it
    completes, busy polling stays on, and later transfers are watched by the busy-wait function again."""
    import functools

    watched: list[list[int]] = []
    seen: set[int] = set()
    poisoned = 51
    spin_failed = threading.Event()
    fails_at = {}

    # The device as these handles describe it: a healthy copy is done once the busy-wait has watched its event;
    # the poisoned one fails, and only the busy-wait's event query can tell first (Python's readiness check
    # sees the error only after the busy-wait raised), whatever the threads' timing.
    def spin(fd: int, max_us: int, warm_stream: int = 0, events: list[int] | None = None) -> bool:
        if events:
            watched.append(list(events))
            seen.update(events)
            if poisoned in events and time.monotonic() >= fails_at[poisoned]:
                spin_failed.set()
                raise RuntimeError("cudaEventQuery: an illegal memory access was encountered")
        return python_busy_wait(fd, max_us, lambda: any(h in seen and h != poisoned for h in events or ()))

    def ready(handle: int) -> bool:
        if handle == poisoned:
            if spin_failed.is_set():
                raise RuntimeError("cudaEventQuery: an illegal memory access was encountered")
            return False
        return handle in seen

    def retrieve(key: dict, instance_id: int, *rest: Any) -> Deferred:
        handle = instance_id + 1
        fails_at[handle] = time.monotonic() + 0.02

        def settle() -> dict:
            if handle == poisoned:
                raise RuntimeError(f"copy {instance_id} failed on the device")
            return {"instance_id": instance_id}

        return Deferred(settle, lambda: ready(handle), handle)

    server = serve(2, SlowTransfers(0))
    server.register(RequestType.RETRIEVE, handler_of(RequestType.RETRIEVE, retrieve))
    server.enable_busy_poll(functools.partial(spin, warm_stream=1), 5.0)
    with caplog.at_level("WARNING", logger="kvstrata.core.wire.transport"):
        with Client(server.address, default_timeout=60) as client:
            good = client.submit(RequestType.RETRIEVE, retrieve_payload(5))
            bad = client.submit(RequestType.RETRIEVE, retrieve_payload(poisoned - 1))
            assert client.wait(good)["instance_id"] == 5
            with pytest.raises(RemoteError, match="copy 50 failed on the device"):
                client.wait(bad)
            before = len(watched)
            assert client.call(RequestType.RETRIEVE, retrieve_payload(7))["instance_id"] == 7
    assert "watching transfer completion events failed" in caplog.text
    assert "busy polling failed" not in caplog.text
    assert any(w == [8] for w in watched[before:]), f"later transfers were not watched by the busy-wait again: {watched}"


@pytest.mark.parametrize("busy_polling", [False, True], ids=["no busy polling", "replies not deferred"])
def test_without_busy_polling_the_handler_thread_settles_its_own_deferred_reply(serve: Any,
                                                                                 busy_polling: bool) -> None:
    """Nothing polls the device, or the server was told not to defer replies (``defer_replies=False``), so
    the handler's own thread settles the transfer (ready() never says so)."""
    settled_by: list[str] = []

    def retrieve(key: dict, instance_id: int, *rest: Any) -> Deferred:
        handler = threading.current_thread().name

        def settle() -> dict:
            settled_by.append("handler" if threading.current_thread().name == handler else "another thread")
            return {"instance_id": instance_id}

        return Deferred(settle, lambda: False)

    server = serve(2, SlowTransfers(), defer_replies=not busy_polling)
    server.register(RequestType.RETRIEVE, handler_of(RequestType.RETRIEVE, retrieve))
    if busy_polling:
        server.enable_busy_poll(python_busy_wait, 5.0)
    with Client(server.address, default_timeout=60) as client:
        assert client.call(RequestType.RETRIEVE, retrieve_payload(4))["instance_id"] == 4
    assert settled_by == ["handler"]


def started_server(retrieve: Any, transfer_threads: int = 1) -> Server:
    """A started server whose RETRIEVE is ``retrieve`` and whose other handlers answer ``{}``."""
    server = Server(f"ipc://{tempfile.mkdtemp(prefix='kvstrata-transport-')}/s", transfer_threads=transfer_threads)
    for rt, decl in DECLARATIONS.items():
        if rt not in TRANSPORT_REQUESTS:
            server.register(rt, handler_of(rt, retrieve if rt == RequestType.RETRIEVE
                                                 else (lambda *a: {})))
    server.start()
    return server


def test_stopping_settles_deferred_transfers_left_in_flight() -> None:
    transfers = DeviceTransfers(delay=0.3)
    server = started_server(transfers.retrieve)
    server.enable_busy_poll(python_busy_wait, 5.0)
    client = Client(server.address, default_timeout=10)
    try:
        client.submit(RequestType.RETRIEVE, retrieve_payload(9))
        deadline = time.monotonic() + 60
        while not transfers.started and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        server.stop()
        client.close()
    assert transfers.settled == [9]


def test_a_handler_that_hands_over_the_turn_holds_the_socket_until_it_does(serve: Any) -> None:
    """A hands_over_turn handler keeps the socket (no other thread woken) until release_turn; then PING flows."""
    from kvstrata.core.wire.transport import hands_over_turn

    entered = threading.Event()
    ping_sent = threading.Event()
    released = threading.Event()
    finish = threading.Event()
    holder: list[Server] = []

    class HoldingTransfers(SlowTransfers):
        def retrieve(self, key: dict, instance_id: int, *rest: Any) -> dict:
            entered.set()
            assert ping_sent.wait(60)  # the latency-critical start: the socket stays with this thread
            time.sleep(0.1)  # only gives a broken transport time to answer the PING early; never flakes a good one
            released.set()
            holder[0].release_turn()
            holder[0].release_turn()  # a second call is harmless
            assert finish.wait(60)
            return {"instance_id": instance_id}

    transfers = HoldingTransfers()
    server = serve(2, transfers)
    holder.append(server)
    server.register(RequestType.RETRIEVE, hands_over_turn(handler_of(RequestType.RETRIEVE, transfers.retrieve)))
    with Client(server.address, default_timeout=60) as client:
        fut = client.submit(RequestType.RETRIEVE, retrieve_payload(7))
        assert entered.wait(60)
        ping = client.submit(RequestType.PING, [])
        ping_sent.set()
        assert client.wait(ping) == "pong"
        assert released.is_set(), "PING was answered while the handler still held the turn"
        assert not fut.done()
        assert client.call(RequestType.PING, timeout=60) == "pong"  # after the release: answered meanwhile
        finish.set()
        assert client.wait(fut)["instance_id"] == 7


def test_the_leader_serves_quick_requests_without_handing_over(serve: Any) -> None:
    """PING and LOOKUP are answered by the thread holding the turn: one thread serves a burst of them."""
    seen: set[str] = set()
    server = serve(2, SlowTransfers(delay=0.0))
    server._handlers[RequestType.PING] = lambda: seen.add(threading.current_thread().name) or "pong"
    with Client(server.address, default_timeout=10) as client:
        for _ in range(50):
            assert client.call(RequestType.PING) == "pong"
    assert len(seen) == 1, f"quick requests were served by {sorted(seen)}: the turn changed hands"
