"""The import graph of cxlemu's packages has no cycle.

Built from the source with `ast`: every import statement counts, at module level or inside a
function (a function-level import that closes a cycle only hides it), except those under
``if TYPE_CHECKING:`` (never executed). ``from pkg import name`` is an edge to ``pkg.name`` when
that is a module, else to ``pkg``; ``importlib.import_module("literal")`` counts too. Importing
``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` as well, but those implicit edges are left out
(as import-linter and pydeps do): a package that re-exports its submodules would otherwise be a
cycle with each of them.
"""
from __future__ import annotations

import ast
from pathlib import Path

from cli_support import ROOT

PACKAGES = ("emulator", "driver", "firmware_model", "tools")


def _modules() -> dict[str, Path]:
    """Our modules by dotted name; a compiled extension (``_cdatapath.*.so``) is a module too,
    one that imports nothing of ours."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.so")):
            parts = list(path.relative_to(ROOT).parts)
            parts[-1] = parts[-1].split(".")[0]
            found[".".join(parts)] = path
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `tree` imports, TYPE_CHECKING blocks left out."""
    targets: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def resolve(name: str) -> None:
        while name and name not in known:  # `import a.b.c` where only a.b is ours-and-known
            name = name.rpartition(".")[0]
        if name:
            targets.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    targets.add(f"{base}.{alias.name}")
                else:
                    resolve(base)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            resolve(node.args[0].value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    targets.discard(module)
    return targets


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
            if path.suffix == ".py" else set() for name, path in known.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path that returns to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("a strongly connected component without a cycle")


def test_the_graph_sees_function_level_imports() -> None:
    """A function-level import is an edge (the graph would be blind to hidden cycles otherwise)."""
    tree = ast.parse("def f():\n    import emulator.spec\n")
    assert _imported(tree, "x", False, {"emulator.spec": Path()}) == {"emulator.spec"}


def test_the_graph_skips_type_checking_imports() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import emulator.spec\n")
    assert _imported(tree, "x", False, {"emulator.spec": Path()}) == set()


def test_find_cycles_reports_one() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (one per strongly connected group of modules):\n" + "\n".join(
        " -> ".join(c) for c in cycles)
