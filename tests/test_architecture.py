"""The layout rules docs/architecture.md states, checked against the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def core_nodes(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    return {n: d for n, d in edges.items() if n.startswith("core")}


def test_the_core_imports_neither_native_nor_adapters_nor_the_cli() -> None:
    edges = import_graph.graph()
    for node, deps in core_nodes(edges).items():
        bad = {d for d in deps if not d.startswith("core")}
        if node == "core.testing":
            bad -= {"kvstrata"}  # the slice hold runs `kvstrata serve` in a child process
        assert not bad, f"{node} imports {sorted(bad)}"


def test_the_cores_subpackages_import_each_other_without_a_circle() -> None:
    edges = {n: {d for d in deps if d.startswith("core") and d != "core.testing"}
             for n, deps in core_nodes(import_graph.graph()).items() if n != "core.testing"}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import circle: {' -> '.join(path + [node])}"
        if node in done:
            return
        for dep in sorted(edges.get(node, ())):
            visit(dep, path + [node])
        done.add(node)

    for node in sorted(edges):
        visit(node, [])


def test_architecture_page_shows_the_graph_the_code_has() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"## Who imports whom.*?```\n(.*?)\n```", page, re.S)
    assert found, "docs/architecture.md has no import graph block under 'Who imports whom'"
    assert found.group(1).strip() == import_graph.render(import_graph.graph()).strip(), (
        "docs/architecture.md's import graph is stale: paste the output of `python docs/import_graph.py`")
