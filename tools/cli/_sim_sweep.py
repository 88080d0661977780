"""``cxlemu sim sweep``'s arguments and output: the grid from the flags, prices, the run with a
progress bar (the sweep itself is ``tools.sim.sweep``)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tools.cli._common import ArgumentError, CliError, need_extra, parse_port
from tools.sim import hardware as hw
from tools.sim import sweep
from tools.sim.export import json_rows, write_csv
from tools.sim.grid import DEFAULT_GRID, NA, WORKLOADS, SweepError, expand
from tools.sim.modes import SIM_MODES as MODES
from tools.sim.plots import write_plots
from tools.sim.pricing import Prices, cost_per_token
from tools.sim.sweep import run_sweep

MAX_LEVELS = 1024  # concurrency levels one run takes: each is a whole simulation
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
        more = range(lo, hi + 1, step)
        if len(levels) + len(more) > MAX_LEVELS:  # checked before a set of 10^8 levels is built
            raise ArgumentError(f"too many concurrency levels in {text!r}: at most {MAX_LEVELS} (each is a "
                                f"whole simulation); use a step, e.g. {lo}..{hi}:{max(1, (hi - lo) // 16)}")
        levels.update(more)
    return sorted(levels)


#: Dask's protocols a scheduler listens on; a bare HOST:PORT is tcp
_SCHEDULER_PROTOCOLS = ("tcp", "tls", "ucx", "ws", "wss")
_ADDRESS_RE = re.compile(r"(?:(?P<proto>[A-Za-z][A-Za-z0-9+.-]*)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+)"
                         r":(?P<port>[^:/\s]*)")


def parse_address(text: str) -> str:
    """A Dask scheduler address, ``[PROTOCOL://]HOST:PORT``, checked before a cluster is asked (an
    argparse ``type=``); returns it stripped. Raises ArgumentError saying the form."""
    address = text.strip()
    m = _ADDRESS_RE.fullmatch(address)
    if not m:
        raise ArgumentError(f"malformed scheduler address {text!r}: use [PROTOCOL://]HOST:PORT, "
                            "e.g. tcp://10.0.0.5:8786")
    if m["proto"] and m["proto"] not in _SCHEDULER_PROTOCOLS:
        raise ArgumentError(f"unknown protocol {m['proto']!r} in {text!r}: use one of "
                            f"{', '.join(_SCHEDULER_PROTOCOLS)}, e.g. tcp://10.0.0.5:8786")
    parse_port(m["port"])  # 1..65535, or an ArgumentError saying so
    return address


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
        acc = r.get("accelerator") if r.get("tp", 1) == 1 else f"{r.get('tp')} x {r.get('accelerator')}"
        acc += "" if r.get("cost_model", "roofline") == "roofline" else f" ({r.get('cost_model')})"
        cells = [r.get("model"), acc, r.get("workload"), _fmt(r.get("pool_gb"), 0),
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


_FLAGS = {"models": "--models", "accelerators": "--accelerators", "tp": "--tp", "cost": "--cost",
          "pool_gb": "--pool-gb",
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
    tps = []
    for s in _list(args.tp):
        if not s.isdigit() or int(s) < 1:
            raise CliError(f"--tp: malformed tensor parallelism {s!r}: use whole numbers >= 1, e.g. 1,4,8")
        tps.append(int(s))
    grid: dict[str, Any] = {"models": _list(args.models), "accelerators": _list(args.accelerators),
                            "pool_gb": pools, "policies": _list(args.policies),
                            "workloads": _list(args.workloads), "modes": _list(args.modes), "concurrency": levels,
                            "tp": tps, "cost": _list(args.cost)}
    if args.context is not None:
        if args.context < 1:
            raise CliError(f"--context: the fixed workload's context must be >= 1 token, got {args.context}")
        grid["context"] = args.context
    return grid


def register_sweep(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``sweep`` to the ``cxlemu sim`` subparsers ``sub``."""
    p = sub.add_parser("sweep", help="simulate a grid of points on a Dask cluster; table, JSON, CSV, plots",
                       description=sweep.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--tp", default="1", help="comma list of tensor parallelism degrees: accelerators per instance "
                                             "(default 1); an instance is priced as that many accelerators")
    p.add_argument("--cost", default="roofline", help="comma list of step cost models: roofline (default), profile "
                                                      "(Vidur's measured operators where profiled)")
    p.add_argument("--address", type=parse_address, default=None, help="an existing Dask scheduler, tcp://host:port "
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
