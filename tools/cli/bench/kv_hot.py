"""`cxlemu bench kv --attention hot`: hot-page attention against dense attention from the device and
all-resident dense (``tools.bench.kv_hot``): its flags, checks and output."""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from tools.bench.kv import WARMUP_STEPS
from tools.bench.kv_hot import BYTES_GOAL, KV_OVER_HBM_GOAL, STEP_GOAL, KvHotGoals, KvHotRow, goals
from tools.cli._common import CliError, need_extra, print_json

HOT_BLOCK_TOKENS = 16  # Quest's page size; the dense bench's 256-token chunks would be 1/32 of a 8k context


def add_arguments(p: Any) -> None:
    """The flags of hot mode, on `bench kv`'s parser."""
    p.add_argument("--attention", choices=("dense", "hot"), default="dense",
                   help="dense (default: the residency benchmark) or hot (hot-page attention vs dense "
                        "from the device and all-resident)")
    p.add_argument("--page-budget", type=float, default=None,
                   help="hot: the fraction of a sequence's pages each decode query reads (default 0.1)")
    p.add_argument("--batch", type=int, default=None, help="hot: sequences decoding together (default 1)")
    p.add_argument("--kv-over-hbm", type=float, default=None,
                   help=f"hot: the KV over the HBM budget of both device modes (default {KV_OVER_HBM_GOAL:g})")
    p.add_argument("--plot", default=None,
                   help="hot: PNG path for step time and hot / all-resident against context (default none)")
    p.add_argument("--in-process", action="store_true",
                   help="hot: serve the device in this process (default: `cxlemu serve` in its own, its firmware "
                        "off the interpreter that computes, as a controller's is off the host)")


def check_dense(args: Any) -> None:
    """Hot mode's flags given without it: refused, rather than ignored."""
    given = [f for f, v in (("--page-budget", args.page_budget), ("--batch", args.batch),
                            ("--kv-over-hbm", args.kv_over_hbm), ("--plot", args.plot),
                            ("--in-process", args.in_process or None)) if v is not None]
    if given:
        raise CliError(f"{', '.join(given)}: only with --attention hot")


def cmd_kv_hot(args: Any) -> int:
    torch = need_extra("torch", "kv", "bench kv")
    need_extra("transformers", "kv", "bench kv")
    from emulator import presets
    from tools.bench import kv_hot

    _check(args)
    timing = replace(presets.load(args.preset).timing, time_scale=args.time_scale)
    if not timing.read_bandwidth_gbps:
        raise CliError(f"preset {args.preset!r} has an unthrottled link: pick one with a bandwidth (e.g. leo-x16)")
    torch.set_num_threads(args.threads)
    if args.plot:
        need_extra("matplotlib", "bench", "bench kv --attention hot --plot")
    from rich.console import Console

    with Console(stderr=True).status("bench kv --attention hot") as status:
        rows = kv_hot.run(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                          contexts=args.context or [2048, 8192], batch=args.batch, steps=args.steps,
                          page_budget=args.page_budget, block_tokens=args.block_tokens,
                          kv_over_hbm=args.kv_over_hbm, timing=timing, repeat=args.repeat,
                          progress=lambda m: status.update(f"bench kv --attention hot: {m}"),
                          serve_args=None if args.in_process else
                          ("--preset", args.preset, "--time-scale", f"{args.time_scale:g}"))
    if args.plot:
        kv_hot.plot(rows, args.plot)
    if args.json:
        print_json({"rows": [r.to_dict() for r in rows], "goals": [_goal_dict(g) for g in goals(rows)]})
    elif args.markdown:
        print(markdown(rows))
    else:
        Console(width=None if sys.stdout.isatty() else 160).print(render(rows, args, timing))
    dense_ok = all(r.tokens_agree == 1.0 for r in rows if r.mode in ("dense", "in-hbm"))
    return 0 if dense_ok else 1


def _check(args: Any) -> None:
    args.page_budget = 0.1 if args.page_budget is None else args.page_budget
    args.batch = 1 if args.batch is None else args.batch
    args.kv_over_hbm = KV_OVER_HBM_GOAL if args.kv_over_hbm is None else args.kv_over_hbm
    if args.budget or args.policy or getattr(args, "kv_format", None):
        raise CliError("--budget, --policy and --kv-format are dense mode's; with --attention hot the HBM budget "
                       "is the KV over --kv-over-hbm, dense from the device uses the reuse policy, KV is native")
    if not 0 < args.page_budget <= 1:
        raise CliError(f"--page-budget is a fraction in (0, 1], got {args.page_budget}")
    if args.batch < 1:
        raise CliError(f"--batch must be >= 1, got {args.batch}")
    if not args.kv_over_hbm >= 1:
        raise CliError(f"--kv-over-hbm must be >= 1, got {args.kv_over_hbm}")
    if args.repeat < 1:
        raise CliError("--repeat must be >= 1")
    if args.block_tokens is None:
        args.block_tokens = HOT_BLOCK_TOKENS
    check_run(args)


def check_run(args: Any) -> None:
    """The flags of both modes of `bench kv`: the model's shape, contexts, threads, chunk size,
    time scale and steps."""
    for flag, values, low in (("--layers", [args.layers], 2), ("--hidden", [args.hidden], 1),
                              ("--heads", [args.heads], 1), ("--kv-heads", [args.kv_heads], 1),
                              ("--context", args.context or [], 1), ("--block-tokens", [args.block_tokens], 1),
                              ("--threads", [args.threads], 1)):
        bad = [v for v in values if v < low]
        if bad:
            raise CliError(f"{flag} must be >= {low}, got {bad[0]}")
    if not args.time_scale > 0:
        raise CliError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.steps <= WARMUP_STEPS:
        raise CliError(f"--steps must be > {WARMUP_STEPS} (the warm-up steps are not timed)")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise CliError("--hidden must be a multiple of --heads, and --heads of --kv-heads")


def _goal_dict(g: KvHotGoals) -> dict[str, Any]:
    met = g.met
    return {"context": g.context, "bytes_ratio": g.bytes_ratio, "bytes_vs_dense": g.bytes_vs_dense,
            "step_ratio": g.step_ratio,
            "kv_over_hbm": g.kv_over_hbm, "within_budget": g.within_budget,
            "bytes_met": met[0], "step_met": met[1], "capacity_met": met[2]}


_COLUMNS = ("context", "batch", "mode", "page budget", "HBM budget MB", "KV MB", "HBM peak MB", "step ms",
            "MB read/step", "stall ms/step", "predicted", "tokens = resident")
_GOAL_COLUMNS = ("context", f"bytes / dense from device <= {BYTES_GOAL:.2f}", "bytes / dense mode", f"step / all-resident <= {STEP_GOAL:.2f}",
                 f"KV / HBM >= {KV_OVER_HBM_GOAL:g}, peak within")


def _cells(r: KvHotRow) -> list[str]:
    return [str(r.context), str(r.batch), r.mode, f"{r.page_budget:g}",
            f"{r.hbm_budget_bytes / 1e6:.1f}" if r.hbm_budget_bytes else "-", f"{r.kv_bytes / 1e6:.1f}",
            f"{r.hbm_peak_bytes / 1e6:.1f}", f"{r.step_ms:.2f}", f"{r.bytes_per_step / 1e6:.3f}",
            f"{r.stall_ms:.2f}", f"{r.predicted_used:.2f}" if r.mode == "hot" else "-", f"{r.tokens_agree:.2f}"]


def _goal_cells(g: KvHotGoals) -> list[str]:
    ok = ["met" if m else "not met" for m in g.met]
    return [str(g.context), f"{g.bytes_ratio:.3f} ({ok[0]})", f"{g.bytes_vs_dense:.3f}", f"{g.step_ratio:.3f} ({ok[1]})",
            f"{g.kv_over_hbm:.2f}, {'yes' if g.within_budget else 'NO'} ({ok[2]})"]


def render(rows: list[KvHotRow], args: Any, timing: Any) -> Any:
    """Rich tables of the rows and the goals (pure: rows in, renderable out)."""
    from rich.console import Group
    from rich.table import Table

    t = Table(title=f"bench kv --attention hot: {args.layers} layers, hidden {args.hidden}, {args.kv_heads} kv "
                    f"heads, preset {args.preset} x{timing.time_scale:g} "
                    f"({timing.read_bandwidth_gbps / timing.time_scale:g} GB/s effective)")
    for col in _COLUMNS:
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        t.add_row(*_cells(r))
    g = Table(title="goals (issue 26, deliverable 5)")
    for col in _GOAL_COLUMNS:
        g.add_column(col, justify="right")
    for goal in goals(rows):
        g.add_row(*_goal_cells(goal))
    return Group(t, g)


def markdown(rows: list[KvHotRow]) -> str:
    """The rows and the goals as markdown tables."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---:|" * 2 + "---|" + "---:|" * (len(_COLUMNS) - 3)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    lines += ["", "| " + " | ".join(_GOAL_COLUMNS) + " |", "|" + "---:|" * len(_GOAL_COLUMNS)]
    lines += ["| " + " | ".join(_goal_cells(g)) + " |" for g in goals(rows)]
    return "\n".join(lines)
