"""`cxlemu bench pool --sim`: the fleet simulator (``tools.sim.fleet``) on the exact workload
`cxlemu bench pool` sends its vLLM engines, its hit rates against the bench's measured ones
(issue 27, item 9: within 10 %).

The workload (``pool_serve.trace_workload``) becomes a Mooncake trace (:func:`to_mooncake`) at
the trace's own scale: each kept hash id one 512-token block again (the bench made it one 128-token
vLLM block), the prompt's own tail (``TAIL_TOKENS``) a last block of its own with a fresh id, the
output scaled alike. Requests arrive ``GAP_MS`` apart, in the bench's order, so that (as there)
none overlaps another; :func:`run` checks it. The fleet mirrors the engines: ``engines``
instances, round-robin, each with an HBM prefix cache as small as an engine's ``kv_blocks`` vLLM
blocks (in 16-token blocks; one null block either way); modes ``alone`` -> ``--kv none``,
``private`` -> ``--kv host`` (``tier_blocks / engines`` blocks each), ``shared`` -> ``--kv
cxl-pool`` (``tier_blocks`` in all). Hit rate as the bench counts it: tokens served from a cache
over the prompts' whole blocks (the tails never hit).
"""
from __future__ import annotations

import json
from typing import Any

from tools.bench.pool_serve import TAIL_TOKENS, PoolBenchConfig, Request, default_trace, load_trace, trace_workload
from tools.sim import hardware as hw
from tools.sim.fleet import Fleet, FleetConfig
from tools.sim.mooncake import TRACE_BLOCK_TOKENS, TraceRequest, read
from tools.sim.profile import step_cost

__all__ = ["GAP_MS", "HOME", "MEASURED", "SIM_BLOCK_TOKENS", "compare", "run", "sim_config", "to_mooncake"]

GAP_MS = 60_000  # between arrivals: far past one request's service (run() checks none overlaps)
SIM_BLOCK_TOKENS = 16  # the simulator's vLLM block (FleetConfig.block_tokens)
MODEL, ACCELERATOR = "llama-3-8b", "h100"  # the step cost only: with no overlap it moves no hit
HOME = {"alone": "none", "private": "host", "shared": "cxl-pool"}
#: `cxlemu bench pool`'s hit rates by engines (defaults otherwise: 41 requests), BENCHMARKS.md "vLLM
#: engines on one shared pool" (2: code at 6b18b39, 3: at 0f83bfc); a saved report (``--save``)
#: replaces them (``measured_from``)
MEASURED = {2: {"alone": 0.129, "private": 0.323, "shared": 0.515},
            3: {"alone": 0.125, "private": 0.248, "shared": 0.512}}
GOAL = 0.10  # |simulated / measured - 1|


def _scale(cfg: PoolBenchConfig) -> int:
    if TRACE_BLOCK_TOKENS % cfg.tokens_per_hash:
        raise ValueError(f"tokens_per_hash must divide {TRACE_BLOCK_TOKENS}, got {cfg.tokens_per_hash}")
    return TRACE_BLOCK_TOKENS // cfg.tokens_per_hash


def to_mooncake(workload: list[Request], cfg: PoolBenchConfig) -> list[dict[str, Any]]:
    """The bench's requests as Mooncake trace lines (see the module doc), in its order."""
    k = _scale(cfg)
    fresh = 1 + max((h for r in workload for h in r.hash_ids), default=0)  # tail ids no request shares
    out = []
    for j, r in enumerate(workload):
        out.append({"timestamp": j * GAP_MS, "input_length": len(r.hash_ids) * TRACE_BLOCK_TOKENS + TAIL_TOKENS * k,
                    "output_length": cfg.output_tokens * k, "hash_ids": [*r.hash_ids, fresh + j]})
    return out


def sim_config(cfg: PoolBenchConfig, mode: str) -> FleetConfig:
    """The fleet standing for the bench's engines in ``mode``."""
    k = _scale(cfg)
    per_vllm_block = cfg.tokens_per_hash * k // SIM_BLOCK_TOKENS  # one engine block at the trace's scale
    cache = cfg.tier_blocks // cfg.engines * cfg.tokens_per_hash * k if HOME[mode] != "none" else 0
    return FleetConfig(instances=cfg.engines, kv_blocks=(cfg.kv_blocks - 1) * per_vllm_block + 1,
                       kv_bytes_per_token=hw.MODELS[MODEL].kv_bytes_per_token, router="rr", kv=HOME[mode],
                       cache_tokens=cache, block_tokens=SIM_BLOCK_TOKENS)


def _simulate(trace: list[TraceRequest], fc: FleetConfig) -> dict[str, Any]:
    shape = hw.MODELS[MODEL]
    fleet = Fleet(trace, fc, step_cost("roofline", MODEL, shape, ACCELERATOR))
    fleet.run()
    recs = sorted((r for inst in fleet.instances for r in inst.records), key=lambda r: r.tr.index)
    for a, b in zip(recs, recs[1:]):  # the bench sends one at a time: so must the fleet serve them
        if a.finish > b.tr.arrival_ns:
            raise RuntimeError(f"request {a.tr.index} ends after {b.tr.index} arrives: raise GAP_MS")
    whole = sum((len(r.tr.hash_ids) - 1) * TRACE_BLOCK_TOKENS for r in recs)
    hbm, home = sum(r.hbm_hit for r in recs), sum(r.home_hit for r in recs)
    return {"hit_rate": (hbm + home) / whole, "hbm_hit_rate": hbm / whole, "home_hit_rate": home / whole,
            "hit_tokens": hbm + home, "whole_tokens": whole, "kv": fc.kv, "kv_blocks": fc.kv_blocks,
            "cache_tokens": fc.cache_tokens}


def measured_from(path: str) -> dict[str, float]:
    """The hit rates of a saved `cxlemu bench pool --save` report."""
    from tools.bench.pool_serve import analyse

    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    return {m: v["hit_rate"] for m, v in analyse(report)["modes"].items()}


def run(cfg: PoolBenchConfig, measured: dict[str, float] | None = None) -> dict[str, Any]:
    """Every mode simulated on the bench's workload; ``compare``'s rows against ``measured``
    (default :data:`MEASURED` for ``cfg.engines``)."""
    workload = trace_workload(load_trace(cfg.trace or str(default_trace()), cfg.window), cfg)
    lines = to_mooncake(workload, cfg)
    trace = list(read(json.dumps(x) for x in lines))  # through the simulator's own trace reader
    modes = {mode: _simulate(trace, sim_config(cfg, mode)) for mode in HOME}
    return {"requests": len(workload), "blocks": sum(len(r.hash_ids) for r in workload),
            "distinct": len({h for r in workload for h in r.hash_ids}), "gap_ms": GAP_MS, "modes": modes,
            "rows": compare(modes, MEASURED[cfg.engines] if measured is None else measured), "trace": lines}


def compare(sim: dict[str, dict[str, Any]], measured: dict[str, float]) -> list[dict[str, Any]]:
    """Per mode: simulated, measured, their ratio and whether it is within :data:`GOAL`."""
    rows = []
    for mode, m in sim.items():
        ref = measured.get(mode)
        ratio = m["hit_rate"] / ref if ref else None
        rows.append({"mode": mode, "kv": m["kv"], "simulated": m["hit_rate"], "measured": ref, "ratio": ratio,
                     "within_goal": ratio is not None and abs(ratio - 1) <= GOAL})
    return rows
