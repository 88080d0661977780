"""``cxlemu sim fleet-sweep``: fleets on a trace over speeds x sizes x KV homes x routers x admissions
x home sizes x pool policies, each point a Dask task (``tools.sim.sweep.run_sweep``); the fleet
question's comparisons and the pool's break-even price.

Dimensions that do not apply collapse: ``none`` has no home size, only ``cxl-pool`` has a policy.

:func:`goals` sets each ``cxl-pool`` row beside the rows it is judged against (the same speed,
size, router, admission and home size): its hit rate over ``host``'s, its TTFT p99 over
``rdma``'s, its goodput over ``none`` with ``fcfs``. :func:`break_even` gives the pool price per
GB-hour at which the pool's $ per million output tokens of requests within the SLOs equals
``host``'s and ``none``'s: with ``A`` the instances' USD/h, ``G`` the pool's GB and ``R`` each
row's good tokens per hour, ``(A + p G) / R_pool = cost_x / R_x`` gives ``p = (cost_x R_pool /
R_x - A) / G`` (negative: the pool never pays at these prices).
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.sim.fleet import ADMISSIONS
from tools.sim.fleet_point import FleetPoint, run_point
from tools.sim.kvhome import HOMES
from tools.sim.router import ROUTERS

__all__ = ["FLEET_GRID", "break_even", "expand_fleet", "fleet_fields", "fleet_order", "fleet_row", "goals",
           "write_fleet_plots"]

FLEET_GRID: dict[str, list[Any]] = {"speeds": [1.0, 2.0, 4.0], "instances": [8, 16], "kv": list(HOMES),
                                    "routers": list(ROUTERS), "admissions": list(ADMISSIONS),
                                    "cache_tokens": [1_000_000, 3_000_000], "policies": ["lru"]}
_GROUP = ("speed", "instances", "router", "admission")


def expand_fleet(base: FleetPoint, grid: Mapping[str, Sequence[Any]]) -> list[FleetPoint]:
    """The grid's points on ``base`` (missing keys take :data:`FLEET_GRID`'s), in grid order."""
    g = {k: list(grid.get(k, v)) for k, v in FLEET_GRID.items()}
    for k, v in g.items():
        if not v:
            raise ValueError(f"the fleet grid's {k} is empty: give at least one")
    out: list[FleetPoint] = []
    for speed, k, kv, router, adm in itertools.product(g["speeds"], g["instances"], g["kv"], g["routers"],
                                                       g["admissions"]):
        sizes = [0] if kv == "none" else g["cache_tokens"]
        policies = g["policies"] if kv == "cxl-pool" else ["lru"]
        for size, policy in itertools.product(sizes, policies):
            out.append(replace(base, speed=float(speed), instances=int(k), kv=kv, router=router, admission=adm,
                               cache_tokens=int(size), policy=policy))
    return out


def fleet_fields(p: FleetPoint) -> dict[str, Any]:
    return {"speed": p.speed, "instances": p.instances, "kv": p.kv, "router": p.router, "admission": p.admission,
            "cache_tokens": p.cache_tokens, "policy": p.policy if p.kv == "cxl-pool" else "-", "tp": p.tp,
            "model": p.model, "accelerator": p.accelerator, "cost": p.cost}


def fleet_row(p: FleetPoint) -> dict[str, Any]:
    """One task: the fleet's metrics and the point's fields, or the fields and ``error``."""
    try:
        out = run_point(p)
    except Exception as e:  # noqa: BLE001 - a failed point is a row, not a crashed sweep
        return {**fleet_fields(p), "error": f"{type(e).__name__}: {e}"}
    return {**out["fleet"], **fleet_fields(p)}


def fleet_order(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return (row.get("speed", 0), row.get("instances", 0), row.get("router", ""), row.get("admission", ""),
            row.get("cache_tokens", 0), HOMES.index(row["kv"]) if row.get("kv") in HOMES else 9, row.get("policy", ""))


def _key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(k) for k in _GROUP)


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def goals(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each ``cxl-pool`` row against ``host`` (same home size), ``rdma`` (same home size) and
    ``none`` with ``fcfs`` (same speed, size and router)."""
    ok = [r for r in rows if "error" not in r]
    by = {(_key(r), r["kv"], r["cache_tokens"]): r for r in ok if r["kv"] != "cxl-pool"}
    out = []
    for r in ok:
        if r["kv"] != "cxl-pool":
            continue
        host = by.get((_key(r), "host", r["cache_tokens"]))
        rdma = by.get((_key(r), "rdma", r["cache_tokens"]))
        none = by.get(((r["speed"], r["instances"], r["router"], "fcfs"), "none", 0))
        out.append({**{k: r[k] for k in (*_GROUP, "cache_tokens", "policy")},
                    "hit_vs_host": _ratio(r["hit_rate"], host and host["hit_rate"]),
                    "ttft_p99_vs_rdma": _ratio(r["ttft_p99_ms"], rdma and rdma["ttft_p99_ms"]),
                    "goodput_vs_none_fcfs": _ratio(r["goodput"], none and none["goodput"])})
    return out


def break_even(rows: Sequence[Mapping[str, Any]], *, accelerator_hour: float,
               host_gb_hour: float) -> list[dict[str, Any]]:
    """The pool price per GB-hour at which each ``cxl-pool`` row's $/M good tokens equals ``host``'s
    (same home size) and ``none``'s (same admission); None where a row served no good tokens."""
    ok = [r for r in rows if "error" not in r]
    by = {(_key(r), r["kv"], r["cache_tokens"]): r for r in ok}
    out = []
    for r in ok:
        if r["kv"] != "cxl-pool" or not r.get("home_gb"):
            continue
        a = r["instances"] * r["tp"] * accelerator_hour
        rate = r["good_tokens"] / r["sim_s"] * 3600 if r["sim_s"] else 0.0

        def price(other: Mapping[str, Any] | None, cost: float) -> float | None:
            if other is None or not other["good_tokens"] or not rate:
                return None
            other_rate = other["good_tokens"] / other["sim_s"] * 3600
            return (cost * rate / other_rate - a) / r["home_gb"]
        host = by.get((_key(r), "host", r["cache_tokens"]))
        none = by.get((_key(r), "none", 0))
        out.append({**{k: r[k] for k in (*_GROUP, "cache_tokens", "policy")},
                    "pool_gb": r["home_gb"],
                    "vs_host": price(host, a + (host["home_gb"] * host_gb_hour if host else 0.0)),
                    "vs_none": price(none, a)})
    return out


def write_fleet_plots(rows: Sequence[Mapping[str, Any]], prefix: str | Path) -> list[Path]:
    """One PNG per (fleet size, router, admission, home size): hit rate, TTFT p99 and goodput
    against speed, a line per KV home."""
    from tools.sim.plots import plot_against_concurrency

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if "error" not in r]
    panels = [("hit_rate", "hit rate", "prompt tokens from a cache"), ("ttft_p99_ms", "TTFT p99 (ms)", None),
              ("goodput", "goodput (req/s within SLOs)", None)]
    paths = []
    groups = sorted({(r["instances"], r["router"], r["admission"], r["cache_tokens"]) for r in ok if r["kv"] != "none"})
    for k, router, adm, size in groups:
        lines: dict[str, list[tuple[float, Mapping[str, Any]]]] = {}
        for kv in HOMES:
            pts = [r for r in ok if (r["instances"], r["router"], r["admission"], r["kv"]) == (k, router, adm, kv)
                   and r["cache_tokens"] in ((0,) if kv == "none" else (size,)) and r.get("policy") in ("-", "lru")]
            if pts:
                lines[kv] = [(r["speed"], r) for r in sorted(pts, key=lambda r: r["speed"])]
        path = prefix.with_name(f"{prefix.name}-{k}x-{router}-{adm}-{size // 10**6}M.png")
        plot_against_concurrency(lines, panels, path, xlabel="trace speed (x)",
                                 title=f"{k} instances, router {router}, {adm}, {size / 1e6:g}M tokens a host")
        paths.append(path)
    return paths
