"""`cxlemu bench sim`: how fast the serving simulator runs, and how its cost grows with sessions.

Multi-turn sessions (``tools.sim.workload.sessions``) of 1k, 3k and 10k sessions, served by the
simulated engine with the offload tier (``cxl-smart`` by default: the most work per step: the
tier's policy, stores and layer-wise loads), each size timed on the wall clock. The growth
exponent is the slope of log(wall) against log(sessions) between the smallest and the largest
size (1.0: linear). Target (issue #15): 10,000 sessions in <= 5 minutes on a 2-core host.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

TARGET_S = 300.0
TARGET_SESSIONS = 10_000


def measure(sizes: list[int], modes: list[str], *, model: str, accelerator: str, concurrency: int,
            progress: Any = None) -> list[dict[str, Any]]:
    from tools.sim.run import Point, simulate

    base = Point(model=model, accelerator=accelerator, concurrency=concurrency,
                 workload={"kind": "sessions", "sessions": 0, "turns": 4, "system_tokens": 1024,
                           "system_prompts": 4, "user_tokens": 256, "output_tokens": 128, "think_s": 5.0})
    rows = []
    for mode in modes:
        for n in sizes:
            if progress:
                progress(f"{mode}: {n} sessions")
            p = replace(base, mode=mode, workload={**base.workload, "sessions": n})
            t = time.perf_counter()
            r = simulate(p)
            wall = time.perf_counter() - t
            rows.append({"mode": mode, "sessions": n, "requests": r["requests"], "wall_s": wall,
                         "steps": r["steps"], "simulated_s": r["sim_s"], "steps_per_s": r["steps"] / wall,
                         "requests_per_s": r["requests"] / wall, "output_tokens_per_s": r["output_tokens_per_s"],
                         "preemptions": r["preemptions"], "tier_hit_tokens": r["tier_hit_tokens"]})
    return rows


def growth(rows: list[dict[str, Any]], mode: str) -> float:
    rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["sessions"])
    if len(rs) < 2:
        return math.nan
    a, b = rs[0], rs[-1]
    return math.log(b["wall_s"] / a["wall_s"]) / math.log(b["sessions"] / a["sessions"])


def register(bench: Any) -> None:
    from tools.sim import hardware as hw
    from tools.sim.run import MODES

    p = bench.add_parser("sim", help="the serving simulator's speed: 1k / 3k / 10k multi-turn sessions")
    p.add_argument("--sessions", default="1000,3000,10000", help="sizes, comma-separated (default 1000,3000,10000)")
    p.add_argument("--modes", default="cxl-smart",
                   help=f"comma-separated of {', '.join(MODES)} (default cxl-smart)")
    p.add_argument("--model", default="llama-2-7b", choices=list(hw.MODELS))
    p.add_argument("--accelerator", default="h100", choices=list(hw.ACCELERATORS))
    p.add_argument("--concurrency", type=int, default=256, help="sessions open at once (default 256)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sim)


def cmd_sim(args: Any) -> int:
    from rich.console import Console
    from rich.table import Table

    from tools.common import CliError, print_json
    from tools.sim.run import parse_modes

    try:
        sizes = sorted({int(x) for x in args.sessions.split(",") if x.strip()})
    except ValueError:
        raise CliError(f"--sessions: expected comma-separated integers, got {args.sessions!r}") from None
    if not sizes or sizes[0] < 1:
        raise CliError(f"--sessions must be >= 1, got {args.sessions!r}")
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        raise CliError(f"--modes: {exc}") from None
    if args.concurrency < 1:
        raise CliError(f"--concurrency must be >= 1, got {args.concurrency}")
    from tools.sim.run import ConcurrencyError, Point

    try:  # the sessions open at once, within what the KV space holds
        Point(model=args.model, accelerator=args.accelerator, concurrency=args.concurrency).check_concurrency()
    except ConcurrencyError as exc:
        raise CliError(f"--concurrency: {exc}") from None
    err = Console(stderr=True)
    with err.status("bench sim") as status:
        rows = measure(sizes, modes, model=args.model, accelerator=args.accelerator, concurrency=args.concurrency,
                       progress=lambda m: status.update(f"bench sim: {m}"))
    checks = []
    for mode in modes:
        big = [r for r in rows if r["mode"] == mode and r["sessions"] >= TARGET_SESSIONS]
        if big:
            r = big[0]
            checks.append({"mode": mode, "sessions": r["sessions"], "wall_s": r["wall_s"],
                           "passed": r["wall_s"] <= TARGET_S})
    out: dict[str, Any] = {"rows": rows, "growth_exponent": {m: growth(rows, m) for m in modes}, "checks": checks,
           "config": {"model": args.model, "accelerator": args.accelerator, "concurrency": args.concurrency}}
    if args.json:
        print_json(out)
    else:
        t = Table(title=f"bench sim: {args.model} on {args.accelerator}, {args.concurrency} sessions open, 4 turns")
        for col in ("mode", "sessions", "requests", "wall s", "steps", "steps/s", "simulated s", "tok/s (sim)",
                    "preempt", "tier hit tok"):
            t.add_column(col, justify="left" if col == "mode" else "right")
        for r in rows:
            t.add_row(r["mode"], str(r["sessions"]), str(r["requests"]), f"{r['wall_s']:.1f}", str(r["steps"]),
                      f"{r['steps_per_s']:,.0f}", f"{r['simulated_s']:.0f}", f"{r['output_tokens_per_s']:.0f}",
                      str(r["preemptions"]), str(r["tier_hit_tokens"]))
        con = Console(width=160)
        con.print(t)
        for m, g in out["growth_exponent"].items():
            con.print(f"{m}: wall time grows as sessions^{g:.2f} ({sizes[0]} -> {sizes[-1]})")
        for c in checks:
            con.print(f"{c['mode']}: {c['sessions']} sessions in {c['wall_s']:.1f} s (target <= {TARGET_S:.0f} s): "
                      + ("pass" if c["passed"] else "FAIL"))
    return 0 if all(c["passed"] for c in checks) else 1
