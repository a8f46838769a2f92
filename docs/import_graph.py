"""The import graph of kvstrata's packages, read from the code (``python docs/import_graph.py``).

Nodes are the core's subpackages (``core.wire``, ``core.engine``, ...), the core's top-level modules, and
``native``, ``adapters.<name>``, each adapter's conformance driver ``adapters.<name>.conformance``,
``conformance_tests`` and ``kvstrata`` (the CLI). An edge A -> B means a module of A imports a module of B
when it runs (at module level or inside a function; imports only for type annotations, under
``if TYPE_CHECKING:``, are not edges). ``docs/architecture.md`` embeds the output, and
``tests/unit/test_architecture.py`` checks that the two agree, that the core imports neither ``native`` nor an
adapter, that no two modules of the package import each other in a circle (:func:`module_graph`, module by
module, adapters included) and that no product module imports test support (:func:`is_test_support`).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"core": "core", "native": "native", "adapters": "adapters",
                "conformance_tests": "conformance_tests", "kvstrata": "kvstrata"}


def node_of(dotted: str) -> str | None:
    """``kvstrata.core.wire.transport`` -> ``core.wire``; ``kvstrata.core.shm`` -> ``core.shm``."""
    parts = dotted.split(".")
    if parts[0] != "kvstrata":
        return None
    if len(parts) == 1:
        return "kvstrata"
    top = parts[1]
    if top == "core":
        return "core." + parts[2] if len(parts) > 2 else "core"
    if top == "adapters":
        if len(parts) > 3 and parts[3] == "conformance":
            return f"adapters.{parts[2]}.conformance"
        return "adapters." + parts[2] if len(parts) > 2 else "adapters"
    if top in ("native", "conformance_tests"):
        return top
    return "kvstrata"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    top = rel.parts[0]
    inner = list(rel.with_suffix("").parts[1:])
    if inner and inner[-1] == "__init__":
        inner = inner[:-1]
    base = "kvstrata" if top == "kvstrata" else f"kvstrata.{top}"
    return ".".join([base, *inner])


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for branch in node.orelse for n in ast.walk(branch))
            continue
        yield node
        yield from _runtime_nodes(node)


def import_statements(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of every run-time import of a module (module level or inside functions; not
    TYPE_CHECKING blocks): ``import a.b`` is ``("a.b", ())``, ``from a import b, c`` is ``("a", ("b", "c"))``."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    is_package = path.name == "__init__.py"
    out = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, tuple(a.name for a in node.names)))
    return out


def imports_of(path: Path) -> set[str]:
    """What a module imports at run time: each module named, and ``pkg.name`` for ``from pkg import name``."""
    out = set()
    for mod, names in import_statements(path):
        out.add(mod)
        out.update(f"{mod}.{name}" for name in names)  # "from pkg import module"
    return out


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            src = node_of(module_name(path))
            if src is None:
                continue
            for dotted in imports_of(path):
                dst = node_of(dotted)
                if dst and dst != src and not (dst in ("core", "adapters") and dotted.count(".") <= 1):
                    edges.setdefault(src, set()).add(dst)
            edges.setdefault(src, set())
    return edges


TEST_SUPPORT_PACKAGES = ("kvstrata.conformance_tests", "kvstrata_testing")
"""Test support: the conformance suite (shipped, for third parties to run) and ``tests/kvstrata_testing`` (not
shipped). With each adapter's conformance driver (``kvstrata.adapters.<name>.conformance``), only tests and the
suite import them."""


def is_test_support(module: str) -> bool:
    """Whether ``module`` is test support, which no product module may import."""
    parts = module.split(".")
    if any(module == p or module.startswith(p + ".") for p in TEST_SUPPORT_PACKAGES):
        return True
    return len(parts) >= 4 and parts[:2] == ["kvstrata", "adapters"] and parts[3] == "conformance"


def package_modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    out = {}
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            out[module_name(path)] = path
    return out


def module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time (``from pkg import name`` is ``pkg.name`` where
    that is a module, else ``pkg``); imports of ``kvstrata_testing`` (test support outside the package) are kept
    as edges to that name, so a product module importing it shows."""
    modules = package_modules()
    edges: dict[str, set[str]] = {}
    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for name, path in modules.items():
        deps = edges.setdefault(name, set())
        for mod, names in import_statements(path):
            if mod.split(".")[0] == "kvstrata_testing":
                deps.add(mod)
                continue
            # "from pkg import module" imports that module (pkg is already initialised); any other name, pkg
            targets = {f"{mod}.{n}" if f"{mod}.{n}" in modules else resolve(mod) for n in names} or {resolve(mod)}
            deps.update(t for t in targets if t and t != name)
    return edges


def render(edges: dict[str, set[str]]) -> str:
    width = max(len(n) for n in edges)
    return "\n".join(f"{node:<{width}} -> {', '.join(sorted(deps)) or '(nothing)'}"
                     for node, deps in sorted(edges.items()))


if __name__ == "__main__":
    sys.stdout.write(render(graph()) + "\n")
