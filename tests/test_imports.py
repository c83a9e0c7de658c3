"""kvlab's modules import one another without circles: every import counts, the lazy ones
inside functions too (a lazy import only hides a circle from Python, not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvlab"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The kvlab modules ``path`` imports (``from a.b import c`` is ``a.b.c`` when that is a
    module, else ``a.b``); a package's ``__init__`` is not counted as imported by its own
    submodules' relative imports of siblings."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
    return {name for name in found if name in known}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: imported_modules(path, set(files)) - {name} for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def package_edges_only(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exports its submodules: importing the package from a
    submodule is an edge to the ``__init__`` alone, which is how Python resolves it too,
    so edges from a package's own submodules to the package are dropped."""
    return {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph.items()
    }


def test_no_import_circles():
    found = circles(package_edges_only(import_graph()))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)
