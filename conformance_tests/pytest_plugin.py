"""The suite's command-line options, registered with pytest through the ``pytest11`` entry point.

``pytest --pyargs kvstrata.conformance_tests`` loads the suite's conftest.py
only once collection reaches the installed package, too late for pytest to
accept an option declared there. So the options live in this small plugin,
which pytest loads at start-up wherever kvstrata is installed; it imports
nothing heavy and changes nothing unless the conformance suite is collected.
(So do ``--driver``, which names the conformance driver of an adapter given by
module path: see :mod:`kvstrata.conformance_tests.drivers`.)
"""

from __future__ import annotations

import os

import pytest

ENV_VAR = "KVSTRATA_ADAPTER"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvstrata-conformance", "kvstrata adapter conformance (kvstrata.conformance_tests)")
    group.addoption("--adapter", action="append", default=[], metavar="NAME",
                    help="adapter to check: an entry-point name in group kvstrata.adapters or a module path "
                         f"(pkg.module[:attr]); repeatable or comma-separated. Default: ${ENV_VAR} (comma-separated), else every "
                         "installed adapter")
    group.addoption("--driver", action="append", default=[], metavar="ADAPTER=MODULE:FACTORY",
                    help="the conformance driver of an adapter that publishes none in entry-point group "
                         "kvstrata.conformance_drivers (one given by module path); repeatable or comma-separated. "
                         "Default: $KVSTRATA_CONFORMANCE_DRIVER")


def selected_adapters(config: pytest.Config) -> tuple[list[str], bool]:
    """(adapter specs, whether they were named explicitly rather than discovered)."""
    given = list(config.getoption("adapter", default=None) or []) or [os.environ.get(ENV_VAR, "")]
    names = [s.strip() for value in given for s in value.split(",") if s.strip()]
    if names:
        return names, True
    from kvstrata.core.adapter_api.plugins import discover

    return sorted(discover()), False


def pytest_report_header(config: pytest.Config) -> str | None:
    if not (config.getoption("adapter", default=None) or os.environ.get(ENV_VAR)):
        return None  # not a conformance run, or one over every installed adapter: nothing to announce
    names, _ = selected_adapters(config)
    return f"kvstrata conformance: adapters selected: {', '.join(names)}"
