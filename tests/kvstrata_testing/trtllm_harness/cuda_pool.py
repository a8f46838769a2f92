"""A KV pool allocated by ``cudaMalloc`` outside torch's caching allocator, as TensorRT-LLM allocates its own.

TensorRT-LLM's KV cache manager allocates the primary pool itself; torch only ever sees it wrapped. So the
GPU test allocates its pool the same way: ``cudaMalloc`` through ctypes on the CUDA runtime that torch has
already loaded (``libcudart``), or, where no runtime library can be opened by name, ``cuMemAlloc`` on the
driver (``libcuda.so.1``, always present with a GPU) in the primary context torch made current. The memory
is wrapped as a tensor through ``__cuda_array_interface__`` (no copy; torch does not own or free it).
Needs nothing beyond torch.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import math
import os

import torch

log = logging.getLogger("kvstrata_testing.trtllm_harness")

_TYPESTR = {torch.float32: "<f4", torch.float16: "<f2", torch.uint8: "|u1"}
_RUNTIME_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def _runtime_library() -> ctypes.CDLL | None:
    candidates = list(_RUNTIME_NAMES)
    site = os.path.dirname(os.path.dirname(torch.__file__))
    candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so*")))
    candidates += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*")))
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class CudaMallocPool:
    """``shape`` of ``dtype`` in memory from ``cudaMalloc`` (or ``cuMemAlloc``); ``tensor`` views it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: int = 0) -> None:
        torch.cuda.set_device(device)
        torch.empty(1, device=f"cuda:{device}")  # the primary context exists and is current on this thread
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        self._runtime = _runtime_library()
        err, self.ptr = -1, 0
        if self._runtime is not None:
            self.api = "cudaMalloc"
            ptr = ctypes.c_void_p()
            self._runtime.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            self._runtime.cudaMalloc.restype = ctypes.c_int
            err = self._runtime.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes))
            self.ptr = int(ptr.value or 0)
            if err != 0:
                log.warning("cudaMalloc through %s failed with error %d; trying the driver's cuMemAlloc",
                            self._runtime._name, err)
        if err != 0 or not self.ptr:
            self.api = "cuMemAlloc_v2"
            self._driver = ctypes.CDLL("libcuda.so.1")
            dptr = ctypes.c_uint64()
            self._driver.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
            self._driver.cuMemAlloc_v2.restype = ctypes.c_int
            err = self._driver.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(self.nbytes))
            self.ptr = int(dptr.value)
        if err != 0 or not self.ptr:
            raise RuntimeError(f"{self.api} of {self.nbytes} bytes failed with error {err}")
        log.info("KV pool of %d bytes from %s at 0x%x (outside torch's caching allocator)", self.nbytes, self.api,
                 self.ptr)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": _TYPESTR[dtype],
                                         "data": (self.ptr, False), "version": 2, "strides": None}
        self.tensor = torch.as_tensor(self, device=f"cuda:{device}")
        if self.tensor.data_ptr() != self.ptr or tuple(self.tensor.shape) != self.shape:
            raise RuntimeError("torch did not wrap the cudaMalloc'ed pool in place")
        self.tensor.zero_()  # cudaMalloc does not clear memory; the model must never read NaN garbage

    def free(self) -> None:
        """After every user of the memory is done (synchronizes the device first)."""
        if not self.ptr:
            return
        torch.cuda.synchronize(self.device)
        self.tensor = None
        if self.api == "cudaMalloc":
            self._runtime.cudaFree.argtypes = [ctypes.c_void_p]
            err = self._runtime.cudaFree(ctypes.c_void_p(self.ptr))
        else:
            self._driver.cuMemFree_v2.argtypes = [ctypes.c_uint64]
            err = self._driver.cuMemFree_v2(ctypes.c_uint64(self.ptr))
        if err != 0:
            log.warning("%s free of 0x%x returned error %d", self.api, self.ptr, err)
        self.ptr = 0
