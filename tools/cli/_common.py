"""Helpers shared by the `cxlemu` subcommands: argparse types, opening a device, tables.

The error, the size and number parsers and JSON output live in ``tools.common`` (the libraries
below the CLI raise and use them too); they are imported here so a subcommand finds them in one
place."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tools.common import VLLM_MODULE, CliError, need_extra, parse_hex, parse_int, parse_size, print_json

__all__ = ["PORT_RANGE", "VLLM_MODULE", "ArgumentError", "CliError", "add_host_flag", "device_error", "human_table",
           "memdev_session", "need_extra", "open_memdev", "parse_hex", "parse_host", "parse_int", "parse_port",
           "parse_size", "print_json"]


class ArgumentError(CliError, argparse.ArgumentTypeError):
    """A bad option value: as an argparse ``type=`` it becomes ``argument --x: ...`` (exit 2);
    raised anywhere else it is a CliError (exit 2)."""


PORT_RANGE = (1, 65535)


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse ``type=`` for a number > 0 of ``kind`` (int or float; not NaN or infinite):
    a bad one is one line, exit 2."""
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise ArgumentError(f"expected a {'whole number' if kind is int else 'number'}, got {text!r}") from None
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise ArgumentError(f"must be > 0, got {text!r}")
        return v
    return parse


def choice(options: Any, what: str) -> Callable[[str], str]:
    """An argparse ``type=`` for one of ``options`` (named ``what`` in the error)."""
    def parse(text: str) -> str:
        if text not in options:
            raise ArgumentError(f"unknown {what} {text!r}: choose from {', '.join(options)}")
        return text
    return parse


def parse_port(text: str | int) -> int:
    """A TCP port, 1..65535, from decimal text; usable as an argparse ``type=``. Raises
    ArgumentError (a CliError and an argparse.ArgumentTypeError) with the valid range."""
    lo, hi = PORT_RANGE
    try:
        port = int(str(text).strip(), 10)
    except ValueError:
        raise ArgumentError(f"malformed port {text!r}: use a number {lo}..{hi}") from None
    if not lo <= port <= hi:
        raise ArgumentError(f"port must be {lo}..{hi}, got {port}")
    return port


def parse_host(text: str | int) -> int:
    """A host port index from decimal text (``--host``), usable as an argparse ``type=``; whether
    the device has that port is for ``MemDev.open`` to say (``NoSuchHost``, exit 2)."""
    from emulator.device_dir import MAX_HOSTS

    try:
        host = int(str(text).strip(), 10)
    except ValueError:
        raise ArgumentError(f"malformed host port {text!r}: use a number 0..{MAX_HOSTS - 1}") from None
    if not 0 <= host < MAX_HOSTS:
        raise ArgumentError(f"host port must be 0..{MAX_HOSTS - 1}, got {host}")
    return host


def add_host_flag(p: argparse.ArgumentParser) -> None:
    """``--host H``: the host port a device command goes through (default 0)."""
    p.add_argument("--host", type=parse_host, default=0, metavar="H",
                   help="the host port to use (a device served with --hosts N has 0..N-1; default 0)")


def open_memdev(name: str, host: int = 0):  # -> driver.MemDev (imported lazily: `cxlemu --help` stays fast)
    """Open a served device through host port ``host`` for a subcommand; unknown or stopped
    devices, a port it lacks or another process holds, and files that cannot be used as they
    are, become one-line errors."""
    from driver import DeviceFileError, DeviceGone, DeviceNotFound, MemDev, NoSuchHost, PortClaimed

    try:
        return MemDev.open(name, host=host)
    except (DeviceNotFound, DeviceFileError, NoSuchHost) as exc:
        raise CliError(str(exc), exit_code=2) from None
    except (DeviceGone, PortClaimed) as exc:
        raise CliError(str(exc), exit_code=1) from None


@contextmanager
def memdev_session(name: str, host: int = 0) -> Iterator[Any]:
    """An open MemDev for one subcommand: a bad argument (ValueError from a typed wrapper) exits 2,
    a device error (return code, poison, timeout) exits 1, one line each."""
    from driver import CxlemuError

    with open_memdev(name, host) as md:
        try:
            yield md
        except ValueError as exc:
            raise CliError(str(exc)) from None
        except CxlemuError as exc:
            raise CliError(f"{name}: {exc}", exit_code=1) from None


def device_error(exc: Exception) -> CliError:
    """A device-side failure (return code, poison, timeout) as a one-line error with exit 1."""
    return CliError(str(exc), exit_code=1)


def human_table(title: str, rows: dict[str, Any]) -> None:
    """Print a two-column rich table (`--human` output)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in rows.items():
        table.add_row(str(key), str(value))
    Console().print(table)
