"""The layout rules docs/architecture.md states, checked against the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def core_nodes(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    return {n: d for n, d in edges.items() if n.startswith("core")}


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``edges`` (as a path that ends where it starts), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for dep in sorted(edges.get(node, ())):
            circle = visit(dep, path + [node])
            if circle:
                return circle
        done.add(node)
        return None

    for node in sorted(edges):
        circle = visit(node, [])
        if circle:
            return circle
    return None


def test_the_core_imports_neither_native_nor_adapters_nor_the_cli() -> None:
    edges = import_graph.graph()
    for node, deps in core_nodes(edges).items():
        bad = {d for d in deps if not d.startswith("core")}
        assert not bad, f"{node} imports {sorted(bad)}"


def test_the_cores_subpackages_import_each_other_without_a_circle() -> None:
    edges = {n: {d for d in deps if d.startswith("core")} for n, deps in core_nodes(import_graph.graph()).items()}
    circle = find_circle(edges)
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_no_two_modules_of_the_package_import_each_other_in_a_circle() -> None:
    """Module by module, across the whole package (core, native, adapters, the CLI, the conformance suite)."""
    edges = import_graph.module_graph()
    assert "kvstrata.adapters.vllm.hooks" in edges and "kvstrata.cli" in edges  # the graph covers the package
    circle = find_circle(edges)
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_no_product_module_imports_test_support() -> None:
    """Test support (the conformance suite, the adapters' conformance drivers, tests/kvstrata_testing) may import
    the product; nothing an engine or the server loads imports it."""
    edges = import_graph.module_graph()
    assert import_graph.is_test_support("kvstrata.conformance_tests.slice_hold")
    assert import_graph.is_test_support("kvstrata.adapters.vllm.conformance")
    assert import_graph.is_test_support("kvstrata_testing.trtllm_harness.standin")
    assert not import_graph.is_test_support("kvstrata.adapters.vllm.hooks")
    bad = {module: sorted(d for d in deps if import_graph.is_test_support(d))
           for module, deps in edges.items() if not import_graph.is_test_support(module)}
    bad = {module: deps for module, deps in bad.items() if deps}
    assert not bad, f"product modules import test support: {bad}"


def test_the_wheel_ships_no_test_support_but_the_conformance_suite() -> None:
    """The harnesses, broken adapters and test caches are not in the package list (nor in its folders)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]
    assert "kvstrata.conformance_tests" in packages
    shipped_support = [p for p in packages if import_graph.is_test_support(p) and p != "kvstrata.conformance_tests"]
    assert not shipped_support, shipped_support
    for gone in ("core/testing", "adapters/trtllm/harness", "conformance_tests/selftest", "native/gpu_caches.py"):
        assert not (ROOT / gone).exists(), f"{gone} would ship in the wheel"


def test_architecture_page_shows_the_graph_the_code_has() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"## Who imports whom.*?```\n(.*?)\n```", page, re.S)
    assert found, "docs/architecture.md has no import graph block under 'Who imports whom'"
    assert found.group(1).strip() == import_graph.render(import_graph.graph()).strip(), (
        "docs/architecture.md's import graph is stale: paste the output of `python docs/import_graph.py`")
