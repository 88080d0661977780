"""``cxlemu bench fwmodel``: firmware-model figures — policy hits against OPT, replay speed, CHMU throughput.

* **Policies**: every online policy replays each trace (demand fill) at capacities of 25 %, 50 %
  and 75 % of the trace's distinct blocks; the figure is hits / OPT hits (1.0 = the oracle).
  Traces: the four synthetic generators with their defaults, and a trace recorded from a seeded
  random tiny Llama's attention (``tools.trace.record``, defaults) or one given with ``--attention``.
* **Replay speed**: each policy (and OPT) on a 200k-access Zipf trace (``trace gen zipf``
  defaults: 20k blocks, alpha 1.0) at 25 % of its distinct blocks, in accesses per wall-clock
  second of the replay (median of ``reps``; the key array as a binary trace holds it, so the
  figure includes the id check but not file reading): cxlemu's replay (C for lru, lfu, arc,
  s3fifo, opt), the same with the ids spread over int64 (mapped to dense ids by a C hash map
  first, as any integer keys are), the Python policies alone, and libCacheSim's C simulator on the same trace (its Python
  binding's ``process_trace``, hashpower 16, reading its oracleGeneral file), side by side with
  the ratio, when libCacheSim is installed.
* **Peer**: hit counts side by side with libCacheSim's on Zipf and Zipf + scan traces at 10, 25
  and 50 % of their distinct blocks (lru, lfu, arc, s3fifo, opt), when it is installed.
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
from firmware_model.replay import Access, opt_hit_count, replay, replay_keys

FRACTIONS = (0.25, 0.5, 0.75)


@dataclass
class FwmodelBenchResult:
    policies: list[dict[str, Any]] = field(default_factory=list)  # one row per trace x capacity x policy
    speed: list[dict[str, Any]] = field(default_factory=list)  # replay speed on one long trace
    hotness: list[dict[str, Any]] = field(default_factory=list)
    peer: list[dict[str, Any]] = field(default_factory=list)  # hits beside libCacheSim's

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def best(self, trace: str, capacity: int) -> dict[str, Any]:
        rows = [r for r in self.policies if r["trace"] == trace and r["capacity"] == capacity]
        return max(rows, key=lambda r: r["opt_ratio"])


def bench_traces(attention: list[Access] | None = None, record_steps: int = 96) -> dict[str, list[Access]]:
    """The synthetic traces with default parameters plus a recorded attention trace."""
    from tools.trace.gen import KINDS, KV_KINDS

    traces = {kind: KINDS[kind]() for kind in KV_KINDS}
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


def _median_seconds(keys: np.ndarray, policy: str, capacity: int, impl: str, reps: int) -> float:
    """Median wall-clock seconds of a demand-fill replay of ``keys`` (no OPT pass)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        replay_keys(keys, policy, capacity, with_opt=False, impl=impl)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_speed(policies: tuple[str, ...] = ONLINE_POLICY_NAMES + ("opt",), reps: int = 5,
                  python_reps: int = 1, accesses: int = 200_000) -> list[dict[str, Any]]:
    """Replay speed on a Zipf trace at 25 % of its blocks: cxlemu, its Python policies, libCacheSim."""
    import os
    import tempfile

    from firmware_model.replay import replays_in_c
    from tools.trace import peer
    from tools.trace.gen import zipf

    keys = np.array([a.block for a in zipf(accesses=accesses)], dtype=np.int64)
    capacity = len(np.unique(keys)) // 4
    sparse = keys * 1_000_003 + 17
    path = None
    if peer.available():
        fd, path = tempfile.mkstemp(suffix=".oracleGeneral")
        os.close(fd)
        peer.write_oracle_general(keys, path)
    rows = []
    try:
        for policy in policies:
            result = replay_keys(keys, policy, capacity, with_opt=False)
            fast = replays_in_c(policy)
            row: dict[str, Any] = {"policy": policy, "accesses": len(keys), "capacity": capacity,
                                   "impl": "c" if fast else "py", "hits": result.hits}
            row["accesses_per_s"] = int(len(keys) / _median_seconds(
                keys, policy, capacity, "auto", reps if fast else python_reps))
            row["python_accesses_per_s"] = row["accesses_per_s"] if not fast else int(len(keys) / _median_seconds(
                keys, policy, capacity, "py", python_reps))
            if fast:  # the same trace with ids spread over int64: the C hash map gives them dense ids first
                row["sparse_accesses_per_s"] = int(len(keys) / _median_seconds(
                    sparse, policy, capacity, "auto", reps))
            if path is not None and policy in peer.PEER_NAMES:
                runs = [peer.peer_replay(path, len(keys), policy, capacity) for _ in range(reps)]
                row["peer_hits"] = runs[0].hits
                row["peer_accesses_per_s"] = int(len(keys) / statistics.median(r.seconds for r in runs))
                row["ratio"] = round(row["accesses_per_s"] / row["peer_accesses_per_s"], 3)
            rows.append(row)
    finally:
        if path is not None:
            os.unlink(path)
    return rows


def measure_peer(seeds: tuple[int, ...] = (0, 1), fractions: tuple[float, ...] = (0.10, 0.25, 0.50)
                 ) -> list[dict[str, Any]]:
    """Hit counts beside libCacheSim's (empty when it is not installed)."""
    from tools.trace import peer
    from tools.trace.gen import scanmix, zipf

    if not peer.available():
        return []
    traces = {f"zipf s{seed}": zipf(accesses=50_000, blocks=5_000, seed=seed) for seed in seeds}
    traces |= {f"scanmix s{seed}": scanmix(seed=seed) for seed in seeds}
    rows = []
    for name, trace in traces.items():
        keys = np.array([a.block for a in trace], dtype=np.int64)
        unique = len(np.unique(keys))
        for frac in fractions:
            capacity = int(unique * frac)
            theirs = peer.peer_hits(keys, list(peer.PEER_NAMES), capacity)
            for policy in peer.PEER_NAMES:
                ours = replay_keys(keys, policy, capacity, with_opt=False).hits
                rows.append({"trace": name, "accesses": len(keys), "unique_blocks": unique, "capacity": capacity,
                             "policy": policy, "hits": ours, "peer_hits": theirs[policy],
                             "equal": ours == theirs[policy]})
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
                              speed=measure_speed(), hotness=measure_hotness(), peer=measure_peer())
