"""`cxlemu` entry point.

Each subcommand group lives in a module of this package that exposes
``register(subparsers) -> None``; the parser it adds sets ``func=handler(args) -> int``.
``COMMANDS`` names each command's module and the line ``cxlemu --help`` lists for it, so that
``--help`` and ``--version`` import no module and a command imports its own only: the modules
import numpy, the timing core and more at registration, 0.3 s of start-up. A new command goes
into ``COMMANDS`` in the order its module registers it (tests/tools/cli/test_cli_main.py checks
the table against the modules).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from tools.cli._common import CliError

_DEVICE, _MEMDEV, _POISON = "tools.cli.cmd_device", "tools.cli.cmd_memdev", "tools.cli.cmd_poison"
COMMANDS: dict[str, tuple[str, str]] = {  # name -> (module, help), in the order --help lists them
    "presets": ("tools.cli.cmd_presets", "list timing presets with their numbers and sources"),
    "bench": ("tools.cli.cmd_bench", "measure the device: latency, bandwidth, overhead, ..."),
    "trace": ("tools.cli.cmd_trace", "replay, generate and record KV block-access traces"),
    "sim": ("tools.cli.cmd_sim", "simulate serving at datacenter scale: a vLLM-like engine, an "
                                 "accelerator's roofline and the offload tier's firmware model"),
    "quality": ("tools.cli.cmd_quality", "rebuild the quality yardstick (a small Llama that attends far)"),
    "chmu": ("tools.cli.cmd_chmu", "show or configure a device's CHMU (hotness monitoring unit)"),
    "monitor": ("tools.cli.cmd_monitor", "live dashboard of devices (rich)"),
    "exporter": ("tools.cli.cmd_monitor", "Prometheus metrics of devices over HTTP"),
    "serve": (_DEVICE, "serve a device (created if new, as it was if stopped) until SIGINT/SIGTERM"),
    "list": (_DEVICE, "list devices as JSON (like `cxl list -M`)"),
    "raw": (_DEVICE, "send one mailbox command and print the answer as JSON"),
    "destroy": (_DEVICE, "remove a stopped device's files"),
    "identify": (_MEMDEV, "Identify and Identify Memory Device as JSON (MemDev.identity())"),
    "health": (_MEMDEV, "health, temperature and alert state (Get Health Info)"),
    "set-alert-config": (_MEMDEV, "program warning thresholds (like `cxl set-alert-config`)"),
    "partition": (_MEMDEV, "capacity partitioning (Get Partition Info)"),
    "timestamp": (_MEMDEV, "read or set the device clock"),
    "lsa": (_MEMDEV, "read or write the label storage area"),
    "fw": (_MEMDEV, "firmware slots: info, pack, update, activate"),
    "region": ("tools.cli.cmd_region", "create, list and destroy HPA regions over memdevs"),
    "demo": ("tools.cli.cmd_demo", "serve a device in-process and walk through it"),
    "events": ("tools.cli.cmd_events", "show (and with --clear, drain) the event logs as JSON"),
    "poison": (_POISON, "list, inject or clear poisoned 64-B lines"),
    "scan-media": (_POISON, "scan the media for errors (background) and print what it found"),
    "sanitize": (_POISON, "erase media, LSA, poison and events (background, with progress)"),
    "dcd": ("tools.cli.cmd_dcd", "offer, release or list Dynamic Capacity (the fabric manager's side)"),
    "pool": ("tools.cli.cmd_pool", "create the shared KV pool: an index extent offered to hosts"),
}


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


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Given ``argv``, only the module of the command it names registers its parsers;
    every other command is listed by its name and help alone. Without, every module registers."""
    parser = _Parser(prog="cxlemu", description="CXL Type-3 memory expander emulator")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    wanted = None if argv is None else _module_named(argv)
    for name, (module, help_text) in COMMANDS.items():
        if name in sub.choices:  # its module registered it with an earlier command
            continue
        if argv is None or module == wanted:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _module_named(argv: list[str]) -> str | None:
    """The module of the command in ``argv``: its first word that is not an option (cxlemu's own
    options take no value); None for none or an unknown one, which argparse then reports."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    return COMMANDS[command][0] if command in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser(argv).parse_args(argv)
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
    except BrokenPipeError:  # `cxlemu ... | head`: the reader has what it wanted; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        os.close(devnull)
        return 1  # as rich's Console does for the commands that print through it
    except Exception as exc:  # a bug or an unexpected device state: one line unless --debug
        if debug:
            raise
        from emulator.spec.errors import DeviceFileError, DeviceNotFound

        print(f"cxlemu: error: {exc}", file=sys.stderr)
        # no such device, or its files cannot be used as they are (another user's, deleted, no room)
        return 2 if isinstance(exc, (DeviceNotFound, DeviceFileError)) else 1


if __name__ == "__main__":
    sys.exit(main())
