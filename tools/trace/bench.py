"""``cxlemu bench fwmodel``: firmware-model figures — policy hits against OPT, replay speed, CHMU throughput.

* **Policies**: every online policy replays each trace (demand fill) at capacities of 25 %, 50 %
  and 75 % of the trace's distinct blocks; the figure is hits / OPT hits (1.0 = the oracle).
  Traces: the four synthetic generators with their defaults, and a trace recorded from a seeded
  random tiny Llama's attention (``tools.trace.record``, defaults) or one given with ``--attention``.
* **Replay speed**: each policy (and OPT) on one long trace (``heavy``, 4 sequences x 1024 steps,
  134k accesses) at half its distinct blocks, in accesses per wall-clock second of the replay loop.
* **Hotness unit**: batches of 1 Mi DPAs (Zipf-distributed 4 KiB units over 16 GiB) counted in
  epoch and always-on modes; accesses per wall-clock second and per CPU second of this process
  (the latter is what a loaded 2-core host still shows faithfully), median of ``reps`` batches.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from firmware_model.hotness import HotnessConfig, HotnessUnit
from firmware_model.policies import ONLINE_POLICY_NAMES
from firmware_model.replay import Access, opt_hit_count, replay

FRACTIONS = (0.25, 0.5, 0.75)


@dataclass
class FwmodelBenchResult:
    policies: list[dict[str, Any]] = field(default_factory=list)  # one row per trace x capacity x policy
    speed: list[dict[str, Any]] = field(default_factory=list)  # replay speed on one long trace
    hotness: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def best(self, trace: str, capacity: int) -> dict[str, Any]:
        rows = [r for r in self.policies if r["trace"] == trace and r["capacity"] == capacity]
        return max(rows, key=lambda r: r["opt_ratio"])


def bench_traces(attention: list[Access] | None = None, record_steps: int = 96) -> dict[str, list[Access]]:
    """The synthetic traces with default parameters plus a recorded attention trace."""
    from tools.trace.gen import KINDS

    traces = {kind: fn() for kind, fn in KINDS.items()}
    if attention is None:
        from tools.trace.record import RecordSpec, record

        attention = record(RecordSpec(steps=record_steps))
    traces["attention"] = attention
    return traces


def measure_policies(traces: dict[str, list[Access]], fractions: tuple[float, ...] = FRACTIONS,
                     policies: tuple[str, ...] = ONLINE_POLICY_NAMES) -> list[dict[str, Any]]:
    rows = []
    for name, trace in traces.items():
        keys = [a.block for a in trace]
        unique = len(set(keys))
        for frac in fractions:
            capacity = max(1, int(unique * frac))
            opt = opt_hit_count(keys, capacity)
            for policy in policies:
                t0 = time.perf_counter()
                r = replay(trace, policy, capacity, with_opt=False)
                dt = time.perf_counter() - t0
                rows.append({"trace": name, "accesses": len(trace), "unique_blocks": unique,
                             "capacity": capacity, "policy": policy, "hits": r.hits, "opt_hits": opt,
                             "opt_ratio": round(r.hits / opt, 4) if opt else 1.0,
                             "accesses_per_s": int(len(trace) / dt)})
    return rows


def measure_speed(policies: tuple[str, ...] = ONLINE_POLICY_NAMES + ("opt",), reps: int = 3) -> list[dict[str, Any]]:
    """Replay speed on a long trace (``heavy``, 4 sequences x 1024 steps) at half its blocks."""
    from tools.trace.gen import heavy

    trace = heavy(seqs=4, steps=1024, seed=0)
    capacity = len({a.block for a in trace}) // 2
    rows = []
    for policy in policies:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            replay(trace, policy, capacity, with_opt=False)
            times.append(time.perf_counter() - t0)
        rows.append({"policy": policy, "accesses": len(trace), "capacity": capacity,
                     "accesses_per_s": int(len(trace) / statistics.median(times))})
    return rows


def measure_hotness(batch: int = 1 << 20, reps: int = 9, capacity: int = 16 << 30) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    dpas = ((rng.zipf(1.2, batch) * 4096) % capacity).astype(np.uint64)
    rows = []
    for mode in ("epoch", "always_on"):
        unit = HotnessUnit(capacity, HotnessConfig(unit_size=4096, threshold=64, mode=mode, epoch_ns=10**9))
        wall, cpu = [], []
        for i in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            unit.record(dpas, now=i)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        rows.append({"mode": mode, "batch": batch, "units": unit.num_units,
                     "accesses_per_s": int(batch / statistics.median(wall)),
                     "accesses_per_cpu_s": int(batch / max(statistics.median(cpu), 1e-9))})
    return rows


def measure(attention: list[Access] | None = None, record_steps: int = 96) -> FwmodelBenchResult:
    return FwmodelBenchResult(policies=measure_policies(bench_traces(attention, record_steps)),
                              speed=measure_speed(), hotness=measure_hotness())


def render(result: FwmodelBenchResult) -> Any:
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
    if result.speed:
        by = {r["policy"]: r for r in result.speed}
        r0 = result.speed[0]
        pol.add_row("replay speed", f"{r0['accesses'] // 1000}k acc.", *[
            f"{by[n]['accesses_per_s'] / 1e6:.2f} M/s" if n in by else "" for n in names])
        if "opt" in by:
            pol.caption = f"OPT (Belady) replays the same trace at {by['opt']['accesses_per_s'] / 1e6:.2f} M/s"
    hot = Table(title="hotness unit (batched numpy counting)")
    for c in ("mode", "batch", "units", "accesses/s (wall)", "accesses/CPU-s"):
        hot.add_column(c, justify="right")
    for r in result.hotness:
        hot.add_row(r["mode"], str(r["batch"]), str(r["units"]), f"{r['accesses_per_s'] / 1e6:.1f} M",
                    f"{r['accesses_per_cpu_s'] / 1e6:.1f} M")
    return Group(pol, hot)


def register(bench: Any) -> None:
    p = bench.add_parser("fwmodel", help="policies vs OPT on traces, replay speed, CHMU counting throughput")
    p.add_argument("--attention", metavar="FILE", help="a recorded attention trace (default: record one)")
    p.add_argument("--record-steps", type=int, default=96, help="decode steps to record (default 96)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fwmodel)


def cmd_fwmodel(args: Any) -> int:
    from tools.cli._common import CliError, print_json
    from tools.trace.io import load_trace

    attention = None
    if args.attention:
        try:
            attention = load_trace(args.attention)
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot use {args.attention}: {exc}") from None
    result = measure(attention, args.record_steps)
    if args.json:
        print_json(result.to_dict())
    else:
        from rich.console import Console

        Console().print(render(result))
    return 0
