"""Build and load the CUDA extension (``native/csrc``) with torch's C++ extension tooling.

Built just in time on first use, into a persistent cache directory
(``$KVSTRATA_CUDA_BUILD_DIR`` or ``~/.cache/kvstrata/cuda-ext``) keyed by the
sources' hash and the torch/CUDA versions, so a process after the first one
loads the built module in well under a second, and two processes building at
once share torch's build lock instead of racing. The sources need no torch
headers (only the CUDA runtime and pybind11), which keeps a cold build short.

Why JIT and not a wheel-time build: the same wheel must install on CPU-only CI
machines; the kernels are only needed where a CUDA device is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "kernels.cu", "load_issuer.cpp", "staged_slices.cpp")
HEADERS = ("kvstrata_cuda.h", "load_issuer.h", "staged_slices.h")

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


class CudaExtensionError(RuntimeError):
    """The CUDA extension cannot be built or loaded here; the message says why and what to check."""


def _sources_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        path = CSRC / name
        if not path.exists():
            raise CudaExtensionError(f"CUDA extension source {path} is missing (was kvstrata installed without "
                                     "its csrc package data?)")
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def build_directory(digest: str | None = None) -> Path:
    """Where the extension for these sources, this torch and this CUDA is built and cached."""
    import torch

    root = os.environ.get("KVSTRATA_CUDA_BUILD_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvstrata", "cuda-ext")
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-{digest or _sources_digest()}"
    return Path(root) / tag.replace("+", "_")


def load(verbose: bool | None = None) -> ModuleType:
    """The loaded extension module, building it on first use. Raises CudaExtensionError.

    A failure is remembered for the life of the process, so callers that fall
    back after one failure do not pay a second build attempt per request.
    """
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise CudaExtensionError(_error)
        try:
            _module = _build(verbose)
        except CudaExtensionError as exc:
            _error = str(exc)
            raise
        return _module


def _build(verbose: bool | None) -> ModuleType:
    import torch

    if torch.version.cuda is None:
        raise CudaExtensionError(f"torch {torch.__version__} is a CPU-only build; the kvstrata CUDA kernels need a "
                                 "CUDA build of torch")
    if not torch.cuda.is_available():
        raise CudaExtensionError("no CUDA device is visible (torch.cuda.is_available() is False)")
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise CudaExtensionError(f"torch.utils.cpp_extension cannot be imported: {exc}") from None
    digest = _sources_digest()
    build_dir = build_directory(digest)
    build_dir.mkdir(parents=True, exist_ok=True)
    if verbose is None:
        verbose = os.environ.get("KVSTRATA_CUDA_BUILD_VERBOSE", "") not in ("", "0")
    flags = ["-O3", "-std=c++17", "-lineinfo"]
    started = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=f"kvstrata_cuda_{digest}",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=flags,
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            verbose=verbose,
            with_cuda=True,
        )
    except Exception as exc:  # compiler missing, nvcc error, ABI mismatch: all reported the same way
        raise CudaExtensionError(
            f"building the kvstrata CUDA extension in {build_dir} failed: {type(exc).__name__}: {exc}. "
            "Check that nvcc matching torch's CUDA ({cuda}) and ninja are on PATH; set "
            "KVSTRATA_CUDA_BUILD_VERBOSE=1 for the compiler output.".format(cuda=torch.version.cuda)
        ) from exc
    log.info("kvstrata CUDA extension ready in %.1f s (%s)", time.perf_counter() - started, build_dir)
    return module


def available() -> bool:
    """True if the extension loads (building it if needed); never raises."""
    try:
        load()
        return True
    except CudaExtensionError as exc:
        log.warning("kvstrata CUDA extension unavailable: %s", exc)
        return False
