"""GPU tests: marked ``gpu`` and skipped, with the reason, where torch sees no CUDA device.

They are collected everywhere (CI's CPU machines too), so nothing here or in
the test modules may touch CUDA at import time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _no_cuda_reason() -> str | None:
    if torch.version.cuda is None:
        return f"needs a CUDA build of torch (this is {torch.__version__}, CPU only)"
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _no_cuda_reason()
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def gpu_server():
    """One real `kvstrata serve` per module; every test registers its own instance id and request ids."""
    from kvstrata.server_process import ServerProcess

    with ServerProcess(l1_bytes=512 << 20, chunk_size=64) as srv:
        yield srv


@pytest.fixture(scope="session", autouse=True)
def cuda_extension_built():
    """Build (or load) the extension once, up front: a server building it inside a
    registration request would outlast the client's timeout."""
    if _no_cuda_reason() is not None:
        yield None
        return
    from kvstrata.native import cuda_ext

    yield cuda_ext.load()
