import logging
import uuid

import pytest

from kvstrata.core.client import CacheClient
from kvstrata.core.testing.server_process import ServerProcess


@pytest.fixture
def server():
    """A fresh `kvstrata serve` child process per test: no locks carried between tests."""
    with ServerProcess(l1_bytes=256 << 20, chunk_size=64) as srv:
        yield srv


@pytest.fixture
def client(server):
    c = CacheClient(server.address, timeout=20.0)
    yield c
    c.close()


@pytest.fixture
def rid():
    return f"req-{uuid.uuid4().hex[:8]}"
