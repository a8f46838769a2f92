"""Run a real ``kvstrata serve`` in a child process and wait until it answers (the demo, benchmarks, tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.transport import RequestTimeout, RemoteError


class ServerProcess:
    def __init__(self, *, l1_bytes: int = 256 << 20, chunk_size: int = 256, address: str | None = None,
                 log_level: str = "WARNING", extra_args: list[str] | None = None,
                 entry: Sequence[str] = ("kvstrata",), client_options: dict | None = None) -> None:
        """``entry``: what ``python -m`` runs, with its own leading arguments, before ``serve ARGS...`` (a
        wrapper that sets the server up first, such as the conformance suite's slice hold).
        ``client_options``: :class:`CacheClient` keywords for connecting to it (CURVE keys for a tcp:// server,
        whose ``--curve-*`` flags go in ``extra_args``)."""
        if address is None:
            self._tmp = tempfile.mkdtemp(prefix="kvstrata-test-")
            os.chmod(self._tmp, 0o700)
            address = f"ipc://{self._tmp}/server.sock"
        self.address = address
        self.client_options = dict(client_options or {})
        self.args = [sys.executable, "-m", *entry, "serve", "--address", address, "--l1-size", str(l1_bytes),
                     "--chunk-size", str(chunk_size), "--log-level", log_level, *(extra_args or [])]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "ServerProcess":
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        client = CacheClient(self.address, timeout=1.0, **self.client_options)
        started = False
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvstrata serve exited with {self.proc.returncode} during start-up")
                try:
                    client.ping(timeout=0.5)
                    started = True
                    return self
                except (RequestTimeout, RemoteError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"kvstrata serve did not answer PING on {self.address}") from None
        finally:
            client.close()
            if not started:
                self.kill()  # a server that never answered must not outlive the caller

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait: the clean shutdown path."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
