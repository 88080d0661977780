"""The KV offload's benches, their arguments and output: `cxlemu bench kv` (decode with the KV cache
on the device: ``tools.bench.kv``), `bench tier` (the vLLM tier's own cost per block:
``tools.bench.tier``) and `bench fwmodel` (the firmware model's policies, replay speed and CHMU
counting: ``tools.trace.bench``)."""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from firmware_model.kv_codec import FORMATS
from firmware_model.policies import ONLINE_POLICY_NAMES
from tools.bench import kv, tier
from tools.bench.kv import DEMAND_GOAL, RATIO_GOAL, WARMUP_STEPS, FormatRow, KvBenchRow, KvGoals, format_rows, goals
from tools.bench.tier import TARGET_US
from tools.cli._common import VLLM_MODULE, CliError, need_extra, print_json
from tools.cli.bench import kv_hot, show
from tools.trace import bench as fwbench
from tools.trace.bench import FwmodelBenchResult
from tools.trace.io import load_trace


def register_kv(bench: Any) -> None:
    p = bench.add_parser("kv", help="LLM decode with the KV cache on the device vs resident, demand "
                                    "fetch and whole-layer offload")
    p.add_argument("--preset", default="leo-x16", help="device timing preset (default leo-x16)")
    p.add_argument("--time-scale", type=float, default=5.0,
                   help="multiply device times (default 5: a 50 GB/s link above this host's memcpy)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--context", type=int, action="append", help="context tokens (repeatable; default 2048, 8192)")
    p.add_argument("--budget", type=int, action="append", help="HBM budget, %% of the KV (repeatable; default 100, 50, 25)")
    p.add_argument("--steps", type=int, default=16, help=f"decode steps (the first {WARMUP_STEPS} are not timed)")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens per device chunk (default 256; with --attention hot 16, a page)")
    p.add_argument("--prefetch-depth", default="auto",
                   help="layers loaded ahead, 'auto' (default: the firmware model's window for the link), "
                        "or module:function (your own window function)")
    p.add_argument("--policy", action="append",
                   help="firmware policies: built-in names or module:Class (repeatable; default all online ones)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the DMA engine gets a core)")
    p.add_argument("--repeat", type=int, default=2, help="rounds over all modes; each keeps its fastest")
    p.add_argument("--kv-format", action="append", choices=[f for f in FORMATS if f != "native"],
                   help="also run each policy with the KV kept in this compressed format on the device "
                        "(repeatable): link bytes per token, device bytes and step time against native")
    p.add_argument("--markdown", action="store_true", help="a markdown table (for BENCHMARKS.md)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    kv_hot.add_arguments(p)
    p.set_defaults(func=cmd_kv)


def cmd_kv(args: Any) -> int:
    if args.attention == "hot":
        return kv_hot.cmd_kv_hot(args)
    kv_hot.check_dense(args)
    if args.block_tokens is None:
        args.block_tokens = 256
    torch = need_extra("torch", "kv", "bench kv")
    need_extra("transformers", "kv", "bench kv")
    from emulator import presets
    from firmware_model.policies import resolve_policy

    prefetch_depth: int | str = args.prefetch_depth
    if prefetch_depth != "auto":
        try:
            prefetch_depth = int(prefetch_depth)
        except ValueError:
            if ":" not in args.prefetch_depth:
                raise CliError(f"--prefetch-depth must be a number of layers, 'auto' or module:function, "
                               f"got {args.prefetch_depth!r}") from None
            from firmware_model.prefetch import resolve_window

            try:
                resolve_window(args.prefetch_depth)
            except ValueError as exc:  # PolicyProtocolError is one too
                raise CliError(f"--prefetch-depth: {exc}") from None
    if args.repeat < 1:
        raise CliError("--repeat must be >= 1")
    kv_hot.check_run(args)
    bad_budget = [b for b in args.budget or [] if not 0 < b <= 100]
    if bad_budget:
        raise CliError(f"--budget is a percentage of the KV in (0, 100], got {bad_budget[0]}")
    policies = args.policy or list(ONLINE_POLICY_NAMES)
    unknown = {p for p in policies if ":" not in p} - set(ONLINE_POLICY_NAMES)
    if unknown:
        raise CliError(f"unknown policy {min(unknown)!r}: choose from {', '.join(ONLINE_POLICY_NAMES)}, "
                       "or your own class as module:Class")
    for spec in policies:
        try:
            resolve_policy(spec)  # module:Class imported and checked against the protocol
        except ValueError as exc:
            raise CliError(str(exc)) from None
    timing = replace(presets.load(args.preset).timing, time_scale=args.time_scale)
    if not timing.read_bandwidth_gbps:
        raise CliError(f"preset {args.preset!r} has an unthrottled link: pick one with a bandwidth (e.g. leo-x16)")
    torch.set_num_threads(args.threads)
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("bench kv") as status:
        rows = kv.run(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                   contexts=args.context or [2048, 8192], budgets=args.budget or [100, 50, 25],
                   steps=args.steps, block_tokens=args.block_tokens, policies=policies, timing=timing,
                   prefetch_depth=prefetch_depth, repeat=args.repeat,
                   progress=lambda m: status.update(f"bench kv: {m}"),
                   kv_formats=tuple(dict.fromkeys(args.kv_format or ())))
    if args.json:
        print_json([r.to_dict() for r in rows])
    elif args.markdown:
        print(markdown(rows))
    else:
        Console(width=None if sys.stdout.isatty() else 140).print(render_kv(rows, args, timing))
    return 0 if all(r.tokens_equal for r in rows if r.kv_format == "native") else 1


def _equal_cell(r: KvBenchRow) -> str:
    """Native rows must equal resident's tokens; a quantized row shows how many it kept."""
    if r.kv_format != "native":
        return f"{r.token_agreement:.0%} (lossy)"
    return "yes" if r.tokens_equal else "NO"


def _goal_cells(g: KvGoals) -> list[str]:
    ok = ["met" if m else "not met" for m in g.met]
    return [str(g.context), str(g.budget_pct), g.best, f"{g.ratio:.3f} ({ok[0]})",
            f"{g.over_demand:.2f}x ({ok[1]})", f"{g.over_layerwise:.2f}x ({ok[2]})"]


_GOAL_COLUMNS = ("context", "budget %", "best", f"ratio <= {RATIO_GOAL:.2f}", f"x demand >= {DEMAND_GOAL}",
                 "x whole-layer > 1")


def render_kv(rows: list[KvBenchRow], args: Any, timing: Any) -> Any:
    """A rich table of the rows (pure: rows in, renderable out)."""
    from rich.table import Table

    t = Table(title=f"bench kv: {args.layers} layers, hidden {args.hidden}, {args.kv_heads} kv heads, "
                    f"preset {args.preset} x{timing.time_scale:g} "
                    f"({timing.read_bandwidth_gbps / timing.time_scale:g} GB/s effective)")
    for col in ("context", "budget %", "mode", "frames", "step ms", "tokens/s", "ratio", "hit rate",
                "GB loaded", "stall ms/step", "tokens ok"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        t.add_row(str(r.context), str(r.budget_pct), r.mode, str(r.frames), f"{r.step_ms:.2f}",
                  f"{r.tokens_per_s:.1f}", f"{r.ratio:.2f}", f"{r.hit_rate:.2f}", f"{r.gb_loaded:.3f}",
                  f"{r.stall_ms:.2f}", _equal_cell(r))
    from rich.console import Group

    parts: list[Any] = [t]
    found = goals(rows)
    if found:
        parts.append(_side_table("goals for the best cxlemu policy in this run (budgets below 100 %)",
                                 _GOAL_COLUMNS, "best", [_goal_cells(g) for g in found]))
    fmts = format_rows(rows)
    if fmts:
        parts.append(_side_table("compressed KV on the device against native (same policy and budget)",
                                 _FORMAT_COLUMNS, "mode", [_format_cells(r) for r in fmts]))
    return Group(*parts)


def _side_table(title: str, columns: tuple[str, ...], left: str, cells: list[list[str]]) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col == left else "right")
    for row in cells:
        t.add_row(*row)
    return t


_FORMAT_COLUMNS = ("context", "budget %", "mode", "link KB/token", "x native", "device MB", "x native",
                   "step ms", "x native", "tokens as resident")


def _format_cells(r: FormatRow) -> list[str]:
    return [str(r.context), str(r.budget_pct), r.mode, f"{r.link_kb_per_token:.1f}", f"{r.link_vs_native:.3f}",
            f"{r.device_mb:.2f}", f"{r.device_vs_native:.3f}", f"{r.step_ms:.2f}", f"{r.step_vs_native:.2f}",
            f"{r.token_agreement:.0%}"]


def markdown(rows: list[KvBenchRow]) -> str:
    """The rows as a markdown table."""
    head = ("| context | budget % | mode | frames | step ms | tokens/s | ratio | hit rate | GB loaded "
            "| stall ms/step | tokens equal |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.context} | {r.budget_pct} | {r.mode} | {r.frames} | {r.step_ms:.2f} | "
                     f"{r.tokens_per_s:.1f} | {r.ratio:.2f} | {r.hit_rate:.2f} | {r.gb_loaded:.3f} | "
                     f"{r.stall_ms:.2f} | {_equal_cell(r)} |")
    found = goals(rows)
    if found:
        lines += ["", "| " + " | ".join(_GOAL_COLUMNS) + " |", "|---:|---:|---|---:|---:|---:|"]
        lines += ["| " + " | ".join(_goal_cells(g)) + " |" for g in found]
    fmts = format_rows(rows)
    if fmts:
        lines += ["", "| " + " | ".join(_FORMAT_COLUMNS) + " |", "|---:|---:|---|" + "---:|" * 7]
        lines += ["| " + " | ".join(_format_cells(r)) + " |" for r in fmts]
    return "\n".join(lines)


def register_tier(bench: Any) -> None:
    p = bench.add_parser("tier", help="the vLLM tier's own cost per KV block (needs vLLM)")
    p.add_argument("--layers", type=int, default=32, help="KV pages per block (attention layers; 32 as a 7B)")
    p.add_argument("--page-kib", type=int, default=16, help="bytes per layer page, KiB (default 16)")
    p.add_argument("--blocks", default="16,64", help="KV blocks per job, comma-separated sizes (default 16,64)")
    p.add_argument("--jobs", type=int, default=200, help="jobs per pattern and direction (default 200)")
    p.add_argument("--reps", type=int, default=3, help="timed passes per row, alternated with the copies' "
                                                       "(medians; default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tier)


def cmd_tier(args: Any) -> int:
    for flag in ("layers", "page_kib", "jobs", "reps"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    try:
        blocks = tuple(int(b) for b in args.blocks.split(","))
    except ValueError:
        blocks = ()
    if not blocks or min(blocks) < 1:
        raise CliError(f"--blocks must be sizes >= 1 separated by commas (e.g. 16,64), got {args.blocks!r}")
    need_extra(VLLM_MODULE, "vllm", "bench tier")
    result = tier.run(layers=args.layers, page=args.page_kib << 10, blocks=blocks, jobs=args.jobs, reps=args.reps)
    show(args.json, result, lambda: render_tier(result))
    return 0 if result["ok"] else 1


def render_tier(result: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"cxlemu bench tier: the tier's own cost per KV block ({result['layers']} layers, "
                    "untimed device)")
    for col in ("page", "blocks/job", "pattern", "direction", "descs/job", "CPU us/block",
                "copies us/block", "own us/block", "wall us/block", "target (own)"):
        t.add_column(col)
    for r in result["rows"]:
        if r["target_us"] is None:
            verdict = "(real page: copies)"
        elif r["pattern"] == "runs":
            verdict = f"<= {TARGET_US:g} us " + ("[green]pass[/green]" if r["pass"] else "[red]FAIL[/red]")
        else:
            verdict = f"{'within' if r['pass'] else 'over'} (worst case)"
        t.add_row(f"{r['page_bytes']} B", str(r["blocks_per_job"]), r["pattern"], r["direction"],
                  str(r["descriptors_per_job"]), f"{r['cpu_us_per_block']:g}", f"{r['copies_us_per_block']:g}",
                  f"{r['own_us_per_block']:g}", f"{r['wall_us_per_block']:g}", verdict)
    return t


def register_fwmodel(bench: Any) -> None:
    p = bench.add_parser("fwmodel", help="policies vs OPT on traces, replay speed, CHMU counting throughput")
    p.add_argument("--attention", metavar="FILE", help="a recorded attention trace (default: record one)")
    p.add_argument("--record-steps", type=int, default=96, help="decode steps to record (default 96)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fwmodel)


def cmd_fwmodel(args: Any) -> int:
    attention = None
    if args.attention:
        try:
            attention = load_trace(args.attention)
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot use {args.attention}: {exc}") from None
    result = fwbench.measure(attention, args.record_steps)
    show(args.json, result.to_dict(), lambda: render_fwmodel(result))
    return 0


def render_fwmodel(result: FwmodelBenchResult) -> Any:
    from rich.console import Group
    from rich.table import Table

    pol = Table(title="hits / OPT hits (demand fill), replay accesses/s")
    pol.add_column("trace")
    pol.add_column("capacity", justify="right")
    names = sorted({r["policy"] for r in result.policies}, key=list(ONLINE_POLICY_NAMES).index)
    for n in names:
        pol.add_column(n, justify="right")
    keys = list(dict.fromkeys((r["trace"], r["capacity"]) for r in result.policies))
    for trace, cap in keys:
        rows = {r["policy"]: r for r in result.policies if (r["trace"], r["capacity"]) == (trace, cap)}
        best = result.best(trace, cap)["policy"]
        cells = [f"{'[bold]' if n == best else ''}{rows[n]['opt_ratio']:.3f}" for n in names]
        pol.add_row(trace, f"{cap}/{rows[names[0]]['unique_blocks']}", *cells)
    tables: list[Any] = [pol]
    if result.speed:
        r0 = result.speed[0]
        speed = Table(title=f"replay speed, Zipf {r0['accesses'] // 1000}k accesses, capacity {r0['capacity']} "
                            "(M accesses/s, median)")
        for c in ("policy", "cxlemu", "impl", "sparse ids", "python policy", "libCacheSim C", "cxlemu / libCacheSim",
                  "hits", "libCacheSim hits"):
            speed.add_column(c, justify="right")
        for r in result.speed:
            speed.add_row(r["policy"], f"{r['accesses_per_s'] / 1e6:.2f}", r["impl"],
                          f"{r['sparse_accesses_per_s'] / 1e6:.2f}" if "sparse_accesses_per_s" in r else "",
                          f"{r['python_accesses_per_s'] / 1e6:.2f}",
                          f"{r['peer_accesses_per_s'] / 1e6:.2f}" if "peer_accesses_per_s" in r else "",
                          f"{r['ratio']:.2f}" if "ratio" in r else "", str(r["hits"]), str(r.get("peer_hits", "")))
        tables.append(speed)
    if result.peer:
        side = Table(title="hits beside libCacheSim's (cxlemu / libCacheSim)")
        side.add_column("trace")
        side.add_column("capacity", justify="right")
        peer_policies = list(dict.fromkeys(r["policy"] for r in result.peer))
        for n in peer_policies:
            side.add_column(n, justify="right")
        for trace, cap in dict.fromkeys((r["trace"], r["capacity"]) for r in result.peer):
            rows = {r["policy"]: r for r in result.peer if (r["trace"], r["capacity"]) == (trace, cap)}
            side.add_row(trace, f"{cap}/{rows[peer_policies[0]]['unique_blocks']}", *[
                f"{rows[n]['hits']} / {rows[n]['peer_hits']}{'' if rows[n]['equal'] else ' [red]differ'}"
                for n in peer_policies])
        tables.append(side)
    hot = Table(title="hotness unit (batched numpy counting)")
    for c in ("mode", "batch", "units", "accesses/s (wall)", "accesses/CPU-s"):
        hot.add_column(c, justify="right")
    for r in result.hotness:
        hot.add_row(r["mode"], str(r["batch"]), str(r["units"]), f"{r['accesses_per_s'] / 1e6:.1f} M",
                    f"{r['accesses_per_cpu_s'] / 1e6:.1f} M")
    return Group(*tables, hot)
