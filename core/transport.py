"""ZMQ transport: a ROUTER server loop and a DEALER client with futures.

ZMQ sockets must not be touched by two threads at once, so each side has exactly
one thread that owns its network socket. Other threads hand it outgoing frames
through an ``inproc`` PUSH socket of their own (one per thread, created lazily),
which the owner polls next to the network socket.

The server runs non-blocking handlers (PING, LOOKUP, ...) inline on its loop and
hands blocking ones (STORE, RETRIEVE, registration) to a thread pool, so one slow
transfer never stalls a PING or a LOOKUP.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import tempfile
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import zmq

from . import codec
from .protocol import DECLARATIONS, ProtocolError, RequestType, check_handler_signature

log = logging.getLogger(__name__)

Handler = Callable[..., Any]


class RemoteError(RuntimeError):
    """The server answered a request with an error."""


class RequestTimeout(TimeoutError):
    """No reply arrived within the request's timeout."""


def default_address() -> str:
    """An IPC path inside a directory only the current user can open."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    directory = os.path.join(base, f"kvstrata-{os.getuid()}")
    ensure_private_dir(directory)
    return f"ipc://{directory}/server.sock"


def ensure_private_dir(directory: str) -> None:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to uid {st.st_uid}, not to this user; refusing to use it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(directory, 0o700)


def check_bind_address(address: str, allow_remote: bool = False) -> None:
    """Refuse to bind anything but loopback TCP or an IPC path unless asked explicitly."""
    if address.startswith("ipc://"):
        ensure_private_dir(os.path.dirname(address[len("ipc://"):]) or ".")
        return
    if address.startswith("tcp://"):
        host = address[len("tcp://"):].rsplit(":", 1)[0]
        if host in ("127.0.0.1", "localhost", "[::1]", "::1") or allow_remote:
            return
        raise ValueError(
            f"refusing to bind {address}: only loopback TCP or ipc:// paths are allowed "
            "by default (pass allow_remote=True / --allow-remote to serve other hosts)"
        )
    raise ValueError(f"unsupported address {address!r}: use ipc://PATH or tcp://127.0.0.1:PORT")


class _Outbox:
    """Per-thread inproc PUSH sockets feeding one PULL socket owned by a loop thread."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def send(self, frames: list[bytes]) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("transport is closed")
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self._endpoint)
                self._sockets.append(sock)
            self._local.sock = sock
        sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for s in self._sockets:
                s.close(linger=0)
            self._sockets.clear()


class Server:
    """Serves registered handlers on one ROUTER socket until :meth:`stop`."""

    def __init__(self, address: str, *, transfer_threads: int = 4, allow_remote: bool = False) -> None:
        check_bind_address(address, allow_remote)
        self.address = address
        self._handlers: dict[RequestType, Handler] = {}
        self._ctx = zmq.Context()
        self._executor = ThreadPoolExecutor(max_workers=transfer_threads, thread_name_prefix="kvstrata-transfer")
        self._inproc = f"inproc://kvstrata-server-out-{uuid.uuid4().hex}"
        self._outbox = _Outbox(self._ctx, self._inproc)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self.requests_served = 0
        self.requests_rejected = 0

    def register(self, request_type: RequestType, handler: Handler) -> None:
        """Register a handler; raises ProtocolError if its arity differs from the declaration."""
        check_handler_signature(request_type, handler)
        self._handlers[request_type] = handler

    def start(self) -> None:
        missing = [rt.name for rt in RequestType if rt not in self._handlers]
        if missing:
            raise ProtocolError(f"no handler registered for {', '.join(missing)}")
        self._thread = threading.Thread(target=self._loop, name="kvstrata-server-loop", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            raise self._bind_error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._outbox.close()
        self._ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except FileNotFoundError:
                pass

    # --- loop thread ---------------------------------------------------------------

    def _loop(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, codec.MAX_FRAME_BYTES)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        try:
            pull.bind(self._inproc)
            old_umask = os.umask(0o077)  # the IPC socket file is private to this user
            try:
                router.bind(self.address)
            finally:
                os.umask(old_umask)
            if self.address.endswith(":0"):
                self.address = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException as exc:  # surfaced to start()
            self._bind_error = exc
            self._bound.set()
            router.close(0)
            pull.close(0)
            return
        self._bound.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=100))
                if pull in events:
                    while True:
                        try:
                            frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        router.send_multipart(frames, copy=False)
                if router in events:
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(router, frames)
        finally:
            router.close(0)
            pull.close(0)

    def _dispatch(self, router: zmq.Socket, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[-1]
        if len(frames) != 2:
            log.warning("dropping a message of %d frames (expected identity + one frame)", len(frames))
            self.requests_rejected += 1
            return
        try:
            request = codec.decode_request(body)
            DECLARATIONS[request.request_type].validate(request.payload)
        except (codec.DecodeError, ProtocolError) as exc:
            self.requests_rejected += 1
            rid = codec.peek_request_id(body)
            log.warning("rejected request %s: %s", rid, exc)
            router.send_multipart([identity, codec.encode_reply(rid if rid is not None else -1, False, str(exc))])
            return
        handler = self._handlers[request.request_type]
        if DECLARATIONS[request.request_type].blocking:
            self._executor.submit(self._run_blocking, identity, request, handler)
        else:
            router.send_multipart([identity, self._run(request, handler)])

    def _run_blocking(self, identity: bytes, request: codec.Request, handler: Handler) -> None:
        self._outbox.send([identity, self._run(request, handler)])

    def _run(self, request: codec.Request, handler: Handler) -> bytes:
        try:
            result = handler(*request.payload)
            self.requests_served += 1
            return codec.encode_reply(request.request_id, True, result)
        except Exception as exc:
            self.requests_rejected += 1
            log.warning("%s request %d failed: %s", request.request_type.name, request.request_id, exc,
                        exc_info=log.isEnabledFor(logging.DEBUG))
            return codec.encode_reply(request.request_id, False, f"{request.request_type.name}: {exc}")


class Client:
    """Sends requests from any thread; replies resolve futures on one I/O thread."""

    def __init__(self, address: str, *, default_timeout: float = 30.0) -> None:
        self.address = address
        self.default_timeout = default_timeout
        self._ctx = zmq.Context()
        self._inproc = f"inproc://kvstrata-client-out-{uuid.uuid4().hex}"
        self._outbox = _Outbox(self._ctx, self._inproc)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[RequestType, Future]] = {}
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstrata-client-io", daemon=True)
        self._thread.start()
        self._ready.wait()

    def submit(self, request_type: RequestType, payload: list[Any] | tuple[Any, ...]) -> Future:
        """Send a request and return a future for its value (RemoteError on an error reply).

        The payload is validated here too, so a caller bug fails in the caller with
        the same message the server would have sent.
        """
        payload = list(payload)
        DECLARATIONS[request_type].validate(payload)
        return self.submit_unchecked(request_type, payload)

    def submit_unchecked(self, request_type: RequestType | int, payload: Any) -> Future:
        """Send without local validation (tests use this to probe the server's checks)."""
        rid = next(self._ids)
        fut: Future = Future()
        with self._pending_lock:
            self._pending[rid] = (request_type, fut)
        frame = codec._pack([codec.WIRE_VERSION, rid, int(request_type), payload])
        self._outbox.send([frame])
        return fut

    def send_oneway(self, request_type: RequestType, payload: list[Any] | tuple[Any, ...]) -> None:
        """Send a validated request whose reply nobody waits for (lock releases, session ends).

        No future is kept, so a server that is down costs nothing that piles up.
        """
        payload = list(payload)
        DECLARATIONS[request_type].validate(payload)
        self._outbox.send([codec._pack([codec.WIRE_VERSION, next(self._ids), int(request_type), payload])])

    def send_raw(self, frame: bytes) -> None:
        """Send an arbitrary frame (for robustness tests); any reply is dropped unless it matches a future."""
        self._outbox.send([frame])

    def call(self, request_type: RequestType, payload: list[Any] | tuple[Any, ...] = (),
             timeout: float | None = None) -> Any:
        fut = self.submit(request_type, payload)
        return self.wait(fut, timeout)

    def wait(self, fut: Future, timeout: float | None = None) -> Any:
        timeout = self.default_timeout if timeout is None else timeout
        try:
            return fut.result(timeout=timeout)
        except TimeoutError:
            self._forget(fut)
            raise RequestTimeout(f"no reply from {self.address} within {timeout:.1f}s") from None

    def _forget(self, fut: Future) -> None:
        with self._pending_lock:
            for rid, (_, f) in list(self._pending.items()):
                if f is fut:
                    del self._pending[rid]

    def fail_pending(self, reason: str) -> None:
        """Fail every outstanding future (used when the peer is known to be gone)."""
        with self._pending_lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for rt, fut in pending:
            if not fut.done():
                fut.set_exception(RemoteError(f"{RequestType(rt).name if isinstance(rt, int) else rt}: {reason}"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.fail_pending("client closed")
        self._outbox.close()
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _loop(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, codec.MAX_FRAME_BYTES)
        dealer.connect(self.address)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(self._inproc)
        self._ready.set()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=50))
                if pull in events:
                    while True:
                        try:
                            frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        dealer.send_multipart(frames, copy=False)
                if dealer in events:
                    while True:
                        try:
                            frame = dealer.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._resolve(frame)
        finally:
            dealer.close(0)
            pull.close(0)

    def _resolve(self, frame: bytes) -> None:
        try:
            reply = codec.decode_reply(frame)
        except codec.DecodeError as exc:
            log.warning("dropping an undecodable reply from %s: %s", self.address, exc)
            return
        with self._pending_lock:
            entry = self._pending.pop(reply.request_id, None)
        if entry is None:
            return  # timed out earlier, or an error reply to a raw frame
        _, fut = entry
        if reply.ok:
            fut.set_result(reply.value)
        else:
            fut.set_exception(RemoteError(str(reply.value)))
