"""Where the yardstick's attention goes when it answers: the mass each query head puts on the
tokens an answer could come from, under dense attention (``cxlemu quality probe``).

``bench quality`` says whether a mode got an answer right; this says what the trained model reads
to answer at all. Each held-out document goes through ``DynamicCache`` decode steps as the bench
scores them (``tools.quality.evaluate.score``), its attention function wrapped: at each needle
position, the weight on the passkey token answered; at each recall query, the weight on the
answer's value ``v`` and key ``k`` (the pair ``v k`` in the body) and on all the document's values
and keys. A model that retrieves by the key puts its weight on the answer's ``v`` or ``k``; one
that spreads it evenly over all the values answers with one of them, whichever the key.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tools.quality.tasks import KEYS, VALUES, Document, answer_sources, make_document

PROBE = "cxlemu-probe"  # the attention implementation name the probe registers
FIGURES = ("needle_answer", "recall_answer_value", "recall_values", "recall_answer_key", "recall_keys")


@dataclass(frozen=True)
class ProbeRow:
    """One query head's mean attention weights (softmax, summed over the tokens named)."""

    context: int
    examples: int
    layer: int
    head: int
    needle_answer: float  # on the passkey token being answered
    recall_answer_value: float  # on the answer's value v
    recall_values: float  # on all the document's values (the answer's among them)
    recall_answer_key: float  # on the queried key's k in the body
    recall_keys: float  # on all the document's keys

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _targets(doc: Document) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Each answer position -> the token groups of :data:`FIGURES` (empty for the other task's)."""
    body = doc.tokens[:doc.needle_at[0]]
    values = tuple(int(i) for i in np.flatnonzero((body >= VALUES[0]) & (body < VALUES[1])))
    keys = tuple(int(i) for i in np.flatnonzero((body >= KEYS[0]) & (body < KEYS[1])))
    src = answer_sources(doc)
    out = {p: (src[p], (), (), (), ()) for p in doc.needle_at}
    for p in doc.recall_at:
        v, k = src[p]
        out[p] = ((), (v,), values, (k,), keys)
    return out


def probe(model: Any, contexts: list[int], examples: int, first_seed: int) -> list[ProbeRow]:
    """Per context, layer and query head, the mean weights over ``examples`` documents (seeds
    ``first_seed``, ...). The model's attention implementation is restored after."""
    import torch
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from tools.quality.evaluate import score

    state: dict[str, Any] = {"at": None}
    sums: dict[tuple[int, int], np.ndarray] = {}

    def spy(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        groups = state["targets"].get(state["at"]) if query.shape[2] == 1 else None
        if groups is not None:
            keys = key.repeat_interleave(query.shape[1] // key.shape[1], 1)[0]  # (Hq, L, D)
            w = torch.softmax((keys @ query[0, :, 0].unsqueeze(-1)).squeeze(-1).float() * module.scaling, -1)
            for h in range(w.shape[0]):
                acc = sums.setdefault((module.layer_idx, h), np.zeros(2 * len(FIGURES)))
                for i, tokens in enumerate(groups):
                    if tokens:
                        acc[i] += float(w[h, list(tokens)].sum())
                        acc[len(FIGURES) + i] += 1
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register(PROBE, spy)
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(PROBE)
    rows: list[ProbeRow] = []
    try:
        for ctx in contexts:
            sums.clear()
            for i in range(examples):
                doc = make_document(ctx, first_seed + i)
                state["targets"] = _targets(doc)
                score(model, doc, DynamicCache(), before=lambda p: state.__setitem__("at", p))
            for (layer, head), acc in sorted(sums.items()):
                means = acc[:len(FIGURES)] / np.maximum(acc[len(FIGURES):], 1)
                rows.append(ProbeRow(ctx, examples, layer, head, *(float(x) for x in means)))
    finally:
        model.set_attn_implementation(before)
    return rows
