"""Export a CUDA tensor's memory to another process as plain data, and open it there.

The engine registers its KV cache with the server as ``Region(kind='cuda_ipc')``
whose ``handle`` is a dict of ints, bytes and strings (it travels in msgpack,
never pickle). It carries what ``torch.UntypedStorage._share_cuda_`` reports for
the tensor's storage (the CUDA IPC memory handle of the underlying allocation,
the storage's offset in it, torch's cross-process reference counter and the
producer's "ready" event), plus the tensor's byte offset inside its storage and
the device's UUID, so the server maps the right GPU even when its
``CUDA_VISIBLE_DEVICES`` numbers devices differently.

torch keeps the producer's allocation alive while a consumer holds it open
(through that reference counter), and opening the same allocation twice in one
process is served from torch's own handle cache, so several regions that share
one caching-allocator block (SGLang's per-layer buffers often do) are fine.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from kvstrata.core.transfer.layouts import LayoutError, Region

HANDLE_VERSION = 1


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index_for(handle: dict[str, Any]) -> int:
    """This process's index of the GPU a handle was exported from (matched by UUID)."""
    want = handle.get("device_uuid")
    if want:
        for i in range(torch.cuda.device_count()):
            if device_uuid(i) == want:
                return i
        raise LayoutError(f"CUDA IPC region is on GPU {want}, which this process cannot see "
                          f"({torch.cuda.device_count()} visible devices; check CUDA_VISIBLE_DEVICES)")
    return int(handle["device"])


def export_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """The wire handle for a contiguous CUDA tensor's bytes."""
    if tensor.device.type != "cuda":
        raise LayoutError(f"CUDA IPC export needs a CUDA tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise LayoutError("CUDA IPC export needs a contiguous tensor (export the buffer the views are made of)")
    storage = tensor.untyped_storage()
    (device, handle, storage_size, storage_offset, ref_handle, ref_offset, event_handle,
     event_sync_required) = storage._share_cuda_()
    return {
        "v": HANDLE_VERSION,
        "device": int(device),
        "device_uuid": device_uuid(int(device)),
        "handle": bytes(handle),
        "storage_size": int(storage_size),
        "storage_offset": int(storage_offset),
        "ref_counter_handle": bytes(ref_handle),
        "ref_counter_offset": int(ref_offset),
        "event_handle": bytes(event_handle) if event_handle is not None else None,
        "event_sync_required": bool(event_sync_required),
        "tensor_offset": int(tensor.storage_offset() * tensor.element_size()),
    }


def export_region(tensor: torch.Tensor) -> Region:
    """A ``cuda_ipc`` Region covering all of a contiguous CUDA tensor's bytes."""
    return Region("cuda_ipc", tensor.numel() * tensor.element_size(), handle=export_tensor(tensor))


def open_region(region: Region) -> torch.Tensor:
    """Open an exported region in this (another) process as a flat uint8 CUDA tensor of ``region.size`` bytes."""
    if region.kind != "cuda_ipc":
        raise LayoutError(f"region kind {region.kind!r} is not cuda_ipc")
    h = region.handle
    try:
        if int(h.get("v", 0)) != HANDLE_VERSION:
            raise LayoutError(f"CUDA IPC handle version {h.get('v')!r}, this kvstrata reads {HANDLE_VERSION}")
        index = device_index_for(h)
        tensor_offset = int(h["tensor_offset"])
        if tensor_offset < 0 or tensor_offset + region.size > int(h["storage_size"]):
            raise LayoutError(f"CUDA IPC region of {region.size} bytes at offset {tensor_offset} exceeds its "
                              f"storage of {h['storage_size']} bytes")
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, bytes(h["handle"]), int(h["storage_size"]), int(h["storage_offset"]),
            bytes(h["ref_counter_handle"]), int(h["ref_counter_offset"]),
            bytes(h["event_handle"]) if h["event_handle"] is not None else None, bool(h["event_sync_required"]))
    except LayoutError:
        raise
    except KeyError as exc:
        raise LayoutError(f"CUDA IPC handle lacks field {exc}") from None
    except (RuntimeError, TypeError, ValueError) as exc:
        raise LayoutError(f"cannot open CUDA IPC region ({type(exc).__name__}: {exc}); the exporting process "
                          "must be alive, on this host, and sharing the same GPU") from None
    # The handle's sizes are the client's word; the allocation the handle opened is the driver's. Every
    # byte a copy may address must lie inside the latter.
    start = storage.data_ptr() + tensor_offset
    base, size = allocation_range(start, index)
    if start + region.size > base + size:
        raise LayoutError(f"CUDA IPC region claims {region.size} bytes at byte {start - base} of its allocation, "
                          f"but the allocation the handle opened holds only {size} bytes")
    out = torch.empty((0,), dtype=torch.uint8, device=f"cuda:{index}")
    out.set_(storage, tensor_offset, (region.size,), (1,))
    return out


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_uint64]
    lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
    return lib


def allocation_range(pointer: int, device: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation that holds device ``pointer``, as the driver knows it."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(device):
        rc = _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
    if rc != 0:
        raise LayoutError(f"cuMemGetAddressRange failed (CUDA driver error {rc}) for a CUDA IPC region")
    return base.value, size.value
