"""A loader's abilities are declared (``ondeck.loader.Loader``), never looked up: no
``getattr(loader, ...)`` or ``hasattr(loader, ...)`` in the package."""

from __future__ import annotations

import ast
from pathlib import Path

from ondeck.loader import DeclaredLoader, PlainLoader, as_loader

from .test_layers import ROOT, modules


def _names_a_loader(node: ast.expr) -> bool:
    """``loader``, ``self.loader``, ``quantized_loader``, ``self.loaders[name]``..."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return "loader" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "loader" in node.attr.lower()
    return False


def loader_probes(path: Path, source: str) -> list[str]:
    """``file:line: call`` for each getattr or hasattr whose object is named a loader."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and _names_a_loader(node.args[0])
        ):
            problems.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return problems


def test_the_check_finds_probes_of_a_loader_and_leaves_other_objects_alone():
    source = (
        "a = getattr(loader, 'placement', None)\n"
        "b = hasattr(self.loaders[name], 'begin')\n"
        "c = getattr(module, 'config', None)\n"
    )
    assert loader_probes(Path("x.py"), source) == [
        "x.py:1: getattr(loader, 'placement', None)",
        "x.py:2: hasattr(self.loaders[name], 'begin')",
    ]


def test_no_loader_is_probed_with_getattr_or_hasattr():
    problems = []
    for path in sorted(modules().values()):
        problems += loader_probes(path.relative_to(ROOT.parent), path.read_text())
    assert not problems, "loaders probed instead of declared:\n" + "\n".join(problems)


def test_a_plain_callable_gets_the_protocols_defaults_and_a_declared_loader_stays_itself():
    plain = as_loader(lambda: "module")
    assert isinstance(plain, PlainLoader)
    assert plain.begin() == ("module", None)
    assert plain.spec is None and plain.upcast_bytes == 0 and not plain.returns_fresh_module
    assert plain.setup_seconds == 0.0

    class Declared(DeclaredLoader):
        returns_fresh_module = True

        def __call__(self):
            return "fresh"

    declared = Declared()
    assert as_loader(declared) is declared
