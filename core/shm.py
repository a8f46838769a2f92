"""Private POSIX shared-memory segments.

Segments are files under /dev/shm created with mode 0600, so only the creating
user can map them. Unlike :mod:`multiprocessing.shared_memory` nothing here
registers with a resource tracker, so a process that merely attaches never
unlinks a segment it does not own when it exits; the creator unlinks explicitly.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import secrets
import stat
from typing import Callable

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def new_segment_name(prefix: str) -> str:
    return f"kvstrata-{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


_OURS = re.compile(r"^kvstrata-.+-(\d+)-[0-9a-f]{8}$")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def sweep_stale_segments() -> list[str]:
    """Unlink this user's kvstrata segments whose creating process no longer exists.

    A process killed with SIGKILL cannot unlink what it created, and an L1
    pool left in /dev/shm keeps its memory. Every name carries its creator's
    pid (:func:`new_segment_name`), so a server starting up removes what dead
    processes left, and logs each removal.
    """
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        m = _OURS.match(name)
        if m is None or _process_alive(int(m.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
        log.warning("removed shared-memory segment %s left by process %s, which no longer exists", name, m.group(1))
    return removed


def _path(name: str) -> str:
    if "/" in name or not name or name.startswith("."):
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return os.path.join(SHM_DIR, name)


class Segment:
    """One mapped segment; ``buf`` is a memoryview over the whole mapping."""

    def __init__(self, name: str, size: int, *, create: bool, readonly: bool = False) -> None:
        self.name = name
        self.owner = create
        path = _path(name)
        if create:
            if size <= 0:
                raise ValueError(f"segment size must be positive, got {size}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDONLY if readonly else os.O_RDWR)
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                os.close(fd)
                raise PermissionError(f"segment {name} belongs to uid {st.st_uid}, not to this user")
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.close(fd)
                raise PermissionError(f"segment {name} is readable by other users (mode {oct(st.st_mode)})")
            size = st.st_size if size <= 0 else size
            if st.st_size < size:
                os.close(fd)
                raise ValueError(f"segment {name} holds {st.st_size} bytes, fewer than the {size} expected")
        try:
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.size = size
        self.readonly = readonly
        self.buf = memoryview(self._mmap)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap)) if not readonly else 0
        """Where the mapping starts in this process (0 for a read-only one)."""
        self.before_close: list[Callable[[], None]] = []
        """Run first by :meth:`close`: whatever was registered on the mapping (such as a CUDA host
        registration of it) must be let go while the mapping still exists."""

    @classmethod
    def create(cls, prefix: str, size: int) -> "Segment":
        return cls(new_segment_name(prefix), size, create=True)

    @classmethod
    def attach(cls, name: str, size: int = 0, *, readonly: bool = False) -> "Segment":
        return cls(name, size, create=False, readonly=readonly)

    def close(self) -> None:
        """Unmap. Views handed out (numpy arrays, tensors) must be dropped first."""
        hooks, self.before_close = self.before_close, []
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # the mapping goes regardless
                log.warning("shared-memory segment %s: a close hook failed: %s", self.name, exc)
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes away with the process

    def unlink(self) -> None:
        try:
            os.unlink(_path(self.name))
        except FileNotFoundError:
            pass

    def destroy(self) -> None:
        self.close()
        if self.owner:
            self.unlink()
