"""Score one document through a KV cache: prefill, then one token per forward, as decoding does.

The prompt before the first scored position is prefilled in one forward; every later token
(the perplexity tail, then the queries with their answers) is fed alone with its position, so
each scored prediction is a decode step reading the cache as generation would. The answers are
teacher-forced: the needle counts as found only when all its value tokens are the argmax, which
is exactly when greedy generation writes them.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools.quality.tasks import Document


@dataclass(frozen=True)
class DocScore:
    """One document's result: the needle found, recall queries right, the tail's summed NLL and
    the argmax at every scored position (to compare modes); ``recall_ok``: each recall query
    right, in ``Document.recall_at``'s order (to pair modes query by query)."""

    needle_ok: bool
    recall_hits: int
    recall_total: int
    nll_sum: float
    nll_count: int
    argmax: tuple[int, ...]
    recall_ok: tuple[bool, ...] = ()


def score(model: Any, doc: Document, cache: Any, before: Callable[[int], None] | None = None) -> DocScore:
    """Run ``doc`` through ``model`` with ``cache`` (any transformers ``Cache``); ``before(p)`` is
    called before the decode step that feeds position ``p`` (diagnostics: what that step reads)."""
    import torch

    from driver.kv import cache_argument

    kwarg = cache_argument(model)
    tokens = torch.from_numpy(doc.tokens)[None]
    scored = set(doc.needle_at) | set(doc.recall_at) | set(doc.ppl_at)
    logits: dict[int, Any] = {}
    with torch.no_grad():
        n = doc.prompt_len
        model(input_ids=tokens[:, :n], position_ids=torch.arange(n)[None], use_cache=True, **{kwarg: cache})
        for p in range(n, tokens.shape[1] - 1):
            if before is not None:
                before(p)
            out = model(input_ids=tokens[:, p:p + 1], position_ids=torch.tensor([[p]]), use_cache=True,
                        **{kwarg: cache})
            if p in scored:
                logits[p] = out.logits[0, -1].float()
    argmax = {p: int(v.argmax()) for p, v in logits.items()}
    nll = [-float(torch.log_softmax(logits[p], -1)[a]) for p, a in zip(doc.ppl_at, doc.answers(doc.ppl_at))]
    needle_ok = all(argmax[p] == a for p, a in zip(doc.needle_at, doc.answers(doc.needle_at)))
    recall_ok = tuple(argmax[p] == a for p, a in zip(doc.recall_at, doc.answers(doc.recall_at)))
    return DocScore(needle_ok, sum(recall_ok), len(doc.recall_at), math.fsum(nll), len(nll),
                    tuple(argmax[p] for p in sorted(argmax)), recall_ok)


@dataclass(frozen=True)
class Totals:
    """Documents' scores summed: accuracies and the perplexity over all their tails."""

    examples: int
    needle_acc: float
    recall_acc: float
    perplexity: float


def totals(scores: list[DocScore]) -> Totals:
    n = len(scores)
    recall = sum(s.recall_hits for s in scores) / max(1, sum(s.recall_total for s in scores))
    nll = math.fsum(s.nll_sum for s in scores) / max(1, sum(s.nll_count for s in scores))
    return Totals(n, sum(s.needle_ok for s in scores) / max(1, n), recall, math.exp(nll))


def forward_accuracy(model: Any, context: int, examples: int, first_seed: int) -> tuple[float, float]:
    """(needle, recall) accuracy of one full forward per document (no cache), on the documents
    of seeds ``first_seed``, ``first_seed + 1``, ...: the cheap check ``quality train`` prints
    while it trains (the bench's decode-step scoring gives the same argmax, slower)."""
    import torch

    from tools.quality.tasks import make_document

    found = hits = total = 0
    for i in range(examples):
        doc = make_document(context, first_seed + i)
        with torch.no_grad():
            argmax = model(input_ids=torch.from_numpy(doc.tokens)[None]).logits[0].argmax(-1).tolist()
        found += all(argmax[p] == a for p, a in zip(doc.needle_at, doc.answers(doc.needle_at)))
        hits += sum(argmax[p] == a for p, a in zip(doc.recall_at, doc.answers(doc.recall_at)))
        total += len(doc.recall_at)
    return found / max(1, examples), hits / max(1, total)
