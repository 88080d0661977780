"""Trace files: one JSON object per line with at least ``"t"`` (step) and ``"block"`` (a key).

Optional fields: ``"seq"`` (sequence id) and ``"layer"``. A block key may be any JSON value; lists
become tuples so they can be dictionary keys. Blank lines and lines starting with ``#`` are skipped.
"""
from __future__ import annotations

import json
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any, TextIO

from firmware_model.replay import Access

__all__ = ["TraceFormatError", "dump_access", "load_trace", "parse_line", "read_trace", "write_trace"]


class TraceFormatError(ValueError):
    """A trace line is not a JSON object with "t" and "block"; the message names the line."""


def _hashable(value: Any) -> Hashable:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        raise TypeError("a block key cannot be a JSON object: use a number, string or list")
    return value


def _jsonable(value: Hashable) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def parse_line(text: str, lineno: int, source: str = "<trace>") -> Access | None:
    """One line -> an Access, None for a blank or comment line; raises TraceFormatError."""
    text = text.strip()
    if not text or text.startswith("#"):
        return None
    where = f"{source}:{lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON ({exc.msg}); each line must be one JSON object") from None
    if not isinstance(obj, dict) or "t" not in obj or "block" not in obj:
        raise TraceFormatError(f'{where}: each line needs an object with "t" and "block", got {text[:80]!r}')
    t = obj["t"]
    if not isinstance(t, int) or isinstance(t, bool):
        raise TraceFormatError(f'{where}: "t" must be an integer step, got {t!r}')
    try:
        block = _hashable(obj["block"])
        seq = _hashable(obj.get("seq", 0))
    except TypeError as exc:
        raise TraceFormatError(f"{where}: {exc}") from None
    layer = obj.get("layer", 0)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise TraceFormatError(f'{where}: "layer" must be an integer, got {layer!r}')
    return Access(t=t, block=block, seq=seq, layer=layer)


def read_trace(stream: TextIO, source: str = "<trace>") -> list[Access]:
    out = []
    for lineno, line in enumerate(stream, 1):
        access = parse_line(line, lineno, source)
        if access is not None:
            out.append(access)
    return out


def load_trace(path: str | Path) -> list[Access]:
    """Read a JSON-lines trace file; raises TraceFormatError or OSError."""
    with open(path, encoding="utf-8") as f:
        return read_trace(f, str(path))


def dump_access(a: Access) -> str:
    """One Access as a compact JSON line (without the newline)."""
    obj: dict[str, Any] = {"t": a.t, "block": _jsonable(a.block)}
    if a.seq != 0:
        obj["seq"] = _jsonable(a.seq)
    if a.layer != 0:
        obj["layer"] = a.layer
    return json.dumps(obj, separators=(",", ":"))


def write_trace(accesses: Iterable[Access], stream: TextIO) -> int:
    """Write accesses as JSON lines; returns how many."""
    n = 0
    for a in accesses:
        stream.write(dump_access(a) + "\n")
        n += 1
    return n
