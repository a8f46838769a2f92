"""kvstrata on NVIDIA GPUs: the CUDA copy executor and kernels, CUDA IPC targets, interprocess CUDA events.

Native code implements interfaces the core declares (an executor, an event backend, a write target);
the core never imports it. The pure-torch executor lives in ``kvstrata.core.transfer.torch_executor``.
"""

import functools
from typing import Any


def open_cuda_ipc_target(layout: Any, pool: Any, cuda_config: Any = None) -> Any:
    """The server's target for a cache exported over CUDA IPC (imports CUDA only when one registers).

    ``cuda_config``: a :class:`~kvstrata.native.cuda_executor.CudaTransferConfig` (None: the defaults).
    """
    from kvstrata.native.cuda_target import CudaIpcTarget

    return CudaIpcTarget(layout, pool, cuda_config)


def target_openers(cuda_config: Any = None) -> dict[str, Any]:
    """The region kinds native code lets a :class:`~kvstrata.core.server.cache_server.CacheServer` open.

    ``cuda_config``: how CUDA targets copy (a :class:`~kvstrata.native.cuda_executor.CudaTransferConfig`;
    None: the defaults); each target gets its own copy.
    """
    return {"cuda_ipc": functools.partial(open_cuda_ipc_target, cuda_config=cuda_config)}
