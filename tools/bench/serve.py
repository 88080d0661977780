"""`cxlemu bench serve`: the seed's concurrency experiment at workstation scale, on vLLM-CPU.

A seeded random Llama (float32, an init whose greedy output varies) serves closed-loop clients —
multi-turn sessions that resend their growing conversation and clients asking questions about a
long document (``tools.sim.serve_workload``) — at rising concurrency. The "accelerator" is
vLLM's KV space sized for ``C0`` clients' whole context, so above ``C0`` vLLM preempts and the
prefix cache loses returning sessions' history. Modes, each on its own engine (one process per
mode, all kept up; each level runs every mode in turn, in rotating order, so a host swing lands on
all of them; prefix cache and tier reset between levels):

* ``all-resident``    KV space for every client: the reference (tokens, throughput);
* ``none``            vLLM alone with the C0-sized KV space: preempt and recompute;
* ``host-lru``        + a cxlemu tier behind a PCIe host link (preset ``pcie-host``), LRU, loads
                      before the forward (vLLM's CPU offload, in kind);
* ``cxl-lru``         + the tier on a Leo-class CXL link (``leo-x16``), LRU, before the forward;
* ``cxl-arc-forward`` leo-x16, ARC, before the forward;
* ``cxl-smart``       leo-x16, ARC, layer-wise prefetch (differs from cxl-arc-forward only there).

Time scale: this machine's prefill cost per token is measured on the all-resident engine, and the
link is slowed by k so that link time : compute time for a context is the reference's (a 7B
model on an H100-class accelerator; ``tools.sim.serve_workload.time_scale`` shows the arithmetic).

Measured per mode and level: TTFT p50/p99, time per output token, output tokens/s, prefix-hit
tokens, tokens served from the tier (blocks loaded x block size), bytes each way, preemptions,
stall; the max concurrency whose TTFT p99 (of later turns) stays within 2x the mode's level-1 p99.
Not measured: a real accelerator (compute is this CPU's) and decode-time KV traffic (the tier
moves whole blocks between requests only).
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

from tools.sim.serve_workload import (
    MAX_CONCURRENCY_KEY,
    Check,
    LevelResult,
    RequestRecord,
    WorkloadConfig,
    checks,
    max_concurrency,
    mismatches,
    outputs_vary,
    time_scale,
)

MODES = ("all-resident", "none", "host-lru", "cxl-lru", "cxl-arc-forward", "cxl-smart")
#: mode -> (preset, policy, prefetch) of its tier; None: no tier
TIERS: dict[str, tuple[str, str, str] | None] = {
    "all-resident": None, "none": None,
    "host-lru": ("pcie-host", "lru", "forward"),
    "cxl-lru": ("leo-x16", "lru", "forward"),
    "cxl-arc-forward": ("leo-x16", "arc", "forward"),
    "cxl-smart": ("leo-x16", "arc", "layer"),
}
BLOCK_TOKENS = 128  # vLLM-CPU's block size; each engine reports its own and a mismatch is an error
TIER_FACTOR = 4  # the tier holds at least this many KV spaces
MODE_TIMEOUT_S = 1800.0
GiB, MiB = 1 << 30, 1 << 20

QUICK: dict[str, Any] = {
    "levels": [1, 2, 3, 5], "c0": 2,
    "workload": WorkloadConfig(system_tokens=128, user_tokens=124, output_tokens=8, turns=3, doc_tokens=320),
    "model": {"layers": 6, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1408}}
DEFAULT: dict[str, Any] = {
    "levels": [1, 2, 4, 6, 8, 10], "c0": 4, "workload": WorkloadConfig(),
    "model": {"layers": 8, "hidden": 768, "heads": 12, "kv_heads": 4, "intermediate": 2048}}


def plan_modes(names: list[str], *, c0: int, levels: list[int], blocks_per_client: int,
               block_bytes: int, time_scale_k: float) -> list[Any]:
    """The ModeSpec of each mode: KV space, tier size, device capacity, link time scale."""
    from tools.bench._serve_engine import ModeSpec

    small = c0 * blocks_per_client
    tier_blocks = max(TIER_FACTOR * small, max(levels) * blocks_per_client)
    tier_bytes = tier_blocks * block_bytes
    capacity = (-(-tier_bytes // (256 * MiB)) + 1) * 256 * MiB
    specs = []
    for name in names:
        tier = TIERS[name]
        if tier is None:
            blocks = (max(levels) * blocks_per_client + 2) if name == "all-resident" else small
            specs.append(ModeSpec(name=name, kv_blocks=blocks))
            continue
        preset, policy, prefetch = tier
        specs.append(ModeSpec(name=name, kv_blocks=small, preset=preset, policy=policy, prefetch=prefetch,
                              tier_bytes=tier_bytes, device_capacity=capacity, time_scale=time_scale_k))
    return specs


class ModeProcess:
    """One mode's engine in a spawned process, driven level by level (``_serve_engine.serve_mode``)."""

    def __init__(self, name: str, kwargs: dict[str, Any], progress: Any) -> None:
        import multiprocessing as mp

        from tools.bench._serve_engine import child

        ctx = mp.get_context("spawn")
        self.name, self.progress = name, progress
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=child, args=(self.commands, self.results, kwargs))
        self.proc.start()
        self.error: str | None = None
        self.traceback = ""

    def wait(self, kind: str, timeout_s: float = MODE_TIMEOUT_S) -> Any:
        """The next reply of ``kind`` (progress forwarded); None after an error, kept in ``error``."""
        import queue as queue_mod

        deadline = time.monotonic() + timeout_s
        while self.error is None:
            try:
                msg = self.results.get(timeout=1.0)
            except queue_mod.Empty:
                if not self.proc.is_alive():
                    self.error = f"the engine process died (exit code {self.proc.exitcode})"
                elif time.monotonic() > deadline:
                    self.error = f"no answer in {timeout_s:.0f} s"
                continue
            if msg[0] == "progress":
                self.progress(msg[1])
            elif msg[0] == "error":
                self.error, self.traceback = msg[1], msg[2]
            elif msg[0] == kind:
                return msg[1:]
        return None

    def run_level(self, level: int, think_s: float) -> dict[str, Any] | None:
        self.commands.put(("level", level, think_s))
        got = self.wait("level")
        return None if got is None else got[1]

    def stop(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        if self.error is None and self.proc.is_alive():
            self.commands.put(("stop",))
            got = self.wait("done", timeout_s=120)
            totals = got[0] if got else {}
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        return totals


def _level_results(name: str, res: dict[str, Any]) -> dict[int, LevelResult]:
    out = {}
    for level, data in res.get("levels", {}).items():
        recs = [RequestRecord(**r) for r in data["records"]]
        out[int(level)] = LevelResult(name, int(level), recs, data["tier"], res.get("block_tokens", BLOCK_TOKENS),
                                      data["wall_s"])
    return out


def run(args: Any, progress: Any) -> dict[str, Any]:
    """Every mode's engine up at once (all-resident first: it measures the compute cost that sets
    the think time and the link's time scale), then level by level, every mode in turn (the order
    rotating), so a shared machine's slow minutes fall on all modes alike."""
    from tools.bench._serve_engine import build_model
    from tools.sim.serve_workload import ModelSpec

    preset = QUICK if args.quick else DEFAULT
    levels = args.levels or preset["levels"]
    c0 = args.c0 or preset["c0"]
    workload = replace(preset["workload"], seed=args.seed)
    model = ModelSpec(**preset["model"], vocab=workload.vocab)
    bpc = workload.blocks_per_client(BLOCK_TOKENS)
    block_bytes = BLOCK_TOKENS * model.kv_bytes_per_token
    names = [m for m in MODES if m in (args.modes or MODES)]
    report: dict[str, Any] = {"config": {"levels": levels, "c0": c0, "workload": asdict(workload),
                                         "model": asdict(model), "block_tokens": BLOCK_TOKENS,
                                         "blocks_per_client": bpc, "block_bytes": block_bytes,
                                         "modes": names, "quick": args.quick, "threads": args.threads,
                                         "log_stats": args.log_stats},
                              "modes": {}}
    procs: dict[str, ModeProcess] = {}
    with tempfile.TemporaryDirectory(prefix="cxlemu-serve-") as model_dir:
        progress("building the model")
        build_model(model_dir, model)
        max_model_len = bpc * BLOCK_TOKENS
        base = {"model_dir": model_dir, "model": model, "workload": workload, "max_num_seqs": max(levels) + 2,
                "max_model_len": max_model_len, "log_stats": args.log_stats, "threads": args.threads}
        try:
            for name in names:
                if name != "all-resident" and "time_scale" not in report:
                    resident = report["modes"].get("all-resident", {})
                    if "compute" not in resident:
                        break  # nothing to scale the link or the think time by
                    report["time_scale"] = _time_scale(report, args, model)
                    report["think_s"] = (workload.think_contexts * workload.context_tokens
                                         * resident["compute"]["s_per_token"])
                k = report.get("time_scale", {}).get("time_scale", 1.0)
                spec = plan_modes([name], c0=c0, levels=levels, blocks_per_client=bpc, block_bytes=block_bytes,
                                  time_scale_k=k)[0]
                proc = ModeProcess(name, dict(base, mode=spec, measure=name == "all-resident"), progress)
                got = proc.wait("ready")
                info = got[0] if got else {}
                if got and info.get("block_tokens") != BLOCK_TOKENS:
                    proc.error = f"vLLM's block size is {info.get('block_tokens')}, the bench sized for {BLOCK_TOKENS}"
                report["modes"][name] = {**info, "levels": {}}
                procs[name] = proc
            for i, level in enumerate(levels):
                live = [n for n in names if n in procs and procs[n].error is None]
                for name in live[i % len(live):] + live[:i % len(live)] if live else []:
                    progress(f"concurrency {level}: {name}")
                    data = procs[name].run_level(level, report["think_s"])
                    if data is not None:
                        report["modes"][name]["levels"][level] = data
        finally:
            for name, proc in procs.items():
                report["modes"][name]["tier_total"] = proc.stop()
                if proc.error is not None:
                    report["modes"][name].update(error=proc.error, traceback=proc.traceback)
    for name in names:
        report["modes"].setdefault(name, {"error": "not started: all-resident measured no compute cost"})
    report.setdefault("time_scale", _time_scale(report, args, model) if args.time_scale else None)
    return report


def _time_scale(report: dict[str, Any], args: Any, model: Any) -> dict[str, Any]:
    from emulator import presets

    links = {p: float(presets.load(p).timing.read_bandwidth_gbps or 0) for p in ("pcie-host", "leo-x16")}
    compute = report["modes"].get("all-resident", {}).get("compute")
    if compute is None and not args.time_scale:
        raise RuntimeError("the all-resident engine did not measure the compute cost: give --time-scale")
    s = compute["s_per_token"] if compute else 1.0
    out = time_scale(kv_bytes_per_token=model.kv_bytes_per_token, compute_s_per_token=s, links_gbps=links)
    if args.time_scale:
        out["time_scale_measured"] = out["time_scale"] if compute else None
        out["time_scale"] = args.time_scale
        out["overridden"] = True
    return out


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    """Summaries, max concurrency, token comparison and checks from a run's plain data."""
    results = {m: _level_results(m, r) for m, r in report["modes"].items() if "error" not in r}
    errors = {m: r["error"] for m, r in report["modes"].items() if "error" in r}
    summary = {m: {lv: lr.summary() for lv, lr in levels.items()} for m, levels in results.items()}
    tokens = {m: {rec.request_id: rec.output for lr in levels.values() for rec in lr.records}
              for m, levels in results.items()}
    ref = tokens.get("all-resident", {})
    varied = outputs_vary(list(ref.values())) if ref else (False, "all-resident did not run")
    mism = {m: mismatches(ref, t) for m, t in tokens.items() if m != "all-resident"}
    mc = {m: max_concurrency({lv: s[MAX_CONCURRENCY_KEY] for lv, s in lv_s.items()}) for m, lv_s in summary.items()}
    mc_all = {m: max_concurrency({lv: s["ttft_p99_s"] for lv, s in lv_s.items()}) for m, lv_s in summary.items()}
    found = checks(summary, mism, errors)
    return {"summary": summary, "max_concurrency": mc, "max_concurrency_all_requests": mc_all, "errors": errors, "outputs_vary": varied,
            "mismatches": mism, "checks": found}


# --- rendering ---------------------------------------------------------------------------------
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


def plot(analysis: dict[str, Any], path: str) -> None:
    from tools.sim.plots import plot_against_concurrency

    lines = {mode: [(lv, {"output_tokens_per_s": lvs[lv]["output_tokens_per_s"], "ttft_p99_ms": lvs[lv]["ttft_p99_s"] * 1e3})
                    for lv in sorted(lvs)] for mode, lvs in analysis["summary"].items()}
    plot_against_concurrency(lines, [("output_tokens_per_s", "output tokens/s", "throughput"),
                                     ("ttft_p99_ms", "TTFT p99 (ms)", "time to first token, p99")],
                             path, title="cxlemu bench serve (vLLM-CPU, random Llama)", xlabel="concurrent clients",
                             xticks=sorted({lv for lvs in analysis["summary"].values() for lv in lvs}))


# --- the command -------------------------------------------------------------------------------
def register(bench: Any) -> None:
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
    from tools.common import CliError

    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CliError(f"--levels: expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise CliError(f"--levels: levels must be >= 1, got {text!r}")
    return values


def _mode_list(text: str) -> list[str]:
    from tools.common import CliError

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise CliError(f"--modes: unknown mode {bad[0]!r}: choose from {', '.join(MODES)}")
    return modes


def cmd_serve(args: Any) -> int:
    from rich.console import Console

    from tools.common import VLLM_MODULE, CliError, need_extra, print_json

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
        report = run(args, lambda m: status.update(f"bench serve [{time.perf_counter() - t0:.0f} s]: {m}"))
    report["wall_s"] = time.perf_counter() - t0
    analysis = analyse(report)
    ok, why = analysis["outputs_vary"]
    if not ok:
        raise CliError(f"greedy outputs do not vary ({why}): token equality would prove nothing; "
                       "not reporting", exit_code=1)
    if args.plot:
        plot(analysis, args.plot)
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


__all__ = ["MODES", "analyse", "cmd_serve", "plan_modes", "register", "render_chart", "render_table"]
