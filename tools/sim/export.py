"""Simulated rows as files: valid JSON (NaN as null, numpy scalars as numbers) and CSV."""
from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tools.sim.grid import point_fields
from tools.sim.run import Point

__all__ = ["json_rows", "write_csv"]


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars
        return _clean(v.item())
    return v


def json_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with NaN/inf as null and numpy scalars as Python numbers: valid JSON."""
    return [{k: _clean(v) for k, v in r.items()} for r in rows]


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """Every key of every row as a column, the identifying fields first."""
    first = list(point_fields(Point()))
    cols = first + sorted({k for r in rows for k in r} - set(first))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        for r in json_rows(rows):
            w.writerow({k: "" if v is None else v for k, v in r.items()})
