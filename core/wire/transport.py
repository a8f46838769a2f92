"""ZMQ transport: a ROUTER server and a DEALER client with futures, tuned for few thread hand-offs.

A request's latency is mostly thread wake-ups, not bytes: each hand-off from one
Python thread to another costs tens of microseconds, more under GIL contention.
So neither side funnels its sends through an owner thread. Each side's network
socket is a :class:`SharedSocket`: any thread may use it while holding its lock
(ZMQ sockets are not thread-safe, but may be used by several threads with a full
memory barrier between uses, which a lock gives).

Server: a small pool of threads takes turns waiting on the socket. The thread
holding the turn (the leader) serves quick requests (PING, LOOKUP) itself and
keeps waiting, so a LOOKUP and its RETRIEVE wake no other thread. On a blocking
request (STORE, RETRIEVE) it hands the turn to the next thread and runs the
handler, which answers once its copies are done. At most ``transfer_threads``
transfers run at once, so one thread is always left to answer PING and LOOKUP
while transfers copy; blocking requests beyond that wait in a queue.

Client: the caller's thread sends; one I/O thread waits for replies and
resolves futures. A caller that polls anyway (an engine asking each step which
transfers finished) may resolve arrived replies itself (:meth:`Client.poll`).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import secrets
import select
import stat
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from kvstrata.core.wire import codec
from kvstrata.core.wire.curve import FLAGS_HINT, HANDSHAKE_EVENTS, ClientCurve, ServerCurve, handshake_hint
from kvstrata.core.wire.protocol import DECLARATIONS, ProtocolError, RequestType, check_handler_signature

log = logging.getLogger(__name__)

Handler = Callable[..., Any]
BusyWait = Callable[[int, int], bool]
"""``busy_wait(fd, max_us)``: poll ``fd`` for up to ``max_us`` microseconds without sleeping and without the
GIL; True once readable. The CUDA extension provides one (``spin_until_readable``); see
:meth:`Server.enable_busy_poll`."""

_POLL_MS = 100
"""How long a waiting thread sleeps on the socket before it checks for shutdown."""

HEARTBEAT_S = 1.0
"""A client sends a PING when it has sent nothing for this long, so the server can tell a live connection that
has nothing to ask from a stopped process (the server's lease is many heartbeats long)."""

_IDLE_S = 1.0
"""How long a thread waiting for the turn sleeps before it looks for queued work (a hand-over wakes it sooner)."""

class RemoteError(RuntimeError):
    """The server answered a request with an error; ``code`` says which kind (see :data:`ERROR_CODES`)."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


ERROR_CODES = {
    "error": "the request could not be served (the message says why)",
    "bad_request": "the request does not match the protocol's declaration",
    "unknown_instance": "the instance is not registered on this server (it restarted, or never had it): "
                        "register the cache again",
    "instance_taken": "another live connection registered that instance id: register under another one",
    "not_owner": "the request names state another connection holds (lookup locks, an instance, a reservation)",
    "limit": "a per-connection bound of the server would be exceeded (the message names the setting)",
}
"""The kinds of error replies. An error reply's value is ``{"code": <one of these>, "message": <text>}``; a
handler's exception chooses its code with an ``error_code`` attribute."""


def error_reply_value(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def remote_error(value: Any) -> RemoteError:
    """The client-side exception for an error reply's value."""
    if isinstance(value, dict) and isinstance(value.get("message"), str):
        code = value.get("code")
        return RemoteError(value["message"], code if code in ERROR_CODES else "error")
    return RemoteError(str(value))


class RequestTimeout(TimeoutError):
    """No reply arrived within the request's timeout."""


def default_address() -> str:
    """An IPC path inside a directory only the current user can open."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    directory = os.path.join(base, f"kvstrata-{os.getuid()}")
    ensure_private_dir(directory)
    return f"ipc://{directory}/server.sock"


def ensure_private_dir(directory: str) -> None:
    """Create ``directory`` (mode 0700), or check the one there: it must be a real directory (a symbolic link
    is not followed), owned by this user, that no group or other user may open.

    Anything else raises PermissionError naming the path and what is wrong with it; nothing is changed to
    make it fit (a directory someone else could open may already have been used by them).
    """
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    try:  # O_NOFOLLOW: a symbolic link fails here rather than being followed
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(directory):
            raise PermissionError(f"{directory} is a symbolic link (to {os.readlink(directory)}); refusing to "
                                  "use it for a socket: give a real directory") from None
        if exc.errno == errno.ENOTDIR:
            raise PermissionError(f"{directory} is not a directory; refusing to use it for a socket") from None
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                              "refusing to use it for a socket")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise PermissionError(f"{directory} has mode {mode:04o}: group or other users may open it and connect to "
                              f"a socket inside; refusing to use it (make it private: chmod 700 {directory})")


DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""The largest frame a server takes (ZMQ_MAXMSGSIZE): libzmq reads a frame's length first and disconnects a
peer announcing more, so an oversize frame is never read into memory. The largest legitimate frames are a long
prompt's STORE or RETRIEVE: 8 bytes per token id (or a page hash's characters plus 2 per page) and up to 5 per
block id per block group, so 64 MiB holds a 4M-token prompt with one block per token (kvstrata serve
--max-message-bytes raises it, up to the decoder's own limit, ``codec.MAX_FRAME_BYTES``)."""


def check_bind_address(address: str, allow_remote: bool = False, *, curve: bool = False) -> None:
    """Refuse what other users could connect to: an abstract or shared IPC socket, TCP without CURVE
    (``curve``: the server has CURVE keys), non-loopback TCP unless ``allow_remote``."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if path.startswith("@") or path.startswith("\0") or path.startswith("\x00"):
            raise ValueError(f"refusing to bind {address}: an abstract socket (ipc://@NAME) has no file "
                             "permissions, so any local user could connect; use ipc:///PATH in a private directory")
        if not path:
            raise ValueError(f"refusing to bind {address}: no socket path")
        ensure_private_dir(os.path.dirname(path) or ".")
        return
    if address.startswith("tcp://"):
        host = address[len("tcp://"):].rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost", "[::1]", "::1") and not allow_remote:
            raise ValueError(
                f"refusing to bind {address}: only loopback TCP or ipc:// paths are allowed "
                "by default (pass allow_remote=True / --allow-remote to serve other hosts)"
            )
        if not curve:
            raise ValueError(
                f"refusing to bind {address} without CURVE keys: any local user (and, with --allow-remote, any "
                f"host) could connect to a TCP port, so kvstrata serves TCP only to CURVE-authenticated clients. "
                f"Pass {FLAGS_HINT}; or bind ipc:///PATH in a private directory")
        return
    raise ValueError(f"unsupported address {address!r}: use ipc://PATH or tcp://127.0.0.1:PORT")


class SharedSocket:
    """A ZMQ socket that several threads use in turn, each operation under one lock.

    A waiter sleeps on the socket's file descriptor, which ZMQ signals on a state
    change and resets on any operation, including another thread's send. So every
    holder of the lock drains what is readable into :attr:`inbox` before letting
    go: a message whose signal a sender absorbed is then already in the inbox, and
    the sender (who knows to look) handles it. Nothing waits on a signal that was
    consumed.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        # pyzmq sends frames above copy_threshold (64 KiB) without copying even when asked
        # to copy, tracking each with a message to a garbage-collector thread that then
        # wakes and takes the GIL from the engine thread. A RETRIEVE carries its prompt's
        # token ids (64 KiB for 8k tokens); copying it costs microseconds.
        sock.copy_threshold = codec.MAX_FRAME_BYTES
        self.sock = sock
        self.inbox: collections.deque[list[bytes]] = collections.deque()
        self._lock = threading.Lock()
        self._fd = sock.getsockopt(zmq.FD)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self.busy_wait: BusyWait | None = None

    def send(self, frames: list[Any], flags: int = 0) -> None:
        """``flags``: zmq.NOBLOCK raises zmq.Again instead of waiting when the socket cannot take the frame."""
        with self._lock:
            try:
                self.sock.send_multipart(frames, flags)  # always a copy: see copy_threshold above
            finally:
                self._drain()

    def wait(self, timeout_ms: int, spin_us: int = 0) -> None:
        """Wait until the socket may have input (or the timeout), then drain it. One waiter at a time.

        With ``spin_us`` and a :attr:`busy_wait` function, first poll without
        sleeping for up to that long (outside the GIL), then sleep as usual.
        """
        if not self.inbox:
            if not (spin_us > 0 and self.busy_wait is not None and self.busy_wait(self._fd, spin_us)):
                self._poll.poll(timeout_ms)
        with self._lock:
            self._drain()

    def reachable(self, identity: bytes, frame: bytes) -> bool:
        """ROUTER only: send ``frame`` to ``identity`` if it is connected; whether it was."""
        with self._lock:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # for this send only: unroutable raises
            try:
                self.sock.send_multipart([identity, frame], zmq.NOBLOCK)
                return True
            except zmq.Again:
                return True  # connected, its queue full
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    return False
                raise
            finally:
                self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
                self._drain()

    def try_drain(self) -> None:
        """Drain without waiting, unless another thread holds the socket (it drains then)."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        # Asking EVENTS first processes ZMQ's commands just as recv would, and costs
        # less than the zmq.Again a recv on an empty socket raises (most sends find none).
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                self.inbox.append(self.sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def close(self) -> None:
        with self._lock:
            self.sock.close(linger=0)


class Server:
    """Serves registered handlers on one ROUTER socket until :meth:`stop`."""

    def __init__(self, address: str, *, transfer_threads: int = 4, allow_remote: bool = False,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 curve_secret_key: str | None = None, curve_clients: str | None = None) -> None:
        """``max_message_bytes``: see :data:`DEFAULT_MAX_MESSAGE_BYTES`.
        ``curve_secret_key`` (the server's ``NAME.key_secret`` file) and ``curve_clients`` (a directory of the
        authorized clients' ``NAME.key`` files): serve CURVE-authenticated clients only (see
        :mod:`kvstrata.core.wire.curve`); a tcp:// address requires them."""
        if transfer_threads < 1:
            raise ValueError(f"transfer_threads must be at least 1, got {transfer_threads}")
        if not 1 <= max_message_bytes <= codec.MAX_FRAME_BYTES:
            raise ValueError(f"max_message_bytes must be in [1, {codec.MAX_FRAME_BYTES}], got {max_message_bytes}")
        curve = bool(curve_secret_key or curve_clients)
        check_bind_address(address, allow_remote, curve=curve)
        self._curve = ServerCurve.load(curve_secret_key, curve_clients) if curve else None
        self._auth: Any = None
        """The CURVE authenticator (a zmq.auth ThreadAuthenticator) while serving with CURVE."""
        self.max_message_bytes = max_message_bytes
        self.address = address
        self.transfer_threads = transfer_threads
        self._handlers: dict[RequestType, Handler] = {}
        self._ctx = zmq.Context()
        self._sock: SharedSocket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._turn = threading.Lock()  # held by the one thread waiting on the socket
        self._work = threading.Condition()
        self._runs_blocking: dict[RequestType | int, bool] = {}
        """Per request type, whether its handler runs on a transfer thread (see :meth:`register`)."""
        self._blocking_running = 0
        self._blocking_queued: collections.deque[tuple[bytes, codec.Request]] = collections.deque()
        self._counts = threading.Lock()
        self.requests_served = 0
        self.requests_rejected = 0
        self._busy_wait: BusyWait | None = None
        self._busy_window_s = 0.0
        self._last_request = 0.0
        self._local = threading.local()  # .holds_turn: this thread is the leader
        self._last_seen: dict[bytes, float] = {}
        """When each client's last frame arrived (see :meth:`last_seen`)."""

    def enable_busy_poll(self, busy_wait: BusyWait, window_ms: float) -> None:
        """After each request, have the waiting thread poll without sleeping for ``window_ms``.

        The next request of a burst (a LOOKUP's RETRIEVE, the next transfer) is
        then taken at once rather than after the time a sleeping thread needs to
        wake on a virtual machine. Costs up to one core while the window
        lasts; the spinning happens outside the GIL, so handlers run undisturbed.
        """
        if window_ms < 0:
            raise ValueError(f"window_ms must be >= 0, got {window_ms}")
        self._busy_wait = busy_wait
        if self._sock is not None:
            self._sock.busy_wait = busy_wait
        self._busy_window_s = window_ms / 1e3

    def register(self, request_type: RequestType, handler: Handler, *, blocking: bool | None = None) -> None:
        """Register a handler; raises ProtocolError if its arity differs from the declaration. ``blocking``
        overrides the declaration's: a handler that may wait on something slow (a LOOKUP reading the shared
        tier) runs on a transfer thread, so the thread that answers PING and quick requests stays free."""
        check_handler_signature(request_type, handler)
        self._handlers[request_type] = handler
        self._runs_blocking[request_type] = DECLARATIONS[request_type].blocking if blocking is None else blocking

    def start(self) -> None:
        missing = [rt.name for rt in RequestType if rt not in self._handlers]
        if missing:
            raise ProtocolError(f"no handler registered for {', '.join(missing)}")
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # a longer frame: libzmq drops the peer unread
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if self._curve is not None:
                self._auth = self._curve.apply(router, self._ctx)  # before the bind: no client unchecked
            old_umask = os.umask(0o077)  # the IPC socket file is private to this user
            try:
                router.bind(self.address)
            finally:
                os.umask(old_umask)
        except BaseException:
            router.close(0)
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
            raise
        if self.address.endswith(":0"):
            self.address = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sock = SharedSocket(router)
        self._sock.busy_wait = self._busy_wait
        # one thread per concurrent blocking handler, plus one that is always free to answer PING
        for i in range(self.transfer_threads + 1):
            t = threading.Thread(target=self._serve, name=f"kvstrata-server-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except FileNotFoundError:
                pass

    def _count(self, served: bool) -> None:
        with self._counts:
            if served:
                self.requests_served += 1
            else:
                self.requests_rejected += 1

    # --- server threads --------------------------------------------------------------

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                queued = self._take_queued_blocking()
                if queued is not None:
                    self._run_blocking(*queued)
                    continue
                if self._turn.acquire(timeout=_IDLE_S):
                    self._lead(sock)
            except Exception:  # a server thread that died would leave requests unanswered for good
                if self._stop.is_set():
                    return
                log.exception("server thread %s: unexpected error; it goes on serving",
                              threading.current_thread().name)

    def _lead(self, sock: SharedSocket) -> None:
        """Hold the turn: wait on the socket and serve quick requests until a blocking one arrives, which
        then runs on this thread once the turn is handed to the next one."""
        self._local.holds_turn = True
        try:
            while not self._stop.is_set():
                frames = self._pop(sock)
                if frames is None:
                    self._wait(sock)
                    continue
                decoded = self._decode(frames)
                if decoded is None:
                    continue
                identity, request = decoded
                if not self._runs_blocking.get(request.request_type, False):
                    self._send(identity, self._run(request, identity))
                    continue
                with self._work:
                    if self._blocking_running >= self.transfer_threads:
                        self._blocking_queued.append((identity, request))
                        continue
                    self._blocking_running += 1
                self._release_turn()
                self._run_blocking(identity, request)
                return
        finally:
            self._release_turn()

    def _wait(self, sock: SharedSocket) -> None:
        """Wait for the socket as the leader: spin inside the busy window, else sleep."""
        spin_s = self._last_request + self._busy_window_s - time.monotonic()
        if self._busy_wait is None or spin_s <= 0:
            sock.wait(_POLL_MS)
            return
        try:
            sock.wait(0, int(spin_s * 1e6) + 1)
        except zmq.ZMQError:
            raise
        except Exception as exc:
            log.error("busy polling failed and is now off (waits sleep on the socket instead): %s", exc)
            self._busy_wait = None
            sock.busy_wait = None

    def _release_turn(self) -> None:
        """Let the next thread wait on the socket, if this thread holds the turn (else nothing)."""
        if getattr(self._local, "holds_turn", False):
            self._local.holds_turn = False
            self._turn.release()

    @staticmethod
    def _pop(sock: SharedSocket) -> list[bytes] | None:
        try:
            return sock.inbox.popleft()
        except IndexError:
            return None

    def _take_queued_blocking(self) -> tuple[bytes, codec.Request] | None:
        with self._work:
            if self._blocking_queued and self._blocking_running < self.transfer_threads:
                self._blocking_running += 1
                return self._blocking_queued.popleft()
        return None

    def _decode(self, frames: list[bytes]) -> tuple[bytes, codec.Request] | None:
        """(identity, request) of a well-formed request; anything else is answered with an error or dropped."""
        self._last_request = now = time.monotonic()
        if len(frames) == 2:
            self._last_seen[frames[0]] = now  # any frame renews its connection's lease
        if len(frames) != 2:
            log.warning("dropping a message of %d frames (expected identity + one frame)", len(frames))
            self._count(False)
            return None
        identity, body = frames
        try:
            request = codec.decode_request(body)
            DECLARATIONS[request.request_type].validate(request.payload)
        except (codec.DecodeError, ProtocolError) as exc:
            self._count(False)
            rid = codec.peek_request_id(body)
            log.warning("rejected request %s: %s", rid, exc)
            self._send(identity, codec.encode_reply(rid if rid is not None else -1, False,
                                                    error_reply_value("bad_request", str(exc))))
            return None
        return identity, request

    def _run_blocking(self, identity: bytes, request: codec.Request) -> None:
        try:
            self._send(identity, self._run(request, identity))
        finally:
            with self._work:
                self._blocking_running -= 1

    def _send(self, identity: bytes, reply: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send([identity, reply])
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                log.warning("could not send a reply: %s", exc)

    def _run(self, request: codec.Request, identity: bytes) -> bytes:
        handler = self._handlers[request.request_type]
        self._local.client = identity
        try:
            return self._reply(request, lambda: handler(*request.payload))
        finally:
            self._local.client = None

    def current_client(self) -> bytes | None:
        """The connection whose request this thread's handler is serving (its ZMQ routing id), or None.

        Handlers use it to tie what a client registers to that client (see ``CacheServer``)."""
        return getattr(self._local, "client", None)

    def last_seen(self, identity: bytes) -> float | None:
        """When client ``identity``'s last frame arrived (``time.monotonic()``), None if never or forgotten."""
        return self._last_seen.get(identity)

    def forget(self, identity: bytes) -> None:
        """Drop when client ``identity`` was last seen: its later frames are served as any new client's."""
        self._last_seen.pop(identity, None)

    def forget_silent(self, older_than_s: float) -> None:
        """Forget every client silent for more than ``older_than_s`` seconds (the server's lease)."""
        cutoff = time.monotonic() - older_than_s
        for identity, seen in list(self._last_seen.items()):
            if seen < cutoff:
                self.forget(identity)

    def is_connected(self, identity: bytes) -> bool:
        """Whether the client ``identity`` is still connected: a frame it ignores (a reply to request 0,
        which no client sends) is routed to it, and ZMQ says at once if it has no such peer."""
        assert self._sock is not None
        return self._sock.reachable(identity, codec.encode_reply(0, True, None))

    def _reply(self, request: codec.Request, produce: Callable[[], Any]) -> bytes:
        """The encoded reply to ``request`` from ``produce()``'s value or error."""
        try:
            result = produce()
            self._count(True)
            return codec.encode_reply(request.request_id, True, result)
        except Exception as exc:
            self._count(False)
            log.warning("%s request %d failed: %s", request.request_type.name, request.request_id, exc,
                        exc_info=log.isEnabledFor(logging.DEBUG))
            return codec.encode_reply(request.request_id, False,
                                      error_reply_value(getattr(exc, "error_code", "error"),
                                                        f"{request.request_type.name}: {exc}"))


_REFUSED_CHECK_MS = 100
"""A TCP send that cannot be queued looks this often whether the server refused the handshake for good."""

_REFUSED_FOR_GOOD = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
"""Handshake ends after which libzmq drops the connection and its queue without reconnecting."""


class Client:
    """Sends requests from the caller's thread; replies resolve futures on one I/O thread."""

    def __init__(self, address: str, *, default_timeout: float = 30.0,
                 curve_server_key: str | None = None, curve_client_key: str | None = None) -> None:
        """``curve_server_key`` (the
        server's public ``NAME.key`` file) and ``curve_client_key`` (this client's ``NAME.key_secret`` file):
        connect with CURVE, as a kvstrata server on tcp:// requires (see :mod:`kvstrata.core.wire.curve`)."""
        self._curve = ClientCurve.load(curve_server_key, curve_client_key) \
            if curve_server_key or curve_client_key else None
        self.address = address
        self.default_timeout = default_timeout
        self._ctx = zmq.Context()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # A routing id of our own, kept across reconnects: the server ties what this client registers to it,
        # and a socket that reconnects is still the same client. Random, so no other client can claim it.
        dealer.setsockopt(zmq.ROUTING_ID, b"kvstrata-" + secrets.token_bytes(12))
        dealer.setsockopt(zmq.MAXMSGSIZE, codec.MAX_FRAME_BYTES)
        if self._curve is not None:
            self._curve.apply(dealer)
        # TCP: a monitor tells how handshakes ended, read only when a request times out, to say why (CURVE),
        # or when a send finds no connection (see _send_frame)
        self._monitor = dealer.get_monitor_socket(HANDSHAKE_EVENTS) if address.startswith("tcp://") else None
        self._monitor_lock = threading.Lock()
        self._handshake: tuple[int | None, int] = (None, 0)
        if self._monitor is not None:
            dealer.setsockopt(zmq.SNDTIMEO, _REFUSED_CHECK_MS)
        dealer.connect(address)
        self._sock = SharedSocket(dealer)
        self._next_id = 1
        self._pending: dict[int, tuple[RequestType, Future]] = {}
        self._pending_lock = threading.Lock()
        self._closed = False
        self._last_sent = time.monotonic()
        self._send_lock = threading.Lock()
        """Held from numbering a request to sending it: ids follow the order requests are sent in."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstrata-client-io", daemon=True)
        self._thread.start()

    def submit(self, request_type: RequestType, payload: list[Any] | tuple[Any, ...], *,
               validate: bool = True) -> Future:
        """Send a request and return a future for its value (RemoteError on an error reply).

        The payload is validated here too, so a caller bug fails in the caller with
        the same message the server would have sent. ``validate=False`` is for
        payloads a typed builder made (``CacheClient``'s transfer calls): the server
        still checks them and answers a bad one with an error naming the item, and
        the check stays off the engine thread's path to the first slice.
        """
        payload = list(payload)
        if validate:
            DECLARATIONS[request_type].validate(payload)
        fut: Future = Future()
        self._send_request(request_type, payload, fut)
        return fut

    def _send_request(self, request_type: RequestType | int, payload: Any, fut: Future | None) -> None:
        with self._send_lock:
            self._check_open()
            rid = self._next_id
            self._next_id += 1
            self._last_sent = time.monotonic()
            frame = codec._pack([codec.WIRE_VERSION, rid, int(request_type), payload])
            if fut is not None:
                with self._pending_lock:
                    self._pending[rid] = (request_type, fut)
            self._send_frame(frame)
        self._resolve_inbox()  # outside the lock: resolving runs callbacks, which may send

    def send_oneway(self, request_type: RequestType, payload: list[Any] | tuple[Any, ...]) -> None:
        """Send a validated request whose reply nobody waits for (lock releases, session ends).

        No future is kept, so a server that is down costs nothing that piles up.
        """
        payload = list(payload)
        DECLARATIONS[request_type].validate(payload)
        self._send_request(request_type, payload, None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("transport is closed")

    def poll(self) -> None:
        """Resolve whatever replies have arrived, on the calling thread, without waiting.

        For callers that poll anyway, such as an engine asking each step which
        transfers finished: a reply is then resolved by a thread that is already
        awake instead of waiting for the I/O thread to be woken from its sleep.
        """
        if not self._closed:
            self._sock.try_drain()
            self._resolve_inbox()

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
            raise RequestTimeout(f"no reply from {self.address} within {timeout:.1f}s{self._handshake_hint()}") \
                from None

    def _handshake_hint(self) -> str:
        """Over TCP: why no reply came, if a CURVE handshake failed (or this client has no CURVE keys)."""
        if self._monitor is None or not self._read_monitor():
            return ""
        return handshake_hint(*self._handshake, self._curve, self.address)

    def _read_monitor(self) -> bool:
        """Note how the last handshake ended (TCP only); False once closed."""
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        with self._monitor_lock:
            if self._closed:
                return False
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)
                self._handshake = (int(event["event"]), int(event["value"]))
            return True

    def _send_frame(self, frame: bytes) -> None:
        """Send ``frame``; over TCP, drop it instead once the server has refused the handshake for good.

        A server that refuses this client's CURVE key, or a client without CURVE, ends the connection with a
        protocol error, after which libzmq neither reconnects nor keeps a queue: a send would block for
        ever. So TCP sends wait :data:`_REFUSED_CHECK_MS` at a time, and between tries look at how the
        handshake ended; a refused request is dropped and times out, its message saying why (CURVE).
        """
        if self._monitor is None:
            self._sock.send([frame])
            return
        while True:
            try:
                self._sock.send([frame])
                return
            except zmq.Again:  # no connection to queue on, or its queue full: wait on, unless refused
                if not self._read_monitor() or self._handshake[0] in _REFUSED_FOR_GOOD:
                    return

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
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        self.fail_pending("client closed")
        self._sock.close()
        if self._monitor is not None:
            with self._monitor_lock:
                self._monitor.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sock.wait(_POLL_MS // 2)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            self._resolve_inbox()
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                try:
                    self._heartbeat()
                except (RuntimeError, zmq.ZMQError):
                    if self._stop.is_set() or self._closed:
                        return
                    raise

    def _heartbeat(self) -> None:
        """A PING that renews this connection's lease, sent only if the socket takes it at once: with the server
        gone, frames queue up to ZMQ's high-water mark, and a heartbeat must never be what blocks the engine's
        sends then. A heartbeat not taken uses no request id (the server serves a client's ids in order)."""
        with self._send_lock:
            self._check_open()
            self._last_sent = time.monotonic()
            frame = codec._pack([codec.WIRE_VERSION, self._next_id, int(RequestType.PING), []])
            try:
                self._sock.send([frame], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._next_id += 1

    def _resolve_inbox(self) -> None:
        while True:
            try:
                frames = self._sock.inbox.popleft()
            except IndexError:
                return
            self._resolve(frames[-1])

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
            fut.set_exception(remote_error(reply.value))
