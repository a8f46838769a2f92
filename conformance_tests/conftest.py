"""pytest wiring for the conformance suite: which adapters to check, and the rig fixtures.

The ``--adapter`` option itself is declared in :mod:`.pytest_plugin` (see why
there). Select adapters with ``--adapter NAME`` (repeatable) or ``KVSTRATA_ADAPTER=NAME[,NAME]``;
NAME is an entry-point name in the ``kvstrata.adapters`` group or a module path
(``pkg.module`` / ``pkg.module:attribute``). With neither, every installed
adapter is checked, and one whose engine package is not installed is skipped
with the install hint; an adapter selected by name fails instead, because a
run that was asked to check it and checked nothing must not pass.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import pytest

from kvstrata.core.adapter_api.hookspecs import HarnessSpec, WorkerOptions
from kvstrata.core.adapter_api.plugins import (
    Adapter,
    AdapterError,
    EnginePackageMissing,
    HookSignatureError,
    MissingHookError,
    discover,
    load_adapter,
)

from .pytest_plugin import selected_adapters
from .rig import Rig, RigServer
from .rules import broken

def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "adapter_spec" in metafunc.fixturenames:
        names, _ = selected_adapters(metafunc.config)
        metafunc.parametrize("adapter_spec", names, scope="session", ids=names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    names, _ = selected_adapters(config)
    if not names:
        raise pytest.UsageError("kvstrata conformance: no adapter is installed and none was selected "
                                "(use --adapter NAME or KVSTRATA_ADAPTER)")


@pytest.fixture(scope="session")
def adapter_explicit(request: pytest.FixtureRequest) -> bool:
    return selected_adapters(request.config)[1]


@pytest.fixture(scope="session")
def adapter(adapter_spec: str, adapter_explicit: bool) -> Adapter:
    """The loaded adapter; a load failure fails (or, for an engine not installed here, skips) every test."""
    try:
        return load_adapter(adapter_spec)
    except EnginePackageMissing as exc:
        problem, missing_engine, hooks = str(exc), True, False
    except (MissingHookError, HookSignatureError) as exc:
        problem, missing_engine, hooks = str(exc), False, True
    except AdapterError as exc:
        problem, missing_engine, hooks = str(exc), False, False
    # Reported outside the except blocks, so the message is not buried under a chained traceback.
    if missing_engine and not adapter_explicit:
        pytest.skip(problem)
    if missing_engine:
        pytest.fail(f"adapter {adapter_spec!r} was selected but cannot run here: {problem}", pytrace=False)
    if hooks:
        broken("hooks", problem)
    pytest.fail(problem, pytrace=False)


class _Collect(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # a broken record must not break the suite
            self.sink.append(f"{record.levelname} {record.name}: <unformattable {record.msg!r}>")


@pytest.fixture(scope="session")
def warning_log() -> Iterator[list[str]]:
    """Every WARNING-or-worse log line of the session, in order (for the "log once" and "log line" rules)."""
    sink: list[str] = []
    handler = _Collect(sink)
    root = logging.getLogger()
    root.addHandler(handler)
    yield sink
    root.removeHandler(handler)


@pytest.fixture(scope="session")
def session_state() -> dict[str, Any]:
    return {}


@pytest.fixture(scope="session")
def shared_server() -> Iterator[RigServer]:
    """One server (with its slice hold) for every rig that does not kill or restart its own."""
    shared = RigServer()
    yield shared
    shared.stop()


@pytest.fixture
def make_rig(adapter: Adapter, shared_server: RigServer) -> Iterator[Callable[..., Rig]]:
    """Build rigs (each with its own proxy, engine, worker and instance id, on the shared server unless
    ``own_server``); all are torn down after the test."""
    rigs: list[Rig] = []

    def make(spec: HarnessSpec | None = None, options: WorkerOptions | None = None, *,
             own_server: bool = False) -> Rig:
        rig = Rig(adapter, spec or HarnessSpec(),
                  options or WorkerOptions(layer_wait_timeout=5.0, retrieve_timeout=30.0),
                  shared=None if own_server else shared_server)
        rigs.append(rig)
        return rig.start()

    yield make
    for rig in reversed(rigs):
        rig.close()


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    return make_rig()
