"""The package's imports run one way: no module imports one that imports it back,
directly or through others, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import ondeck

ROOT = Path(ondeck.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import statement, at any depth, but those only type checkers run."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                targets.add(candidate if candidate in known else module)
        else:
            targets.update(alias.name for alias in node.names)
    return {t for t in targets if t in known and t != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_walker_sees_imports_inside_functions_and_finds_a_circle():
    source = "def f():\n    from .b import g\n"
    tree_imports = list(_imports(ast.parse(source)))
    assert len(tree_imports) == 1
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    edges = graph()
    assert edges["ondeck.stages"], "the walker found no imports at all"
    found = cycles(edges)
    described = [
        " / ".join(f"{m} -> {sorted(edges[m] & set(group))}" for m in group) for group in found
    ]
    assert not found, "import circles: " + "; ".join(described)


# Layers look down only: a module may import its own floor and those below, never one
# above. A package's entry covers its submodules; the longest matching name wins.
FLOORS: dict[str, int] = {
    # 0: bytes, device facts, errors, files and folders
    "ondeck.errors": 0,
    "ondeck.memory": 0,
    "ondeck.timeline": 0,
    "ondeck.output": 0,
    "ondeck.hub": 0,
    "ondeck.arguments": 0,
    "ondeck.interrupt": 0,
    "ondeck.embedded": 0,
    "ondeck.loader": 0,
    "ondeck.tiles": 0,
    "ondeck.recency": 0,
    # 1: the proxy, and the record of what was resident when
    "ondeck.lazy": 1,
    "ondeck.tracker": 1,
    # 2: reading weights, streaming blocks, measured profiles, process groups
    "ondeck.loading": 2,
    "ondeck.streaming": 2,
    "ondeck.profiles": 2,
    "ondeck.distributed": 2,
    "ondeck.parallel": 2,
    # 3: pure plans and decisions, and the one executor that acts on them
    "ondeck.planning": 3,
    "ondeck.stage_steps": 3,
    "ondeck.snapshot": 3,
    "ondeck.policy": 3,
    "ondeck.executor": 3,
    "ondeck.host_watch": 3,
    "ondeck.host_pool": 3,
    "ondeck.token_room": 3,
    # 4: stages and pipelines
    "ondeck.stages": 4,
    # 5: concrete pipelines and the diffusers integration
    "ondeck.pipelines": 5,
    "ondeck.integrations": 5,
    # 6: which pipeline for a folder, and the package's front doors
    "ondeck.folder_pipelines": 6,
    "ondeck.diffusers": 6,
    "ondeck": 6,
    # 7: the command line, and the server beside it
    "ondeck.cli": 7,
    "ondeck.serve": 7,
    "ondeck.__main__": 7,
}


def floor_of(module: str, floors: dict[str, int] = FLOORS) -> int | None:
    for name in sorted(floors, key=len, reverse=True):
        if module == name or (name != "ondeck" and module.startswith(name + ".")):
            return floors[name]
    return floors.get(module)


def _module_of(node: ast.ImportFrom, package: str) -> str:
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module or ""


def upward_imports(sources: dict[str, tuple[Path, str]], floors: dict[str, int]) -> list[str]:
    """``file:line: a (floor m) imports b (floor n)`` for each import from a lower floor
    to a higher one; ``sources`` maps module names to (path shown, source text)."""
    known = {name: path for name, (path, _) in sources.items()}
    problems = []
    for name, (path, text) in sorted(sources.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(text)):
            targets = (
                [
                    f"{_module_of(node, package)}.{alias.name}"
                    if f"{_module_of(node, package)}.{alias.name}" in known
                    else _module_of(node, package)
                    for alias in node.names
                ]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
            )
            for target in dict.fromkeys(targets):
                if target not in known or target == name:
                    continue
                mine, theirs = floor_of(name, floors), floor_of(target, floors)
                if mine is not None and theirs is not None and theirs > mine:
                    problems.append(
                        f"{path}:{node.lineno}: {name} (floor {mine}) imports {target} "
                        f"(floor {theirs}), a higher floor"
                    )
    return problems


def test_every_module_has_a_floor():
    missing = sorted(name for name in modules() if floor_of(name) is None)
    assert not missing, f"give these modules a floor in FLOORS: {missing}"


def test_the_floor_check_names_the_file_and_line_of_an_upward_import():
    sources = {
        "pkg.low": (Path("pkg/low.py"), "import os\n\ndef f():\n    from .high import g\n"),
        "pkg.high": (Path("pkg/high.py"), "from .low import f\n"),
    }
    problems = upward_imports(sources, {"pkg.low": 0, "pkg.high": 1})
    assert problems == [
        "pkg/low.py:4: pkg.low (floor 0) imports pkg.high (floor 1), a higher floor"
    ]


def test_no_module_imports_one_on_a_higher_floor():
    sources = {
        name: (path.relative_to(ROOT.parent), path.read_text()) for name, path in modules().items()
    }
    problems = upward_imports(sources, FLOORS)
    assert not problems, "imports that look up:\n" + "\n".join(problems)
