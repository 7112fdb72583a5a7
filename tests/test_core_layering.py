"""The core's modules form no import cycle, counting imports inside functions.

import-linter (pyproject.toml) checks what the plugin folders and the core may import of
each other; this test checks the core against itself. An import placed inside a function
still ties two modules together (it only defers the failure), so every ``import`` and
``from ... import`` in a module counts, wherever it is written; only those under
``if TYPE_CHECKING:`` (annotations, never run) do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core"
PACKAGE = "jaxnitro"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PACKAGE, *parts])] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip |= {id(x) for x in ast.walk(sub)}
    return skip


def _targets(module: str, is_package: bool, node, known) -> list[str]:
    """The core modules an import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
    return [n for n in names if n in known and n != PACKAGE]


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported core module: line of the first such import}}``."""
    known = _modules()
    graph = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                for target in _targets(module, path.name == "__init__.py", node, known):
                    if target != module:
                        edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_scan_sees_the_core_and_its_imports():
    graph = import_graph()
    assert {"jaxnitro.trainer", "jaxnitro.handle", "jaxnitro.split_wrapper"} <= set(graph)
    assert "jaxnitro.events" in graph["jaxnitro.trainer"]  # a module-level import


def test_a_cycle_through_a_function_level_import_is_found():
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 40}, "d": {"a": 2}}  # c -> a inside a function
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_among_core_modules():
    graph = import_graph()
    found = cycles(graph)
    described = []
    for component in found:
        edges = [
            f"{a} -> {b} ({graph_path(a)}:{line})"
            for a in component for b, line in sorted(graph[a].items()) if b in component
        ]
        described.append(" / ".join(edges))
    assert not found, (
        "import cycles among core modules (move the code to the module it belongs to; an import "
        "inside a function still counts): " + "; ".join(described)
    )


def graph_path(module: str) -> str:
    return str(_modules()[module].relative_to(CORE.parent))
