"""`cxlemu bench sim`: how fast the serving simulator runs, and how its cost grows with sessions.

Multi-turn sessions (``tools.sim.workload.sessions``) of 1k, 3k and 10k sessions, served by the
simulated engine with the offload tier (``cxl-smart`` by default: the most work per step: the
tier's policy, stores and layer-wise loads), each size timed on the wall clock. The growth
exponent is the slope of log(wall) against log(sessions) between the smallest and the largest
size (1.0: linear). Target (issue #15): 10,000 sessions in <= 5 minutes on a 2-core host.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

TARGET_S = 300.0
TARGET_SESSIONS = 10_000


def measure(sizes: list[int], modes: list[str], *, model: str, accelerator: str, concurrency: int,
            progress: Any = None) -> list[dict[str, Any]]:
    from tools.sim.run import Point, simulate

    base = Point(model=model, accelerator=accelerator, concurrency=concurrency,
                 workload={"kind": "sessions", "sessions": 0, "turns": 4, "system_tokens": 1024,
                           "system_prompts": 4, "user_tokens": 256, "output_tokens": 128, "think_s": 5.0})
    rows = []
    for mode in modes:
        for n in sizes:
            if progress:
                progress(f"{mode}: {n} sessions")
            p = replace(base, mode=mode, workload={**base.workload, "sessions": n})
            t = time.perf_counter()
            r = simulate(p)
            wall = time.perf_counter() - t
            rows.append({"mode": mode, "sessions": n, "requests": r["requests"], "wall_s": wall,
                         "steps": r["steps"], "simulated_s": r["sim_s"], "steps_per_s": r["steps"] / wall,
                         "requests_per_s": r["requests"] / wall, "output_tokens_per_s": r["output_tokens_per_s"],
                         "preemptions": r["preemptions"], "tier_hit_tokens": r["tier_hit_tokens"]})
    return rows


def growth(rows: list[dict[str, Any]], mode: str) -> float:
    rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["sessions"])
    if len(rs) < 2:
        return math.nan
    a, b = rs[0], rs[-1]
    return math.log(b["wall_s"] / a["wall_s"]) / math.log(b["sessions"] / a["sessions"])


def run(sizes: list[int], modes: list[str], *, model: str, accelerator: str, concurrency: int,
        progress: Any = None) -> dict[str, Any]:
    """The rows of ``measure``, each mode's growth exponent and its check against the target (the
    first size of at least TARGET_SESSIONS, if any, within TARGET_S)."""
    rows = measure(sizes, modes, model=model, accelerator=accelerator, concurrency=concurrency, progress=progress)
    checks = []
    for mode in modes:
        big = [r for r in rows if r["mode"] == mode and r["sessions"] >= TARGET_SESSIONS]
        if big:
            r = big[0]
            checks.append({"mode": mode, "sessions": r["sessions"], "wall_s": r["wall_s"],
                           "passed": r["wall_s"] <= TARGET_S})
    return {"rows": rows, "growth_exponent": {m: growth(rows, m) for m in modes}, "checks": checks,
            "config": {"model": model, "accelerator": accelerator, "concurrency": concurrency}}
