"""A third-party adapter in its own distribution is discovered and checked without editing kvstrata.

examples/third_party_adapter is built and installed (no network: --no-index,
--no-build-isolation, --no-deps) into a private directory; a fresh interpreter
with that directory on its path must list it among the adapters and pass the
whole conformance suite against it, selected through KVSTRATA_ADAPTER.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "third_party_adapter"


def test_third_party_adapter_is_discovered_and_passes_the_suite(tmp_path: Path) -> None:
    src, site = tmp_path / "src", tmp_path / "site"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(src)], check=True, timeout=300, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    env.pop("KVSTRATA_ADAPTER", None)

    listed = subprocess.run(
        [sys.executable, "-c", "from kvstrata.core.adapter_api.plugins import discover; print(sorted(discover()))"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=True)
    assert "'blockmajor'" in listed.stdout and "'reference'" in listed.stdout, listed.stdout

    env["KVSTRATA_ADAPTER"] = "blockmajor"
    suite = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "kvstrata.conformance_tests", "-v",
                            "-p", "no:cacheprovider", "-rs"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
                           stdin=subprocess.DEVNULL)
    out = suite.stdout + suite.stderr
    assert suite.returncode == 0, f"the conformance suite failed on the third-party adapter:\n{out[-6000:]}"
    assert "kvstrata conformance: adapters selected: blockmajor" in out
    assert ("test_released_on_first_slice_and_every_layer_read_after_its_wait[blockmajor-server-placement] PASSED"
            in out)
    # it declares server placement only: the engine-placement runs are skipped, saying why
    assert "declares placements ('server',), not 'engine'" in out
    assert "CONFORMANCE RULE" not in out
