"""Rooms a reader can take in: no module of the package over 800 lines, no function
over 80."""

from __future__ import annotations

import ast

from .test_layers import ROOT, modules

MODULE_LINES = 800
FUNCTION_LINES = 80


def long_functions(source: str, limit: int = FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of each function or method longer than ``limit``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, node.lineno, lines))
    return found


def test_the_check_measures_a_function_from_its_def_to_its_last_line():
    source = "def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 80
    assert long_functions(source) == [("long", 5, 81)]


def test_no_module_is_over_800_lines():
    long = {
        str(path.relative_to(ROOT.parent)): lines
        for path in modules().values()
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines():
    long = [
        f"{path.relative_to(ROOT.parent)}:{line}: {name} ({lines} lines)"
        for path in sorted(modules().values())
        for name, line, lines in long_functions(path.read_text())
    ]
    assert not long, f"functions over {FUNCTION_LINES} lines:\n" + "\n".join(long)
