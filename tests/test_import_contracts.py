"""The import rules of cxlemu's packages, from the code.

The contracts are in pyproject.toml (``[tool.importlinter]``) and checked by import-linter's
``lint-imports`` (grimp builds the graph): the layers tools -> driver -> emulator ->
firmware_model, the layers inside tools, tools.sim alone, no cycle between the children of any
package at any depth, private modules imported only from inside their parent package, argparse
only in tools.cli. Every import counts, at module level or inside a function (a function-level
import that closes a cycle only hides it); imports under ``if TYPE_CHECKING:`` do not (never
executed). Checked here besides: a package whose ``__init__`` imports a module of its own that
imports the package back (a cycle the sibling contract cannot see), and private *names*
(``from pkg.mod import _name``) imported from outside their package, as private modules are.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tools", "driver", "emulator", "firmware_model")
_LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the project in ``cwd`` (its pyproject.toml), as the command runs it."""
    return subprocess.run([sys.executable, "-c", _LINT], cwd=cwd, capture_output=True, text=True, timeout=120)


def packages_imported_back(graph: grimp.ImportGraph, roots: tuple[str, ...]) -> list[str]:
    """``package -> module -> ... -> package`` for each package whose ``__init__`` imports one of
    its own modules that imports the package back (a partly initialised package at import)."""
    found = []
    for package in sorted(m for m in graph.modules if m.split(".")[0] in roots and graph.find_children(m)):
        inside = graph.find_descendants(package)
        for module in sorted(graph.find_modules_directly_imported_by(package) & inside):
            chain = graph.find_shortest_chain(importer=module, imported=package)
            if chain:
                found.append(" -> ".join((package, *chain)))
    return found


def private_names_imported_across(root: Path, packages: tuple[str, ...]) -> list[str]:
    """``file:line: from module import _name`` where the importer is outside the package that
    holds ``module`` (its parent package; the package itself for an ``__init__``); a private
    module imported that way is the private_modules contract's."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            importer = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                is_package = (root / node.module.replace(".", "/") / "__init__.py").exists()
                home = node.module if is_package else node.module.rpartition(".")[0]
                if importer == home or importer.startswith(home + "."):
                    continue
                base = root / node.module.replace(".", "/")  # a private module: the contract's
                found += [f"{path.relative_to(root)}:{node.lineno}: from {node.module} import {a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                          and not (base / f"{a.name}.py").exists() and not (base / a.name).is_dir()]
    return found


def test_the_import_contracts_hold() -> None:
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_no_package_imports_itself_back() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=True)
    assert packages_imported_back(graph, PACKAGES) == []


def test_no_private_name_is_imported_from_outside_its_package() -> None:
    assert private_names_imported_across(ROOT, PACKAGES) == []


def _project(tmp_path: Path, files: dict[str, str], contracts: str) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent(
        """\
        [tool.importlinter]
        root_packages = ["toy"]
        include_external_packages = true
        exclude_type_checking_imports = true
        """) + textwrap.dedent(contracts))
    return tmp_path


_TOY = {
    "toy/__init__.py": "",
    "toy/low/__init__.py": "",
    "toy/low/core.py": """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            import argparse  # never executed: not an import of the graph

        def helper():
            import toy.high.cli  # inside a function: still an import, closing a cycle
            return toy.high.cli
        """,
    "toy/high/__init__.py": "",
    "toy/high/cli.py": "import toy.low.core\n",
}
_TOY_CONTRACTS = """\
    [[tool.importlinter.contracts]]
    name = "toy cycles"
    type = "acyclic_siblings"
    ancestors = ["toy"]

    [[tool.importlinter.contracts]]
    name = "toy argparse"
    type = "forbidden"
    source_modules = ["toy.low"]
    forbidden_modules = ["argparse"]
    """


def test_lint_imports_counts_an_import_inside_a_function(tmp_path: Path) -> None:
    """The contracts see a cycle closed by a function-level import (the hidden kind), and skip
    what only a type checker reads."""
    run = lint_imports(_project(tmp_path, _TOY, _TOY_CONTRACTS))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "toy cycles BROKEN" in run.stdout
    assert "- .low -> .high (1 import)" in run.stdout
    assert "toy argparse KEPT" in run.stdout


def test_lint_imports_sees_argparse_imported_inside_a_function(tmp_path: Path) -> None:
    files = {**_TOY, "toy/low/core.py": "def parse():\n    import argparse\n    return argparse\n"}
    run = lint_imports(_project(tmp_path, files, _TOY_CONTRACTS))
    assert "toy argparse BROKEN" in run.stdout, run.stdout + run.stderr
    assert "toy.low.core -> argparse (l.2)" in run.stdout


def test_a_package_imported_back_by_its_own_module_is_found(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _project(tmp_path, {"toy/__init__.py": "", "toy/sub/__init__.py": "from toy.sub.a import X\n",
                        "toy/sub/a.py": "X = 1\n\ndef f():\n    from toy.sub import X\n    return X\n"}, "")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("toy", cache_dir=None, exclude_type_checking_imports=True)
    assert packages_imported_back(graph, ("toy",)) == ["toy.sub -> toy.sub.a -> toy.sub"]


def test_a_private_name_imported_from_another_package_is_found(tmp_path: Path) -> None:
    _project(tmp_path, {"toy/__init__.py": "", "toy/a/__init__.py": "", "toy/a/store.py": "def _claim(): pass\n",
                        "toy/a/user.py": "from toy.a.store import _claim\n",
                        "toy/b/__init__.py": "", "toy/b/worker.py": "import os\nfrom toy.a.store import _claim\n"}, "")
    assert private_names_imported_across(tmp_path, ("toy",)) == [
        "toy/b/worker.py:2: from toy.a.store import _claim"]
