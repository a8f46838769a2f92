"""Host memory registered for the GPU's DMA (``cudaHostRegister``), once per process, and the L1 pool's registration.

Registering pins every page and maps it for the device: about a third of a second per GiB of a populated pool
writable, twice that read-only (``benchmarks/pool_registration.py``). An engine process registering a server's
32 GiB pool before it serves anything would start 10-20 s late, so :class:`PoolPinning` can register the pool on a
thread of its own while the engine already loads: until it is registered, the copy engine reads it as pageable
memory (correct, slower), which is why only copies that read the pool through the copy engine (host addresses) may
start before it is done. The registration lets go of the GIL.

Every registration goes through one reference-counted registry, so two engines of a process on the same pool share
it, and the last one to let go unregisters it before the mapping goes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

_pinned_lock = threading.Lock()
_pinned: dict[tuple[int, int], dict[str, Any]] = {}
"""(host address, size) of each range registered in this process -> {"refs": users, "dev": {device: ptr}}."""


def pin_host_range(addr: int, size: int, device_index: int, ext: Any, *, what: str = "a host range",
                   read_only: bool = False) -> int:
    """Register a host mapping for device access once per process (reference counted); its device pointer.
    ``read_only``: the mapping is read-only in this process (an engine's view of the server's pool)."""
    key = (addr, size)
    with _pinned_lock:
        entry = _pinned.get(key)
        if entry is None:
            for base, n in _pinned:  # a range inside another's registration would unregister it when let go
                if base < addr + size and addr < base + n:
                    raise ValueError(f"{what} ({size} bytes at {addr:#x}) overlaps a range registered apart "
                                     f"({n} bytes at {base:#x})")
            t0 = time.perf_counter()
            dev_ptr = ext.host_register(addr, size, device_index, read_only)
            _pinned[key] = entry = {"refs": 0, "dev": {device_index: dev_ptr}, "register_s": time.perf_counter() - t0}
            log.debug("registered %s for CUDA (cudaHostRegister%s, %d MiB) in %.3f s", what,
                      ", read-only" if read_only else "", size >> 20, entry["register_s"])
        elif device_index not in entry["dev"]:
            entry["dev"][device_index] = ext.host_device_pointer(addr, device_index)
        entry["refs"] += 1
        return entry["dev"][device_index]


def unpin_host_range(addr: int, size: int, ext: Any) -> None:
    """Drop one use of a registered range; the last one unregisters it.

    A registration must not outlive the mapping: a later mapping at the same
    address would otherwise be read through the old pages' device mapping.
    """
    key = (addr, size)
    with _pinned_lock:
        entry = _pinned.get(key)
        if entry is None:
            return
        entry["refs"] -= 1
        if entry["refs"] <= 0:
            del _pinned[key]
            ext.host_unregister(addr)


def pinned_device_pointer(ptr: int, device_index: int, ext: Any) -> int:
    """Device pointer of a host address inside a registered range, or of other pinned memory (cudaHostAlloc)."""
    with _pinned_lock:
        for (base, size), entry in _pinned.items():
            if base <= ptr < base + size and device_index in entry["dev"]:
                return entry["dev"][device_index] + (ptr - base)
    try:
        return ext.host_device_pointer(ptr, device_index)
    except RuntimeError as exc:
        raise ValueError(f"host memory at {ptr:#x} is not pinned: register the L1 pool with the engine first "
                         f"({exc})") from None


class PoolPinning:
    """The L1 pool's registration in this process: before the constructor returns, or (``background``) on the
    ``kvstrata-pin-pool`` thread, the constructor returning at once.

    One registration call for the whole pool, never pieces: a copy whose source spans two registrations (an object,
    or adjacent objects merged into one copy-engine job, across the boundary) fails with ``cudaErrorInvalidValue``
    (``benchmarks/pool_registration.py`` on the H100). In the background the pool's device addresses are its host
    addresses (unified addressing), valid once it is registered; a caller that reads the pool through device
    addresses (a kernel reading it in place) must not start before :meth:`wait` says it is done. The copy engine
    may read it from the start.
    """

    def __init__(self, pool: torch.Tensor, device_index: int, ext: Any, *, read_only: bool = False,
                 background: bool = False) -> None:
        if pool.device.type != "cpu" or pool.dtype != torch.uint8 or not pool.is_contiguous():
            raise ValueError("the L1 pool must be a contiguous uint8 CPU tensor")
        self.base, self.size = pool.data_ptr(), pool.numel()
        self.device_index, self.read_only, self.background = device_index, read_only, background
        self._ext = ext
        self._registered = False
        self._lock = threading.Lock()
        """Held while registering: :meth:`close` waits for a registration under way, never unregisters mid-call."""
        self._stop = False
        self._done = threading.Event()
        self.error: BaseException | None = None
        """Why the registration failed (the copy engine then keeps reading the pool as pageable memory)."""
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self.dev_base = self.base
        """The pool's device address (its host address in the background; what the driver says otherwise)."""
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._register, name="kvstrata-pin-pool", daemon=True)
            self._thread.start()
        else:
            self._register()
            if self.error is not None:
                raise self.error

    @property
    def registered(self) -> bool:
        return self._registered

    def done(self) -> bool:
        """Whether the registration ended (registered, or failed: see :attr:`error`)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`done`; False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def _register(self) -> None:
        what = "read-only " if self.read_only else ""
        try:
            with self._lock:
                if self._stop:
                    return
                dev = pin_host_range(self.base, self.size, self.device_index, self._ext, read_only=self.read_only,
                                     what=f"the {what}L1 pool")
                self._registered = True
            if self.background and dev != self.base:
                raise RuntimeError(f"the device address of the registered pool ({dev:#x}) is not its host address "
                                   f"({self.base:#x}): registering in the background needs unified addressing")
            self.dev_base = dev
            self.finished_at = time.perf_counter()
            log.info("L1 pool (%d MiB, %s) registered for DMA on cuda:%d in %.3f s%s", self.size >> 20,
                     what + "mapped" if what else "writable", self.device_index, self.finished_at - self.started_at,
                     " in the background" if self.background else "")
        except BaseException as exc:  # noqa: BLE001 - reported; in the background the copy engine reads pageable
            self.error = exc
            if self.background:
                log.error("registering the L1 pool (%d MiB) for DMA failed: %s; loads read it as pageable memory "
                          "(slower)", self.size >> 20, exc)
        finally:
            self._done.set()

    def close(self) -> None:
        """Stop a registration not begun, wait for one under way, and unregister (the caller made sure no copy still
        reads the pool)."""
        with self._lock:
            self._stop = True
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            registered, self._registered = self._registered, False
        if registered:
            unpin_host_range(self.base, self.size, self._ext)
