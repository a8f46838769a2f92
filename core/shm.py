"""Private POSIX shared-memory segments.

Segments are files under /dev/shm created with mode 0600, so only the creating
user can map them. Unlike :mod:`multiprocessing.shared_memory` nothing here
registers with a resource tracker, so a process that merely attaches never
unlinks a segment it does not own when it exits; the creator unlinks explicitly.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
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


POPULATE_PIECE_BYTES = 1 << 30
"""How much of a segment one thread allocates at a time (:func:`allocate_every_page`)."""


class SegmentTooLarge(OSError):
    """/dev/shm cannot hold a segment of the size asked for."""


def allocate_every_page(fd: int, size: int, *, name: str, threads: int | None = None) -> float:
    """Allocate every page of the segment file ``fd`` now (``posix_fallocate``, zero-filled, several threads);
    returns the seconds it took.

    Why: a tmpfs file's pages are otherwise allocated and zeroed by whoever first touches them. For the L1
    pool that is an engine process registering the pool for DMA (``cudaHostRegister`` faults in every page):
    tens of seconds at its start for a pool of tens of GiB, instead of a few at the server's. And a pool
    larger than /dev/shm's free room fails here, with ENOSPC named, instead of with SIGBUS at some later
    store."""
    started = time.perf_counter()
    fs = os.fstatvfs(fd)
    free = fs.f_bavail * fs.f_frsize
    if size > free:  # refused before a page is taken: filling /dev/shm would starve every other user of it
        raise SegmentTooLarge(errno.ENOSPC, f"shared-memory segment {name}: {SHM_DIR} has {free} bytes free, "
                              f"fewer than the {size} asked for (see `df -h {SHM_DIR}`); ask for less")
    threads = max(1, min(threads or os.cpu_count() or 1, 16, -(-size // POPULATE_PIECE_BYTES)))
    pieces = [(offset, min(POPULATE_PIECE_BYTES, size - offset)) for offset in range(0, size, POPULATE_PIECE_BYTES)]
    failures: list[OSError] = []
    lock = threading.Lock()

    def allocate() -> None:
        while True:
            with lock:
                if failures or not pieces:
                    return
                offset, length = pieces.pop(0)
            try:
                os.posix_fallocate(fd, offset, length)  # releases the GIL: the threads zero pages at once
            except OSError as exc:
                with lock:
                    failures.append(exc)
                return

    workers = [threading.Thread(target=allocate, name=f"kvstrata-populate-{i}", daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        exc = failures[0]
        if exc.errno == errno.ENOSPC:
            raise SegmentTooLarge(errno.ENOSPC, f"shared-memory segment {name}: {SHM_DIR} has no room for "
                                  f"{size} bytes (see `df -h {SHM_DIR}`); ask for less") from None
        raise exc
    return time.perf_counter() - started


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14's madvise: fault in every page of a mapping, writable, now."""


def map_every_page(mapping: mmap.mmap) -> None:
    """Map every page of this process's ``mapping`` now, so the server's own first writes into its pool (a STORE,
    a fetch from the shared tier) take no page fault per 4 KiB. A kernel without MADV_POPULATE_WRITE leaves
    them to fault as before."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError as exc:
        log.info("the pool's pages will be mapped as they are first written (madvise: %s)", exc)


def _path(name: str) -> str:
    if not isinstance(name, str) or "/" in name or not name or name.startswith(".") or len(name) > 200:
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return os.path.join(SHM_DIR, name)


class Segment:
    """One mapped segment; ``buf`` is a memoryview over the whole mapping."""

    def __init__(self, name: str, size: int, *, create: bool, readonly: bool = False,
                 populate: bool = False) -> None:
        """``populate`` (with ``create``): allocate every page now (:func:`allocate_every_page`)."""
        self.name = name
        self.owner = create
        self.populate_seconds: float | None = None
        """How long populating took, if it was asked for."""
        path = _path(name)
        if create:
            if size <= 0:
                raise ValueError(f"segment size must be positive, got {size}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                if populate:
                    self.populate_seconds = allocate_every_page(fd, size, name=name)
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
            if size <= 0:
                os.close(fd)
                raise ValueError(f"segment {name} is empty")
            if st.st_size < size:
                os.close(fd)
                raise ValueError(f"segment {name} holds {st.st_size} bytes, fewer than the {size} expected")
        st = os.fstat(fd)
        self.file_id = (st.st_dev, st.st_ino)
        """Which file this is, whatever name it was opened by (a second name for the same memory is no
        disguise: the server compares this, not names, to refuse writing into its own L1 pool)."""
        try:
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        if populate:
            map_every_page(self._mmap)
        self.size = size
        self.readonly = readonly
        self.buf = memoryview(self._mmap)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap)) if not readonly else 0
        """Where the mapping starts in this process (0 for a read-only one)."""
        self.before_close: list[Callable[[], None]] = []
        """Run first by :meth:`close`: whatever was registered on the mapping (such as a CUDA host
        registration of it) must be let go while the mapping still exists."""

    @classmethod
    def create(cls, prefix: str, size: int, *, populate: bool = False) -> "Segment":
        return cls(new_segment_name(prefix), size, create=True, populate=populate)

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


# --- engine caches: proof of ownership -----------------------------------------------------------------
#
# The server writes into an engine cache that a REGISTER_KV_CACHE names, so it must know the registering
# process owns that memory: a name is no proof (every segment is listed under /dev/shm). A cache segment made
# by :func:`create_cache_segment` ends in a random token, which only the process that made it (and whoever
# can read the segment: the same user) knows; the client sends it with the registration and the server
# compares it with the segment's last bytes (:func:`proof_matches`).

PROOF_BYTES = 32
_proofs: dict[str, bytes] = {}
"""Segment name -> the token this process wrote at its end."""
_cache_spans: dict[str, tuple[int, int]] = {}
"""Segment name -> (address of its mapping in this process, cache bytes), for :func:`cache_segment_holding`."""


def create_cache_segment(prefix: str, size: int) -> Segment:
    """A segment of ``size`` bytes for an engine cache the server may write into, followed by the proof of
    ownership (so its mapping is ``PROOF_BYTES`` longer; the cache is its first ``size`` bytes)."""
    seg = Segment.create(prefix, size + PROOF_BYTES)
    token = secrets.token_bytes(PROOF_BYTES)
    seg.buf[size:size + PROOF_BYTES] = token
    _proofs[seg.name] = token
    _cache_spans[seg.name] = (seg.address, size)
    seg.before_close.append(lambda name=seg.name: (_proofs.pop(name, None), _cache_spans.pop(name, None)))
    return seg


def cache_segment_holding(address: int, nbytes: int) -> tuple[str, int, int] | None:
    """(name, address of the cache in this process, cache bytes) of the cache segment this process made whose
    cache holds ``[address, address + nbytes)``; None if none does. An adapter whose engine hands it only
    tensors asks this to tell a cache the server can map (one in such a segment: server placement) from private
    memory (engine placement only)."""
    for name, (start, size) in _cache_spans.items():
        if start <= address and address + nbytes <= start + size:
            return name, start, size
    return None


def proof_of(name: str) -> str | None:
    """The proof for a cache segment this process made (hex), None for any other."""
    token = _proofs.get(name)
    return token.hex() if token is not None else None


def proof_matches(seg: Segment, size: int, proof: object) -> bool:
    """Whether ``seg`` (mapped whole) holds ``proof`` (hex) right after its first ``size`` bytes."""
    if not isinstance(proof, str) or len(proof) != 2 * PROOF_BYTES or seg.size < size + PROOF_BYTES:
        return False
    try:
        expected = bytes.fromhex(proof)
    except ValueError:
        return False
    return hmac.compare_digest(bytes(seg.buf[size:size + PROOF_BYTES]), expected)


# --- control segments: what the server may write into -------------------------------------------------


class SegmentKind(enum.IntEnum):
    """What a control segment is for; stamped in its header by the process that creates it."""

    ARRIVAL_BOARD = 1
    # 2, 3 and 4 were the request ring, reply ring and mailbox (removed: see docs/decisions.md)

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")

    @property
    def a_label(self) -> str:
        return ("an " if self.label[0] in "aeiou" else "a ") + self.label


CONTROL_MAGIC = int.from_bytes(b"KVSTRATA", "little")
CONTROL_VERSION = 1
CONTROL_HEADER_BYTES = 64
"""Every control segment (an arrival board) starts with this header; its slots follow.

    word 0   magic  b"KVSTRATA" (written last: the segment is attachable once its geometry is there)
    word 1   version (low 32 bits) | kind (high 32 bits)
    word 2   slot count
    word 3   slot bytes
"""


class SegmentKindError(ValueError):
    """A segment named as a control segment is not one, or is one of another kind or geometry."""


def create_control_segment(kind: SegmentKind, slots: int, slot_bytes: int) -> Segment:
    """A new private segment of ``slots`` slots of ``slot_bytes`` after the header, the header written."""
    seg = Segment.create(kind.name.lower().replace("_", "-"), CONTROL_HEADER_BYTES + slots * slot_bytes)
    words = (ctypes.c_uint64 * 4).from_buffer(seg._mmap)
    words[1] = CONTROL_VERSION | (int(kind) << 32)
    words[2], words[3] = slots, slot_bytes
    words[0] = CONTROL_MAGIC
    del words
    return seg


def read_control_header(seg: Segment) -> tuple[SegmentKind, int, int] | None:
    """(kind, slots, slot bytes) from a segment's header, or None if it carries no kvstrata control header."""
    if seg.size < CONTROL_HEADER_BYTES:
        return None
    magic, version_kind, slots, slot_bytes = (int.from_bytes(seg.buf[i:i + 8], "little") for i in range(0, 32, 8))
    if magic != CONTROL_MAGIC or version_kind & 0xFFFFFFFF != CONTROL_VERSION:
        return None
    try:
        kind = SegmentKind(version_kind >> 32)
    except ValueError:
        return None
    return kind, slots, slot_bytes


def attach_control_segment(name: str, kind: SegmentKind, *, slots: int | None = None,
                           slot_bytes: int | None = None) -> Segment:
    """Map a control segment a request names, only if its header says it is a ``kind`` of that geometry.

    The name comes off the wire, and this user's other segments (the L1 pool, an
    engine's cache) are just as mappable: so nothing is written before the
    header's magic, version, kind and geometry (slot count and size, matching the
    segment's size exactly) are all checked. Raises SegmentKindError naming what
    the segment is instead.
    """
    try:
        seg = Segment.attach(name)
    except FileNotFoundError:
        raise SegmentKindError(f"no shared-memory segment {name}: its creator is not on this host, or has "
                               "closed it") from None
    try:
        header = read_control_header(seg)
        if header is None:
            raise SegmentKindError(f"segment {name} is not a kvstrata {kind.label}: it carries no kvstrata control "
                                   "header (an engine cache, an L1 pool or some other segment)")
        found, found_slots, found_bytes = header
        if found is not kind:
            raise SegmentKindError(f"segment {name} is {found.a_label}, not {kind.a_label}")
        if seg.size != CONTROL_HEADER_BYTES + found_slots * found_bytes or found_slots < 1 or found_bytes < 8:
            raise SegmentKindError(f"{kind.label} {name}: its header's {found_slots} slots of {found_bytes} bytes "
                                   f"do not match its {seg.size} bytes")
        if (slots is not None and found_slots != slots) or (slot_bytes is not None and found_bytes != slot_bytes):
            raise SegmentKindError(f"{kind.label} {name} has {found_slots} slots of {found_bytes} bytes, the "
                                   f"request said {slots} of {slot_bytes}")
    except BaseException:
        seg.close()
        raise
    return seg
