"""`cxlemu bench serve`, the pure parts: the model, the workload, the time scale, the metrics and
the checks. The bench (``tools.bench.serve``) drives vLLM with them; the simulator replays the same
clients (``tools.sim.workload.from_bench``) and reads the bench's reports (``tools.sim.validate``).

Nothing here imports vLLM, torch or a clock: the tests run it on fixed inputs.

The workload is what a serving engine sees when clients come back (seeded; identical in every
mode, so tokens can be compared request by request):

* a *session* client resends its conversation: turn k's prompt is the shared system prompt, then
  every earlier turn's user tokens and the engine's output, then turn k's new user tokens — so
  the prefix grows by one turn each time and the whole earlier context can be reused;
* a *document* client asks ``turns`` questions about one long document of its own: the document
  is the reusable prefix, each question new.

Client ``i`` of a level is a document client when ``i % doc_every == doc_every - 1``. Clients are
closed-loop with think time: a client's first turn arrives at a seeded offset in [0, T), each next
turn a seeded time in [T/2, 3T/2) after its previous one finished, where T (seconds) is
``think_contexts`` x the time this machine takes to prefill one whole client context (measured
by the bench), so the same workload loads a fast and a slow machine alike.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tools.sim.hardware import ModelShape

FIRST_TOKEN_ID = 4  # ids below are the tokenizer's specials (<pad>, <s>, </s>, <unk>)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The random Llama the bench serves (``tools.bench._serve_engine.build_model`` writes it)."""
    layers: int = 8
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 2048
    init_range: float = 0.1  # 0.02 (transformers' default) makes greedy output one token forever
    seed: int = 0

    def shape(self) -> ModelShape:
        """The model as the simulator's ``ModelShape`` (float32, as the bench runs it)."""
        return ModelShape(name="bench-random-llama", layers=self.layers, hidden=self.hidden, heads=self.heads,
                          kv_heads=self.kv_heads, intermediate=self.intermediate, vocab=self.vocab, dtype_bytes=4)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, float32 (``ModelShape``'s arithmetic, GQA included)."""
        return self.shape().kv_bytes_per_token


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    system_tokens: int = 256
    user_tokens: int = 120  # a turn adds user + output tokens, not a multiple of the block: turns'
    output_tokens: int = 16  # decodes cross block boundaries, so vLLM must find (or preempt for) blocks
    turns: int = 4
    doc_tokens: int = 576
    doc_every: int = 4
    think_contexts: float = 3.0  # T; at 1.0 the first turns' burst saturated every mode alike
    vocab: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("system_tokens", "user_tokens", "output_tokens", "turns", "doc_tokens", "doc_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.think_contexts >= 0:
            raise ValueError(f"think_contexts must be >= 0, got {self.think_contexts}")
        if self.vocab <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"vocab must be > {FIRST_TOKEN_ID + 1}, got {self.vocab}")

    @property
    def context_tokens(self) -> int:
        """The most KV one client holds: its last turn's prompt plus its output."""
        session = self.system_tokens + self.turns * (self.user_tokens + self.output_tokens)
        return max(session, self.doc_tokens + self.user_tokens + self.output_tokens)

    def blocks_per_client(self, block_tokens: int) -> int:
        return -(-self.context_tokens // block_tokens)


@dataclass(frozen=True)
class Client:
    """One closed-loop client of one level: its kind and the tokens it will send."""

    level: int
    index: int
    kind: str  # "session" | "doc"
    prefix: tuple[int, ...]  # the system prompt (sessions) or the document (doc clients)
    user: tuple[tuple[int, ...], ...]  # new tokens of each turn
    start: float = 0.0  # first arrival, in units of the think time T
    think: tuple[float, ...] = ()  # before each later turn, in units of T

    def arrival_after(self, turn: int, think_s: float) -> float:
        """Seconds after the level's start (turn 0) or after turn-1's finish (later turns)."""
        return (self.start if turn == 0 else self.think[turn - 1]) * think_s

    @property
    def turns(self) -> int:
        return len(self.user)

    def prompt(self, turn: int, outputs: Sequence[Sequence[int]]) -> list[int]:
        """Turn ``turn``'s prompt, given the outputs of the turns before it."""
        if not 0 <= turn < self.turns:
            raise IndexError(f"client {self.index} has turns 0..{self.turns - 1}, not {turn}")
        if self.kind == "doc":
            return [*self.prefix, *self.user[turn]]
        if len(outputs) < turn:
            raise ValueError(f"session turn {turn} needs the outputs of turns 0..{turn - 1}")
        ids = list(self.prefix)
        for k in range(turn):
            ids += [*self.user[k], *outputs[k]]
        return ids + list(self.user[turn])

    def request_id(self, turn: int) -> str:
        return f"c{self.level}-k{self.index}-t{turn}"


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n))


def system_prompt(cfg: WorkloadConfig) -> tuple[int, ...]:
    return _tokens(random.Random(f"{cfg.seed}:system"), cfg.system_tokens, cfg.vocab)


def clients(cfg: WorkloadConfig, level: int) -> list[Client]:
    """The ``level`` clients of one concurrency level (seeded by seed, level and index)."""
    system = system_prompt(cfg)
    out = []
    for i in range(level):
        rng = random.Random(f"{cfg.seed}:{level}:{i}")
        doc = i % cfg.doc_every == cfg.doc_every - 1
        prefix = _tokens(rng, cfg.doc_tokens, cfg.vocab) if doc else system
        user = tuple(_tokens(rng, cfg.user_tokens, cfg.vocab) for _ in range(cfg.turns))
        start = rng.random()
        think = tuple(0.5 + rng.random() for _ in range(cfg.turns - 1))
        out.append(Client(level, i, "doc" if doc else "session", prefix, user, start, think))
    return out


# --- the time scale ----------------------------------------------------------------------------
#: The reference deployment whose link : compute ratio the bench reproduces (each number's source).
REFERENCE = {
    "model": "Llama-2-7B (32 layers, hidden 4096, 32 KV heads, fp16)",
    "kv_bytes_per_token": 2 * 32 * 4096 * 2,  # K and V x layers x hidden x 2 bytes = 512 KiB
    "accelerator": "H100-class, 80 GB",
    "prefill_flop_per_token": 2 * 7e9,  # 2 x parameters
    "effective_tflops": 400.0,
    "ttft_s": 0.200,  # a 4096-token prompt's time to first token
    "ttft_tokens": 4096,
}


def time_scale(*, kv_bytes_per_token: float, compute_s_per_token: float,
               reference: dict[str, Any] | None = None,
               links_gbps: dict[str, float] | None = None) -> dict[str, Any]:
    """The link time scale k that makes (link time : prefill compute) for a context here equal
    the reference's: k x bytes_here / bw / compute_here = bytes_ref / bw / compute_ref, so
    k = (bytes_ref / compute_ref) / (bytes_here / compute_here), whatever the link's bandwidth.

    The reference's compute per token is its measured TTFT over its prompt (the FLOP estimate is
    shown beside it). Returns every number of the arithmetic."""
    ref = dict(REFERENCE if reference is None else reference)
    if kv_bytes_per_token <= 0 or compute_s_per_token <= 0:
        raise ValueError("kv_bytes_per_token and compute_s_per_token must be > 0")
    ref_s = ref["ttft_s"] / ref["ttft_tokens"]
    flop_s = ref["prefill_flop_per_token"] / (ref["effective_tflops"] * 1e12)
    ref_rate = ref["kv_bytes_per_token"] / ref_s  # bytes of KV the reference computes per second
    here_rate = kv_bytes_per_token / compute_s_per_token
    k = ref_rate / here_rate
    out: dict[str, Any] = {
        "reference": ref, "reference_s_per_token": ref_s, "reference_flop_estimate_s_per_token": flop_s,
        "reference_kv_bytes_per_s_of_compute": ref_rate, "kv_bytes_per_token": kv_bytes_per_token,
        "compute_s_per_token": compute_s_per_token, "kv_bytes_per_s_of_compute": here_rate, "time_scale": k,
        "links": {}}
    for name, gbps in (links_gbps or {}).items():
        ratio = ref["kv_bytes_per_token"] / (gbps * 1e9) / ref_s
        out["links"][name] = {"gbps": gbps, "effective_gbps_here": gbps / k, "link_to_compute": ratio}
    return out


# --- metrics -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestRecord:
    """One request as a client saw it (times in seconds from the level's start)."""

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
    """One mode at one concurrency level."""

    mode: str
    level: int
    records: list[RequestRecord]
    tier: dict[str, int] = field(default_factory=dict)  # tier counters' change over the level
    block_tokens: int = 128
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        recs = self.records
        ttft = [r.ttft for r in recs]
        returning = [r.ttft for r in recs if r.returning]
        warm = [r.ttft for r in recs if r.warm]
        tpot = [r.tpot for r in recs if not math.isnan(r.tpot)]
        out_tokens = sum(len(r.output) for r in recs)
        span = max((r.finish or 0.0) for r in recs) - min(r.arrival for r in recs) if recs else 0.0
        tier = self.tier
        return {
            "mode": self.mode, "level": self.level, "requests": len(recs),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "returning_ttft_p50_s": percentile(returning, 50), "warm_ttft_p99_s": percentile(warm, 99),
            "tpot_s": percentile(tpot, 50), "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / span if span > 0 else math.nan,
            "cached_tokens": sum(r.num_cached_tokens for r in recs),
            "tier_tokens": tier.get("blocks_loaded", 0) * self.block_tokens,
            "tier_hits": tier.get("hits", 0), "bytes_loaded": tier.get("bytes_loaded", 0),
            "bytes_stored": tier.get("bytes_stored", 0), "stall_s": tier.get("stall_ns", 0) / 1e9,
            "failed_loads": tier.get("failed_loads", 0),
            "preemptions": sum(r.preemptions for r in recs), "span_s": span}


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
