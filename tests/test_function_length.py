"""No function in the core is longer than 60 lines (issue 19: the loop in small parts).

A function is measured from its ``def`` line to its last line, docstring and comments
included (decorators not), with ``ast``; nested functions and methods count on their own,
and a nested function's lines count in its enclosing function too. A function over the
limit is split into named pieces with one job each, not squeezed.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core"
LIMIT = 60


def function_lengths(source: str, where: str = "<source>") -> list[tuple[str, int]]:
    """``[(qualified name, lines)]`` of every function (and method) defined in ``source``."""
    out = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, where), "")
    return out


def test_the_measure_counts_a_method_nested_in_a_class_and_a_function():
    source = "class A:\n    def f(self):\n" + "        x = 1\n" * 61 + "\n\ndef g():\n    def h():\n        pass\n    return h\n"
    assert function_lengths(source) == [("A.f", 62), ("g", 4), ("g.h", 2)]


def test_no_core_function_is_longer_than_60_lines():
    too_long = sorted(
        (lines, f"core/{path.relative_to(CORE)}:{name}")
        for path in sorted(CORE.rglob("*.py"))
        for name, lines in function_lengths(path.read_text(), str(path))
        if lines > LIMIT
    )
    assert not too_long, (
        f"core functions longer than {LIMIT} lines (split each into named pieces with one job): "
        + ", ".join(f"{where} ({lines} lines)" for lines, where in reversed(too_long))
    )
