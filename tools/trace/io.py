"""Trace files, in two formats; readers tell them apart by their first bytes, not their names.

**JSON lines**: one JSON object per line with at least ``"t"`` (step) and ``"block"`` (a key).
Optional fields: ``"seq"`` (sequence id) and ``"layer"``. A block key may be any JSON value; lists
become tuples so they can be dictionary keys. Blank lines and lines starting with ``#`` are skipped.
One reader (:func:`load_columns`) decodes the lines with orjson straight into columns; a file it
does not take at once (blank or comment lines, a bad line, an integer beyond 64 bits, which orjson
would round to a float) it reads again line by line with the standard library, exact for any
integer, and names the first bad line. Anything else in a file (binary data) is a
:class:`TraceFormatError` naming the file.

**Binary** (``numpy.savez``, ``.npz``, no pickles): int64 columns ``t``, ``block``, ``seq`` and
``layer`` of equal length. Integer keys are stored as they are; other keys as ids (0, 1, ... in
order of first appearance) with a column ``block_keys`` (or ``seq_keys``) of the keys' JSON texts,
id i's key at index i. A ``.npy`` holding one integer array is read as the block column alone
(``t`` = the access index). :func:`load_columns` gives the columns without building an
:class:`~firmware_model.replay.Access` per record: what ``cxlemu trace replay`` replays.
"""
from __future__ import annotations

import io
import json
import zipfile
import zlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import orjson

from firmware_model.replay import Access

__all__ = ["COLUMNS", "TraceColumns", "TraceFormatError", "dump_access", "is_binary", "load_columns",
           "load_trace", "read_trace", "save_binary", "to_columns", "write_trace"]

COLUMNS = ("t", "block", "seq", "layer")
_NPZ_MAGIC, _NPY_MAGIC = b"PK", b"\x93NUMPY"
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


class TraceFormatError(ValueError):
    """A trace file is not a trace: a line that is not a JSON object with "t" and "block", binary
    data where JSON lines are expected, a binary trace numpy cannot read; the message names the file
    (and the line)."""


class _Irregular(Exception):
    """The fast pass met something it leaves to the careful one (see :func:`_read_jsonl`)."""


def _hashable(value: Any, rounded: bool = False) -> Hashable:
    """A JSON key as a dictionary key (lists as tuples); ``rounded``: the value came from orjson,
    which turns an integer beyond 64 bits into a float, so a float that large is _Irregular."""
    if isinstance(value, list):
        return tuple(_hashable(v, rounded) for v in value)
    if isinstance(value, dict):
        raise TypeError("a block key cannot be a JSON object: use a number, string or list")
    if rounded and type(value) is float and abs(value) >= 2.0 ** 63:
        raise _Irregular
    return value


def _jsonable(value: Hashable) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _record(line: bytes, where: str) -> dict[str, Any]:
    """One line checked as a record, decoded by the standard library; raises TraceFormatError."""
    try:
        text: str | None = line.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:
        raise TraceFormatError(f"{where}: binary data, not JSON lines; a trace is JSON lines or a binary "
                               ".npz/.npy file") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON ({exc.msg}); each line must be one JSON object") from None
    if not isinstance(obj, dict) or "t" not in obj or "block" not in obj:
        raise TraceFormatError(f'{where}: each line needs an object with "t" and "block", got {text[:80]!r}')
    for field, what in (("t", "an integer step"), ("layer", "an integer")):
        value = obj.get(field, 0)
        if not _is_int(value) or not _INT64_MIN <= value <= _INT64_MAX:
            raise TraceFormatError(f'{where}: "{field}" must be {what} (64-bit), got {value!r}')
    try:
        _hashable(obj["block"]), _hashable(obj.get("seq", 0))
    except TypeError as exc:
        raise TraceFormatError(f"{where}: {exc}") from None
    return obj


def read_trace(stream: TextIO, source: str = "<trace>") -> list[Access]:
    """JSON lines from a text stream; raises TraceFormatError naming ``source`` and the line."""
    return _read_jsonl(stream.read().encode("utf-8"), source).accesses()


def load_trace(path: str | Path) -> list[Access]:
    """Read a trace file (JSON lines or binary); raises TraceFormatError or OSError."""
    return load_columns(path).accesses()


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


@dataclass(frozen=True, eq=False)
class TraceColumns:
    """A trace as int64 columns; ``block_keys[i]`` / ``seq_keys[i]`` is id i's key (None: the ids
    are the keys)."""

    t: np.ndarray
    block: np.ndarray
    seq: np.ndarray
    layer: np.ndarray
    block_keys: list[Hashable] | None = None
    seq_keys: list[Hashable] | None = None

    def __len__(self) -> int:
        return len(self.block)

    def accesses(self) -> list[Access]:
        def keys(ids: np.ndarray, table: list[Hashable] | None) -> list[Hashable]:
            return ids.tolist() if table is None else [table[i] for i in ids.tolist()]

        blocks, seqs = keys(self.block, self.block_keys), keys(self.seq, self.seq_keys)
        return [Access(t, b, s, la) for t, b, s, la in zip(self.t.tolist(), blocks, seqs, self.layer.tolist())]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _all_int(values: Sequence[Any]) -> bool:
    """Whether every value is an int, not a bool (one pass in C: 200,000 values in ~5 ms)."""
    return set(map(type, values)) <= {int}


def _id_column(values: Sequence[Hashable]) -> tuple[np.ndarray, list[Hashable] | None]:
    if _all_int(values):
        try:
            return np.array(values, dtype=np.int64), None
        except OverflowError:
            pass  # beyond int64: stored as keys
    index: dict[Hashable, int] = {}
    ids = np.fromiter((index.setdefault(v, len(index)) for v in values), dtype=np.int64, count=len(values))
    return ids, list(index)


def to_columns(accesses: Sequence[Access]) -> TraceColumns:
    block, block_keys = _id_column([a.block for a in accesses])
    seq, seq_keys = _id_column([a.seq for a in accesses])
    return TraceColumns(t=np.array([a.t for a in accesses], dtype=np.int64), block=block, seq=seq,
                        layer=np.array([a.layer for a in accesses], dtype=np.int64),
                        block_keys=block_keys, seq_keys=seq_keys)


def save_binary(trace: Sequence[Access] | TraceColumns, path: str | Path) -> int:
    """Write ``trace`` as a binary (``.npz``) trace; returns the number of accesses.

    ``np.savez`` appends ``.npz`` to a name without it: give the name with it."""
    cols = trace if isinstance(trace, TraceColumns) else to_columns(trace)
    arrays = {name: getattr(cols, name) for name in COLUMNS}
    for name, table in (("block_keys", cols.block_keys), ("seq_keys", cols.seq_keys)):
        if table is not None:
            arrays[name] = np.array([json.dumps(_jsonable(k), separators=(",", ":")) for k in table], dtype=np.str_)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return len(cols)


def is_binary(path: str | Path) -> bool:
    """Whether ``path`` holds a binary (numpy) trace rather than JSON lines."""
    with open(path, "rb") as f:
        return _binary_head(f.read(len(_NPY_MAGIC)))


def _binary_head(data: bytes) -> bool:
    return data.startswith((_NPZ_MAGIC, _NPY_MAGIC))


def _key_table(texts: np.ndarray, where: str) -> list[Hashable]:
    try:
        return [_hashable(json.loads(str(x))) for x in texts]
    except (json.JSONDecodeError, TypeError) as exc:
        raise TraceFormatError(f"{where}: a key is not a JSON number, string or list ({exc})") from None


def _read_jsonl(data: bytes, source: str) -> TraceColumns:
    """JSON lines to columns, without an Access per record. The fast pass decodes every line with
    orjson and takes the file if each is a plain record; anything else (a blank or comment line, a
    bad line, a rounded integer) sends it to the careful pass: the standard library line by line,
    which skips blank and comment lines, is exact for any integer and names the first bad line."""
    lines = data.splitlines()
    try:
        return _columns(list(map(orjson.loads, lines)), rounded=True)
    except (orjson.JSONDecodeError, _Irregular):
        pass
    records = [_record(text, f"{source}:{lineno}") for lineno, line in enumerate(lines, 1)
               if (text := line.strip()) and not text.startswith(b"#")]
    return _columns(records, rounded=False)


def _columns(objs: list[Any], rounded: bool) -> TraceColumns:
    """Records to columns; raises _Irregular for anything that is not a plain record (the careful
    pass gives only records :func:`_record` checked)."""
    try:
        t = [o["t"] for o in objs]
        blocks = [o["block"] for o in objs]
        bare = set(map(len, objs)) <= {2}  # "t" and "block" alone (most traces): seq and layer are 0
        seqs = [] if bare else [o.get("seq", 0) for o in objs]
        layers = [] if bare else [o.get("layer", 0) for o in objs]
    except (TypeError, KeyError, AttributeError):  # a line that is not an object with "t" and "block"
        raise _Irregular from None
    if not _all_int(t) or not _all_int(layers):
        raise _Irregular
    try:
        if not _all_int(blocks):
            blocks = [_hashable(b, rounded) for b in blocks]
        if not _all_int(seqs):
            seqs = [_hashable(v, rounded) for v in seqs]
    except TypeError:
        raise _Irregular from None
    try:
        t_col, layer_col = np.array(t, dtype=np.int64), np.array(layers, dtype=np.int64)
    except OverflowError:  # beyond int64: the careful pass names the line
        raise _Irregular from None
    block, block_keys = _id_column(blocks)
    seq, seq_keys = _id_column(seqs)
    if bare:
        seq = layer_col = np.zeros(len(objs), dtype=np.int64)
    return TraceColumns(t=t_col, block=block, seq=seq, layer=layer_col, block_keys=block_keys, seq_keys=seq_keys)


def load_columns(path: str | Path) -> TraceColumns:
    """Read a trace file (binary or JSON lines) as columns; raises TraceFormatError or OSError."""
    with open(path, "rb") as f:
        data = f.read()
    if not _binary_head(data):
        return _read_jsonl(data, str(path))
    try:
        return _read_binary(io.BytesIO(data), str(path))
    except TraceFormatError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # a damaged file
        raise TraceFormatError(f"{path}: not a trace numpy can read without pickles ({exc})") from None


def _read_binary(f: io.BytesIO, path: str) -> TraceColumns:
    data = np.load(f, allow_pickle=False)
    if isinstance(data, np.ndarray):
        if data.ndim != 1 or data.dtype.kind not in "iu":
            raise TraceFormatError(f"{path}: a .npy trace is one integer array of block keys, "
                                   f"got {data.dtype} of shape {data.shape}")
        n = len(data)
        zeros = np.zeros(n, dtype=np.int64)
        return TraceColumns(t=np.arange(n, dtype=np.int64), block=data.astype(np.int64), seq=zeros, layer=zeros)
    with data:
        missing = [c for c in COLUMNS if c not in data.files]
        if missing:
            raise TraceFormatError(f"{path}: a binary trace needs the columns {', '.join(COLUMNS)}; "
                                   f"missing {', '.join(missing)}")
        cols = {c: data[c] for c in COLUMNS}
        tables = {name: _key_table(data[name], f"{path}:{name}") if name in data.files else None
                  for name in ("block_keys", "seq_keys")}
    n = len(cols["block"])
    for name, col in cols.items():
        if col.ndim != 1 or len(col) != n or col.dtype.kind not in "iu":
            raise TraceFormatError(f"{path}: column {name!r} must be {n} integers, "
                                   f"got {col.dtype} of shape {col.shape}")
    cols = {c: col.astype(np.int64, copy=False) for c, col in cols.items()}
    for name, table in (("block", tables["block_keys"]), ("seq", tables["seq_keys"])):
        if table is not None and n and (cols[name].min() < 0 or cols[name].max() >= len(table)):
            raise TraceFormatError(f"{path}: column {name!r} holds ids outside its {name}_keys table "
                                   f"of {len(table)}")
    return TraceColumns(**cols, block_keys=tables["block_keys"], seq_keys=tables["seq_keys"])
