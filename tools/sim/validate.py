"""The simulator against the real thing: a ``cxlemu bench serve --save FILE`` run.

The run's JSON holds everything the simulator needs to be configured as that experiment:

* the step cost: every ``engine.step()`` of the modes without a tier (all-resident, none) was
  recorded with the batch vLLM's scheduler made (request, new tokens, tokens computed before);
  a :class:`~tools.sim.hardware.LinearCost` is fitted to those step times (least squares,
  coefficients >= 0);
* the engine: vLLM's block size, KV blocks per mode, ``max_num_seqs``, ``max_num_batched_tokens``
  and the long-prefill threshold, as the engines reported them;
* the model's KV bytes per token (float32), the tier's size, link preset, policy and prefetch per
  mode, and the link time scale k the bench derived;
* the workload: the bench's own clients (``tools.sim.workload.from_bench``) with its think time.

Then each (mode, level) is simulated and its TTFT p50 and output tokens/s set beside the
measured ones; the target is within 15 %.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from typing import Any

from tools.sim import hardware as hw
from tools.sim.run import Point, simulate

__all__ = ["TOLERANCE", "compare", "fit_from_report", "points_from_report", "register_validate"]

TOLERANCE = 0.15
RUNS = 16  # simulated runs per (mode, level): the median is compared
#: bench serve's mode -> (the simulator's mode, policy, prefetch); "" keeps the mode's own
BENCH_MODES: dict[str, tuple[str, str, str]] = {
    "all-resident": ("none", "", ""), "none": ("none", "", ""), "host-lru": ("host-lru", "lru", "forward"),
    "cxl-lru": ("cxl-lru", "lru", "forward"), "cxl-arc-forward": ("cxl-lru", "arc", "forward"),
    "cxl-smart": ("cxl-smart", "arc", "layer")}
FIT_MODES = ("all-resident", "none")  # no tier: the steps are the engine's compute alone


def _batches(level: dict[str, Any]) -> list[tuple[float, hw.Batch]]:
    prompt = {r["request_id"]: r["prompt_tokens"] for r in level["records"]}
    out = []
    for _t0, dt, reqs in level.get("steps", []):
        b = hw.Batch()
        for rid, new, computed in reqs:
            b.add(new, computed, computed + new >= prompt[rid])
        out.append((dt, b))
    return out


def _as_list(reports: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [reports] if isinstance(reports, dict) else list(reports)


def fit_from_report(reports: dict[str, Any] | list[dict[str, Any]],
                    modes: tuple[str, ...] = FIT_MODES) -> hw.LinearCost:
    """The CPU's step cost fitted to the recorded steps of ``modes`` at every level (of every
    report given: repeated runs of one experiment)."""
    samples = []
    for report in _as_list(reports):
        for m in modes:
            for level in report["modes"].get(m, {}).get("levels", {}).values():
                samples += _batches(level)
    if not samples:
        raise ValueError("the report holds no recorded steps: it was made before `cxlemu bench serve` recorded "
                         "them; run the bench again with --save")
    return hw.fit_linear(samples, source=f"vLLM-CPU steps of {', '.join(modes)} ({len(samples)} steps)")


def _shape(report: dict[str, Any]) -> hw.ModelShape:
    m = report["config"]["model"]
    return hw.ModelShape(name="bench-random-llama", layers=m["layers"], hidden=m["hidden"], heads=m["heads"],
                         kv_heads=m["kv_heads"], intermediate=m["intermediate"], vocab=m["vocab"], dtype_bytes=4)


def points_from_report(reports: dict[str, Any] | list[dict[str, Any]],
                       cost: hw.LinearCost) -> list[tuple[str, int, Point]]:
    """(bench mode, level, the simulator's point configured as that run) for every measured pair.
    Repeated runs derive slightly different link time scales and think times from their own
    compute measurement: their means are used."""
    runs = _as_list(reports)
    report = runs[0]
    shape = _shape(report)
    k = sum((r.get("time_scale") or {}).get("time_scale", 1.0) for r in runs) / len(runs)
    think_s = sum(r["think_s"] for r in runs) / len(runs)
    block_tokens = report["config"]["block_tokens"]
    block_bytes = report["config"]["block_bytes"]
    out = []
    for name, data in report["modes"].items():
        if "error" in data or name not in BENCH_MODES:
            continue
        sched = data.get("scheduler") or {}
        spec = data.get("mode", {})
        mode, policy, prefetch = BENCH_MODES[name]
        for level in sorted(data.get("levels", {}), key=int):
            p = Point(mode=mode, concurrency=int(level), model_shape=asdict(shape), policy=policy,
                      prefetch=prefetch, block_tokens=block_tokens, kv_blocks=data.get("num_gpu_blocks") or spec["kv_blocks"],
                      max_num_seqs=sched.get("max_num_seqs", report["config"]["levels"][-1] + 2),
                      max_num_batched_tokens=sched.get("max_num_batched_tokens", 2048),
                      long_prefill_token_threshold=sched.get("long_prefill_token_threshold") or 0,
                      tier_blocks=max(1, spec.get("tier_bytes", 0) // block_bytes) if mode != "none" else 0,
                      host_link="pcie-host", cxl_link="leo-x16", time_scale=k,
                      step_cost=cost.coefficients(),
                      workload={"kind": "bench", "config": report["config"]["workload"], "think_s": think_s})
            out.append((name, int(level), p))
    return out


def same_experiment(reports: list[dict[str, Any]]) -> None:
    """Raise ValueError unless every report ran the same configuration (model, workload, levels,
    modes, C0...)."""
    first = reports[0]["config"]
    for i, r in enumerate(reports[1:], 2):
        diff = sorted(k for k in set(first) | set(r["config"]) if first.get(k) != r["config"].get(k))
        if diff:
            raise ValueError(f"report {i} is another experiment than report 1: its {', '.join(diff)} differ")


def compare(reports: dict[str, Any] | list[dict[str, Any]], runs: int = RUNS) -> dict[str, Any]:
    """Simulate every (mode, level) ``runs`` times, each step's cost scattered as the measured
    steps scatter around the fitted cost (the fit's robust sigma, seeds 0..runs-1); the median
    of each metric beside the measured one (the mean over the reports: repeated runs of one
    experiment), with its relative error and both ranges."""
    import numpy as np

    bench = _as_list(reports)
    same_experiment(bench)
    cost = fit_from_report(bench)
    sigma = cost.fit["rel_sigma"] if runs > 1 else 0.0
    rows = []
    for name, level, p in points_from_report(bench, cost):
        sims = [simulate(replace(p, jitter=sigma, seed=seed)) for seed in range(runs)]
        reals = [r["summary"][name][str(level)] for r in bench if str(level) in r["summary"].get(name, {})]
        row: dict[str, Any] = {"mode": name, "level": level, "bench_runs": len(reals)}
        for key, sim_key, scale in (("ttft_p50_s", "ttft_p50_ms", 1e-3), ("output_tokens_per_s", "output_tokens_per_s", 1.0),
                                    ("ttft_p99_s", "ttft_p99_ms", 1e-3), ("tpot_s", "tpot_ms", 1e-3)):
            vals = np.array([s[sim_key] * scale for s in sims], dtype=float)
            got = [x[key] for x in reals if x.get(key) is not None and not math.isnan(x[key])]
            r = float(np.mean(got)) if got else None
            med = float(np.median(vals))
            row[key] = {"bench": r, "bench_min": min(got, default=None), "bench_max": max(got, default=None),
                        "sim": med, "sim_min": float(vals.min()), "sim_max": float(vals.max()),
                        "error": (med / r - 1) if r not in (None, 0) and not math.isnan(med) else None}
        row["preemptions"] = {"bench": float(np.mean([x.get("preemptions", 0) for x in reals])),
                              "sim": float(np.median([s["preemptions"] for s in sims]))}
        row["tier_tokens"] = {"bench": float(np.mean([x.get("tier_tokens", 0) for x in reals])),
                              "sim": float(np.median([s["tier_hit_tokens"] for s in sims]))}
        row["within"] = all(abs(row[k]["error"]) <= TOLERANCE for k in ("ttft_p50_s", "output_tokens_per_s")
                            if row[k]["error"] is not None)
        rows.append(row)
    return {"step_cost": cost.describe(), "runs": runs, "bench_runs": len(bench), "jitter": sigma, "rows": rows,
            "tolerance": TOLERANCE, "all_within": all(r["within"] for r in rows)}


# --- the command -------------------------------------------------------------------------------
def register_validate(sub: Any) -> None:
    v = sub.add_parser("validate", help="the simulator beside a `cxlemu bench serve --save FILE` run")
    v.add_argument("files", metavar="FILE", nargs="+",
                   help="the JSON report of `cxlemu bench serve --save FILE`; several: repeated runs of one "
                        "experiment (fitted together, their mean compared)")
    v.add_argument("--runs", type=int, default=RUNS,
                   help=f"simulated runs per (mode, level), their steps scattered as the measured ones (default "
                        f"{RUNS}; 1: the fitted cost exactly)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_validate)


def cmd_validate(args: Any) -> int:
    from tools.cli._common import CliError, print_json

    reports = []
    for path in args.files:
        try:
            with open(path) as f:
                report = json.load(f)
        except OSError as exc:
            raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise CliError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
        if not isinstance(report, dict) or not {"config", "modes", "summary"} <= set(report):
            raise CliError(f"{path} is not a `cxlemu bench serve --save` report (no config/modes/summary)")
        reports.append(report)
    if args.runs < 1:
        raise CliError(f"--runs must be >= 1, got {args.runs}")
    try:
        out = compare(reports, args.runs)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print_json(out)
    else:
        _print(out)
    return 0 if out["all_within"] else 1


def _print(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=160)
    c = out["step_cost"]
    con.print(f"step cost fitted ({c['source']}): {c['a_ns'] / 1e6:.2f} ms + {c['b_ns_per_token'] / 1e3:.1f} us/token "
              f"+ {c['c_ns_per_pair']:.2f} ns/pair + {c['d_ns_per_seq'] / 1e3:.1f} us/seq + "
              f"{c['e_ns_per_padded_pair']:.2f} ns/padded pair + {c['f_ns_per_decode_context']:.0f} ns/decode context "
              f"token; median step error "
              f"{c['fit']['median_abs_rel_error']:.1%}, total time ratio {c['fit']['total_time_ratio']:.3f}")
    con.print(f"bench: the mean of {out['bench_runs']} run(s); each (mode, level) simulated {out['runs']} times, every step's cost scattered by a lognormal of "
              f"sigma {out['jitter']:.3f} (the measured steps' robust scatter around the fit); sim = the median")
    t = Table(title=f"simulator vs bench serve (target: within {out['tolerance']:.0%})")
    for col in ("mode", "c", "TTFT p50 bench", "bench range", "sim", "sim range", "err", "tok/s bench", "sim", "err",
                "TTFT p99 bench", "sim", "preempt b/s", "tier tok b/s", "ok"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in out["rows"]:
        a, b, p = r["ttft_p50_s"], r["output_tokens_per_s"], r["ttft_p99_s"]
        t.add_row(r["mode"], str(r["level"]), _ms(a["bench"]), f"{_ms(a['bench_min'])}-{_ms(a['bench_max'])}",
                  _ms(a["sim"]), f"{_ms(a['sim_min'])}-{_ms(a['sim_max'])}",
                  _pc(a["error"]), f"{b['bench']:.1f}",
                  f"{b['sim']:.1f}", _pc(b["error"]), _ms(p["bench"]), _ms(p["sim"]),
                  f"{r['preemptions']['bench']:g}/{r['preemptions']['sim']:g}",
                  f"{r['tier_tokens']['bench']:g}/{r['tier_tokens']['sim']:g}", "yes" if r["within"] else "NO")
    con.print(t)
    n = sum(r["within"] for r in out["rows"])
    con.print(f"{n} of {len(out['rows'])} (mode, level) pairs within {out['tolerance']:.0%} on both TTFT p50 and tok/s")


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:.0f}"


def _pc(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"
