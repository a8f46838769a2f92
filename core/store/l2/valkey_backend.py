"""The shared tier on a Valkey cluster (``valkey://``, ``valkeys://`` with TLS), through the ``valkey`` client.

Values are spread over the cluster's primaries by their names' hash slots; reads and writes of many names go
out as one pipeline per node (the client groups them), so a prefix's values cost a round trip per node, not
per value. The client follows MOVED and ASK redirections (a resharding) itself; everything else that keeps a
node from answering within ``timeout`` becomes :class:`TierUnavailable`.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Sequence

from kvstrata.core.store.l2.backend import TierUnavailable
from kvstrata.core.store.l2.valkey_reader import DirectReader


def parse_nodes(address: str) -> tuple[bool, list[tuple[str, int]]]:
    """(TLS, [(host, port), ...]) of ``valkey[s]://HOST:PORT[,HOST:PORT...]``; ValueError naming what is wrong."""
    scheme, _, rest = address.partition("://")
    if scheme not in ("valkey", "valkeys") or not rest:
        raise ValueError(f"--l2 {address!r}: expected valkey://HOST:PORT[,HOST:PORT...] (valkeys:// for TLS)")
    nodes = []
    for part in rest.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--l2 {address!r}: {part!r} is not HOST:PORT")
        nodes.append((host.strip("[]"), int(port)))
    return scheme == "valkeys", nodes


def read_password(path: str) -> str:
    """The password in ``path``, a file only its owner (this user) may read or write."""
    st = os.stat(path)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"the Valkey password file {path} must belong to this user and be mode 0600 "
                              f"(it is uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))})")
    with open(path) as f:
        password = f.read().strip()
    if not password:
        raise ValueError(f"the Valkey password file {path} is empty")
    return password


class ValkeyBackend:
    scheme = "valkey"

    def __init__(self, nodes: Sequence[tuple[str, int]], *, tls: bool = False, username: str | None = None,
                 password: str | None = None, timeout: float = 2.0) -> None:
        from valkey.backoff import NoBackoff
        from valkey.cluster import ClusterNode, ValkeyCluster
        from valkey.retry import Retry

        self.nodes = list(nodes)
        self.timeout = timeout
        self.tls = tls
        self._username, self._password = username, password
        try:
            self._cluster = ValkeyCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], username=username, password=password,
                ssl=tls, socket_timeout=timeout, socket_connect_timeout=timeout, require_full_coverage=False,
                cluster_error_retry_attempts=1, retry=Retry(NoBackoff(), 0))
        except Exception as exc:  # noqa: BLE001 - the client raises many kinds; all mean "no cluster here"
            raise TierUnavailable(f"no Valkey cluster answers at {self._where()}: {exc}") from None

    @classmethod
    def from_address(cls, address: str, *, password_file: str | None = None, timeout: float = 2.0) -> "ValkeyBackend":
        tls, nodes = parse_nodes(address)
        password = read_password(password_file) if password_file else None
        return cls(nodes, tls=tls, password=password, timeout=timeout)

    def _where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.nodes)

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        if not names:
            return []
        try:
            return list(self._cluster.mget_nonatomic(list(names)))
        except Exception as exc:  # noqa: BLE001
            raise TierUnavailable(f"reading {len(names)} values from {self._where()}: {exc}") from None

    def direct_reader(self) -> DirectReader | None:
        """A reader of values straight into the pool, for one thread (:mod:`.valkey_reader`); None with TLS,
        where the client's own TLS setup reads every value."""
        if self.tls:
            return None

        def node_of(name: str) -> tuple[str, int]:
            node = self._cluster.get_node_from_key(name)
            return node.host, node.port

        return DirectReader(node_of, timeout=self.timeout, username=self._username, password=self._password)

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        try:
            pipe = self._cluster.pipeline()
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]
        except Exception as exc:  # noqa: BLE001
            raise TierUnavailable(f"looking up {len(names)} values on {self._where()}: {exc}") from None

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        try:
            pipe = self._cluster.pipeline()
            for name, value in items:
                pipe.set(name, value)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001
            raise TierUnavailable(f"writing {len(items)} values to {self._where()}: {exc}") from None

    def describe(self) -> dict[str, Any]:
        nodes = []
        for node in self._cluster.get_primaries():
            entry: dict[str, Any] = {"node": f"{node.host}:{node.port}", "reachable": False}
            try:
                memory = self._cluster.info("memory", target_nodes=node)
                entry.update(reachable=True, used_bytes=int(memory.get("used_memory", 0)),
                             max_bytes=int(memory.get("maxmemory", 0)),
                             values=int(self._cluster.dbsize(target_nodes=node)))
            except Exception:  # noqa: BLE001 - whatever keeps it from answering, it is not reachable
                pass
            nodes.append(entry)
        return {"backend": self.scheme, "nodes": nodes}

    def close(self) -> None:
        self._cluster.close()
