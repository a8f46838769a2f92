import os
import sys
import tempfile
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers and kvstrata_testing, for every tier

from kvstrata.core.wire.client import CacheClient
from kvstrata.server_process import ServerProcess
from kvstrata_testing import server_count
from kvstrata_testing.server_count import COUNT_FILE_VARIABLE

_count_dir = tempfile.mkdtemp(prefix="kvstrata-server-count-")
os.environ.setdefault(COUNT_FILE_VARIABLE, os.path.join(_count_dir, "starts"))
"""Every ServerProcess started by this run or its subprocesses (the conformance self-test) appends a line."""


def pytest_configure(config) -> None:
    """Every transfer queue and server this process builds tells the slice observers a test adds (a hold, a
    recorder), even one built before the test added its observer (a module's engine fixture)."""
    from kvstrata.conformance_tests.slice_hold import inject_slice_observers

    inject_slice_observers()
    server_count.install()


def pytest_terminal_summary(terminalreporter) -> None:
    path = os.environ.get(COUNT_FILE_VARIABLE)
    lines = open(path).read().splitlines() if path and os.path.exists(path) else []
    mine = sum(1 for line in lines if line.split()[0] == str(os.getpid()))
    terminalreporter.write_line(f"kvstrata serve processes started: {len(lines)} "
                                f"({mine} by this pytest process, {len(lines) - mine} by its workers and subprocesses)")


@pytest.fixture(scope="module")
def server():
    """One `kvstrata serve` child process per test module; tests that kill or stop a server start their own.

    Tests sharing it use their own request ids and prompts, and release what they lock."""
    with ServerProcess(l1_bytes=256 << 20, chunk_size=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def inprocess_server():
    """A real CacheServer (real ZMQ socket, real shared-memory pool) in this process, for the protocol and
    handler tests, which need no process boundary: a module asks for it by overriding ``server`` with it."""
    from helpers import inprocess_cache_server

    with inprocess_cache_server(256 << 20) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """One connection per module: an instance id a test registered belongs to this connection (the server
    ties instances to the connection that registered them), so the module's tests may all use instance 0."""
    c = CacheClient(server.address, timeout=20.0)
    yield c
    c.close()


@pytest.fixture(scope="session")
def curve_keys(tmp_path_factory):
    """CURVE key files for tcp:// servers (which refuse to start without them): the server's pair, an
    authorized client's and a stranger's (see kvstrata_testing.curve_keys)."""
    from kvstrata_testing.curve_keys import CurveKeys

    return CurveKeys.make(str(tmp_path_factory.mktemp("curve") / "keys"))


@pytest.fixture
def rid():
    return f"req-{uuid.uuid4().hex[:8]}"
