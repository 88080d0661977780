"""Why a sparse KV mode missed an answer: did its attention read the tokens the answer comes from?

``cxlemu bench quality`` scores each answer (a needle, a recall query) right or wrong. For hot
pages and H2O that alone cannot say why an answer was lost: the page holding the fact was not read
(the selector's miss, or H2O's eviction), or it was read and the model still answered otherwise
(the other pages it read, or those it no longer read, changed the attention). Here, for every
scored answer position of a document:

* ``tools.quality.tasks.answer_sources``: the body tokens the answer is read from: a needle
  position's passkey token; a recall query's pair ``v k``;
* :class:`ReadLog`: fed the cache's ``record(layer, read)`` (``CxlCache(record=...)``), whether
  each layer's attention at that step read them, per KV head: for ``"hot"`` the pages chosen, or
  resident in the sink (a source is never in the recent window: it lies before the perplexity
  tail, checked); for ``"h2o"`` the tokens kept;
* :func:`diagnose` (pure): per task, the answers whose sources every layer read (a layer reads
  them when one of its KV heads does: each KV head chooses its own pages, and one head
  retrieves: the needle is found through heads whose partner never read its page), the
  misses split into *not read* and *read but answered wrong*, and the answers paired with dense
  attention's: right there and lost here, wrong there and right here. On base rates of ~20 % a
  ratio of accuracies is noise; the paired counts are the figure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from firmware_model.hot_pages import SINK_PAGES, WINDOW_PAGES
from tools.quality.tasks import VALUES, Document, answer_sources, value_positions

__all__ = ["GUESSES", "TASKS", "Answer", "ReadLog", "answer_sources", "answers", "diagnose", "guess_chance",
           "recall_guesses", "sign_test", "tail_fact_share", "value_positions", "values_read"]

TASKS = ("needle", "recall")


class ReadLog:
    """What each layer read at the answer positions of one document; ``before(p)`` (for
    ``score``) marks the step, ``record(layer, read)`` (for ``CxlCache``) logs it.

    ``block_tokens``: hot attention's page size (``read`` are pages chosen; the sink is read
    too); None for H2O (``read`` are token positions)."""

    def __init__(self, sources: dict[int, tuple[int, ...]], layers: int, block_tokens: int | None,
                 values: dict[int, tuple[int, ...]] | None = None, tail: tuple[int, ...] = ()) -> None:
        """``values``: per recall position, the positions of all the document's values: the share
        of them read is kept too (``values_read``). ``tail``: the perplexity tail's positions, at
        which (pages only) the share of the chosen pages that hold a fact (a source of any answer)
        is kept (``tail_fact``: per step, layer and KV head, the fact pages and the pages chosen)."""
        self.sources, self.layers, self.block_tokens = sources, layers, block_tokens
        self.values = values or {}
        self.tail = frozenset(tail) if block_tokens is not None else frozenset()
        self.facts = np.unique([t // block_tokens for src in sources.values() for t in src]) if block_tokens else None
        self.at: int | None = None
        self.read: dict[int, dict[int, np.ndarray]] = {p: {} for p in sources}
        self.values_read: dict[int, dict[int, float]] = {p: {} for p in self.values}
        self.tail_fact: list[tuple[int, int]] = []

    def before(self, position: int) -> None:
        self.at = position if position in self.sources or position in self.tail else None

    def record(self, layer: int, read: Any) -> None:
        """``read`` ``(B, Hkv, n)``: one sequence (B = 1); every KV head's reads."""
        if self.at is None:
            return
        rows = np.asarray(read)[0]
        if self.at in self.tail:
            self.tail_fact += [(int(np.isin(row, self.facts).sum()), row.size) for row in rows]
            return
        self.read[self.at][layer] = self._shares(self.sources[self.at], rows) == 1.0
        if self.at in self.values:
            self.values_read[self.at][layer] = float(self._shares(self.values[self.at], rows).mean())

    def _shares(self, positions: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
        """Per KV head, the share of the pages (or tokens) holding ``positions`` that it read."""
        need = np.asarray(positions)
        if self.block_tokens is None:
            return np.array([np.isin(need, row).mean() for row in rows])
        need = np.unique(need // self.block_tokens)
        seq_pages = (self.at + 1) // self.block_tokens if self.at is not None else 0
        if (need >= seq_pages - WINDOW_PAGES).any():  # the window's pages are read but not recorded
            raise ValueError(f"an answer source page {need.tolist()} may lie in the recent window at "
                             f"position {self.at}: the diagnostic cannot see it")
        return np.array([(np.isin(need, row) | (need < SINK_PAGES)).mean() for row in rows])  # the sink is read

    def per_layer(self, positions: tuple[int, ...]) -> tuple[tuple[bool, ...], ...]:
        """For each layer, whether some KV head read the sources, at every one of ``positions``."""
        out = []
        for layer in range(self.layers):
            if any(layer not in self.read[p] for p in positions):
                raise ValueError(f"layer {layer} recorded nothing at an answer position of {positions}")
            out.append(all(bool(self.read[p][layer].any()) for p in positions))
        return tuple(out)


@dataclass(frozen=True)
class Answer:
    """One scored answer of a mode beside dense's: a document's needle (all its tokens) or one
    recall query; ``read``: per layer, its sources read by some KV head (None: not recorded)."""

    task: str
    ok: bool
    dense_ok: bool
    read: tuple[bool, ...] | None


def answers(doc: Document, score: Any, dense: Any, log: ReadLog | None) -> list[Answer]:
    """The document's answers (``DocScore`` of the mode and of dense attention)."""
    out = [Answer("needle", score.needle_ok, dense.needle_ok, log.per_layer(doc.needle_at) if log else None)]
    for p, ok, dense_ok in zip(doc.recall_at, score.recall_ok, dense.recall_ok, strict=True):
        out.append(Answer("recall", ok, dense_ok, log.per_layer((p,)) if log else None))
    return out


def diagnose(found: list[Answer]) -> dict[str, Any]:
    """The counts (pure; see the module docstring). Per task ``t``: ``t_lost`` (dense right, this
    mode wrong), ``t_gained`` (dense wrong, this right); where reads were recorded ``t_page_read``
    (fraction whose sources every layer read), ``t_miss_unread`` / ``t_miss_read``
    (wrong answers whose sources were not / were read) and ``t_lost_unread``; over both tasks
    ``answer_page_read`` and ``answer_page_read_by_layer``. Unrecorded figures are None."""
    out: dict[str, Any] = {}
    recorded = [a for a in found if a.read is not None]
    for task in TASKS:
        mine = [a for a in found if a.task == task]
        out[f"{task}_lost"] = sum(a.dense_ok and not a.ok for a in mine)
        out[f"{task}_gained"] = sum(a.ok and not a.dense_ok for a in mine)
        seen = [a for a in mine if a.read is not None]
        full = [all(a.read) for a in seen if a.read is not None]
        out[f"{task}_page_read"] = sum(full) / len(seen) if seen else None
        out[f"{task}_miss_unread"] = sum(not a.ok and not r for a, r in zip(seen, full)) if seen else None
        out[f"{task}_miss_read"] = sum(not a.ok and r for a, r in zip(seen, full)) if seen else None
        out[f"{task}_lost_unread"] = (sum(a.dense_ok and not a.ok and not r for a, r in zip(seen, full))
                                      if seen else None)
    if recorded:
        reads = np.array([a.read for a in recorded], bool)  # (answers, layers)
        out["answer_page_read"] = float(reads.all(1).mean())
        out["answer_page_read_by_layer"] = [float(x) for x in reads.mean(0)]
    else:
        out["answer_page_read"] = out["answer_page_read_by_layer"] = None
    return out


GUESSES = ("right", "unasked", "answered", "foreign", "other")


def recall_guesses(doc: Document, score: Any) -> list[str]:
    """Each recall answer of ``score`` (a ``DocScore``), in asking order: ``right``; ``unasked``
    (another value of the document, not yet answered in the queries); ``answered`` (a value the
    queries already answered); ``foreign`` (a value not in the document); ``other`` (no value)."""
    scored = sorted(set(doc.needle_at) | set(doc.recall_at) | set(doc.ppl_at))
    argmax = dict(zip(scored, score.argmax, strict=True))
    body = doc.tokens[:doc.needle_at[0]]
    values = {int(t) for t in body if VALUES[0] <= t < VALUES[1]}
    answered: set[int] = set()
    out = []
    for p, answer in zip(doc.recall_at, doc.answers(doc.recall_at)):
        got = argmax[p]
        out.append("right" if got == answer else "answered" if got in answered else "unasked" if got in values
                   else "foreign" if VALUES[0] <= got < VALUES[1] else "other")
        answered.add(answer)
    return out


def guess_chance(pairs: int) -> float:
    """The recall accuracy of a uniform guess among the values not yet answered: query ``i`` (from
    0) has ``pairs - i`` of them, so the mean of ``1 / (pairs - i)`` (H_pairs / pairs)."""
    return sum(1 / (pairs - i) for i in range(pairs)) / pairs


def values_read(logs: list[ReadLog], layers: int) -> list[float] | None:
    """Per layer, the mean share of the document's value pages (tokens) that attention read at
    the recall queries (every KV head averaged); None without logs."""
    shares = [[log.values_read[p][layer] for layer in range(layers)] for log in logs for p in log.values_read]
    return [float(x) for x in np.mean(shares, 0)] if shares else None


def tail_fact_share(logs: list[ReadLog]) -> tuple[float, float] | None:
    """Over the perplexity tail's steps (every layer and KV head): the share of the chosen pages
    that hold a fact, and the pages chosen a step; None without a choice logged."""
    pairs = [x for log in logs for x in log.tail_fact]
    chosen = sum(n for _, n in pairs)
    return (sum(f for f, _ in pairs) / chosen, chosen / len(pairs)) if chosen else None


def sign_test(lost: int, gained: int) -> float:
    """McNemar's exact two-sided p-value for ``lost`` answers against ``gained`` (the discordant
    pairs): the chance of a split at least as uneven when either way is equally likely."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2 ** n
    return min(1.0, 2 * tail)
