"""``cxlemu sim validate``'s arguments and output (the comparison itself is ``tools.sim.validate``)."""
from __future__ import annotations

import json
import math
from typing import Any

from tools.cli._common import CliError, print_json
from tools.sim.validate import RUNS, compare


def register_validate(sub: Any) -> None:
    v = sub.add_parser("validate", help="the simulator beside a `cxlemu bench serve --save FILE` run")
    v.add_argument("files", metavar="FILE", nargs="+",
                   help="the JSON report of `cxlemu bench serve --save FILE`; several: repeated runs of one "
                        "experiment (each simulated as itself, their mean compared)")
    v.add_argument("--runs", type=int, default=RUNS,
                   help=f"simulated runs per (mode, level), their steps scattered as the measured ones (default "
                        f"{RUNS}; 1: the fitted cost exactly)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_validate)


def cmd_validate(args: Any) -> int:
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
    for i, fit in enumerate(out["fits"], 1):
        c = fit["step_cost"]
        con.print(f"run {i}: step cost fitted ({c['source']}): {c['a_ns'] / 1e6:.2f} ms + "
                  f"{c['b_ns_per_token'] / 1e3:.1f} us/token + {c['c_ns_per_pair']:.2f} ns/pair + "
                  f"{c['d_ns_per_seq'] / 1e3:.1f} us/seq + {c['e_ns_per_padded_pair']:.2f} ns/padded pair + "
                  f"{c['f_ns_per_decode_context']:.0f} ns/decode context token; median step error "
                  f"{c['fit']['median_abs_rel_error']:.1%}, robust sigma {fit['jitter']:.3f}; each mode's steps "
                  "against the fit (median measured / fitted, the factor its cost runs at): "
                  + ", ".join(f"{m} {f:.3f}" for m, f in fit["mode_factors"].items()))
    con.print(f"bench: the mean of {out['bench_runs']} run(s); each (mode, level) of each run simulated {out['runs']} "
              "times as that run, every step's cost scattered by a lognormal of the run's sigma; sim = the median "
              "(the mean of the runs' medians)")
    for m, r in out["links"].items():
        loads = (f"loads {r['load_s']:.2f} s on the link against the link model's {r['load_model_s']:.2f} s (a load "
                 f"landed {r['load_heard_after_s'] * 1e3:.0f} ms before vLLM heard of it, on average), "
                 if r["loads"] else "")
        con.print(f"{m}: {r['jobs']:.0f} tier jobs held to the link model: {loads}stores {r['store_s']:.2f} s "
                  f"against {r['store_model_s']:.2f} s")
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
