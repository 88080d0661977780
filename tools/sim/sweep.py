"""``cxlemu sim sweep``: many simulated points as tasks on a Dask cluster; a table, JSON, CSV, plots.

The grid is models x accelerators x pool sizes x policies x workloads x modes x concurrency
levels (:func:`expand`); each :class:`~tools.sim.run.Point` is one task (:func:`run_sweep`) on a
``distributed.LocalCluster`` of one single-threaded worker process per core, or on an existing
cluster (``--address tcp://host:port``; its workers must import this checkout). A point that
fails becomes a row with an ``error`` key; the sweep goes on.

Why Dask and not Ray: ``distributed`` is a pure-Python wheel that installs in seconds on CI, its
LocalCluster starts in about two seconds on a two-core host, and the same ``Client`` API talks to
a remote scheduler. Ray's wheel is 60 MB and more, and its local cluster needs gigabytes of RAM and
several seconds to start: too heavy for tasks of 0.05-2 s each.

Dimensions that do not apply collapse: the eviction policy applies to ``cxl-smart`` only (its
``smart_policy``), the pool size to the ``cxl-*`` modes only (``pool_gb``); the other modes get
one point each with ``policy`` and ``pool_gb`` shown as ``"-"``. In the plots those modes are
the baselines drawn in every (pool, policy) group.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.cli._common import ArgumentError, CliError, need_extra
from tools.sim import hardware as hw
from tools.sim.run import MODES, Point, simulate

__all__ = ["WORKLOADS", "Prices", "SweepError", "cmd_sweep", "cost_per_token", "expand", "parse_levels",
           "register_sweep", "run_sweep", "sort_key", "workload_label", "write_csv", "write_plots"]

#: The named workload presets (``--workloads``); ``fixed``'s context is the grid's ``context``.
WORKLOADS: dict[str, dict[str, Any]] = {
    "fixed": {"kind": "fixed", "context": 4096, "output_tokens": 128, "requests": 8},
    # long turns (1024 new tokens each): from ~20 open sessions on, a 7B's history outgrows an
    # 80 GB accelerator's KV space, so the modes differ
    "sessions": {"kind": "sessions", "sessions": 96, "turns": 4, "system_tokens": 1024, "system_prompts": 4,
                 "user_tokens": 1024, "output_tokens": 128, "think_s": 5.0},
}
CXL_MODES = ("cxl-lru", "cxl-smart")
NA = "-"  # a dimension that does not apply to the row's mode

#: The grid the CLI starts from; every key may be overridden.
DEFAULT_GRID: dict[str, Any] = {
    "models": ["llama-2-7b"], "accelerators": ["h100"], "pool_gb": [1024.0], "policies": ["arc"],
    "workloads": ["fixed", "sessions"], "modes": list(MODES), "concurrency": [1, 2, 4, 8, 16, 32],
}


class SweepError(ValueError):
    """A bad grid value; ``key`` is the grid key (``models``, ``pool_gb``, ...) to change."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _online_policies() -> tuple[str, ...]:
    from firmware_model.policies import ONLINE_POLICY_NAMES

    return ONLINE_POLICY_NAMES


# --------------------------------------------------------------------------- the grid


def workload_label(spec: Mapping[str, Any]) -> str:
    """A preset's name for a preset's spec; else its kind and the keys that differ from that
    kind's preset, e.g. ``fixed(context=512,requests=2)``."""
    for name, preset in WORKLOADS.items():
        if dict(spec) == preset:
            return name
    kind = str(spec.get("kind", "?"))
    base = WORKLOADS.get(kind, {})
    diff = ",".join(f"{k}={v}" for k, v in spec.items() if k != "kind" and base.get(k) != v)
    return f"{kind}({diff})" if diff else kind


def _workload_specs(grid: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The grid's workloads as specs: a name (a preset) or a dict (passed through)."""
    context = grid.get("context")
    contexts = [None] if context is None else (list(context) if isinstance(context, (list, tuple)) else [context])
    for c in contexts:
        if c is not None and (not isinstance(c, int) or c < 1):
            raise SweepError("context", f"context must be a whole number of tokens >= 1, got {c!r}")
    specs: list[dict[str, Any]] = []
    for w in grid.get("workloads", DEFAULT_GRID["workloads"]):
        if isinstance(w, Mapping):
            if w.get("kind") not in ("fixed", "sessions", "trace", "bench"):
                raise SweepError("workloads", f"workload dict {dict(w)!r} needs kind fixed, sessions, trace or bench")
            specs.append(dict(w))
        elif w not in WORKLOADS:
            raise SweepError("workloads", f"unknown workload {w!r}: choose from {', '.join(WORKLOADS)}")
        elif w == "fixed":
            specs.extend(dict(WORKLOADS[w], **({} if c is None else {"context": c})) for c in contexts)
        else:
            specs.append(dict(WORKLOADS[w]))
    return specs


def _names(grid: Mapping[str, Any], key: str, known: Sequence[str], what: str) -> list[str]:
    values = list(grid.get(key, DEFAULT_GRID[key]))
    if not values:
        raise SweepError(key, f"no {key} given: name at least one of {', '.join(known)}")
    for v in values:
        if v not in known:
            raise SweepError(key, f"unknown {what} {v!r}: choose from {', '.join(known)}")
    return values


def _numbers(grid: Mapping[str, Any], key: str, kind: type, what: str) -> list[Any]:
    values = list(grid.get(key, DEFAULT_GRID[key]))
    if not values:
        raise SweepError(key, f"no {key} given: give at least one {what}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
                or not v > 0:
            raise SweepError(key, f"{key} must be {what}s > 0, got {v!r}")
    return values


def expand(grid: Mapping[str, Any]) -> list[Point]:
    """The grid's cartesian product as points, deduplicated and in grid order.

    Keys (each a list; missing ones take :data:`DEFAULT_GRID`'s): ``models``, ``accelerators``,
    ``pool_gb``, ``policies``, ``workloads`` (preset names, or workload dicts passed through),
    ``modes``, ``concurrency``, and ``context`` (an int or a list: the ``fixed`` preset's context).
    ``policies`` varies ``cxl-smart`` only and ``pool_gb`` the ``cxl-*`` modes only; the other
    modes keep the first value. Raises :class:`SweepError` (a ValueError) naming the key."""
    models = _names(grid, "models", tuple(hw.MODELS), "model")
    accs = _names(grid, "accelerators", tuple(hw.ACCELERATORS), "accelerator")
    modes = _names(grid, "modes", MODES, "mode")
    policies = _names(grid, "policies", _online_policies(), "eviction policy")
    pools = [float(p) for p in _numbers(grid, "pool_gb", float, "pool size in GB")]
    levels = _numbers(grid, "concurrency", int, "whole number")
    workloads = _workload_specs(grid)
    if not workloads:
        raise SweepError("workloads", f"no workloads given: name at least one of {', '.join(WORKLOADS)}")
    out: list[Point] = []
    seen: set[str] = set()
    for model, acc, wl, mode in itertools.product(models, accs, workloads, modes):
        mode_pools = pools if mode in CXL_MODES else pools[:1]
        mode_policies = policies if mode == "cxl-smart" else policies[:1]
        for pool, policy, c in itertools.product(mode_pools, mode_policies, levels):
            p = Point(mode=mode, concurrency=c, model=model, accelerator=acc, workload=dict(wl),
                      pool_gb=pool, smart_policy=policy)
            key = json.dumps(p.to_dict(), sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


def point_fields(p: Point) -> dict[str, Any]:
    """The identifying fields of a point's row."""
    return {"model": p.model, "accelerator": p.accelerator, "workload": workload_label(p.workload),
            "pool_gb": p.pool_gb if p.mode in CXL_MODES else NA,
            "policy": p.smart_policy if p.mode == "cxl-smart" else NA, "mode": p.mode,
            "concurrency": p.concurrency, "host_gb": p.host_gb if p.mode == "host-lru" else NA}


def sort_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """(model, accelerator, workload, pool, policy, mode in MODES order, concurrency)."""
    pool = row.get("pool_gb", NA)
    mode = row.get("mode")
    return (row.get("model", ""), row.get("accelerator", ""), row.get("workload", ""),
            -1.0 if pool == NA else float(pool), row.get("policy", NA),
            MODES.index(mode) if mode in MODES else len(MODES), row.get("concurrency", 0))


# --------------------------------------------------------------------------- running


def _run_point(p: Point) -> dict[str, Any]:
    """One task: ``simulate(p)``'s metrics and the point's fields, or the fields and ``error``."""
    ident = point_fields(p)
    try:
        metrics = simulate(p)
    except Exception as e:  # noqa: BLE001 - a failed point is a row, not a crashed sweep
        return {**ident, "error": f"{type(e).__name__}: {e}"}
    return {**metrics, **ident}


def run_sweep(points: Sequence[Point], *, address: str | None = None, workers: int | None = None,
              progress: Callable[[int, int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run every point as a task on a LocalCluster (``workers`` processes, default one per
    core) or on the scheduler at ``address``; the rows sorted by :func:`sort_key`. A task that
    fails (a lost worker, an exception) is a row with ``error``. ``progress(done, total, row)``
    is called as each row arrives."""
    import logging
    from contextlib import ExitStack

    from distributed import Client, LocalCluster, as_completed

    points = list(points)
    if not points:
        return []
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        if address is None:
            cluster = stack.enter_context(LocalCluster(
                n_workers=workers or os.cpu_count() or 1, threads_per_worker=1, processes=True,
                dashboard_address=None, silence_logs=logging.ERROR))
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(Client(address))
        futures = client.map(_run_point, points, pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        for fut in as_completed(futures):
            if fut.status == "finished":
                row = fut.result()
            else:
                exc = fut.exception()
                row = {**point_fields(points[index[fut.key]]), "error": f"{type(exc).__name__}: {exc}"}
            fut.release()
            rows.append(row)
            if progress is not None:
                progress(len(rows), len(points), row)
    rows.sort(key=sort_key)
    return rows


# --------------------------------------------------------------------------- cost


@dataclass(frozen=True, kw_only=True)
class Prices:
    """USD per hour of one accelerator (by name), per GB-hour of CXL pool (charged to
    ``cxl-*`` rows for their ``pool_gb``) and of host memory (``host-lru`` rows, ``host_gb``)."""

    accelerator: dict[str, float] = field(default_factory=dict)
    pool_gb_hour: float = 0.0
    host_gb_hour: float = 0.0


def hourly_cost(row: Mapping[str, Any], prices: Prices) -> float | None:
    """The row's USD per hour, or None when its accelerator has no price."""
    acc = prices.accelerator.get(row.get("accelerator", ""))
    if acc is None:
        return None
    cost = float(acc)
    if row.get("mode") in CXL_MODES and row.get("pool_gb", NA) != NA:
        cost += float(row["pool_gb"]) * prices.pool_gb_hour
    if row.get("mode") == "host-lru" and row.get("host_gb", NA) != NA:
        cost += float(row["host_gb"]) * prices.host_gb_hour
    return cost


def cost_per_token(rows: list[dict[str, Any]], prices: Prices) -> list[dict[str, Any]]:
    """Set ``usd_per_million_tokens`` = hourly cost / (output_tokens_per_s x 3600) x 1e6 on every
    priced row (None where the row failed or produced no tokens); rows whose accelerator has no
    price are left alone. Mutates and returns ``rows``."""
    for row in rows:
        cost = hourly_cost(row, prices)
        if cost is None:
            continue
        tps = row.get("output_tokens_per_s")
        if "error" in row or not isinstance(tps, (int, float)) or not math.isfinite(tps) or tps <= 0:
            row["usd_per_million_tokens"] = None
        else:
            row["usd_per_million_tokens"] = cost / (tps * 3600) * 1e6
    return rows


# --------------------------------------------------------------------------- output


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


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or v == NA:
        return NA
    if isinstance(v, float):
        return NA if not math.isfinite(v) else f"{v:,.{digits}f}"
    return str(v)


def print_table(rows: Sequence[Mapping[str, Any]], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    priced = any("usd_per_million_tokens" in r for r in rows)
    failed = any("error" in r for r in rows)
    t = Table(title=f"cxlemu sim sweep: {len(rows)} points")
    for name in ("model", "accelerator", "workload", "pool GB", "policy", "mode", "conc"):
        t.add_column(name)
    for name in ("TTFT p50 ms", "TTFT p99 ms", "TPOT ms", "out tok/s", "preempt", "max conc"):
        t.add_column(name, justify="right")
    if priced:
        t.add_column("$/Mtok", justify="right")
    if failed:
        t.add_column("error", style="red")
    for r in rows:
        cells = [r.get("model"), r.get("accelerator"), r.get("workload"), _fmt(r.get("pool_gb"), 0),
                 r.get("policy"), r.get("mode"), str(r.get("concurrency"))]
        cells += [_fmt(r.get("ttft_p50_ms")), _fmt(r.get("ttft_p99_ms")), _fmt(r.get("tpot_ms"), 2),
                  _fmt(r.get("output_tokens_per_s")), _fmt(r.get("preemptions")), _fmt(r.get("max_concurrency"))]
        if priced:
            cells.append(_fmt(r.get("usd_per_million_tokens"), 3))
        if failed:
            cells.append(r.get("error", ""))
        t.add_row(*[str(c) for c in cells])
    if console is None:  # piped: wide enough for every column rather than the 80 of a non-terminal
        console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(t)


def _slug(v: Any) -> str:
    text = f"{v:g}" if isinstance(v, float) else str(v)
    return re.sub(r"[^A-Za-z0-9.=_-]+", "_", text).strip("_") or "x"


def plot_groups(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], dict[str, list[Mapping[str, Any]]]]:
    """(model, accelerator, workload, pool, policy) -> mode -> rows. ``none`` and ``host-lru``
    (no pool, no policy) are drawn in every group of their (model, accelerator, workload),
    ``cxl-lru`` (no policy) in every policy group of its pool."""
    ok = [r for r in rows if "error" not in r]
    out: dict[tuple[Any, ...], dict[str, list[Mapping[str, Any]]]] = {}
    bases = sorted({(r["model"], r["accelerator"], r["workload"]) for r in ok})
    for base in bases:
        mine = [r for r in ok if (r["model"], r["accelerator"], r["workload"]) == base]
        pools = sorted({r["pool_gb"] for r in mine if r["pool_gb"] != NA}) or [NA]
        policies = sorted({r["policy"] for r in mine if r["policy"] != NA}) or [NA]
        for pool, policy in itertools.product(pools, policies):
            lines: dict[str, list[Mapping[str, Any]]] = {}
            for r in mine:
                if r["pool_gb"] not in (NA, pool) or r["policy"] not in (NA, policy):
                    continue
                lines.setdefault(r["mode"], []).append(r)
            if lines:
                out[(*base, pool, policy)] = {m: sorted(v, key=lambda r: r["concurrency"])
                                              for m, v in sorted(lines.items(), key=lambda kv: MODES.index(kv[0])
                                                                 if kv[0] in MODES else len(MODES))}
    return out


def write_plots(rows: Sequence[Mapping[str, Any]], prefix: str | Path) -> list[Path]:
    """One PNG per (model, accelerator, workload, pool, policy): output tokens/s and TTFT p99
    against concurrency, one line per mode, and $/Mtok when priced. Returns the paths written,
    ``<prefix>-<model>-<accelerator>-<workload>-pool<GB>-<policy>.png``."""
    from tools.plots import plot_against_concurrency

    prefix = Path(prefix)
    if prefix.parent != Path(""):
        prefix.parent.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for (model, acc, wl, pool, policy), lines in plot_groups(rows).items():
        priced = any(r.get("usd_per_million_tokens") is not None for rs in lines.values() for r in rs)
        panels: list[tuple[str, str, str | None]] = [("output_tokens_per_s", "output tokens/s", None),
                                                     ("ttft_p99_ms", "TTFT p99 (ms)", None)]
        if priced:
            panels.append(("usd_per_million_tokens", "$ / M output tokens", None))
        pool_txt = NA if pool == NA else f"{_fmt(pool, 0)} GB"
        path = prefix.with_name(f"{prefix.name}-{_slug(model)}-{_slug(acc)}-{_slug(wl)}-pool{_slug(pool)}"
                                f"-{_slug(policy)}.png")
        plot_against_concurrency({mode: [(r["concurrency"], r) for r in rs] for mode, rs in lines.items()}, panels,
                                 path, title=f"{model} on {acc}, {wl}, pool {pool_txt}, policy {policy}",
                                 panel_width=5.2, dpi=100, legend_size=None)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- the CLI

_LEVELS_HELP = "a range 1..32, a list 1,2,4, or a range with a step 1..32:4 (items may be mixed: 1,2,4..32:4)"


def parse_levels(text: str) -> list[int]:
    """Concurrency levels: ``1..32`` (inclusive), ``1,2,4``, ``1..32:4`` (1, 5, ..., 29), or a
    comma list mixing them; sorted, without repeats. Raises ArgumentError (a CliError, usable as
    an argparse ``type=``)."""
    levels: set[int] = set()
    items = [s.strip() for s in str(text).split(",")]
    if not any(items):
        raise ArgumentError(f"no concurrency levels in {text!r}: use {_LEVELS_HELP}")
    for item in items:
        m = re.fullmatch(r"(\d+)(?:\.\.(\d+)(?::(\d+))?)?", item)
        if not m:
            raise ArgumentError(f"malformed concurrency levels {text!r} (at {item!r}): use {_LEVELS_HELP}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        step = int(m.group(3)) if m.group(3) else 1
        if lo < 1:
            raise ArgumentError(f"concurrency levels must be >= 1, got {item!r}")
        if hi < lo:
            raise ArgumentError(f"empty concurrency range {item!r}: the end must be >= the start")
        if step < 1:
            raise ArgumentError(f"concurrency step must be >= 1, got {item!r}")
        levels.update(range(lo, hi + 1, step))
    return sorted(levels)


def _list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _float(text: str, flag: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise CliError(f"{flag}: malformed {what} {text!r}: use a number, e.g. 2.5") from None
    if not math.isfinite(v) or v < 0:
        raise CliError(f"{flag}: {what} must be a finite number >= 0, got {text!r}")
    return v


def parse_prices(items: Sequence[str] | None) -> dict[str, float]:
    """``--price h100=2.5,a100-80gb=1.6`` (repeatable) -> {accelerator: USD per hour}."""
    out: dict[str, float] = {}
    for item in items or []:
        for pair in _list(item):
            acc, eq, usd = pair.partition("=")
            if not eq:
                raise CliError(f"--price: malformed {pair!r}: use ACCELERATOR=USD_PER_HOUR, e.g. h100=2.5")
            if acc.strip() not in hw.ACCELERATORS:
                raise CliError(f"--price: unknown accelerator {acc.strip()!r}: choose from "
                               f"{', '.join(hw.ACCELERATORS)}")
            out[acc.strip()] = _float(usd.strip(), "--price", "USD per hour")
    return out


_FLAGS = {"models": "--models", "accelerators": "--accelerators", "pool_gb": "--pool-gb",
          "policies": "--policies", "workloads": "--workloads", "modes": "--modes",
          "concurrency": "--concurrency", "context": "--context"}


def grid_from_args(args: argparse.Namespace) -> dict[str, Any]:
    try:
        levels = parse_levels(args.concurrency)
    except CliError as e:
        raise CliError(f"--concurrency: {e}") from None
    pools = []
    for s in _list(args.pool_gb):
        v = _float(s, "--pool-gb", "pool size in GB")
        if v <= 0:
            raise CliError(f"--pool-gb: pool sizes must be > 0 GB, got {s!r}")
        pools.append(v)
    grid: dict[str, Any] = {"models": _list(args.models), "accelerators": _list(args.accelerators),
                            "pool_gb": pools, "policies": _list(args.policies),
                            "workloads": _list(args.workloads), "modes": _list(args.modes), "concurrency": levels}
    if args.context is not None:
        if args.context < 1:
            raise CliError(f"--context: the fixed workload's context must be >= 1 token, got {args.context}")
        grid["context"] = args.context
    return grid


def register_sweep(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``sweep`` to the ``cxlemu sim`` subparsers ``sub``."""
    p = sub.add_parser("sweep", help="simulate a grid of points on a Dask cluster; table, JSON, CSV, plots",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULT_GRID
    p.add_argument("--models", default=",".join(d["models"]), help=f"comma list of {', '.join(hw.MODELS)}")
    p.add_argument("--accelerators", default=",".join(d["accelerators"]),
                   help=f"comma list of {', '.join(hw.ACCELERATORS)}")
    p.add_argument("--pool-gb", default=",".join(f"{g:g}" for g in d["pool_gb"]),
                   help="comma list of CXL pool sizes in GB (cxl-* modes)")
    p.add_argument("--policies", default=",".join(d["policies"]),
                   help="comma list of eviction policies for cxl-smart (arc, lru, s3fifo, ...)")
    p.add_argument("--workloads", default=",".join(d["workloads"]), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--context", type=int, default=None, help="the fixed workload's context in tokens (4096)")
    p.add_argument("--modes", default=",".join(d["modes"]), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help=_LEVELS_HELP)
    p.add_argument("--address", default=None, help="an existing Dask scheduler, tcp://host:port "
                                                   "(default: a LocalCluster here)")
    p.add_argument("--workers", type=int, default=None, help="LocalCluster worker processes (default: one per core)")
    p.add_argument("--price", action="append", default=None, metavar="ACC=USD_PER_HOUR",
                   help="accelerator price, e.g. h100=2.5,a100-80gb=1.6 (repeatable); adds $/Mtok")
    p.add_argument("--pool-price", default=None, metavar="USD_PER_GB_HOUR", help="CXL pool price (cxl-* modes)")
    p.add_argument("--host-price", default=None, metavar="USD_PER_GB_HOUR", help="host memory price (host-lru)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="the rows as a JSON list: to stdout instead of the table, or to PATH")
    p.add_argument("--csv", default=None, metavar="PATH", help="the rows as CSV")
    p.add_argument("--plot", nargs="?", const="sweep", default=None, metavar="PREFIX",
                   help="one PNG per (model, accelerator, workload, pool, policy): PREFIX-....png (default: sweep)")
    p.set_defaults(func=cmd_sweep)
    return p


def cmd_sweep(args: argparse.Namespace) -> int:
    need_extra("distributed", "sim", "sim sweep")
    grid = grid_from_args(args)
    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    if args.workers is not None and args.address is not None:
        raise CliError("--workers sizes the local cluster: drop it when giving --address")
    if args.address is not None and not args.address.strip():
        raise CliError("--address: give a scheduler address such as tcp://host:8786")
    prices = Prices(accelerator=parse_prices(args.price),
                    pool_gb_hour=0.0 if args.pool_price is None else _float(args.pool_price, "--pool-price",
                                                                            "USD per GB-hour"),
                    host_gb_hour=0.0 if args.host_price is None else _float(args.host_price, "--host-price",
                                                                            "USD per GB-hour"))
    if (args.pool_price is not None or args.host_price is not None) and not prices.accelerator:
        raise CliError("--pool-price/--host-price need --price ACCELERATOR=USD_PER_HOUR for the accelerators")
    try:
        points = expand(grid)
    except SweepError as e:
        raise CliError(f"{_FLAGS.get(e.key, e.key)}: {e}") from None

    from rich import progress as rp
    from rich.console import Console

    err = Console(stderr=True)
    workers = args.workers or (os.cpu_count() or 1)
    where = args.address or f"a LocalCluster of {workers} workers"
    err.print(f"{len(points)} points on {where}")
    t0 = time.perf_counter()
    with rp.Progress(rp.TextColumn("sweep"), rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
                     console=err, transient=True) as bar:
        task = bar.add_task("sweep", total=len(points))
        rows = run_sweep(points, address=args.address, workers=args.workers,
                         progress=lambda done, total, row: bar.update(task, completed=done))
    wall = time.perf_counter() - t0
    if prices.accelerator:
        cost_per_token(rows, prices)

    to_stdout_json = args.json == "-"
    if args.json is not None and not to_stdout_json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(json_rows(rows), indent=2) + "\n")
    if args.csv is not None:
        write_csv(rows, args.csv)
    if to_stdout_json:
        json.dump(json_rows(rows), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_table(rows)
    note = err if to_stdout_json else Console()
    if args.plot is not None:
        for path in write_plots(rows, args.plot):
            note.print(f"wrote {path}")
    failed = sum("error" in r for r in rows)
    note.print(f"{len(rows)} points in {wall:.1f} s ({len(rows) / wall if wall > 0 else 0:.1f} points/s)"
               + (f", {failed} failed" if failed else ""))
    return 1 if failed else 0
