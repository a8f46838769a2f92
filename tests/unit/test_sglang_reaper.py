"""The SGLang adapter's segment watcher (``kvstrata.adapters.sglang.reaper``), without SGLang.

A real process starts the watcher, creates kvstrata segments with the core's own ``Segment.create`` and is
killed with SIGKILL, as the offline ``sglang.Engine.shutdown`` kills its schedulers; the watcher must then
remove exactly that process's segments, then exit, and must not be in the killed process's tree
(``kill_process_tree`` would kill it too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvstrata.adapters.sglang.reaper import watchers_of
from kvstrata.core.shm import Segment

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open") or not Path("/dev/shm").is_dir(),
                                reason="the watcher needs Linux's pidfd_open and /dev/shm")

BOUND = 60.0
"""Bounds on waits that only catch hangs."""

CHILD = r"""
import sys, time
from kvstrata.adapters.sglang import reaper
from kvstrata.core.shm import Segment

assert reaper.watch() and reaper.watch()  # the second call finds the watcher started
segments = [Segment.create("registration", 4096), Segment.create("request-ring", 4096)]
print(" ".join(s.name for s in segments), flush=True)
time.sleep(600)
"""


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc's children lists)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            continue
        out.update(kids)
        todo.extend(kids)
    return out


def test_a_killed_process_s_segments_are_removed_and_no_one_else_s():
    bystander = Segment.create("registration", 4096)  # this process's: alive, so never the watcher's
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        names = child.stdout.readline().split()
        assert len(names) == 2 and all((Path("/dev/shm") / n).exists() for n in names), names
        watchers = watchers_of([child.pid])
        assert len(watchers) == 1, f"one watcher for the process, found {watchers}"
        assert not set(watchers) & _children(child.pid), "the watcher is in the watched process's tree"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=BOUND)
        # the watcher exits once it has removed the segments: wait for that, then look at once
        deadline = time.monotonic() + BOUND
        while watchers_of([child.pid]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not watchers_of([child.pid]), "the watcher did not exit once its process had"
        assert not [n for n in names if (Path("/dev/shm") / n).exists()], "the killed process's segments stayed"
        assert (Path("/dev/shm") / bystander.name).exists(), "the watcher removed a live process's segment"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        bystander.destroy()
