"""``cxlemu sim fleet-sweep``: fleets over speeds x sizes x KV homes x routers x admissions x home
sizes x pool policies as Dask tasks; a table, the CXL pool's goals, its break-even price, JSON,
CSV and plots (the sweep itself is ``tools.sim.fleet_sweep``)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from tools.cli._common import CliError, need_extra
from tools.cli._sim_fleet import add_fleet_flags, parse_tokens, point_from_args

__all__ = ["register_fleet_sweep"]


def _list(text: str, parse: Any, flag: str) -> list[Any]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise CliError(f"{flag}: give at least one value")
    out = []
    for s in items:
        try:
            out.append(parse(s))
        except (ValueError, CliError) as exc:
            raise CliError(f"{flag}: {exc}") from None
    return out


def _known(options: Any) -> Any:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"unknown {text!r}: choose from {', '.join(options)}")
        return text
    return parse


def _positive_number(text: str) -> float:
    v = float(text)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"must be > 0, got {text!r}")
    return v


def register_fleet_sweep(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tools.sim.fleet_sweep import FLEET_GRID

    g = FLEET_GRID
    p = sub.add_parser("fleet-sweep", help="fleets over speeds, sizes, KV homes, routers and admissions on Dask; "
                                           "the CXL pool's goals and break-even price",
                       description=__doc__)
    add_fleet_flags(p)
    p.add_argument("--speeds", default=",".join(f"{v:g}" for v in g["speeds"]), help="comma list of speeds (1,2,4)")
    p.add_argument("--instances", default=",".join(map(str, g["instances"])), help="comma list of fleet sizes (8,16)")
    p.add_argument("--kv", default=",".join(g["kv"]), help="comma list of KV homes (all)")
    p.add_argument("--routers", default=",".join(g["routers"]), help="comma list of routers (all)")
    p.add_argument("--admissions", default=",".join(g["admissions"]), help="comma list of admissions (both)")
    p.add_argument("--cache-tokens", default="1M,3M", help="comma list of each instance's home share (1M,3M)")
    p.add_argument("--policies", default="lru", help="comma list of the pool's eviction policies (lru)")
    p.add_argument("--workers", type=int, default=None, help="LocalCluster worker processes (default: one per core)")
    p.add_argument("--address", default=None, help="an existing Dask scheduler, tcp://host:port")
    p.add_argument("--json", default=None, metavar="PATH", help="rows, goals and break-even prices as JSON")
    p.add_argument("--csv", default=None, metavar="PATH", help="the rows as CSV")
    p.add_argument("--plot", default=None, metavar="PREFIX", help="PNGs: hit rate, TTFT p99, goodput against speed")
    p.set_defaults(func=cmd_fleet_sweep)
    return p


def _grid(args: argparse.Namespace) -> dict[str, list[Any]]:
    from tools.sim.fleet import ADMISSIONS
    from tools.sim.kvhome import HOMES
    from tools.sim.router import ROUTERS

    return {"speeds": _list(args.speeds, _positive_number, "--speeds"),
            "instances": _list(args.instances, lambda s: int(_positive_number(s)), "--instances"),
            "kv": _list(args.kv, _known(HOMES), "--kv"), "routers": _list(args.routers, _known(ROUTERS), "--routers"),
            "admissions": _list(args.admissions, _known(ADMISSIONS), "--admissions"),
            "cache_tokens": _list(args.cache_tokens, parse_tokens, "--cache-tokens"),
            "policies": _list(args.policies, str, "--policies")}


def cmd_fleet_sweep(args: argparse.Namespace) -> int:
    from tools.sim import fleet_sweep as fs
    from tools.sim.export import json_rows, write_csv
    from tools.sim.sweep import run_sweep

    need_extra("distributed", "sim", "sim fleet-sweep")
    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    base = point_from_args(args)
    try:
        points = fs.expand_fleet(base, _grid(args))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not os.path.exists(args.trace):
        raise CliError(f"cannot read trace {args.trace}: no such file")
    err = sys.stderr
    print(f"{len(points)} fleets on {args.address or f'a LocalCluster of {args.workers or os.cpu_count()} workers'}",
          file=err, flush=True)
    t0 = time.perf_counter()
    rows = run_sweep(points, address=args.address, workers=args.workers, task=fs.fleet_row, fields=fs.fleet_fields,
                     order=fs.fleet_order,
                     progress=lambda done, total, row: print(f"\r{done}/{total}", end="", file=err, flush=True))
    wall = time.perf_counter() - t0
    print(file=err)
    goals = fs.goals(rows)
    even = fs.break_even(rows, accelerator_hour=args.price, host_gb_hour=args.host_price) if args.price else []
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": json_rows(rows), "goals": json_rows(goals),
                                               "break_even": json_rows(even)}, indent=1) + "\n")
    if args.csv:
        write_csv(rows, args.csv)
    _print(rows, goals, even)
    if args.plot:
        need_extra("matplotlib", "sim", "sim fleet-sweep --plot")
        for path in fs.write_fleet_plots(rows, args.plot):
            print(f"wrote {path}")
    failed = [r for r in rows if "error" in r]
    print(f"{len(rows)} fleets in {wall:.0f} s" + (f", {len(failed)} failed: {failed[0]['error']}" if failed else ""))
    return 1 if failed else 0


def _f(v: Any, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:,.{digits}f}"


def _print(rows: list[dict[str, Any]], goals: list[dict[str, Any]], even: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 180)
    t = Table(title=f"sim fleet-sweep: {len(rows)} fleets")
    for c in ("speed", "K", "router", "admission", "home", "tokens/host", "hit %", "TTFT p99 ms", "goodput",
              "$/M tok"):
        t.add_column(c, justify="right")
    for r in rows:
        if "error" in r:
            continue
        t.add_row(f"{r['speed']:g}", str(r["instances"]), r["router"], r["admission"], r["kv"],
                  f"{r['cache_tokens'] / 1e6:g}M", _f(100 * r["hit_rate"], 1), _f(r["ttft_p99_ms"], 0),
                  _f(r["goodput"]), _f(r.get("usd_per_m_output_tokens")))
    con.print(t)
    g = Table(title="cxl-pool against its goals: hit rate >= 2x host's, TTFT p99 <= 0.5x rdma's, goodput >= 1.3x "
                    "none+fcfs's")
    for c in ("speed", "K", "router", "admission", "tokens/host", "policy", "hit / host", "TTFT p99 / rdma",
              "goodput / none fcfs"):
        g.add_column(c, justify="right")
    for r in goals:
        g.add_row(f"{r['speed']:g}", str(r["instances"]), r["router"], r["admission"], f"{r['cache_tokens'] / 1e6:g}M",
                  r["policy"], _f(r["hit_vs_host"]), _f(r["ttft_p99_vs_rdma"]), _f(r["goodput_vs_none_fcfs"]))
    con.print(g)
    for r in even:
        con.print(f"break-even pool price ({r['speed']:g}x, {r['instances']} instances, {r['router']}, "
                  f"{r['admission']}, "
                  f"{r['cache_tokens'] / 1e6:g}M a host, {r['pool_gb']:,.0f} GB): vs host ${_f(r['vs_host'], 4)}"
                  f"/GB-h, vs none ${_f(r['vs_none'], 4)}/GB-h")
