"""A pytest plugin for the conformance self-test: each adapter runs only the tests that show its rule.

The self-test checks every deliberately broken adapter in one pytest process
(``--adapter`` is repeatable), so the interpreter, torch and the suite start
once, not once per adapter. ``KVSTRATA_SELFTEST_SELECTION`` maps each adapter
spec to its selection, an expression of the ``-k`` shape ``a or b and c`` over
the test's name (without the adapter's own id); tests outside an adapter's
selection are deselected. Load it with ``-p kvstrata_testing.conformance_selftest.selection``.
"""

from __future__ import annotations

import json
import os

import pytest

ENV_VAR = "KVSTRATA_SELFTEST_SELECTION"


def selection_matches(expression: str, name: str) -> bool:
    """``a or b and c``: true if some ``or`` alternative has every ``and`` term in ``name``."""
    return any(all(term.strip() in name for term in alternative.split(" and "))
               for alternative in expression.split(" or "))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selection: dict[str, str] = json.loads(os.environ.get(ENV_VAR, "{}"))
    keep, drop = [], []
    for item in items:
        spec = getattr(item, "callspec", None) and item.callspec.params.get("adapter_spec")
        expression = selection.get(spec) if spec else None
        if expression is None or selection_matches(expression, item.name.replace(spec, "")):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
