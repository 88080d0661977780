"""`cxlemu`'s command table: `--help` and `--version` import no command module, a command imports its
own only, and the table lists what the modules register, in their order, with their help."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from cli_support import ROOT

from tools.cli.main import COMMANDS, build_parser


def _listing(parser: argparse.ArgumentParser) -> list[tuple[str, str | None]]:
    """(name, help) of each command the top-level parser lists, in order."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [(choice.dest, choice.help) for choice in sub._choices_actions]


def test_the_table_is_what_the_modules_register() -> None:
    """The whole parser (every module registered) lists exactly the table's names, order and help."""
    assert _listing(build_parser()) == [(name, help_text) for name, (_, help_text) in COMMANDS.items()]


def test_a_command_registers_its_own_module_and_lists_the_rest() -> None:
    """`cxlemu --debug trace ...` builds trace's parsers; the listing is the same as the whole parser's."""
    parser = build_parser(["--debug", "trace", "gen", "loop"])
    assert _listing(parser) == _listing(build_parser())
    args = parser.parse_args(["--debug", "trace", "gen", "loop", "--steps", "3"])
    assert (args.command, args.kind, args.steps, args.func.__module__) == ("trace", "loop", 3, "tools.cli.cmd_trace")


def _modules_after(*argv: str) -> tuple[str, list[str]]:
    """Run cxlemu in a fresh interpreter; its stdout and the command modules and heavy packages it imported."""
    code = ("import atexit, json, sys\n"
            "atexit.register(lambda: print(json.dumps(sorted(m for m in sys.modules if m.startswith(("
            "('tools.cli.cmd_', 'numpy', 'emulator', 'firmware_model', 'driver'))))), file=sys.stderr))\n"
            "from tools.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(proc.stderr.splitlines()[-1])


def test_help_and_version_import_no_command_module() -> None:
    out, modules = _modules_after("--help")
    assert modules == [] and all(f"    {name}" in out for name in COMMANDS)
    out, modules = _modules_after("--version")
    assert modules == [] and out.startswith("cxlemu ")


def test_a_command_imports_only_its_own_module() -> None:
    out, modules = _modules_after("trace", "gen", "loop", "--steps", "1", "--layers", "1", "--blocks", "1")
    assert [m for m in modules if m.startswith("tools.cli.cmd_")] == ["tools.cli.cmd_trace"]
    assert out == '{"t":0,"block":[0,0,0]}\n'



@pytest.mark.parametrize("argv", [["presets"], ["list"]])  # printed through rich; printed as plain JSON
def test_a_reader_that_closes_early_stops_the_command_quietly(argv: list[str]) -> None:
    """`cxlemu ... | head`: stdout's reader is gone before the command writes; it exits 1 with
    nothing on stderr, whether rich or print writes (`list` said `cxlemu: error: [Errno 32]
    Broken pipe`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "tools.cli.main", *argv], cwd=ROOT, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (1, "")
