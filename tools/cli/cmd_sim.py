"""``cxlemu sim``: serving at datacenter scale by simulation (``tools.sim``).

    cxlemu sim serve [--model M] [--accelerator A] [--workload fixed|sessions|trace] [--context N]
                     [--offload none,host-lru,cxl-lru,cxl-smart] [--concurrency 1..32] [--json] ...
                     [--attention dense,hot --page-budget B --kv-format native,int8,int4 --hbm fit,unlimited]
                     [--hot-predicted P]
    cxlemu sim sweep ...        models x accelerators x pools x policies x workloads on Dask
    cxlemu sim validate FILE    the simulator against a `cxlemu bench serve --save FILE` run
    cxlemu sim check [--json]   the step cost models against published first-token latencies
    cxlemu sim fleet --trace F  many instances behind a router on a Mooncake trace, each KV home
    cxlemu sim fleet-sweep ...  fleets over speeds, sizes, homes, routers, admissions on Dask; break-even
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from tools.cli._common import ArgumentError, CliError, choice, need_extra, positive, print_json


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("sim", help="simulate serving at datacenter scale: a vLLM-like engine, an "
                                          "accelerator's roofline and the offload tier's firmware model")
    sub = p.add_subparsers(dest="sim_command", metavar="ACTION", parser_class=type(p))
    sub.required = True
    _register_serve(sub)
    from tools.cli._sim_fleet import register_fleet
    from tools.cli._sim_fleet_sweep import register_fleet_sweep
    from tools.cli._sim_sweep import register_sweep
    from tools.cli._sim_validate import register_validate

    register_sweep(sub)
    register_validate(sub)
    register_fleet(sub)
    register_fleet_sweep(sub)
    c = sub.add_parser("check", help="the step cost models (Vidur's profiles, the roofline) against published "
                                     "first-token latencies")
    c.add_argument("--json", action="store_true", help="the rows as a JSON list")
    c.set_defaults(func=cmd_check)


def parse_modes(text: str) -> list[str]:
    """Comma-separated offload modes (an argparse ``type=``: ArgumentError names the known ones)."""
    from tools.sim.modes import parse_modes as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _levels(text: str) -> list[int]:
    from tools.cli._sim_sweep import parse_levels

    return parse_levels(text)


def _fraction(text: str) -> float:
    v = positive(float)(text)
    if v > 1:
        raise ArgumentError(f"must be in (0, 1], got {text!r}")
    return v


def _register_serve(sub: Any) -> None:
    from firmware_model.policies import ONLINE_POLICY_NAMES
    from tools.sim import hardware as hw

    s = sub.add_parser("serve", help="one model on one accelerator at rising concurrency, per offload mode",
                       description="Simulate a vLLM-like engine (continuous batching, chunked prefill, paged KV "
                                   "with a prefix cache, preemption) with an offload tier made of cxlemu's "
                                   "firmware model, on an accelerator's roofline.")
    s.add_argument("--model", default="llama-2-7b", type=choice(hw.MODELS, "model"),
                   help=f"{', '.join(hw.MODELS)} (default llama-2-7b)")
    s.add_argument("--accelerator", default="h100", type=choice(hw.ACCELERATORS, "accelerator"),
                   help=f"{', '.join(hw.ACCELERATORS)} (default h100)")
    s.add_argument("--tp", type=positive(int), default=1,
                   help="tensor parallelism: accelerators per instance, the weights and the KV split over them, two "
                        "NVLink all-reduces a layer (default 1)")
    s.add_argument("--cost", default="roofline", choices=("profile", "roofline"),
                   help="step times: roofline (published peaks x --mfu/--mbu, default) or profile (Vidur's measured "
                        "operators where profiled: llama-2-7b/70b on a100-80gb and h100, llama-3-8b/70b on "
                        "a100-80gb; the roofline elsewhere)")
    s.add_argument("--workload", default="fixed", choices=("fixed", "sessions", "trace"),
                   help="fixed: the seed's fixed-length sequences (default); sessions: multi-turn chat with "
                        "shared system prompts; trace: --trace FILE")
    s.add_argument("--context", type=positive(int), default=4096, help="fixed: tokens per sequence (default 4096)")
    s.add_argument("--output-tokens", type=positive(int), default=128, help="output tokens per request (default 128)")
    s.add_argument("--requests", type=positive(int), default=8, help="fixed: sequences per client (default 8)")
    s.add_argument("--sessions", type=positive(int), default=256, help="sessions: how many (default 256)")
    s.add_argument("--turns", type=positive(int), default=4, help="sessions: turns each (default 4)")
    s.add_argument("--system-tokens", type=positive(int), default=1024, help="sessions: shared prompt (default 1024)")
    s.add_argument("--system-prompts", type=positive(int), default=4, help="sessions: distinct shared prompts (4)")
    s.add_argument("--user-tokens", type=positive(int), default=256, help="sessions: new tokens a turn (default 256)")
    s.add_argument("--think-s", type=float, default=5.0, help="sessions: mean think time, s (default 5)")
    s.add_argument("--trace", metavar="FILE", help="a session trace (cxlemu trace gen sessions) or a Mooncake trace "
                   "(JSON lines with hash_ids: one request a client, at its timestamp)")
    s.add_argument("--speed", type=positive(float), default=1.0, help="trace: a Mooncake trace's arrival rate x this")
    s.add_argument("--offload", type=parse_modes, default=None,
                   help="modes, comma-separated: none, host-lru, cxl-lru, cxl-smart (default all)")
    s.add_argument("--concurrency", type=_levels, default=None,
                   help="N, a list 1,2,4, or a range 1..32 (step: 1..32:4); default 1,2,4,8,16,24,32; at most "
                        "what the KV space holds (one block a request); not with --workload trace (its "
                        "clients are its concurrency)")
    s.add_argument("--pool-gb", type=positive(float), default=1024.0, help="CXL pool size, GB (default 1024)")
    s.add_argument("--host-gb", type=positive(float), default=256.0, help="host memory for host-lru, GB (256)")
    s.add_argument("--host-link", default="pcie-host", type=choice(("pcie-host", "pcie5-host"), "host link"),
                   help="pcie-host (Gen4 x16, default) or pcie5-host")
    s.add_argument("--smart-policy", default="arc", type=choice(ONLINE_POLICY_NAMES, "policy"),
                   help="cxl-smart's eviction policy (default arc)")
    s.add_argument("--preemption", default="recompute", choices=("recompute", "swap"),
                   help="none's preemption: recompute (vLLM v1) or swap to host over the host link")
    s.add_argument("--block-tokens", type=positive(int), default=16, help="KV block size (vLLM's default 16)")
    s.add_argument("--max-num-seqs", type=positive(int), default=256)
    s.add_argument("--max-num-batched-tokens", type=positive(int), default=8192)
    s.add_argument("--memory-utilization", type=_fraction, default=0.9, help="vLLM's gpu_memory_utilization")
    s.add_argument("--kv-blocks", type=positive(int), default=0,
                   help="the KV space in blocks instead of what the accelerator's memory leaves (e.g. a huge "
                        "one: the all-resident reference)")
    s.add_argument("--mfu", type=_fraction, default=None, help="fraction of peak FLOP/s reached (assumed 0.5)")
    s.add_argument("--mbu", type=_fraction, default=None, help="fraction of HBM bandwidth reached (assumed 0.8)")
    _register_attention(s)
    s.add_argument("--json", action="store_true", help="one JSON object per (mode, concurrency), one per line")
    s.add_argument("--plot", metavar="PATH", help="also draw throughput and TTFT p99 against concurrency (PNG)")
    s.set_defaults(func=cmd_serve)


def _list_of(options: tuple[str, ...], what: str) -> Any:
    def parse(text: str) -> list[str]:
        got = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in got if t not in options]
        if bad or not got:
            raise ArgumentError(f"unknown {what} {bad[0] if bad else text!r}: choose from {', '.join(options)}")
        return list(dict.fromkeys(got))
    return parse


def _register_attention(s: Any) -> None:
    from tools.sim.hot import ATTENTIONS, HOT_PREDICTED, HOT_WHEN, KV_FORMATS

    s.add_argument("--attention", type=_list_of(ATTENTIONS, "attention"), default=["dense"],
                   help="dense (default), hot (hot-page attention: a decoding request keeps its page metadata, sink, "
                        "window and chosen pages in HBM, the rest of its KV in the CXL pool, and reads its chosen "
                        "pages over the link each step), or both: dense,hot")
    s.add_argument("--page-budget", type=_fraction, default=0.1,
                   help="hot: the share of a sequence's pages each decode step attends to (default 0.1)")
    s.add_argument("--kv-format", type=_list_of(KV_FORMATS, "kv format"), default=["native"],
                   help="hot: the device's KV format(s), comma-separated: native, int8, int4 (default native)")
    s.add_argument("--hot-when", type=_list_of(HOT_WHEN, "hot-when"), default=["always"],
                   help="hot: always (every request once its prompt is computed, default), full (a request decodes "
                        "densely until the KV space is full, then the last running ones go hot to make room), or "
                        "always,full")
    s.add_argument("--hot-predicted", type=_fraction, default=None, metavar="P",
                   help="hot: the share of each layer's chosen pages predicted and read a layer ahead, in (0, 1]; "
                        "the rest are read on demand before the layer's attention, and as many predicted pages "
                        f"that were not chosen are read too (default {HOT_PREDICTED:g}, the KV shim's measured "
                        "rate: tools/sim/hot.py HOT_PREDICTED; 1: exact prediction)")
    s.add_argument("--hbm", type=_list_of(("fit", "unlimited"), "hbm"), default=["fit"],
                   help="fit: the accelerator's memory (default); unlimited: also the all-resident reference, dense "
                        "attention with a KV space for every client; fit,unlimited: both")
    s.add_argument("--quality", metavar="FILE",
                   help="the rows of `cxlemu bench quality --json`, printed beside each configuration")


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    if args.workload == "fixed":
        if args.output_tokens >= args.context:
            raise CliError(f"--output-tokens ({args.output_tokens}) must be < --context ({args.context})")
        return {"kind": "fixed", "context": args.context, "output_tokens": args.output_tokens,
                "requests": args.requests}
    if args.workload == "sessions":
        if not args.think_s >= 0:
            raise CliError(f"--think-s must be >= 0, got {args.think_s}")
        return {"kind": "sessions", "sessions": args.sessions, "turns": args.turns,
                "system_tokens": args.system_tokens, "system_prompts": args.system_prompts,
                "user_tokens": args.user_tokens, "output_tokens": args.output_tokens, "think_s": args.think_s}
    if not args.trace:
        raise CliError("--workload trace needs --trace FILE (write one with `cxlemu trace gen sessions`)")
    return {"kind": "trace", "path": args.trace, "speed": args.speed}


def base_point(args: argparse.Namespace) -> Any:
    from tools.sim import hardware as hw
    from tools.sim.run import Point

    try:
        return Point(model=args.model, accelerator=args.accelerator, tp=args.tp, cost_model=args.cost,
                     workload=_workload(args),
                     pool_gb=args.pool_gb, host_gb=args.host_gb, host_link=args.host_link,
                     smart_policy=args.smart_policy, preemption=args.preemption, block_tokens=args.block_tokens,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     memory_utilization=args.memory_utilization, kv_blocks=args.kv_blocks,
                     mfu=args.mfu or hw.DEFAULT_MFU, mbu=args.mbu or hw.DEFAULT_MBU)
    except ValueError as exc:  # a model that does not split --tp ways
        raise CliError(f"--tp: {exc}") from None


DEFAULT_LEVELS = [1, 2, 4, 8, 16, 24, 32]


def _levels_and_trace(args: argparse.Namespace, base: Any) -> tuple[list[int], Any]:
    """The concurrency levels to run, each within what the KV space holds, and a trace's clients
    (None for a generated workload). A trace's concurrency is its number of clients: running it
    at other levels would repeat the same run under another label, so --concurrency is refused."""
    from dataclasses import replace

    from tools.sim.run import ConcurrencyError, build_scripts
    from tools.sim.workload import TraceError

    if args.workload != "trace":
        levels = args.concurrency or DEFAULT_LEVELS
        try:
            replace(base, concurrency=max(levels)).check_concurrency()
        except ConcurrencyError as exc:
            raise CliError(f"--concurrency: {exc}") from None
        return levels, None
    if args.concurrency is not None:
        raise CliError("--concurrency does not apply to --workload trace: the trace's clients are its "
                       "concurrency (write one at N with `cxlemu trace gen sessions --concurrency N`)")
    try:
        scripts = build_scripts(base.workload, 1)
    except OSError as exc:
        raise CliError(f"cannot read trace {args.trace}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # a binary given by mistake: named, with what a session trace is
        raise CliError(f"trace {args.trace} is not a trace: it is binary, not JSON-lines text (byte "
                       f"{exc.object[exc.start]:#04x} is not UTF-8); a session trace is JSON lines (write "
                       "one with `cxlemu trace gen sessions`)") from None
    except TraceError as exc:
        raise CliError(f"trace {args.trace}: {exc}") from None
    return [len(scripts)], scripts


def _variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What each level runs, as Point fields: the dense modes (``--offload``), the all-resident
    reference (``--hbm unlimited``; its KV space set per level), hot-page attention per format."""
    from tools.sim.modes import SIM_MODES

    hot = "hot" in args.attention
    if not hot and (args.kv_format != ["native"] or args.hot_when != ["always"] or args.hot_predicted is not None):
        raise CliError("--kv-format, --hot-when and --hot-predicted apply to hot-page attention: give --attention hot")
    hot_predicted = {} if args.hot_predicted is None else {"hot_predicted": args.hot_predicted}
    if hot and args.offload and args.offload != ["none"] and "dense" not in args.attention:
        raise CliError("--attention hot keeps the KV in the CXL pool itself (mode none): --offload applies to dense")
    out: list[dict[str, Any]] = []
    if "fit" in args.hbm and "dense" in args.attention:
        out += [{"mode": m} for m in (args.offload or list(SIM_MODES))]
    if "unlimited" in args.hbm:
        out.append({"mode": "all-resident"})
    if hot and "fit" in args.hbm:
        out += [{"mode": "none", "attention": "hot", "page_budget": args.page_budget, "kv_format": f, "hot_when": w,
                 **hot_predicted} for w in args.hot_when for f in args.kv_format]
    if not out:
        raise CliError("--attention hot runs on the accelerator's memory: give --hbm fit (or fit,unlimited)")
    return out


def _unlimited_blocks(scripts: list[Any], block_tokens: int) -> int:
    """A KV space holding every client's largest request at once (and vLLM's null block)."""
    return 1 + sum(max((-(-(t.prompt_tokens + t.output_tokens) // block_tokens) for t in s.turns), default=0)
                   for s in scripts)


def _quality(path: str | None) -> list[dict[str, Any]] | None:
    if not path:
        return None
    try:
        with open(path) as f:
            rows = json.load(f)
    except OSError as exc:
        raise CliError(f"cannot read --quality {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CliError(f"--quality {path} is not JSON ({exc}): give the output of `cxlemu bench quality --json`") \
            from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "mode" in r for r in rows):
        raise CliError(f"--quality {path}: expected a list of rows with a mode, as `cxlemu bench quality --json` "
                       "prints")
    return rows


def cmd_serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tools.sim.export import json_rows
    from tools.sim.hot import quality_rows
    from tools.sim.run import build_scripts, simulate

    if args.plot:
        need_extra("matplotlib", "sim", "sim serve")
    base = base_point(args)
    variants = _variants(args)
    quality = _quality(args.quality)
    levels, trace_scripts = _levels_and_trace(args, base)
    rows = []
    t0 = time.perf_counter()
    for c in levels:
        scripts = trace_scripts or build_scripts(base.workload, c, replace(base, concurrency=c))
        for v in variants:
            if v["mode"] == "all-resident":
                v = {**v, "kv_blocks": _unlimited_blocks(scripts, base.block_tokens)}
            try:
                row = simulate(replace(base, concurrency=c, **v), scripts)
            except ValueError as exc:
                raise CliError(str(exc)) from None
            if args.attention != ["dense"] or quality is not None:
                row["quality"] = quality_rows(quality, row["attention"], args.page_budget, row["kv_format"])
            rows.append(row)
            if args.json:
                print(json.dumps(json_rows([row])[0]), flush=True)
    wall = time.perf_counter() - t0
    if args.plot:
        predicted = _hot_predicted(rows)
        hot = "" if predicted is None else f", hot pages predicted {predicted:g}"
        plot_levels(rows, args.plot, f"cxlemu sim serve: {args.model} on {base.instance}, {args.workload}{hot}")
    if not args.json:
        _print(base, rows, wall, args)
    return 0


def _hot_predicted(rows: list[dict[str, Any]]) -> float | None:
    """The prediction rate the hot-page rows ran at (one per run), or None without any."""
    return next((r["hot_predicted"] for r in rows if r["attention"] == "hot"), None)


def rule_max_concurrency(rows: list[dict[str, Any]], mode: str, key: str = "ttft_p99_ms",
                         factor: float = 2.0) -> int:
    """The highest concurrency whose ``key`` stays within ``factor`` x the lowest level's
    (``cxlemu bench serve``'s rule, ``tools.sim.metrics.max_concurrency``)."""
    from tools.sim.metrics import max_concurrency

    return max_concurrency({r["concurrency"]: r[key] for r in rows if r["label"] == mode}, factor)


def _print(base: Any, rows: list[dict[str, Any]], wall: float, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 160)
    shape = base.shape()
    kv_blocks, cap = base.kv_space()
    con.print(render_arithmetic(shape, base, kv_blocks, cap))
    predicted = _hot_predicted(rows)
    if predicted is not None and base.workload.get("kind") == "fixed":
        con.print(render_hot(base, args.page_budget, args.kv_format, predicted))
    t = Table(title=f"sim serve: {shape.name} on {base.instance}, workload {args.workload}")
    hot = any(r["attention"] == "hot" for r in rows)
    cols = ("mode", "c", "TTFT p50 ms", "TTFT p99 ms", "TPOT ms", "out tok/s", "preempt", "tier hit tok",
            "prefix hit tok", "max running", "GB loaded", "stall s") + (("link GB read/step",) if hot else ())
    for col in cols:
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode in dict.fromkeys(r["label"] for r in rows):
        for r in (r for r in rows if r["label"] == mode):
            loaded = r.get("link_bytes_read", r["bytes_loaded"])
            t.add_row(mode, str(r["concurrency"]), _f(r["ttft_p50_ms"]), _f(r["ttft_p99_ms"]), _f(r["tpot_ms"], 1),
                      _f(r["output_tokens_per_s"]), str(r["preemptions"]), str(r["tier_hit_tokens"]),
                      str(r["prefix_hit_tokens"]), str(r["max_concurrency"]), f"{loaded / 1e9:.1f}",
                      f"{r['stall_s']:.2f}", *((f"{r.get('link_read_bytes_per_step', 0) / 1e9:.2f}",) if hot else ()))
        t.add_section()
    con.print(t)
    if hot:
        for line in hot_summary(rows, args.page_budget):
            con.print(line)
    modes = list(dict.fromkeys(r["label"] for r in rows))
    con.print("max concurrency (TTFT p99 within 2x of the lowest level's, bench serve's rule): "
              + ", ".join(f"{m} {rule_max_concurrency(rows, m)}" for m in modes))
    con.print(f"{len(rows)} points simulated in {wall:.1f} s")
    if args.plot:
        con.print(f"plot: {args.plot}")


def hot_summary(rows: list[dict[str, Any]], page_budget: float) -> list[str]:
    """Per hot-page configuration at the highest level: most running at once against ``none``'s,
    tokens/s against the all-resident reference's at the same level, the quality measured."""
    top = max(r["concurrency"] for r in rows)
    at = {r["label"]: r for r in rows if r["concurrency"] == top}
    none, ref = at.get("none"), at.get("all-resident")
    lines = []
    for label, r in at.items():
        if r["attention"] != "hot":
            continue
        parts = [f"{label} at c = {top}: {r['max_concurrency']} running at most"]
        if none is not None:
            parts.append(f"{r['max_concurrency'] / none['max_concurrency']:.2f}x none's {none['max_concurrency']}")
        if ref is not None:
            change = r["output_tokens_per_s"] / ref["output_tokens_per_s"] - 1
            parts.append(f"{r['output_tokens_per_s']:.0f} tok/s, {change:+.1%} against all-resident's "
                         f"{ref['output_tokens_per_s']:.0f}")
        parts.append(f"link {r['link_read_bytes_per_step'] / 1e9:.2f} GB read a decode step (the chosen pages' "
                     f"{r['link_chosen_bytes_per_step'] / 1e9:.2f} GB, {r['hot_predicted']:g} of them predicted), "
                     f"{r['demand_stall_ms_per_step']:.2f} ms a step waiting for reads on demand, "
                     f"{r['link_bytes_written'] / 1e9:.1f} GB written")
        lines.append("; ".join(parts))
        lines.append("  quality (cxlemu bench quality): " + quality_text(r.get("quality"), page_budget, r["kv_format"]))
    return lines


def quality_text(q: dict[str, Any] | None, page_budget: float, kv_format: str) -> str:
    def row(x: dict[str, Any]) -> str:
        return (f"{x['mode']} {x.get('kv_format') or 'native'} at {x.get('context')}: needle "
                f"{x.get('needle_acc')}, recall {x.get('recall_acc')}, perplexity {x.get('perplexity')}")
    if not q or not q["measured"]:
        text = f"not measured for hot {page_budget:g} {kv_format}"
        if q and q["parts"]:
            text += "; measured for its parts, separately: " + "; ".join(row(x) for x in q["parts"])
        return text
    return "; ".join(row(x) for x in q["measured"])


def _f(x: float, digits: int = 0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def render_arithmetic(shape: Any, point: Any, kv_blocks: int, cap: dict[str, float] | None) -> str:
    """The memory arithmetic behind the KV space: weights, KV per token and per request, what fits."""
    gb = 1e9
    lines = [(f"{shape.name}: {shape.params / 1e9:.2f} B parameters, {shape.weight_bytes / gb:.1f} GB of weights; "
              f"KV {shape.kv_bytes_per_token / 1024:.0f} KiB/token (2 x {shape.layers} layers x {shape.kv_heads} KV "
              f"heads x {shape.head_dim} x {shape.dtype_bytes} B)")]
    if cap is not None:
        each = f"{point.accelerator}" if point.tp == 1 else f"{point.instance}, each"
        share = "" if point.tp == 1 else f" (1/{point.tp})"
        per = "" if point.tp == 1 else (f" ({cap['kv_bytes_per_token'] / 1024:.0f} KiB of each token's KV on each: "
                                        "the instance's tokens)")
        lines.append(f"{each}: {cap['memory_bytes'] / gb:.0f} GB x {cap['utilization']:.2f} = "
                     f"{cap['budget_bytes'] / gb:.1f} GB - weights{share} {cap['weight_bytes'] / gb:.1f} - activations "
                     f"{cap['activation_bytes'] / gb:.1f} - reserve {cap['non_torch_bytes'] / gb:.1f} = KV "
                     f"{cap['kv_bytes'] / gb:.1f} GB = {cap['kv_tokens']:,.0f} tokens{per}")
    wl = point.workload
    if wl.get("kind") == "fixed":
        per = wl["context"] * shape.kv_bytes_per_token
        lines.append(f"a {wl['context']}-token sequence holds {per / gb:.2f} GB of KV: the KV space "
                     f"({kv_blocks} blocks of {point.block_tokens}) holds {kv_blocks * point.block_tokens // wl['context']} "
                     "whole sequences at once")
    return "\n".join(lines)


def render_hot(point: Any, page_budget: float, formats: list[str], predicted: float) -> str:
    """Hot-page attention's arithmetic for a fixed workload's sequence at its full length."""
    from dataclasses import replace

    n = point.workload["context"]
    a = replace(point, attention="hot", page_budget=page_budget).hot()
    blocks, attended, _ = a.decode(n)
    reads = ", ".join(f"{replace(a, kv_format=f).read_bytes(n) / 1e6:.0f} MB {f}" for f in formats)
    return (f"hot-page attention at {page_budget:g}: a decoding {n}-token sequence holds {blocks} blocks "
            f"(against {a.pages(n)}: metadata, {a.sink_pages} sink + {a.window_pages} window pages and the partial "
            f"one, two layers' chosen pages) and attends to {attended} tokens' worth; a decode step reads "
            f"{a.pages_read(n)} pages x {a.layers} layers over the link: {reads}; {predicted:g} of them predicted "
            f"and read a layer ahead, the rest on demand, and as many predicted but not chosen: "
            f"{2 - predicted:g}x those bytes")


def plot_levels(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Output tokens/s and TTFT p99 against concurrency, one line per mode."""
    from tools.sim.plots import plot_against_concurrency

    lines = {mode: [(r["concurrency"], r) for r in sorted((r for r in rows if r["label"] == mode),
                                                          key=lambda r: r["concurrency"])]
             for mode in dict.fromkeys(r["label"] for r in rows)}
    try:
        plot_against_concurrency(lines, [("output_tokens_per_s", "output tokens/s", "throughput"),
                                         ("ttft_p99_ms", "TTFT p99 (ms)", "time to first token, p99")],
                                 path, title=title)
    except OSError as exc:
        raise CliError(f"cannot write plot {path}: {exc.strerror or exc}") from None


def cmd_check(args: argparse.Namespace) -> int:
    from tools.sim.check import check

    rows = check()
    if args.json:
        print_json(rows)
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="sim check: one prefill step (first token) against published measurements")
    for col in ("model", "accelerator", "tp", "input tokens", "batch", "published ms", "profile ms", "ratio",
                "roofline ms", "ratio"):
        t.add_column(col, justify="left" if col in ("model", "accelerator") else "right")
    for r in rows:
        prof = r["profile_used"]
        t.add_row(r["model"], r["accelerator"], str(r["tp"]), str(r["input_tokens"]), str(r["batch"]),
                  f"{r['published_ms']:g}", f"{r['profile_ms']:.1f}" + ("" if prof == "profile" else " (roofline)"),
                  f"{r['profile_ratio']:.2f}", f"{r['roofline_ms']:.1f}", f"{r['roofline_ratio']:.2f}")
    con = Console(width=None if sys.stdout.isatty() else 160)
    con.print(t)
    con.print(f"published: {rows[0]['source']}; simulated with the default efficiencies and per-step overhead")
    return 0
