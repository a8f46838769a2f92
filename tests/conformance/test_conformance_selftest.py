"""The conformance suite fails loudly, naming the broken rule, on adapters that break one rule each.

One real ``pytest --pyargs kvstrata.conformance_tests`` subprocess checks every
deliberately broken adapter from
``kvstrata_testing.conformance_selftest.broken_adapters`` and the reference
adapter together; each adapter runs only the tests that exercise its rule (the
``selection`` plugin). The reference adapter, the positive control, runs every
test any broken adapter runs, so a failure below cannot come from the
environment rather than the break.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvstrata_testing.conformance_selftest.broken_adapters import BROKEN_RULES, adapter_spec, driver_option
from kvstrata_testing.conformance_selftest.selection import ENV_VAR

TIMEOUT = 900
REFERENCE = "reference"


def spec_of(broken_adapter: str) -> str:
    return adapter_spec(broken_adapter)


@pytest.fixture(scope="module")
def suite_results(tmp_path_factory) -> dict[str, list[tuple[str, str, str]]]:
    """Run the suite once over every adapter: adapter spec -> [(test name, outcome, failure text)]."""
    cwd = tmp_path_factory.mktemp("selftest")  # a directory holding no kvstrata sources
    selection = {spec_of(name): select for name, (_, select) in BROKEN_RULES.items()}
    selection[REFERENCE] = " or ".join(sorted({select for _, select in BROKEN_RULES.values()}))
    report = cwd / "report.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTRATA_ADAPTER", "KVSTRATA_CONFORMANCE_DRIVER")}
    env[ENV_VAR] = json.dumps(selection)
    # the broken adapters and the selection plugin are test support, outside the installed package
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    adapters = [a for spec in selection for a in ("--adapter", spec)]
    adapters += [a for name in BROKEN_RULES for a in ("--driver", driver_option(name))]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "kvstrata.conformance_tests", *adapters,
         "-p", "kvstrata_testing.conformance_selftest.selection", "-p", "kvstrata_testing.server_count",
         "-p", "no:cacheprovider", "-q",
         f"--junitxml={report}"],
        capture_output=True, text=True, timeout=TIMEOUT, env=env, stdin=subprocess.DEVNULL, cwd=cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1) and report.exists(), f"the suite did not run (exit {proc.returncode}):\n{out[-6000:]}"
    specs = sorted(selection, key=len, reverse=True)
    results: dict[str, list[tuple[str, str, str]]] = {spec: [] for spec in selection}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        spec = next((s for s in specs if f"[{s}" in name or f"-{s}" in name), None)
        assert spec is not None, f"test {name} names no selected adapter"
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                text = f"{child.get('message', '')}\n{child.text or ''}"
        results[spec].append((name, outcome, text))
    return results


def test_positive_control_reference_adapter_passes_the_same_tests(suite_results) -> None:
    ran = suite_results[REFERENCE]
    assert ran, "the reference adapter ran no test"
    bad = [(name, outcome, text[-2000:]) for name, outcome, text in ran if outcome not in ("passed", "skipped")]
    assert not bad, f"the reference adapter failed the selected conformance tests: {bad}"
    skipped = [(name, text) for name, outcome, text in ran if outcome == "skipped"]
    # the one skip the suite declares for the reference adapter: no arrival pool in engine placement
    assert all("exhausted" in name and "engine-placement" in name for name, _ in skipped), skipped
    passed = {name.split("[")[0] for name, outcome, _ in ran if outcome == "passed"}
    assert passed >= {name.split("[")[0] for name, _, _ in ran}, "a selected test passed in no placement"


@pytest.mark.parametrize("broken_adapter", sorted(BROKEN_RULES))
def test_suite_fails_naming_the_broken_rule(broken_adapter: str, suite_results) -> None:
    rule, _ = BROKEN_RULES[broken_adapter]
    ran = suite_results[spec_of(broken_adapter)]
    assert ran, f"no test ran against {broken_adapter}"
    failed = [(name, text) for name, outcome, text in ran if outcome in ("failure", "error")]
    assert failed, f"every selected test passed against {broken_adapter}: {[n for n, _, _ in ran]}"
    assert any(f"CONFORMANCE RULE {rule} BROKEN" in text for _, text in failed), (
        f"the suite failed on {broken_adapter} but did not name rule {rule!r}: {[t[-1500:] for _, t in failed]}")
    other = {r for r, _ in BROKEN_RULES.values() if r != rule
             for _, text in failed if f"CONFORMANCE RULE {r} BROKEN" in text}
    assert not other, f"{broken_adapter} breaks only {rule!r}, but the suite also blamed {sorted(other)}"
