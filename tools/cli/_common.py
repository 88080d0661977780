"""Helpers shared by the `cxlemu` subcommands: errors, size parsing, JSON output."""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class CliError(Exception):
    """A bad argument or a device error: printed as one line, never a traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def parse_size(text: str) -> int:
    """'1G', '256M', '4096', '2GiB' -> bytes; raises CliError on anything else."""
    m = _SIZE_RE.match(text)
    if not m:
        raise CliError(f"malformed size {text!r}: use a number with an optional K/M/G/T suffix, e.g. 1G")
    unit = (m.group(2) or "").upper()[:1]
    return int(m.group(1)) * _UNITS[unit]


def parse_int(text: str, what: str) -> int:
    """Decimal or 0x-prefixed hex integer; raises CliError naming `what`."""
    try:
        return int(text, 0)
    except ValueError:
        raise CliError(f"malformed {what} {text!r}: use a decimal or 0x-prefixed hex number") from None


def parse_hex(text: str, what: str = "hex payload") -> bytes:
    """Hex string (optional 0x, spaces allowed) -> bytes; raises CliError."""
    cleaned = text.strip().removeprefix("0x").replace(" ", "").replace(":", "")
    try:
        return bytes.fromhex(cleaned)
    except ValueError:
        raise CliError(f"malformed {what} {text!r}: use pairs of hex digits, e.g. 0a1b") from None


def print_json(obj: Any) -> None:
    """Print JSON the way `cxl list` does: indented, one document."""
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def open_memdev(name: str):  # -> driver.MemDev (imported lazily: `cxlemu --help` stays fast)
    """Open a served device for a subcommand; unknown or stopped devices become one-line errors."""
    from driver import DeviceGone, DeviceNotFound, MemDev

    try:
        return MemDev.open(name)
    except DeviceNotFound as exc:
        raise CliError(str(exc), exit_code=2) from None
    except DeviceGone as exc:
        raise CliError(str(exc), exit_code=1) from None


@contextmanager
def memdev_session(name: str) -> Iterator[Any]:
    """An open MemDev for one subcommand: a bad argument (ValueError from a typed wrapper) exits 2,
    a device error (return code, poison, timeout) exits 1, one line each."""
    from driver import CxlemuError

    with open_memdev(name) as md:
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
