"""The runtime's record: one JSON line per thing that happened to a request, for operators and tests.

Off unless ``record_path`` is set. Events: ``load_started``, ``released``,
``wait_for_layer_load``, ``settled``, ``load_failed``, ``stored``,
``store_failed``, ``registered``. Each line carries ``event``, ``t``
(monotonic seconds), ``pid`` and the event's fields; several processes (an
engine's scheduler and its workers) may append to one file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Iterator


class EventRecord:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1) if path else None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"event": event, "t": time.monotonic(), "pid": os.getpid(), **fields})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_record(path: str) -> Iterator[dict[str, Any]]:
    """The events of a record file, in order (a line cut off by a crash is skipped)."""
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
