"""Synthetic block-access traces shaped like KV-cache traffic, seeded and deterministic.

Each generator returns a list of :class:`~firmware_model.replay.Access`; every keyword is an int
with a default so the CLI can expose it as ``--name``. Block keys are tuples:
``(seq, layer, block)`` for per-sequence KV, ``(layer, "sys", i)`` for a shared system prompt.

* ``multiturn`` — chat sessions sharing a system prompt; turns of different sessions interleave in
  a batch, so a paused session's KV must survive (or come back) until its next turn.
* ``sliding`` — StreamingLLM: attention sinks plus a recent window that slides as tokens arrive.
* ``heavy`` — H2O: sinks + window + a few heavy-hitter blocks per layer, plus sparse noise.
* ``loop`` — a plain layer loop over a fixed set of blocks: LRU's pathological case.
* ``zipf`` — independent Zipf-distributed integer block ids, the cache literature's workload (the
  trace libCacheSim's figures are compared on).
* ``scanmix`` — Zipf reads interrupted by sequential scans over blocks the Zipf part never reads.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from firmware_model.replay import Access

__all__ = ["KINDS", "KV_KINDS", "heavy", "kind_parameters", "loop", "multiturn", "scanmix", "sliding", "zipf"]


def _positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def multiturn(*, sessions: int = 8, turns: int = 4, batch: int = 2, system_blocks: int = 4,
              prompt_blocks: int = 2, answer_steps: int = 12, block_steps: int = 4, layers: int = 2,
              seed: int = 0) -> list[Access]:
    """Sessions of ``turns`` turns; ``batch`` turns decode together, one step at a time."""
    _positive(sessions=sessions, turns=turns, batch=batch, system_blocks=system_blocks,
              prompt_blocks=prompt_blocks, answer_steps=answer_steps, block_steps=block_steps, layers=layers)
    rng = np.random.default_rng(seed)
    pending = [(int(s), turn) for turn in range(turns) for s in rng.permutation(sessions)]
    own_blocks = [0] * sessions
    running: list[list[int]] = []  # [session, steps left]
    out: list[Access] = []
    t = 0
    while pending or running:
        while pending and len(running) < batch and all(r[0] != pending[0][0] for r in running):
            s, _ = pending.pop(0)
            own_blocks[s] += prompt_blocks
            running.append([s, answer_steps])
        if not running:  # the next turn's session is still running: let it wait a step
            running.append([pending.pop(0)[0], answer_steps])
        for item in running:
            s = item[0]
            if (answer_steps - item[1]) % block_steps == block_steps - 1:
                own_blocks[s] += 1
            for layer in range(layers):
                out += [Access(t, (layer, "sys", i), s, layer) for i in range(system_blocks)]
                out += [Access(t, (s, layer, b), s, layer) for b in range(own_blocks[s])]
            item[1] -= 1
        running = [r for r in running if r[1] > 0]
        t += 1
    return out


def sliding(*, seqs: int = 2, steps: int = 128, sinks: int = 1, window: int = 6, block_steps: int = 4,
            layers: int = 4, seed: int = 0) -> list[Access]:
    """Each step reads the sink blocks and the last ``window`` blocks of every sequence."""
    _positive(seqs=seqs, steps=steps, window=window, block_steps=block_steps, layers=layers)
    rng = np.random.default_rng(seed)
    start = rng.integers(sinks + 1, sinks + window + 1, size=seqs)  # prompt length in blocks
    out: list[Access] = []
    for t in range(steps):
        for s in range(seqs):
            n = int(start[s]) + t // block_steps
            blocks = sorted(set(range(min(sinks, n))) | set(range(max(0, n - window), n)))
            for layer in range(layers):
                out += [Access(t, (s, layer, b), s, layer) for b in blocks]
    return out


def heavy(*, seqs: int = 2, steps: int = 128, sinks: int = 1, window: int = 2, hitters: int = 3,
          noise_permille: int = 30, prompt_blocks: int = 16, block_steps: int = 8, layers: int = 4,
          seed: int = 0) -> list[Access]:
    """Sinks + window + the ``hitters`` highest-scoring older blocks per layer, plus random noise."""
    _positive(seqs=seqs, steps=steps, window=window, prompt_blocks=prompt_blocks,
              block_steps=block_steps, layers=layers)
    rng = np.random.default_rng(seed)
    max_blocks = prompt_blocks + steps // block_steps + 1
    score = rng.lognormal(0.0, 1.5, size=(seqs, layers, max_blocks))
    out: list[Access] = []
    for t in range(steps):
        for s in range(seqs):
            n = prompt_blocks + t // block_steps
            for layer in range(layers):
                keep = set(range(min(sinks, n))) | set(range(max(0, n - window), n))
                older = np.arange(min(sinks, n), max(0, n - window))
                if older.size:
                    top = older[np.argsort(-score[s, layer, older], kind="stable")[:hitters]]
                    noise = older[rng.random(older.size) < noise_permille / 1000]
                    keep |= set(top.tolist()) | set(noise.tolist())
                out += [Access(t, (s, layer, b), s, layer) for b in sorted(keep)]
    return out


def loop(*, steps: int = 32, layers: int = 8, blocks: int = 8, seed: int = 0) -> list[Access]:
    """Every step walks all layers in order, each reading the same ``blocks`` blocks."""
    _positive(steps=steps, layers=layers, blocks=blocks)
    return [Access(t, (0, layer, b), 0, layer) for t in range(steps) for layer in range(layers)
            for b in range(blocks)]


def _zipf_ids(rng: np.random.Generator, n: int, blocks: int, alpha_milli: int) -> np.ndarray:
    """``n`` draws of Zipf(alpha) over ``blocks`` ids (rank r has weight r ** -alpha), ranks shuffled."""
    weights = np.arange(1, blocks + 1, dtype=np.float64) ** (-alpha_milli / 1000)
    ranks = rng.choice(blocks, size=n, p=weights / weights.sum())
    return rng.permutation(blocks)[ranks]


def zipf(*, accesses: int = 200_000, blocks: int = 20_000, alpha_milli: int = 1000, seed: int = 0) -> list[Access]:
    """``accesses`` reads of ``blocks`` integer ids, Zipf(``alpha_milli`` / 1000); t = access index."""
    _positive(accesses=accesses, blocks=blocks, alpha_milli=alpha_milli)
    ids = _zipf_ids(np.random.default_rng(seed), accesses, blocks, alpha_milli).tolist()
    return [Access(t, b) for t, b in enumerate(ids)]


def scanmix(*, accesses: int = 50_000, blocks: int = 2_000, alpha_milli: int = 1000, scan_blocks: int = 1_000,
            scan_every: int = 5_000, seed: int = 0) -> list[Access]:
    """Zipf reads of ``blocks`` ids; every ``scan_every`` accesses, one pass over ``scan_blocks`` ids
    beyond them (ids ``blocks`` ...), in order: one-hit wonders that flush a recency-only cache."""
    _positive(accesses=accesses, blocks=blocks, alpha_milli=alpha_milli, scan_blocks=scan_blocks,
              scan_every=scan_every)
    hot = _zipf_ids(np.random.default_rng(seed), accesses, blocks, alpha_milli).tolist()
    out: list[int] = []
    for start in range(0, accesses, scan_every):
        out += hot[start:start + scan_every]
        out += range(blocks, blocks + scan_blocks)
    return [Access(t, b) for t, b in enumerate(out[:accesses])]


KINDS: dict[str, Callable[..., list[Access]]] = {
    "multiturn": multiturn,
    "sliding": sliding,
    "heavy": heavy,
    "loop": loop,
    "zipf": zipf,
    "scanmix": scanmix,
}
KV_KINDS = ("multiturn", "sliding", "heavy", "loop")
"""The kinds shaped like KV-cache traffic (the ones ``cxlemu bench fwmodel`` scores policies on)."""


def kind_parameters(kind: str) -> dict[str, int]:
    """The generator's keyword parameters and their defaults (all ints)."""
    sig = inspect.signature(KINDS[kind])
    return {p.name: p.default for p in sig.parameters.values()}
