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

import dataclasses
import logging
import tempfile
from typing import Any, Callable, Iterator

import pytest

from kvstrata.core.adapter_api.plugins import (
    Adapter,
    AdapterError,
    EnginePackageMissing,
    HookSignatureError,
    MissingHookError,
    load_adapter,
)
from kvstrata.core.adapter_api.types import PLACEMENTS, HarnessSpec
from kvstrata.conformance_tests.slice_hold import SliceHold

from .drivers import DriverNotFound, find, make_driver
from .pytest_plugin import selected_adapters
from .rig import Rig, RigServer
from .rules import broken


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "adapter_spec" in metafunc.fixturenames:
        names, _ = selected_adapters(metafunc.config)
        metafunc.parametrize("adapter_spec", names, scope="session", ids=names)
    if "placement" in metafunc.fixturenames:
        metafunc.parametrize("placement", PLACEMENTS, scope="session", ids=[f"{p}-placement" for p in PLACEMENTS])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    names, _ = selected_adapters(config)
    if not names:
        raise pytest.UsageError("kvstrata conformance: no adapter is installed and none was selected "
                                "(use --adapter NAME or KVSTRATA_ADAPTER)")


@pytest.fixture(scope="session")
def adapter_explicit(request: pytest.FixtureRequest) -> bool:
    return selected_adapters(request.config)[1]


@pytest.fixture(scope="session")
def driver_factory(adapter_spec: str, adapter: Adapter, request: pytest.FixtureRequest) -> Callable[[HarnessSpec], Any]:
    """Builds the adapter's conformance driver for a spec (:mod:`.drivers`: found by the adapter's name in
    entry-point group ``kvstrata.conformance_drivers``, or given with ``--driver``)."""
    try:
        source = find(adapter_spec, request.config.getoption("driver", default=None))
        return make_driver(source, adapter)
    except DriverNotFound as exc:
        problem = str(exc)
    except Exception as exc:  # the driver's module failed to import
        problem = f"the conformance driver of adapter {adapter_spec!r} could not be loaded: {type(exc).__name__}: {exc}"
    broken("hooks", problem)


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
def session_hold() -> Iterator[SliceHold]:
    """The slice hold every server of the session runs with, installed in this process too (engine placement
    copies here)."""
    hold = SliceHold(tempfile.mkdtemp(prefix="kvstrata-conformance-hold-"))
    hold.install()
    yield hold
    hold.open_all()
    hold.uninstall()


@pytest.fixture(scope="session")
def shared_server(session_hold: SliceHold) -> Iterator[RigServer]:
    """One server for every rig that does not kill or restart its own."""
    shared = RigServer(session_hold)
    yield shared
    shared.stop()


@pytest.fixture
def placed_adapter(adapter: Adapter, placement: str) -> Adapter:
    """The adapter, for a placement it declares (a placement it does not declare is skipped, saying so)."""
    if placement not in adapter.info.placements:
        pytest.skip(f"adapter {adapter.name!r} declares placements {adapter.info.placements}, not {placement!r}")
    return adapter


@pytest.fixture
def make_rig(placed_adapter: Adapter, driver_factory: Callable[[HarnessSpec], Any], placement: str,
             session_hold: SliceHold, shared_server: RigServer) -> Iterator[Callable[..., Rig]]:
    """Build rigs (each with its own proxy, driver and instance id, on the shared server unless ``own_server``),
    in the test's placement; all are torn down after the test."""
    rigs: list[Rig] = []

    def make(spec: HarnessSpec | None = None, *, own_server: bool = False, **settings: Any) -> Rig:
        spec = dataclasses.replace(spec or HarnessSpec(), placement=placement)
        rig = Rig(placed_adapter, driver_factory, session_hold, spec, shared=None if own_server else shared_server,
                  **settings)
        rigs.append(rig)
        return rig.start()

    yield make
    for rig in reversed(rigs):
        rig.close()


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    return make_rig()
