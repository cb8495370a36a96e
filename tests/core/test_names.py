"""Names that say what they are: no module reaches into another's private names, and no
function of the package hides a module of the same name."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

from .test_layers import ROOT, modules


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str | None, level: int, package: str) -> str:
    if not level:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(base + ([module] if module else []))


def private_uses(name: str, path: Path, source: str, known: set[str]) -> list[str]:
    """``file:line: what`` for each private name of another ondeck module this source
    uses: imported (``from x import _y``) or read through the module (``x._y``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the ondeck module it is bound to
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, package)
            for alias in node.names:
                target = f"{module}.{alias.name}"
                if target in known:
                    bound[alias.asname or alias.name] = target
                elif module in known and module != name and _private(alias.name):
                    problems.append(f"{path}:{node.lineno}: imports {alias.name} from {module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and bound[node.value.id] != name
            and _private(node.attr)
        ):
            problems.append(f"{path}:{node.lineno}: reads {bound[node.value.id]}.{node.attr}")
    return problems


def private_attributes(source: str) -> set[str]:
    """The private attributes a module's classes define: methods, class-level names and
    ``self._x`` assignments."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: an object reading its own (or inherited) state."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def private_attribute_reads(path: Path, source: str, elsewhere: dict[str, set[str]]) -> list[str]:
    """``file:line: what`` for each ``obj._x`` on another object where ``_x`` is a private
    attribute only other ondeck modules define (``elsewhere``: module -> its names)."""
    mine = private_attributes(source)
    problems = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)) or _own(node.value):
            continue
        if node.attr in mine:
            continue
        owners = sorted(module for module, names in elsewhere.items() if node.attr in names)
        if owners:
            problems.append(f"{path}:{node.lineno}: reads {node.attr} of {', '.join(owners)}")
    return problems


def test_the_check_finds_an_imported_private_name_and_one_read_through_its_module():
    known = {"pkg", "pkg.a", "pkg.b"}
    source = "from .a import _hidden\nfrom . import b\nb._inner()\nb.public()\n"
    problems = private_uses("pkg.c", Path("pkg/c.py"), source, known)
    assert problems == [
        "pkg/c.py:1: imports _hidden from pkg.a",
        "pkg/c.py:3: reads pkg.b._inner",
    ]


def test_no_module_uses_another_modules_private_names():
    known = modules()
    problems = []
    for name, path in sorted(known.items()):
        relative = path.relative_to(ROOT.parent)
        problems += private_uses(name, relative, path.read_text(), set(known))
    assert not problems, "private names across modules:\n" + "\n".join(problems)


def test_the_check_finds_a_private_method_called_on_another_modules_object():
    elsewhere = {"pkg.a": private_attributes("class A:\n    def _hidden(self): ...\n")}
    source = (
        "class B:\n"
        "    def _mine(self): ...\n"
        "    def run(self, a, b):\n"
        "        a._hidden()\n"
        "        b._mine()\n"
        "        self._hidden()\n"
        "        module._parameters\n"
    )
    assert private_attribute_reads(Path("pkg/b.py"), source, elsewhere) == [
        "pkg/b.py:4: reads _hidden of pkg.a"
    ]


def test_no_module_calls_another_modules_private_methods_on_its_objects():
    known = modules()
    sources = {name: path.read_text() for name, path in known.items()}
    defined = {name: private_attributes(source) for name, source in sources.items()}
    problems = []
    for name, path in sorted(known.items()):
        elsewhere = {other: names for other, names in defined.items() if other != name}
        problems += private_attribute_reads(path.relative_to(ROOT.parent), sources[name], elsewhere)
    assert not problems, "private attributes across modules:\n" + "\n".join(problems)


def test_no_public_function_shadows_a_module_of_its_package():
    for name in sorted(modules()):
        if name == "ondeck.__main__":
            continue
        module = importlib.import_module(name)
        if not hasattr(module, "__path__"):
            continue
        for child in (n for n in modules() if n.rpartition(".")[0] == name):
            attribute = getattr(module, child.rpartition(".")[2], None)
            assert attribute is None or isinstance(attribute, types.ModuleType), (
                f"{name}.{child.rpartition('.')[2]} is a {type(attribute).__name__}, "
                f"hiding the module {child}"
            )


def test_ondeck_plan_is_the_function_and_planning_the_module():
    import ondeck.planning

    assert callable(ondeck.plan) and not isinstance(ondeck.plan, types.ModuleType)
    assert ondeck.Plan is ondeck.planning.Plan
