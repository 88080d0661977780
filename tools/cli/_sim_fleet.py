"""``cxlemu sim fleet``: many instances behind a router on a Mooncake trace, each KV home
(the fleet itself is ``tools.sim.fleet``; one run from plain values ``tools.sim.fleet_point``)."""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any

from tools.cli._common import ArgumentError, CliError, choice, positive

__all__ = ["add_fleet_flags", "parse_tokens", "point_from_args", "register_fleet"]

_TOKENS_RE = re.compile(r"(\d+(?:\.\d+)?)([KMG]?)", re.IGNORECASE)
_SCALE = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}


def parse_tokens(text: str) -> int:
    """A token count, ``3000000``, ``3M``, ``512K``, ``1.5G`` (decimal: Mooncake's "3M tokens");
    an argparse ``type=`` (ArgumentError says the form)."""
    m = _TOKENS_RE.fullmatch(text.strip())
    if not m:
        raise ArgumentError(f"malformed token count {text!r}: use a whole number with an optional K, M or G "
                            "suffix (powers of 1000), e.g. 3M")
    return int(float(m.group(1)) * _SCALE[m.group(2).upper()])


def _price(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ArgumentError(f"malformed price {text!r}: use a number, e.g. 2.5") from None
    if not math.isfinite(v) or v < 0:
        raise ArgumentError(f"a price must be a finite number >= 0, got {text!r}")
    return v


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the fleet's setup (``sim fleet``, ``sim fleet-sweep``; the swept ones apart)."""
    from tools.sim import hardware as hw
    from tools.sim.profile import COST_MODELS

    p.add_argument("--trace", required=True, metavar="FILE", help="a Mooncake trace (JSON lines: timestamp, "
                   "input_length, output_length, hash_ids)")
    p.add_argument("--model", default="llama-3-70b", type=choice(hw.MODELS, "model"),
                   help=f"{', '.join(hw.MODELS)} (default llama-3-70b)")
    p.add_argument("--accelerator", default="h100", type=choice(hw.ACCELERATORS, "accelerator"),
                   help=f"{', '.join(hw.ACCELERATORS)} (default h100)")
    p.add_argument("--tp", type=positive(int), default=8, help="accelerators per instance, tensor parallel (8)")
    p.add_argument("--limit", type=positive(int), default=None, help="only the trace's first N requests")
    p.add_argument("--cost", default="roofline", type=choice(COST_MODELS, "cost model"),
                   help="the step cost: roofline (default) or profile (Vidur's measured operators where profiled)")
    p.add_argument("--slo-ttft-ms", type=positive(float), default=5000.0, help="goodput's TTFT SLO (5000 ms)")
    p.add_argument("--slo-tpot-ms", type=positive(float), default=100.0, help="goodput's TPOT SLO (100 ms)")
    p.add_argument("--kv-blocks", type=positive(int), default=0,
                   help="each instance's HBM KV space in 16-token blocks instead of what its memory leaves")
    p.add_argument("--rdma-gbps", type=positive(float), default=None, help="rdma: GB/s per node (87)")
    p.add_argument("--rdma-latency-us", type=float, default=None, help="rdma: us per transfer (25, an assumption)")
    p.add_argument("--price", type=_price, default=0.0, metavar="USD_PER_HOUR",
                   help="one accelerator's price per hour (adds $/M output tokens)")
    p.add_argument("--host-price", type=_price, default=0.0, metavar="USD_PER_GB_HOUR",
                   help="host DRAM per GB-hour (host; rdma's store is host DRAM too)")
    p.add_argument("--pool-price", type=_price, default=0.0, metavar="USD_PER_GB_HOUR", help="CXL pool per GB-hour")


def register_fleet(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tools.sim.fleet import ADMISSIONS
    from tools.sim.kvhome import HOMES
    from tools.sim.router import ROUTERS

    p = sub.add_parser("fleet", help="many instances behind a router on a Mooncake trace, KV in HBM, host DRAM, "
                                     "an RDMA store or a CXL pool",
                       description="Simulate a fleet of vLLM instances serving a Mooncake trace: a router, each "
                                   "instance's HBM prefix cache and a KV home (none, per-host DRAM, one RDMA store "
                                   "or one CXL pool shared by all).")
    add_fleet_flags(p)
    p.add_argument("--speed", type=positive(float), default=1.0, help="arrival rate x this (default 1: the trace's)")
    p.add_argument("--admission", default="fcfs", type=choice(ADMISSIONS, "admission"),
                   help="fcfs (vLLM, default) or memory-aware (early rejection by predicted load)")
    p.add_argument("--policy", default="lru", help="the CXL pool's eviction policy: lru (default), arc, s3fifo, "
                   "... or package.module:Class")
    p.add_argument("--instances", type=positive(int), default=16, help="instances (default 16)")
    p.add_argument("--router", default="prefix", type=choice(ROUTERS, "router"),
                   help="rr, least-loaded or prefix (uncached prefill + queued work; default)")
    p.add_argument("--kv", default="none", type=choice(HOMES, "KV home"), help=", ".join(HOMES) + " (default none)")
    p.add_argument("--cache-tokens", type=parse_tokens, default=0,
                   help="each instance's share of its KV home in tokens, K/M/G accepted (3M); shared homes hold "
                        "instances x this")
    p.add_argument("--json", action="store_true", help="the fleet, its instances and the setup as one JSON object")
    p.set_defaults(func=cmd_fleet)
    return p


def point_from_args(args: argparse.Namespace, **over: Any) -> Any:
    """A FleetPoint from the flags (``over`` sets the swept keys)."""
    from tools.sim.fleet_point import FleetPoint
    from tools.sim.kvhome import RDMA_GBPS, RDMA_LATENCY_US

    if args.rdma_latency_us is not None and not (math.isfinite(args.rdma_latency_us) and args.rdma_latency_us >= 0):
        raise CliError(f"--rdma-latency-us must be >= 0, got {args.rdma_latency_us}")
    kw: dict[str, Any] = dict(
        trace=args.trace, model=args.model, accelerator=args.accelerator, tp=args.tp,
        limit=args.limit or 0, cost=args.cost,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, kv_blocks=args.kv_blocks,
        rdma_gbps=args.rdma_gbps or RDMA_GBPS,
        rdma_latency_us=RDMA_LATENCY_US if args.rdma_latency_us is None else args.rdma_latency_us,
        accelerator_hour=args.price, host_gb_hour=args.host_price, pool_gb_hour=args.pool_price)
    kw.update(over)
    try:
        return FleetPoint(**kw)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def check_run(point: Any) -> dict[str, Any]:
    """Run one point; every input error as a CliError (one line, exit 2)."""
    from tools.sim.fleet_point import run_point
    from tools.sim.mooncake import MooncakeTraceError

    try:
        return run_point(point)
    except OSError as exc:
        raise CliError(f"cannot read trace {point.trace}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"trace {point.trace} is binary, not JSON lines (byte {exc.object[exc.start]:#04x} is not "
                       "UTF-8)") from None
    except MooncakeTraceError as exc:
        raise CliError(f"trace {point.trace}: {exc}") from None
    except ValueError as exc:  # an unknown policy, a KV space too small, a model that does not split
        raise CliError(str(exc)) from None


def cmd_fleet(args: argparse.Namespace) -> int:
    from tools.sim.export import json_rows

    if args.kv != "none" and args.cache_tokens == 0:
        raise CliError(f"--kv {args.kv} needs --cache-tokens T (each instance's share, e.g. 3M)")
    out = check_run(point_from_args(args, instances=args.instances, router=args.router, kv=args.kv,
                                    cache_tokens=args.cache_tokens, speed=args.speed, admission=args.admission,
                                    policy=args.policy))
    if args.json:
        doc = {"fleet": json_rows([out["fleet"]])[0], "instances": json_rows(out["instances"]),
               "home": out["home"], "point": out["point"]}
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    _print(out)
    return 0


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:,.{digits}f}"


def _print(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 160)
    p = out["point"]
    t = Table(title=f"sim fleet: {p['instances']} x {p['model']} on {p['tp']} x {p['accelerator']}, router "
                    f"{p['router']}, KV home {p['kv']}, {p['speed']:g}x")
    cols = ("", "requests", "rejected", "hit %", "HBM %", "home %", "TTFT p50 ms", "TTFT p99 ms", "TPOT ms",
            "out tok/s", "goodput req/s", "GB read", "GB written")
    for c in cols:
        t.add_column(c, justify="left" if not c else "right")
    rows = [("fleet", out["fleet"])] + [(f"#{m['instance']}", m) for m in out["instances"]]
    for name, m in rows:
        t.add_row(name, str(m["requests"]), str(m["rejected"]), _f(100 * m["hit_rate"]), _f(100 * m["hit_rate_hbm"]),
                  _f(100 * m["hit_rate_home"]), _f(m["ttft_p50_ms"], 0), _f(m["ttft_p99_ms"], 0), _f(m["tpot_ms"]),
                  _f(m["throughput_tok_s"], 0), _f(m["goodput"], 2), _f(m["bytes_read"] / 1e9, 0),
                  _f(m["bytes_written"] / 1e9, 0))
        if name == "fleet":
            t.add_section()
    con.print(t)
    f = out["fleet"]
    cost = f"; ${f['usd_per_m_output_tokens']:.2f}/M output tokens" if f.get("usd_per_m_output_tokens") else ""
    con.print(f"HBM KV {f['kv_capacity_tokens']:,} tokens an instance; home {out['home']['capacity_tokens']:,} "
              f"tokens ({out['home']['link'] or 'no link'}); {f['sim_s']:.0f} s simulated in {f['wall_s']:.1f} s"
              + cost)
