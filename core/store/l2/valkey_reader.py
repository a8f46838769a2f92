"""Values read from Valkey nodes straight into the L1 pool, with no copy in between.

The client library (``valkey``) reads a reply into its own buffer and hands back a ``bytes`` object, which the
fill then copies into the pool: two copies of every byte beside the kernel's, and the parsing in Python. This
reader speaks the few lines of RESP a pipelined ``GET`` needs on its own socket to each node, reads each value's
header into a small buffer, checks it against the header the expected key gives before any payload byte is
read, and only then receives the payload into the object's ranges in the pool (``recv_into``), its checksum
taken from the pool afterwards. A reply of any other length or header is read aside and judged by
:func:`~kvstrata.core.store.l2.value.decode`, never into the pool.

What this reader does not handle it hands back for the client to read: a ``MOVED``/``ASK`` redirection (a
resharding: the client follows it and refreshes its slot map), and TLS clusters (``valkeys://``), where the
client's own TLS setup is used for every read.
"""

from __future__ import annotations

import concurrent.futures
import socket
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstrata.core.store.l2.backend import TierUnavailable
from kvstrata.core.store.l2.value import MissReason, TierKey, TierMiss, decode, expected_header, payload_checksum_of


READ_THREADS = 15
"""Threads receiving replies beside the caller's: one per node of a batch but the first, up to this many."""


@dataclass
class Outcome:
    """What became of one value read into the pool."""

    landed: bool = False
    absent: bool = False
    miss: TierMiss | None = None
    redirected: bool = False
    """The node answered MOVED/ASK (or an error): the client must read this one."""


class _Node:
    """One connection to one node, used by one thread at a time."""

    def __init__(self, host: str, port: int, timeout: float, username: str | None, password: str | None) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = bytearray()
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if password is not None:
                args = ["AUTH", username, password] if username else ["AUTH", password]
                self.sock.sendall(command(*args))
                line = self.line()
                if not line.startswith(b"+"):
                    raise ConnectionError(f"{host}:{port} refused the password: {line[:80]!r}")
        except BaseException:
            self.sock.close()
            raise

    def line(self) -> bytes:
        """The next CRLF-terminated line, without its CRLF."""
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                out = bytes(self.buf[:end])
                del self.buf[:end + 2]
                return out
            self._more()

    def _more(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the node closed the connection")
        self.buf += chunk

    def exactly_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next ``len(view)`` bytes (those already buffered first)."""
        taken = min(len(self.buf), len(view))
        if taken:
            view[:taken] = self.buf[:taken]
            del self.buf[:taken]
        while taken < len(view):
            n = self.sock.recv_into(view[taken:])
            if n == 0:
                raise ConnectionError("the node closed the connection")
            taken += n

    def close(self) -> None:
        self.sock.close()


def command(*args: str) -> bytes:
    """One RESP command."""
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        data = a.encode()
        parts += [f"${len(data)}\r\n".encode(), data, b"\r\n"]
    return b"".join(parts)


class DirectReader:
    """Pipelined GETs straight into the pool, one connection per node (see the module docstring)."""

    def __init__(self, node_of: Callable[[str], tuple[str, int]], *, timeout: float, username: str | None = None,
                 password: str | None = None) -> None:
        self.node_of = node_of
        self.timeout = timeout
        self.username = username
        self.password = password
        self._nodes: dict[tuple[str, int], _Node] = {}
        self._readers = concurrent.futures.ThreadPoolExecutor(max_workers=READ_THREADS,
                                                              thread_name_prefix="kvstrata-l2-read")

    def _node(self, where: tuple[str, int]) -> _Node:
        node = self._nodes.get(where)
        if node is None:
            node = self._nodes[where] = _Node(*where, self.timeout, self.username, self.password)
        return node

    def read_into(self, items: Sequence[tuple[str, TierKey, memoryview]]) -> list[Outcome]:
        """Read each ``(name, key, object bytes)``'s value, its payload into the object's ranges for ``key``;
        one outcome per item, in order. Raises :class:`TierUnavailable` when a node does not answer in time."""
        outcomes = [Outcome() for _ in items]
        by_node: dict[tuple[str, int], list[int]] = {}
        for i, (name, _, _) in enumerate(items):
            by_node.setdefault(self.node_of(name), []).append(i)
        try:
            nodes = [(self._node(where), indices) for where, indices in by_node.items()]
            for node, indices in nodes:
                node.sock.sendall(b"".join(command("GET", items[i][0]) for i in indices))
            # Each node's replies on a thread of their own: one thread receiving them node after node left the
            # other nodes waiting on full socket buffers (a node sends from one thread; receiving releases the
            # GIL).
            reads = [self._readers.submit(self._read_all, node, indices, items, outcomes) for node, indices in nodes[1:]]
            errors = []
            try:
                self._read_all(nodes[0][0], nodes[0][1], items, outcomes)
            except Exception as exc:  # noqa: BLE001 - reported below, once the other nodes' reads ended
                errors.append(exc)
            for read in reads:
                exc = read.exception()  # each read ends: a node's socket has a timeout
                if exc is not None:
                    errors.append(exc)
            if errors:
                raise errors[0]
        except Exception as exc:  # noqa: BLE001 - a socket, a reply we cannot parse: the connections are out of step
            for where in by_node:  # whatever they still owe is lost with them
                node = self._nodes.pop(where, None)
                if node is not None:
                    node.close()
            raise TierUnavailable(f"reading {len(items)} values: {exc}") from None
        return outcomes

    def _read_all(self, node: _Node, indices: list[int], items: Sequence[tuple[str, TierKey, memoryview]],
                  outcomes: list[Outcome]) -> None:
        for i in indices:
            self._read_one(node, items[i][1], items[i][2], outcomes[i])

    def _read_one(self, node: _Node, key: TierKey, data: memoryview, outcome: Outcome) -> None:
        line = node.line()
        if line.startswith(b"-"):
            outcome.redirected = True  # MOVED, ASK, or an error the client reports better
            return
        if not line.startswith(b"$"):
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        length = int(line[1:])
        if length < 0:
            outcome.absent = True
            return
        header = expected_header(key)
        expected = len(header) + key.payload_bytes
        if length != expected:
            outcome.miss = self._judge_aside(node, key, length, expected)
            return
        got = memoryview(bytearray(len(header)))
        node.exactly_into(got)
        if got[:-8] != header[:-8]:  # everything but the checksum is known before the payload is read
            outcome.miss = self._judge_aside(node, key, length, expected, bytes(got))
            return
        ranges = [data[a:b] for a, b in key.payload_ranges()]
        for view in ranges:
            node.exactly_into(view)
        if node.line() != b"":
            raise ConnectionError("a value's bulk reply did not end where its length said")
        if payload_checksum_of(got, ranges):
            outcome.landed = True
        else:
            outcome.miss = TierMiss.checksum()

    @staticmethod
    def _judge_aside(node: _Node, key: TierKey, length: int, expected: int, head: bytes = b"") -> TierMiss:
        """Read the rest of a value that is not the expected one (``head``: its first bytes, read already)
        aside, into a scratch buffer, or where it is far longer than the ``expected`` length, through a small
        one and dropped; why it is a miss."""
        left = length - len(head)
        if length > 2 * expected:
            scratch = memoryview(bytearray(1 << 20))
            while left:
                step = min(left, len(scratch))
                node.exactly_into(scratch[:step])
                left -= step
            node.line()
            return TierMiss(MissReason.LENGTH, f"a value of {length} bytes where {expected} were expected")
        rest = bytearray(left)
        node.exactly_into(memoryview(rest))
        node.line()
        try:
            decode(key, head + rest)
        except TierMiss as miss:
            return miss
        return TierMiss.other("it differs from the expected value of its key")

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        for node in self._nodes.values():
            node.close()
        self._nodes.clear()
