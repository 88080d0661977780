"""The command line is built only in ``tools/cli``: outside it no module adds parsers or
arguments, sets a parser's defaults or takes an ``argparse.Namespace`` (annotated so, or a
parameter ``args`` whose attributes it reads: the project's name for one; libraries take typed
parameters and return data; the CLI parses, formats and prints). The import-linter contract keeps
``import argparse`` inside tools.cli; this catches what it cannot see, a library filling a parser
or reading a Namespace someone else handed it.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("emulator", "driver", "firmware_model", "tools")
#: a runnable example's own command line (`python -m driver.vllm.example`), as pyproject's
#: argparse contract exempts it
EXEMPT = {"driver/vllm/example.py"}
PARSER_CALLS = ("add_parser", "add_argument", "add_subparsers", "set_defaults")


def _is_namespace(annotation: ast.expr | None) -> bool:
    """``argparse.Namespace``, ``Namespace`` or their string forms."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.split(".")[-1].strip() == "Namespace"
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Namespace"
    return isinstance(annotation, ast.Name) and annotation.id == "Namespace"


def _reads_attributes(function: ast.AST, name: str) -> bool:
    """Whether ``function`` reads an attribute of its parameter ``name``: a parameter called
    ``args`` read as ``args.flag`` is a Namespace in all but its annotation (``args: Any``)."""
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name
               for n in ast.walk(function))


def command_line_code(source: str, name: str) -> list[str]:
    """``name:line: what`` for each parser call and each function taking a Namespace in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, name)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in PARSER_CALLS):
            found.append((node.lineno, f".{node.func.attr}("))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                if _is_namespace(arg.annotation):
                    found.append((node.lineno, f"{node.name}({arg.arg}: Namespace)"))
                elif arg.arg == "args" and _reads_attributes(node, "args"):
                    found.append((node.lineno, f"{node.name}(args) reading args.<flag>"))
    return [f"{name}:{line}: {what}" for line, what in sorted(found)]


def library_modules(root: Path) -> list[Path]:
    """Every module of the packages outside tools/cli, less the exempt scripts."""
    paths = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith("tools/cli/") and rel not in EXEMPT:
                paths.append(path)
    return paths


def test_only_tools_cli_builds_the_command_line() -> None:
    found = []
    for path in library_modules(ROOT):
        found += command_line_code(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not found, "command-line code outside tools/cli:\n" + "\n".join(found)


def test_the_scan_finds_parser_calls_and_namespace_parameters() -> None:
    source = textwrap.dedent("""\
        import argparse
        from argparse import Namespace

        def register(bench):
            p = bench.add_parser("x")
            p.add_argument("--n", type=int)
            p.set_defaults(func=run)
            p.add_subparsers()

        def run(args: argparse.Namespace) -> int:
            return 0

        def other(*, ns: "Namespace") -> None:
            pass

        def fine(n: int, names: dict, *args: int) -> None:
            names.setdefault("x", n)

        def handler(args: Any) -> int:
            return args.n

        def passes(args: list) -> int:
            return len(args)
        """)
    assert command_line_code(source, "lib.py") == [
        "lib.py:5: .add_parser(", "lib.py:6: .add_argument(",
        "lib.py:7: .set_defaults(", "lib.py:8: .add_subparsers(", "lib.py:10: run(args: Namespace)",
        "lib.py:13: other(ns: Namespace)", "lib.py:19: handler(args) reading args.<flag>"]
