"""Count the ``kvstrata serve`` processes a test run and its pytest subprocesses start (a pytest plugin).

Keeping the suite fast means sharing server processes; this makes the count visible. Every
:meth:`ServerProcess.start` in a process that loaded this plugin (``-p kvstrata_testing.server_count``)
appends "<pytest pid> <server pid>" to the file ``KVSTRATA_TEST_SERVER_COUNT_FILE`` names;
``tests/conftest.py`` sets it and prints the total when the run ends.
"""

from __future__ import annotations

import functools
import os

from kvstrata.server_process import ServerProcess

COUNT_FILE_VARIABLE = "KVSTRATA_TEST_SERVER_COUNT_FILE"


def install() -> None:
    """Wrap :meth:`ServerProcess.start` once in this process so that each start is counted."""
    if getattr(ServerProcess.start, "_kvstrata_counted", False):
        return
    original = ServerProcess.start

    @functools.wraps(original)
    def start(self: ServerProcess, *args, **kwargs) -> ServerProcess:
        started = original(self, *args, **kwargs)
        count_file = os.environ.get(COUNT_FILE_VARIABLE)
        if count_file and self.proc is not None:
            with open(count_file, "a") as f:
                f.write(f"{os.getpid()} {self.proc.pid}\n")
        return started

    start._kvstrata_counted = True  # type: ignore[attr-defined]
    ServerProcess.start = start  # type: ignore[method-assign]


def pytest_configure(config) -> None:
    install()
