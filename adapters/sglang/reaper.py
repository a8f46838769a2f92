"""Removes an SGLang scheduler process's kvstrata shared-memory segments once it has died, however it died.

The offline ``sglang.Engine.shutdown`` stops its schedulers with SIGKILL (``kill_process_tree``, no
``ShutdownReq`` first), so nothing in a scheduler runs at its end: not SGLang's ``release_host_resources``, not
an ``atexit`` hook, not the linker's or the HiCache backend's ``close``. The kvstrata server forgets a silent
connection's instances, locks and boards when its lease runs out, but the segment files the scheduler created
in /dev/shm (the registration area, its connections' arrival boards) stay until something
unlinks them.

:func:`watch` starts, once per process, a small watcher outside the engine's process tree: it holds a pidfd
of the scheduler and, when that process has exited, unlinks every ``kvstrata-<kind>-<pid>-<token>`` segment
it created (what :func:`kvstrata.core.shm.sweep_stale_segments` removes of any dead process at a server's
start, for this one process only). It is a fresh ``python -I -S`` that imports the standard library only,
detaches (its own session, adopted once its launcher exits: ``kill_process_tree`` walks children and does
not reach it) and exits once done. After a graceful shutdown, where the adapter's ``close`` removed the
segments, it finds nothing to remove.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

NAME = "kvstrata-segment-watcher"
"""The watcher's first argument: how it is found among processes (:func:`watchers_of`)."""
WATCHER = r"""
import os, re, select, sys
pid, shm = int(sys.argv[2]), sys.argv[3]
fd = os.pidfd_open(pid)  # taken while the launcher waits for us: the pid is still the scheduler's
if os.fork():
    os._exit(0)  # the launcher reaps this at once; the child below is adopted, outside the engine's tree
os.setsid()
os.chdir("/")
null = os.open(os.devnull, os.O_RDWR)
for std in (0, 1, 2):  # the launcher's caller reads its stderr to the end: let go of it
    os.dup2(null, std)
select.select([fd], [], [])  # readable once the process has exited
ours = re.compile(r"^kvstrata-.+-%d-[0-9a-f]{8}$" % pid)
for name in os.listdir(shm):
    if ours.match(name):
        try:
            if os.stat(os.path.join(shm, name)).st_uid == os.getuid():
                os.unlink(os.path.join(shm, name))
        except OSError:
            pass
"""

_lock = threading.Lock()
_watched: set[int] = set()


def watch(shm_dir: str = "/dev/shm") -> bool:
    """Have this process's kvstrata segments removed once it has exited; True if a watcher runs for it
    (started now or before). Never raises: without a watcher the segments stay until a server's sweep."""
    pid = os.getpid()
    with _lock:
        if pid in _watched:
            return True
        if not hasattr(os, "pidfd_open"):
            log.warning("kvstrata: no pidfd_open here; a killed engine's shared-memory segments stay in %s "
                        "until a kvstrata server starts and sweeps them", shm_dir)
            return False
        try:
            launcher = subprocess.run([sys.executable, "-I", "-S", "-c", WATCHER, NAME, str(pid), shm_dir],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, close_fds=True, timeout=60, check=False)
        except Exception as exc:
            log.warning("kvstrata: the segment watcher did not start (%s); a killed engine's shared-memory "
                        "segments stay until a kvstrata server starts and sweeps them", exc)
            return False
        if launcher.returncode != 0:
            log.warning("kvstrata: the segment watcher did not start (exit %d: %s)", launcher.returncode,
                        launcher.stderr.decode(errors="replace").strip()[-500:])
            return False
        _watched.add(pid)
        return True


def watchers_of(pids: list[int] | set[int]) -> list[int]:
    """The live watchers of any of ``pids`` (from /proc). A watcher exits only once it has removed its
    process's segments, so none left means that work is done."""
    wanted = {str(p).encode() for p in pids}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 6 and argv[5] == NAME.encode() and argv[6] in wanted:
            found.append(int(entry))
    return found
