"""`cxlemu` entry point.

Each subcommand group lives in a module of this package that exposes
``register(subparsers) -> None``; the parser it adds sets ``func=handler(args) -> int``.
Add a module to ``_MODULES`` to make its subcommands appear.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tools.cli._common import CliError

_MODULES = [
    "tools.cli.cmd_presets",
    "tools.cli.cmd_bench",
    "tools.cli.cmd_trace",
    "tools.cli.cmd_sim",
    "tools.cli.cmd_chmu",
    "tools.cli.cmd_monitor",
    "tools.cli.cmd_device",
    "tools.cli.cmd_memdev",
    "tools.cli.cmd_region",
    "tools.cli.cmd_demo",
    "tools.cli.cmd_events",
    "tools.cli.cmd_poison",
]


class _Parser(argparse.ArgumentParser):
    """argparse with cxlemu's one-line error format and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)


def version() -> str:
    """The installed distribution's version; from a source tree that is not installed, pyproject's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("cxlemu")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
        except OSError:
            m = None
        return m.group(1) if m else "unknown"


class _VersionAction(argparse.Action):
    """`cxlemu --version`: `cxlemu <version>` on stdout, exit 0 (looked up only when asked)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: object, values: object,
                 option_string: str | None = None) -> None:
        print(f"cxlemu {version()}")
        raise _Done(0)


class _Done(Exception):
    """An option that did all the work (--version): main returns its exit code."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cxlemu", description="CXL Type-3 memory expander emulator")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in _MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except _Done as done:
        return done.exit_code
    except CliError as exc:
        if debug:
            raise
        print(f"cxlemu: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug or an unexpected device state: one line unless --debug
        if debug:
            raise
        from emulator.spec.errors import DeviceFileError, DeviceNotFound

        print(f"cxlemu: error: {exc}", file=sys.stderr)
        # no such device, or its files cannot be used as they are (another user's, deleted, no room)
        return 2 if isinstance(exc, (DeviceNotFound, DeviceFileError)) else 1


if __name__ == "__main__":
    sys.exit(main())
