"""What a serving run is measured by, for the simulator and ``cxlemu bench serve`` alike: TTFT p50
and p99 over every request, returning sessions' TTFT p50, later turns' TTFT p99, time per output
token p50, output tokens over the span from the first arrival to the last finish
(:func:`latency_summary`); the max-concurrency rule; the bench's token comparisons.

The simulator's requests (``tools.sim.engine.Request``, times in ns) are summarized in ms by
:func:`summarize`; the bench's (:class:`RequestRecord`, times in s) in s by
:meth:`LevelResult.summary`. Both go through :func:`latency_summary` and :func:`percentile`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["MAX_CONCURRENCY_KEY", "LevelResult", "RequestRecord", "latency_summary", "max_concurrency",
           "mismatches", "outputs_vary", "percentile", "summarize"]


def percentile(values: Sequence[float] | np.ndarray, p: float) -> float:
    """The p-th percentile (0..100), linear between closest ranks (numpy's default); NaN when empty."""
    return float(np.percentile(values, p)) if len(values) else math.nan


def latency_summary(arrival: Iterable[float], first: Iterable[float | None], finish: Iterable[float | None],
                    generated: Iterable[int], turn: Iterable[int], session: Iterable[bool], *,
                    latency_unit: float, second: float) -> dict[str, Any]:
    """The metrics of a run's requests, one entry per request in each argument: its arrival,
    first token and finish (in the caller's time unit; None: not yet), its output tokens, its turn
    and whether it is a session's. Latencies are returned divided by ``latency_unit``, the span
    in seconds (``second``: one second in the caller's unit). Keys: requests, ttft_p50, ttft_p99,
    ttft_mean, returning_ttft_p50 (sessions' later turns), warm_ttft_p99 (every later turn),
    tpot (p50 over requests of >= 2 tokens), output_tokens, output_tokens_per_s, span_s."""
    arr = np.asarray(list(arrival), dtype=float)
    fst = np.array([math.nan if x is None else x for x in first], dtype=float)
    fin = np.array([math.nan if x is None else x for x in finish], dtype=float)
    gen = np.asarray(list(generated), dtype=int)
    trn = np.asarray(list(turn), dtype=int)
    ses = np.asarray(list(session), dtype=bool)
    if not len(arr):
        return {"requests": 0}
    ttft = (fst - arr) / latency_unit
    mask = (gen >= 2) & ~np.isnan(fst) & ~np.isnan(fin)
    tpot = (fin - fst)[mask] / (gen[mask] - 1) / latency_unit
    span = (float(np.nanmax(np.append(fin, 0.0))) - arr.min()) / second  # an unfinished request: 0
    out_tokens = int(gen.sum())
    return {"requests": len(arr), "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "ttft_mean": float(ttft.mean()), "returning_ttft_p50": percentile(ttft[ses & (trn > 0)], 50),
            "warm_ttft_p99": percentile(ttft[trn > 0], 99), "tpot": percentile(tpot, 50),
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / span if span > 0 else math.nan,
            "span_s": span}


def summarize(records: Sequence[Any]) -> dict[str, Any]:
    """The simulator's metrics of its finished requests (``tools.sim.engine.Request``: ns), in ms
    where timed, with its preemptions and the prompt tokens served from the prefix cache and the tier."""
    if not records:
        return {"requests": 0}
    s = latency_summary((r.arrival for r in records), (r.first_token for r in records),
                        (r.finish for r in records), (r.generated for r in records), (r.turn for r in records),
                        (r.kind == "session" for r in records), latency_unit=1e6, second=1e9)
    return {"requests": s["requests"], "ttft_p50_ms": s["ttft_p50"], "ttft_p99_ms": s["ttft_p99"],
            "ttft_mean_ms": s["ttft_mean"], "returning_ttft_p50_ms": s["returning_ttft_p50"],
            "warm_ttft_p99_ms": s["warm_ttft_p99"], "tpot_ms": s["tpot"], "output_tokens": s["output_tokens"],
            "output_tokens_per_s": s["output_tokens_per_s"], "span_s": s["span_s"],
            "preemptions": int(sum(r.preemptions for r in records)),
            "prefix_hit_tokens": int(sum(r.local_hit_tokens for r in records)),
            "tier_hit_tokens": int(sum(r.tier_hit_tokens for r in records))}


@dataclass
class RequestRecord:
    """One request as a ``cxlemu bench serve`` client saw it (times in seconds from the level's start)."""

    request_id: str
    client: int
    kind: str
    turn: int
    prompt_tokens: int
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    output: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float:
        return math.nan if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        if self.finish is None or self.first_token is None or len(self.output) < 2:
            return math.nan
        return (self.finish - self.first_token) / (len(self.output) - 1)

    @property
    def warm(self) -> bool:
        """A later turn of any client: something of its prompt was computed before (cold first
        turns cost the same in every mode)."""
        return self.turn > 0

    @property
    def returning(self) -> bool:
        """A session's later turn: its whole earlier conversation could be reused."""
        return self.kind == "session" and self.turn > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LevelResult:
    """One ``cxlemu bench serve`` mode at one concurrency level."""

    mode: str
    level: int
    records: list[RequestRecord]
    tier: dict[str, int] = field(default_factory=dict)  # tier counters' change over the level
    block_tokens: int = 128
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        recs = self.records
        s = latency_summary((r.arrival for r in recs), (r.first_token for r in recs), (r.finish for r in recs),
                            (len(r.output) for r in recs), (r.turn for r in recs),
                            (r.kind == "session" for r in recs), latency_unit=1.0, second=1.0)
        tier = self.tier
        return {
            "mode": self.mode, "level": self.level, "requests": len(recs),
            "ttft_p50_s": s.get("ttft_p50", math.nan), "ttft_p99_s": s.get("ttft_p99", math.nan),
            "returning_ttft_p50_s": s.get("returning_ttft_p50", math.nan),
            "warm_ttft_p99_s": s.get("warm_ttft_p99", math.nan), "tpot_s": s.get("tpot", math.nan),
            "output_tokens": s.get("output_tokens", 0),
            "output_tokens_per_s": s.get("output_tokens_per_s", math.nan),
            "cached_tokens": sum(r.num_cached_tokens for r in recs),
            "tier_tokens": tier.get("blocks_loaded", 0) * self.block_tokens,
            "tier_hits": tier.get("hits", 0), "bytes_loaded": tier.get("bytes_loaded", 0),
            "bytes_stored": tier.get("bytes_stored", 0), "stall_s": tier.get("stall_ns", 0) / 1e9,
            "failed_loads": tier.get("failed_loads", 0),
            "preemptions": sum(r.preemptions for r in recs), "span_s": s.get("span_s", 0.0)}


#: The TTFT the max-concurrency rule reads: p99 over later turns. First turns are cold in every
#: mode and on this CPU a cold document prompt alone (first seen at c=4) costs 2x a session's
#: level-1 TTFT, which capped even all-resident at c=2; the all-request p99 is reported beside it.
MAX_CONCURRENCY_KEY = "warm_ttft_p99_s"


def max_concurrency(ttft_p99_by_level: dict[int, float], factor: float = 2.0) -> int:
    """The highest level whose TTFT p99 stays within ``factor`` x the level-1 (lowest level)
    TTFT p99, every level up to it included (a level that breaks the bound ends the count)."""
    levels = sorted(ttft_p99_by_level)
    if not levels:
        return 0
    bound = factor * ttft_p99_by_level[levels[0]]
    best = 0
    for level in levels:
        if not ttft_p99_by_level[level] <= bound:  # NaN breaks it too
            break
        best = level
    return best


def outputs_vary(outputs: Sequence[Sequence[int]]) -> tuple[bool, str]:
    """Whether greedy outputs carry information: no output is one token repeated, and they are
    not all the same sequence. A constant reference would make token equality prove nothing."""
    if not outputs:
        return False, "no outputs"
    constant = sum(1 for o in outputs if len(set(o)) <= 1)
    if constant:
        return False, f"{constant} of {len(outputs)} outputs are one token repeated"
    if len({tuple(o) for o in outputs}) == 1 and len(outputs) > 1:
        return False, f"all {len(outputs)} outputs are the same sequence"
    return True, f"{len(outputs)} outputs, {len({t for o in outputs for t in o})} distinct tokens"


def mismatches(reference: dict[str, list[int]], other: dict[str, list[int]]) -> list[str]:
    """Request ids whose output differs from the reference's (or is missing), sorted."""
    return sorted(rid for rid, toks in reference.items() if other.get(rid) != toks)
