"""A recording proxy between an adapter and a real server, on real sockets.

The suite must judge what an adapter actually *sends*, not what its hooks say
they would send, so the adapter's client talks to this proxy and the proxy to
a real ``kvstrata serve``. Every request frame is decoded and recorded as it
arrives (a frame that does not even decode is recorded too), then forwarded
unchanged; every reply is recorded on its way back.

The proxy can also *hold* the replies to chosen retrieves: the server has done
its work, but the adapter does not hear so until the suite lets the reply go.
That is how the suite proves a request was released on its first slice and not
on the transfer's completion: an adapter that waits for the reply can never
release while it is held.

One thread owns every socket (ZMQ sockets are not thread-safe); other threads
only touch the recorded lists under a lock.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from kvstrata.core.engine.requests import request_of_lock_owner
from kvstrata.core.wire import codec
from kvstrata.core.wire.protocol import RequestType


@dataclass
class WireRequest:
    """One request frame as it arrived from the adapter."""

    at: float
    identity: bytes
    request_id: int | None
    request_type: RequestType | None
    payload: Any
    decode_error: str | None = None
    reply: "WireReply | None" = None

    @property
    def key_request_id(self) -> str | None:
        """The engine's request id in a CacheKey payload item (RETRIEVE, STORE, LOOKUP), if any: the key's
        ``request_id`` is its lock owner (``<request id>@i<instance>``), which names the request this way."""
        if isinstance(self.payload, list) and self.payload and isinstance(self.payload[0], dict):
            rid = self.payload[0].get("request_id")
            return request_of_lock_owner(rid) if isinstance(rid, str) else None
        return None


@dataclass
class WireReply:
    at: float
    ok: bool
    value: Any
    forwarded_at: float | None = None


@dataclass
class _Held:
    identity: bytes
    frame: bytes
    reply: WireReply


@dataclass
class _State:
    requests: list[WireRequest] = field(default_factory=list)
    by_id: dict[tuple[bytes, int], WireRequest] = field(default_factory=dict)
    hold_keys: set[str] = field(default_factory=set)
    held: list[_Held] = field(default_factory=list)


class RecordingProxy:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._dir = tempfile.mkdtemp(prefix="kvstrata-proxy-")
        os.chmod(self._dir, 0o700)
        self.address = f"ipc://{self._dir}/proxy.sock"
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._state = _State()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvstrata-conformance-proxy", daemon=True)

    # --- control (any thread) ----------------------------------------------------------

    def start(self) -> "RecordingProxy":
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()
        try:
            os.unlink(self.address[len("ipc://"):])
            os.rmdir(self._dir)
        except OSError:
            pass

    def hold_replies(self, key_request_id: str) -> None:
        """Hold every reply to a RETRIEVE for this CacheKey request id until :meth:`release_replies`."""
        with self._lock:
            self._state.hold_keys.add(key_request_id)

    def release_replies(self, key_request_id: str) -> None:
        with self._lock:
            self._state.hold_keys.discard(key_request_id)

    def requests(self, request_type: RequestType | None = None, key_request_id: str | None = None,
                 predicate: Callable[[WireRequest], bool] | None = None) -> list[WireRequest]:
        with self._lock:
            out = list(self._state.requests)
        if request_type is not None:
            out = [r for r in out if r.request_type == request_type]
        if key_request_id is not None:
            out = [r for r in out if r.key_request_id == key_request_id]
        if predicate is not None:
            out = [r for r in out if predicate(r)]
        return out

    def undecodable(self) -> list[WireRequest]:
        with self._lock:
            return [r for r in self._state.requests if r.decode_error is not None]

    def reply_held(self, key_request_id: str) -> bool:
        with self._lock:
            return any(self._reply_key(h) == key_request_id for h in self._state.held)

    def wait_for(self, condition: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.002)
        return condition()

    # --- the loop (socket-owning thread) -------------------------------------------------

    def _reply_key(self, held: _Held) -> str | None:
        for r in self._state.requests:
            if r.reply is held.reply:
                return r.key_request_id
        return None

    def _loop(self) -> None:
        front = self._ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.MAXMSGSIZE, codec.MAX_FRAME_BYTES)
        backs: dict[bytes, zmq.Socket] = {}
        owner: dict[zmq.Socket, bytes] = {}
        try:
            old = os.umask(0o077)
            try:
                front.bind(self.address)
            finally:
                os.umask(old)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            front.close(0)
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=2))
                if front in events:
                    while True:
                        try:
                            frames = front.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        identity, body = frames[0], frames[-1]
                        back = backs.get(identity)
                        if back is None:
                            back = self._ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.setsockopt(zmq.MAXMSGSIZE, codec.MAX_FRAME_BYTES)
                            back.connect(self.backend)
                            backs[identity], owner[back] = back, identity
                            poller.register(back, zmq.POLLIN)
                        self._record_request(identity, body)
                        back.send(body)
                for back, identity in owner.items():
                    if back not in events:
                        continue
                    while True:
                        try:
                            body = back.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if not self._record_reply(identity, body):
                            front.send_multipart([identity, body])
                self._flush_released(front)
        finally:
            for back in backs.values():
                back.close(0)
            front.close(0)

    def _record_request(self, identity: bytes, body: bytes) -> RequestType | None:
        now = time.perf_counter()
        try:
            req = codec.decode_request(body)
            rec = WireRequest(now, identity, req.request_id, req.request_type, req.payload)
        except codec.DecodeError as exc:
            rec = WireRequest(now, identity, codec.peek_request_id(body), None, None, str(exc))
        with self._lock:
            self._state.requests.append(rec)
            if rec.request_id is not None:
                self._state.by_id[(identity, rec.request_id)] = rec
        return rec.request_type

    def _record_reply(self, identity: bytes, body: bytes) -> bool:
        """Record a reply; True if it is held back rather than forwarded now."""
        now = time.perf_counter()
        try:
            reply = codec.decode_reply(body)
        except codec.DecodeError:
            return False
        wr = WireReply(now, reply.ok, reply.value)
        with self._lock:
            req = self._state.by_id.get((identity, reply.request_id))
            if req is not None:
                req.reply = wr
            if (req is not None and req.request_type == RequestType.RETRIEVE
                    and req.key_request_id in self._state.hold_keys):
                self._state.held.append(_Held(identity, body, wr))
                return True
            wr.forwarded_at = now
        return False

    def _flush_released(self, front: zmq.Socket) -> None:
        with self._lock:
            if not self._state.held:
                return
            keep, go = [], []
            for h in self._state.held:
                (keep if self._reply_key(h) in self._state.hold_keys else go).append(h)
            self._state.held = keep
            now = time.perf_counter()
            for h in go:
                h.reply.forwarded_at = now
        for h in go:
            front.send_multipart([h.identity, h.frame])
