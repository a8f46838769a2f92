"""kvstrata on NVIDIA GPUs: the CUDA copy executor and kernels, CUDA IPC targets, interprocess CUDA events.

Native code implements interfaces the core declares (an executor, an event backend, a write target);
the core never imports it. The pure-torch executor lives in ``kvstrata.core.transfer.torch_executor``.
"""

from typing import Any


def open_cuda_ipc_target(layout: Any, pool: Any) -> Any:
    """The server's target for a cache exported over CUDA IPC (imports CUDA only when one registers)."""
    from kvstrata.native.cuda_target import CudaIpcTarget

    return CudaIpcTarget(layout, pool)


def target_openers() -> dict[str, Any]:
    """The region kinds native code lets a :class:`~kvstrata.core.server.cache_server.CacheServer` open."""
    return {"cuda_ipc": open_cuda_ipc_target}
