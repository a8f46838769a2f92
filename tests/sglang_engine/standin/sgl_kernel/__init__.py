"""Import stand-in for ``sgl_kernel`` (test-only): lets SGLang 0.5.23 import on a CPU without AMX.

SGLang imports ``sgl_kernel`` unconditionally and no CPU build of it exists on PyPI. On this machine every
layer runs SGLang's own ``forward_native`` paths, so no kernel is needed; SGLang's modules only import
kernel names at module level (``from sgl_kernel import x`` in some 60 modules). Every public name this
package is asked for is therefore a function, and nothing is faked: each raises :class:`StandInCalled` if it
is ever called, and records the call in ``$KVSTRATA_TEST_SGL_KERNEL_CALLS`` (a directory) when that is set,
so a call made inside an engine process whose exception SGLang might swallow still fails the test that
checks the directory. Private and dunder names are missing (AttributeError), as in any module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, NoReturn

CALLS_ENV = "KVSTRATA_TEST_SGL_KERNEL_CALLS"


class StandInCalled(RuntimeError):
    """SGLang called a kernel the stand-in does not provide: the test must not pass on faked work."""


def _called(name: str) -> NoReturn:
    where = os.environ.get(CALLS_ENV)
    if where:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"{name}-{os.getpid()}-{time.monotonic_ns()}"), "w") as f:
            f.write(name)
    raise StandInCalled(f"sgl_kernel.{name} was called, but sgl_kernel here is the tests' import stand-in "
                        "(no CPU build exists): this code path needs the real kernel")


def _stand_in(name: str) -> Callable[..., NoReturn]:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        _called(name)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("_"):
        raise AttributeError(f"module 'sgl_kernel' (the tests' import stand-in) has no attribute {name!r}")
    return _stand_in(name)
