"""The conformance suite fails loudly, naming the broken rule, on adapters that break one rule each.

Each run is a real ``pytest --pyargs kvstrata.conformance_tests`` subprocess
against a deliberately broken adapter from
``kvstrata.conformance_tests.selftest.broken_adapters``, limited with ``-k`` to
the tests that exercise its rule. The positive control runs the same tests
against the reference adapter, so a failure below cannot come from the
environment rather than the break.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.conformance_tests.selftest.broken_adapters import BROKEN_RULES, MODULE

TIMEOUT = 300


def run_suite(adapter: str, select: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run the suite in a fresh interpreter, from a directory holding no kvstrata sources."""
    env = {**os.environ}
    env.pop("KVSTRATA_ADAPTER", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "kvstrata.conformance_tests", "--adapter", adapter,
         "-k", select, "-p", "no:cacheprovider", "-q", "-rfE"],
        capture_output=True, text=True, timeout=TIMEOUT, env=env, stdin=subprocess.DEVNULL, cwd=cwd)


def test_positive_control_reference_adapter_passes_the_same_tests(tmp_path: Path) -> None:
    cwd = tmp_path
    select = " or ".join(f"({k})" for _, k in sorted(set(BROKEN_RULES.values())))
    proc = run_suite("reference", select, cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the reference adapter failed the selected conformance tests:\n{out[-6000:]}"
    assert " passed" in out and "CONFORMANCE RULE" not in out


@pytest.mark.parametrize("broken_adapter", sorted(BROKEN_RULES))
def test_suite_fails_naming_the_broken_rule(broken_adapter: str, tmp_path: Path) -> None:
    cwd = tmp_path
    rule, select = BROKEN_RULES[broken_adapter]
    proc = run_suite(f"{MODULE}:{broken_adapter}", select, cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"expected test failures (exit 1), got exit {proc.returncode}:\n{out[-6000:]}"
    assert f"CONFORMANCE RULE {rule} BROKEN" in out, (
        f"the suite failed on {broken_adapter} but did not name rule {rule!r}:\n{out[-6000:]}")
    other = {r for r, _ in BROKEN_RULES.values() if r != rule and f"CONFORMANCE RULE {r} BROKEN" in out}
    assert not other, f"{broken_adapter} breaks only {rule!r}, but the suite also blamed {sorted(other)}:\n{out[-4000:]}"
