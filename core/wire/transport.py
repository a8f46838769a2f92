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
handler. A handler marked with :func:`hands_over_turn` keeps the turn until it
calls :meth:`Server.release_turn`: the hand-over wakes a thread that then wants
the GIL, and on a virtual machine that contention costs a tenth of a
millisecond or more, so a transfer hands over only once its first slice is
enqueued. A handler whose device is still copying returns a :class:`Deferred`:
the thread holding the turn watches its completion along with the socket and
answers it from there, so the handler's thread is free once the copies are
enqueued. At most ``transfer_threads`` transfers run at once, so one thread is
always left to answer PING and LOOKUP while transfers copy; blocking requests
beyond that wait in a queue.

Client: the caller's thread sends; one I/O thread waits for replies and
resolves futures.

A client on the server's host may also attach shared-memory rings
(:mod:`kvstrata.core.wire.rings`, ATTACH_RINGS), so that neither side's ZMQ I/O
thread has to wake on the way: it writes each request into its request ring
before sending it, and the server's spin sees it there; the server writes each
reply into the reply ring before sending it, and a client that polls
(:meth:`Client.poll`, which an engine calls every step) resolves it from there.
Every frame still goes over ZMQ. The client numbers its requests in the order it
sends them, and the server takes a request from the ring only if it is the next
one that client sent; its ZMQ copy, arriving later, is dropped. So each request
is served once and in order, whichever copy comes first.
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
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, get_args

import zmq

from kvstrata.core.wire import codec
from kvstrata.core.wire.curve import FLAGS_HINT, HANDSHAKE_EVENTS, ClientCurve, ServerCurve, handshake_hint
from kvstrata.core.wire.protocol import DECLARATIONS, TRANSPORT_REQUESTS, ProtocolError, RequestType, check_handler_signature
from kvstrata.core.shm import Segment, SegmentKind
from kvstrata.core.wire.rings import (MAILBOX_SLOT_BYTES, MAILBOX_SLOTS, REPLY_SLOT_BYTES, REPLY_SLOTS, REQUEST_SLOT_BYTES,
                       REQUEST_SLOTS, Mailbox, SlotRing)

log = logging.getLogger(__name__)

Handler = Callable[..., Any]
BusyWait = Callable[..., bool]
"""``busy_wait(fd, max_us, *, events=..., words=...)``: poll ``fd`` without sleeping and without the GIL;
True once readable or, given ``events`` (handles such as a :class:`Deferred`'s ``wait_handle``), once one of
them has completed, or, given ``words`` ((address, value) pairs), once one of those 64-bit words holds its
value (a request ring's next frame published). The CUDA extension provides one (``spin_until_readable``);
see :meth:`Server.enable_busy_poll`."""

_POLL_MS = 100
"""How long a waiting thread sleeps on the socket before it checks for shutdown."""

HEARTBEAT_S = 1.0
"""A client sends a PING when it has sent nothing for this long, so the server can tell a live connection that
has nothing to ask from a stopped process (the server's lease is many heartbeats long)."""

_IDLE_S = 1.0
"""How long a thread waiting for the turn sleeps before it looks for queued work (a hand-over wakes it sooner)."""

_SPIN_SLICE_S = 100e-6
"""Busy polling returns to Python this often to look for newly deferred replies (see :class:`Deferred`)."""

_AWAIT_SPIN_S = 2e-3
"""With replies deferred on handles the busy-wait function watches, it spins this long at most per call."""

_MAX_PEERS = 256
"""Clients whose rings a server keeps mapped; beyond that the least recently attached is let go (its
frames then travel over ZMQ only). ZMQ does not say when a client went away."""

RingSetting = Literal["all", "rings", "replies", "none"]
"""What :meth:`Client.attach_rings` attaches: ``all`` (request and reply rings and the mailbox), ``rings``
(no mailbox), ``replies`` (the reply ring only) or ``none`` (nothing: frames travel over ZMQ only). Anything
but ``all`` is for A/B measurements of what each shared-memory path is worth."""
RING_SETTINGS: tuple[str, ...] = get_args(RingSetting)


def hands_over_turn(handler: Handler) -> Handler:
    """Mark a blocking handler that calls :meth:`Server.release_turn` once its latency-critical start is done.

    Until then no other server thread is woken, so the handler's first steps run
    without GIL contention; requests arriving meanwhile wait that long (the
    transport releases the turn when the handler returns in any case).
    """
    handler.hands_over_turn = True  # type: ignore[attr-defined]
    return handler


class Deferred:
    """What a blocking handler returns when its device is still copying: the reply comes once it is done.

    ``ready()`` says, without blocking, whether the device has finished (a hint:
    it may say so late, never early); ``settle()`` then finishes the request (it
    may block until the device is done, release what the request held, raise) and
    returns the reply's value. ``wait_handle``, if not 0, is a handle the server's
    busy-wait function can watch without the GIL (a raw CUDA event).

    With busy polling on, the thread that polls the socket also watches these and
    settles each one as soon as it is ready, so the reply leaves within
    microseconds of the copy's end from a thread that is awake, and the handler's
    own thread is free at once. Without it, the handler's thread settles it at once.
    """

    __slots__ = ("settle", "ready", "wait_handle", "mail")

    def __init__(self, settle: Callable[[], Any], ready: Callable[[], bool], wait_handle: int = 0) -> None:
        self.settle = settle
        self.ready = ready
        self.wait_handle = wait_handle
        self.mail: MailSlot | None = None
        """The client's mailbox slot the handler took (:meth:`Server.mailbox_slot`): freed once answered."""


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

    def wait(self, timeout_ms: int, spin_us: int = 0, events: list[int] | None = None,
             words: list[tuple[int, int]] | None = None) -> None:
        """Wait until the socket may have input (or the timeout), then drain it. One waiter at a time.

        With ``spin_us`` and a :attr:`busy_wait` function, first poll without
        sleeping for up to that long (outside the GIL), then sleep as usual. The
        spin also ends when one of ``events`` (handles the busy-wait function
        understands) has completed or one of ``words`` holds its value; the
        caller then looks at what it waits for.
        """
        if not self.inbox:
            spun_to_input = False
            if spin_us > 0 and self.busy_wait is not None:
                watch: dict[str, Any] = {}
                if events:
                    watch["events"] = events
                if words:
                    watch["words"] = words
                spun_to_input = self.busy_wait(self._fd, spin_us, **watch)
            if not spun_to_input:
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


@dataclass
class _Peer:
    """A client that attached rings, by its ZMQ identity.

    Only the thread holding the turn reads or changes it, except :attr:`replies`,
    which every answering thread writes (the ring has its own lock).
    """

    replies: SlotRing
    requests: SlotRing | None
    mailbox: Mailbox | None
    next_id: int
    """The id of the request this client sent next after the last one served: it numbers its requests
    in the order it sends them, so the ring's next frame may be served early only if it has this id."""
    early: set[int] = field(default_factory=set)
    """Requests served from the ring whose ZMQ copy has not arrived yet; that copy is dropped."""
    stalled: bool = False
    """The ring's next frame is ahead of next_id: ZMQ must deliver what was sent before it first."""
    mail_free: list[int] = field(default_factory=list)
    """Mailbox slots no transfer holds (guarded by the server's peers lock)."""
    retired: bool = False
    """Replaced or let go: its mailbox closes once no transfer holds a slot (a device may still write one)."""

    def close(self) -> None:
        """Close the rings now, the mailbox once no transfer in flight holds a slot of it."""
        self.retired = True
        self.replies.close()
        if self.requests is not None:
            self.requests.close()
        if self.mailbox is not None and len(self.mail_free) == self.mailbox.slots:
            self.mailbox.close()


@dataclass
class MailSlot:
    """A slot of a client's mailbox, lent to the transfer being served until its reply has gone out."""

    peer: _Peer
    index: int
    request_id: int

    @property
    def segment(self) -> Segment:
        assert self.peer.mailbox is not None
        return self.peer.mailbox.segment

    @property
    def word_offset(self) -> int:
        assert self.peer.mailbox is not None
        return self.peer.mailbox.word_offset(self.index)

    def fill(self, value: Any) -> bool:
        """Write the success reply ``value`` into the slot (the device stores the request id when done)."""
        box = self.peer.mailbox
        return box is not None and not self.peer.retired and box.fill(
            self.index, codec.encode_reply(self.request_id, True, value))


class Server:
    """Serves registered handlers on one ROUTER socket until :meth:`stop`."""

    def __init__(self, address: str, *, transfer_threads: int = 4, allow_remote: bool = False,
                 defer_replies: bool = True, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 curve_secret_key: str | None = None, curve_clients: str | None = None) -> None:
        """``defer_replies``: with busy polling on, the polling thread settles and answers a handler's
        :class:`Deferred`; False has the handler's own thread do it (as without busy polling), for A/B
        measurements of what deferring is worth. ``max_message_bytes``: see :data:`DEFAULT_MAX_MESSAGE_BYTES`.
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
        self._blocking_running = 0
        self._blocking_queued: collections.deque[tuple[bytes, codec.Request]] = collections.deque()
        self._counts = threading.Lock()
        self.requests_served = 0
        self.requests_rejected = 0
        self._busy_wait: BusyWait | None = None
        self._busy_window_s = 0.0
        self._last_request = 0.0
        self._awaiting: list[tuple[bytes, codec.Request, Deferred]] = []
        """Blocking requests whose handler returned a :class:`Deferred`: settled by the polling thread."""
        self._awaiting_lock = threading.Lock()
        self._watch_events = True  # off while transfers whose event failed to be watched are in flight
        self._defer_replies = defer_replies
        self._local = threading.local()  # .holds_turn: this thread is the leader
        self._peers: collections.OrderedDict[bytes, _Peer] = collections.OrderedDict()
        """Clients that attached rings, by ZMQ identity (see ATTACH_RINGS)."""
        self._peers_lock = threading.Lock()
        self._last_seen: dict[bytes, float] = {}
        """When each client's last frame arrived (see :meth:`last_seen`)."""
        self.ring_requests = 0
        """Requests served from a client's request ring, ahead of their ZMQ copy."""

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

    def register(self, request_type: RequestType, handler: Handler) -> None:
        """Register a handler; raises ProtocolError if its arity differs from the declaration."""
        if request_type in TRANSPORT_REQUESTS:
            raise ProtocolError(f"{request_type.name} is served by the transport; it takes no handler")
        check_handler_signature(request_type, handler)
        self._handlers[request_type] = handler

    def start(self) -> None:
        missing = [rt.name for rt in RequestType if rt not in self._handlers and rt not in TRANSPORT_REQUESTS]
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
        with self._awaiting_lock:
            left, self._awaiting = self._awaiting, []
        for _, request, deferred in left:  # no reply goes out any more, but what they hold is released
            self._settle(request, deferred)
            self._free_mail(deferred.mail)
        if left:
            log.info("stopped with %d transfer(s) in flight: settled without replies", len(left))
        if self._sock is not None:
            self._sock.close()
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), collections.OrderedDict()
            for peer in peers:  # every transfer has been settled above: no device writes a mailbox now
                peer.mail_free = list(range(peer.mailbox.slots)) if peer.mailbox is not None else []
                peer.close()
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
        """Hold the turn: wait on the socket and serve quick requests until a blocking one arrives.

        The blocking request runs on this thread, which hands the turn on before
        the handler starts, or (:func:`hands_over_turn`) when the handler says so.
        Meanwhile this thread also settles deferred replies whose device is done.
        """
        self._local.holds_turn = True
        try:
            while not self._stop.is_set():
                if self._awaiting:
                    self._settle_ready()
                if self._blocking_queued:  # a settled transfer may have freed a slot a queued one waits for
                    queued = self._take_queued_blocking()
                    if queued is not None:
                        self._start_blocking(*queued)
                        return
                frames = self._pop_ring() if self._peers else None
                if frames is None:
                    frames = self._pop_socket(sock)
                if frames is None:
                    self._wait(sock)
                    continue
                decoded = self._decode(frames)
                if decoded is None:
                    continue
                identity, request = decoded
                if request.request_type is RequestType.ATTACH_RINGS:
                    self._send(identity, self._reply(
                        request, lambda: self._attach_rings(identity, request.request_id, *request.payload)))
                    continue
                if not DECLARATIONS[request.request_type].blocking:
                    reply = self._run(request, identity)
                    self._send(identity, self._settle(request, reply) if isinstance(reply, Deferred) else reply)
                    continue
                with self._work:
                    if self._blocking_running >= self.transfer_threads:
                        self._blocking_queued.append((identity, request))
                        continue
                    self._blocking_running += 1
                self._start_blocking(identity, request)
                return
        finally:
            self.release_turn()

    def _wait(self, sock: SharedSocket) -> None:
        """Wait for the socket as the leader: spin inside the busy window (or while replies are deferred),
        else sleep."""
        now = time.monotonic()
        spin_s = self._last_request + self._busy_window_s - now
        awaiting = self._awaiting
        if awaiting:
            spin_s = max(spin_s, _AWAIT_SPIN_S)  # transfers in flight: keep watching them whatever the window
        if self._busy_wait is None:
            sock.wait(1 if awaiting else _POLL_MS)  # deferred replies are looked at every millisecond
            return
        if spin_s <= 0:
            sock.wait(_POLL_MS)
            return
        handles = [d.wait_handle for _, _, d in awaiting]
        watch = bool(handles) and all(handles) and self._watch_events
        words = [p.requests.watch() for p in list(self._peers.values())
                 if p.requests is not None and not p.stalled] if self._peers else None
        try:
            if watch:  # the busy-wait function watches them: no need to come back early
                sock.wait(0, int(min(spin_s, _AWAIT_SPIN_S) * 1e6) + 1, handles, words)
            else:  # come back soon for replies deferred meanwhile, or whose readiness only Python can tell
                sock.wait(0, int(min(spin_s, _SPIN_SLICE_S) * 1e6) + 1, None, words)
        except zmq.ZMQError:
            raise
        except Exception as exc:
            if watch:
                # Most likely a transfer failed on the device and its event reports the error: its
                # settle() answers it with that error. Until the transfers watched now have all
                # settled, their readiness is asked from Python between short spins instead.
                log.warning("watching transfer completion events failed (%s); polling them from Python until "
                            "they settle", exc)
                self._watch_events = False
                return
            log.error("busy polling failed and is now off (waits sleep on the socket instead): %s", exc)
            self._busy_wait = None
            sock.busy_wait = None

    def _start_blocking(self, identity: bytes, request: codec.Request) -> None:
        """Run a blocking request (its slot already counted) on this thread, handing the turn over first
        unless the handler keeps it (:func:`hands_over_turn`)."""
        if not getattr(self._handlers[request.request_type], "hands_over_turn", False):
            self.release_turn()
        self._run_blocking(identity, request)

    def _settle_ready(self) -> None:
        """Settle and answer every deferred reply whose device is done, freeing its transfer slot."""
        with self._awaiting_lock:
            entries = list(self._awaiting)
        for entry in entries:
            identity, request, deferred = entry
            try:
                ready = deferred.ready()
            except Exception:  # settle() reports what went wrong
                ready = True
            if not ready:
                continue
            with self._awaiting_lock:
                self._awaiting.remove(entry)
            try:
                self._send(identity, self._settle(request, deferred))
            finally:
                self._end_blocking(deferred.mail)
        if not self._awaiting:
            self._watch_events = True  # whatever made a watched event fail has been settled

    def release_turn(self) -> None:
        """Let the next thread wait on the socket, if this thread holds the turn (else nothing).

        Called by :func:`hands_over_turn` handlers once the work that must not
        be disturbed is done; the transport calls it too when such a handler returns.
        """
        if getattr(self._local, "holds_turn", False):
            self._local.holds_turn = False
            self._turn.release()

    @staticmethod
    def _pop(sock: SharedSocket) -> list[bytes] | None:
        try:
            return sock.inbox.popleft()
        except IndexError:
            return None

    def _pop_socket(self, sock: SharedSocket) -> list[bytes] | None:
        """The next message from the socket, less the copies of requests already served from a ring."""
        while True:
            frames = self._pop(sock)
            if frames is None or len(frames) != 2 or not self._peers:
                return frames
            peer = self._peers.get(frames[0])
            rid = codec.request_id_of(frames[1]) if peer is not None else None
            if rid is None:
                return frames
            if rid in peer.early:
                peer.early.discard(rid)
                continue
            if rid >= peer.next_id:
                peer.next_id, peer.stalled = rid + 1, False
            return frames

    def _pop_ring(self) -> list[bytes] | None:
        """[identity, frame] of a request a client's ring holds and that is the next one it sent, if any.

        A frame further ahead stays in the ring until ZMQ has delivered what was
        sent before it (then it is a copy, and skipped): serving it first would
        reorder that client's requests. Frames without a request id are left to
        their ZMQ copy, which gets the error reply.
        """
        for identity, peer in list(self._peers.items()):
            ring = peer.requests
            while ring is not None and not peer.stalled:
                frame = ring.peek()
                if frame is None:
                    break
                rid = codec.request_id_of(frame)
                if rid is None or rid < peer.next_id:
                    ring.advance()  # served from its ZMQ copy already, or malformed
                    continue
                if rid > peer.next_id:
                    peer.stalled = True
                    break
                ring.advance()
                peer.early.add(rid)
                peer.next_id = rid + 1
                self.ring_requests += 1
                return [identity, frame]
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
        deferred = False
        self._local.request, self._local.mail = (identity, request.request_id), None
        try:
            try:
                reply = self._run(request, identity)
            finally:
                mail, self._local.request, self._local.mail = self._local.mail, None, None
            if isinstance(reply, Deferred):
                reply.mail = mail
                if self._busy_wait is not None and self._defer_replies and not self._stop.is_set():
                    with self._awaiting_lock:  # the polling thread settles and answers it
                        self._awaiting.append((identity, request, reply))
                    deferred = True
                    return
                reply = self._settle(request, reply)
            self._send(identity, reply)
        finally:
            if not deferred:
                self._end_blocking(mail)

    def _end_blocking(self, mail: MailSlot | None) -> None:
        """A blocking request has been answered: its mailbox slot and its transfer slot are free."""
        self._free_mail(mail)
        with self._work:
            self._blocking_running -= 1

    def _send(self, identity: bytes, reply: bytes) -> None:
        assert self._sock is not None
        peer = self._peers.get(identity)
        if peer is not None:
            peer.replies.post(reply)  # first: a polling client finds it there before the socket leg ends
        try:
            self._sock.send([identity, reply])
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                log.warning("could not send a reply: %s", exc)

    def mailbox_slot(self) -> MailSlot | None:
        """For the blocking request this thread is serving: a free slot of its client's mailbox, or None.

        Lent until the request's reply has gone out (one per request); see
        :class:`~kvstrata.core.wire.rings.Mailbox` for what the slot is for.
        """
        current = getattr(self._local, "request", None)
        if current is None or getattr(self._local, "mail", None) is not None:
            return None
        identity, request_id = current
        peer = self._peers.get(identity)
        if peer is None or peer.mailbox is None:
            return None
        with self._peers_lock:
            if peer.retired or not peer.mail_free:
                return None
            slot = MailSlot(peer, peer.mail_free.pop(), request_id)
        self._local.mail = slot
        return slot

    def _free_mail(self, slot: MailSlot | None) -> None:
        if slot is None:
            return
        with self._peers_lock:
            peer = slot.peer
            peer.mail_free.append(slot.index)
            if peer.retired:
                peer.close()

    @property
    def ring_clients(self) -> int:
        """Clients that attached shared-memory rings (see ATTACH_RINGS)."""
        return len(self._peers)

    def _attach_rings(self, identity: bytes, request_id: int, replies: dict[str, Any],
                      requests: dict[str, Any] | None, mailbox: dict[str, Any] | None) -> bool:
        """ATTACH_RINGS: map the sender's rings; from its next request on, they carry copies of its frames."""
        peer = _Peer(SlotRing.attach(replies, SegmentKind.REPLY_RING), None, None, request_id + 1)
        try:
            if requests is not None:
                peer.requests = SlotRing.attach(requests, SegmentKind.REQUEST_RING)
            if mailbox is not None:
                peer.mailbox = Mailbox.attach(mailbox)
                peer.mail_free = list(range(peer.mailbox.slots))
        except Exception:
            peer.close()
            raise
        with self._peers_lock:
            old = self._peers.pop(identity, None)
            self._peers[identity] = peer
            evicted = self._peers.popitem(last=False)[1] if len(self._peers) > _MAX_PEERS else None
        for p in (old, evicted):
            if p is not None:
                with self._peers_lock:
                    p.close()
        if evicted is not None:
            log.info("rings %s let go: more than %d clients attached rings; that client's frames travel over "
                     "ZMQ only", evicted.replies.name, _MAX_PEERS)
        log.debug("rings attached: replies %s, requests %s", peer.replies.name,
                  peer.requests.name if peer.requests is not None else None)
        return True

    def _run(self, request: codec.Request, identity: bytes) -> bytes | Deferred:
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

    def forget(self, identity: bytes) -> list[Callable[[], None]]:
        """Drop what the transport keeps for client ``identity``: its rings and when it was last seen; its later
        frames are served as any new client's. Returns what closes its rings, for the caller to run once no
        thread can still be reading them (a busy poll started before may still watch a ring's word, and a
        device may still be writing its mailbox)."""
        self._last_seen.pop(identity, None)
        with self._peers_lock:
            peer = self._peers.pop(identity, None)
        if peer is None:
            return []

        def close() -> None:
            with self._peers_lock:
                peer.close()

        return [close]

    def forget_silent(self, older_than_s: float) -> list[Callable[[], None]]:
        """Forget every client silent for more than ``older_than_s`` seconds (the server's lease); see
        :meth:`forget` for what it returns."""
        cutoff = time.monotonic() - older_than_s
        closers: list[Callable[[], None]] = []
        for identity, seen in list(self._last_seen.items()):
            if seen < cutoff:
                closers += self.forget(identity)
        return closers

    @property
    def replies_deferred(self) -> int:
        """Transfers whose copies may still be running, answered by the polling thread once they are done."""
        return len(self._awaiting)

    def is_connected(self, identity: bytes) -> bool:
        """Whether the client ``identity`` is still connected: a frame it ignores (a reply to request 0,
        which no client sends) is routed to it, and ZMQ says at once if it has no such peer."""
        assert self._sock is not None
        return self._sock.reachable(identity, codec.encode_reply(0, True, None))

    def _settle(self, request: codec.Request, deferred: Deferred) -> bytes:
        reply = self._reply(request, deferred.settle)
        if isinstance(reply, Deferred):
            raise ProtocolError(f"{request.request_type.name}: a deferred reply settled into another deferred one")
        return reply

    def _reply(self, request: codec.Request, produce: Callable[[], Any]) -> bytes | Deferred:
        """The encoded reply to ``request`` from ``produce()``'s value or error, or the Deferred it returned."""
        try:
            result = produce()
            if isinstance(result, Deferred):
                return result
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

    def __init__(self, address: str, *, default_timeout: float = 30.0, rings: RingSetting = "all",
                 curve_server_key: str | None = None, curve_client_key: str | None = None) -> None:
        """``rings``: what :meth:`attach_rings` attaches (see :data:`RingSetting`). ``curve_server_key`` (the
        server's public ``NAME.key`` file) and ``curve_client_key`` (this client's ``NAME.key_secret`` file):
        connect with CURVE, as a kvstrata server on tcp:// requires (see :mod:`kvstrata.core.wire.curve`)."""
        if rings not in RING_SETTINGS:
            raise ValueError(f"rings must be one of {RING_SETTINGS}, got {rings!r}")
        self._curve = ClientCurve.load(curve_server_key, curve_client_key) \
            if curve_server_key or curve_client_key else None
        self.address = address
        self.default_timeout = default_timeout
        self.rings = rings
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
        """Held from numbering a request to sending it: ids follow the order requests are sent in, which the
        server relies on to serve a request from the ring only when it is the next one (see Server)."""
        self._replies: SlotRing | None = None
        self._requests: SlotRing | None = None
        self._mailbox: Mailbox | None = None
        self._mail_wanted: set[int] = set()
        """Pending requests whose reply the server may announce in the mailbox (guarded by the pending lock)."""
        self._replies_lock = threading.Lock()  # one reader at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstrata-client-io", daemon=True)
        self._thread.start()

    def submit(self, request_type: RequestType, payload: list[Any] | tuple[Any, ...], *,
               validate: bool = True, mailbox: bool = False) -> Future:
        """Send a request and return a future for its value (RemoteError on an error reply).

        The payload is validated here too, so a caller bug fails in the caller with
        the same message the server would have sent. ``validate=False`` is for
        payloads a typed builder made (``CacheClient``'s transfer calls): the server
        still checks them and answers a bad one with an error naming the item, and
        the check stays off the engine thread's path to the first slice.
        ``mailbox``: the server may announce this request's reply in the mailbox
        (a chunk-major RETRIEVE), so :meth:`poll` looks there while it is pending.
        """
        payload = list(payload)
        if validate:
            DECLARATIONS[request_type].validate(payload)
        fut: Future = Future()
        self._send_request(request_type, payload, fut, mailbox)
        return fut

    def submit_unchecked(self, request_type: RequestType | int, payload: Any) -> Future:
        """Send without local validation (tests use this to probe the server's checks)."""
        fut: Future = Future()
        self._send_request(request_type, payload, fut)
        return fut

    def _send_request(self, request_type: RequestType | int, payload: Any, fut: Future | None,
                      mailbox: bool = False) -> None:
        with self._send_lock:
            self._check_open()
            rid = self._next_id
            self._next_id += 1
            self._last_sent = time.monotonic()
            frame = codec._pack([codec.WIRE_VERSION, rid, int(request_type), payload])
            if fut is not None:
                with self._pending_lock:
                    self._pending[rid] = (request_type, fut)
                    if mailbox and self._mailbox is not None:
                        self._mail_wanted.add(rid)
            if self._requests is not None:
                self._requests.post(frame)  # first: the server's spin may take it from there
            self._send_frame(frame)
        self._resolve_inbox()  # outside the lock: resolving runs callbacks, which may send

    def send_oneway(self, request_type: RequestType, payload: list[Any] | tuple[Any, ...]) -> None:
        """Send a validated request whose reply nobody waits for (lock releases, session ends).

        No future is kept, so a server that is down costs nothing that piles up.
        """
        payload = list(payload)
        DECLARATIONS[request_type].validate(payload)
        self._send_request(request_type, payload, None)

    def send_raw(self, frame: bytes) -> None:
        """Send an arbitrary frame (for robustness tests); any reply is dropped unless it matches a future."""
        with self._send_lock:
            self._check_open()
            self._sock.send([frame])
        self._resolve_inbox()  # replies this send drained are ours to resolve (see SharedSocket)

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
            self._take_replies()
            self._sock.try_drain()
            self._resolve_inbox()

    def attach_rings(self, timeout: float | None = None) -> bool:
        """Attach shared-memory rings for this client's requests and replies (see the module docstring).

        Worth it for a client on the server's host that polls (an engine asking
        each step which transfers finished) while the server busy-polls (a GPU
        server does). Returns False, with a log line saying why, where that cannot
        work (the server is on another host, or this client was built with
        ``rings="none"``); frames then travel over ZMQ alone, as they always also
        do. ``rings="replies"`` attaches the reply ring only, ``rings="rings"`` no
        mailbox.
        """
        if self._replies is not None:
            return True
        setting = self.rings
        if setting == "none":
            log.info("shared-memory rings off (rings=%r): frames to and from %s travel over ZMQ only", setting,
                     self.address)
            return False
        replies = SlotRing.create(REPLY_SLOTS, REPLY_SLOT_BYTES, SegmentKind.REPLY_RING)
        requests = SlotRing.create(REQUEST_SLOTS, REQUEST_SLOT_BYTES, SegmentKind.REQUEST_RING) \
            if setting != "replies" else None
        mailbox = Mailbox.create(MAILBOX_SLOTS, MAILBOX_SLOT_BYTES) if setting == "all" else None
        refs = [r.ref() if r is not None else None for r in (replies, requests, mailbox)]
        try:
            self.call(RequestType.ATTACH_RINGS, refs, timeout)
        except (RemoteError, RequestTimeout) as exc:
            for ring in (replies, requests, mailbox):
                if ring is not None:
                    ring.destroy()
            log.warning("no shared-memory rings with %s, frames travel over ZMQ only: %s", self.address, exc)
            return False
        with self._send_lock, self._replies_lock:
            self._replies, self._requests, self._mailbox = replies, requests, mailbox
        log.info("requests to and replies from %s also travel through shared memory (%s)", self.address,
                 ", ".join(r.name for r in (replies, requests, mailbox) if r is not None))
        return True

    @property
    def reply_ring(self) -> SlotRing | None:
        return self._replies

    @property
    def request_ring(self) -> SlotRing | None:
        return self._requests

    @property
    def mailbox(self) -> Mailbox | None:
        return self._mailbox

    def _take_replies(self) -> None:
        if self._replies is None or not self._replies_lock.acquire(blocking=False):
            return  # no ring, or another thread is reading it now
        try:
            # replies the GPU announced itself first: the ring may hold later copies of the same
            frames = self._mailbox.scan(self._mail_wanted) if self._mailbox is not None and self._mail_wanted else []
            if self._replies is not None:
                frames += self._replies.take()
        finally:
            self._replies_lock.release()
        for frame in frames:
            self._resolve(frame)

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
                    self._mail_wanted.discard(rid)

    def fail_pending(self, reason: str) -> None:
        """Fail every outstanding future (used when the peer is known to be gone)."""
        with self._pending_lock:
            pending = list(self._pending.values())
            self._pending.clear()
            self._mail_wanted.clear()
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
        with self._send_lock, self._replies_lock:
            rings = (self._replies, self._requests, self._mailbox)
            self._replies, self._requests, self._mailbox = None, None, None
        for ring in rings:
            if ring is not None:
                ring.destroy()
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
            self._mail_wanted.discard(reply.request_id)
        if entry is None:
            return  # timed out earlier, or an error reply to a raw frame
        _, fut = entry
        if reply.ok:
            fut.set_result(reply.value)
        else:
            fut.set_exception(remote_error(reply.value))
