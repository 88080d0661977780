"""H2O (NeurIPS'23) heavy-hitter eviction: the comparison hot-page attention is measured against.

Every layer keeps at most ``ceil(page_budget * seq_len)`` tokens per sequence and KV head, on the
accelerator: half of them the most recent, the other half the *heavy hitters*, the tokens with
the largest attention weight accumulated over every query since they were written (summed over
the query heads that read the KV head). What leaves is dropped, not offloaded: a fact the model
needs only much later is gone when it is asked for (the second seed, 5.2). Its attention is
computed here (softmax in float32, as transformers' eager attention) since the weights are what
it keeps score with; ``CxlCache(attention="h2o")`` routes the model's attention to it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from driver.kv import _attention

__all__ = ["H2OEngine"]


@dataclass
class _Kept:
    """One layer's kept tokens, in the order written: (B, H, n, D) K and V, positions, scores."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor  # (B, H, n) int64
    score: torch.Tensor  # (B, H, n) float32: accumulated attention weight
    seq_len: int


class H2OEngine:
    """Heavy hitters plus a recent window within ``page_budget`` of the tokens; see the docstring."""

    COUNTERS = ("tokens_generated", "tokens_evicted", "decode_attentions")

    def __init__(self, *, page_budget: float, record: Callable[[int, Any], None] | None = None, **_: Any) -> None:
        """``record(layer, positions)``: called at every attention with the positions ``(B, Hkv, n)``
        (numpy int64) of the tokens it reads (diagnostics)."""
        self.page_budget = page_budget
        self._record = record
        self.layers: list[_Kept | None] = []
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.peak_bytes = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k`` / ``v`` ``(B, H, n, D)``; the attention function computes over the kept."""
        while len(self.layers) <= layer:
            self.layers.append(None)
        if layer == 0:
            self.counters["tokens_generated"] += k.shape[0] * k.shape[2]
        kept = self.layers[layer]
        b, h, n, _ = k.shape
        if kept is None:
            pos = torch.arange(n, device=k.device).expand(b, h, n)
            kept = _Kept(k, v, pos, torch.zeros(b, h, n, device=k.device), n)
        else:
            pos = torch.arange(kept.seq_len, kept.seq_len + n, device=k.device).expand(b, h, n)
            kept = _Kept(torch.cat((kept.k, k), 2), torch.cat((kept.v, v), 2), torch.cat((kept.pos, pos), 2),
                         torch.cat((kept.score, torch.zeros(b, h, n, device=k.device)), 2), kept.seq_len + n)
        self.layers[layer] = kept
        _attention.expect(self, layer, lambda module, query, mask, **kw: self.attend(layer, module, query, mask, **kw))
        return k, v

    def seq_length(self, layer: int = 0) -> int:
        kept = self.layers[layer] if layer < len(self.layers) else None
        return kept.seq_len if kept is not None else 0

    def attend(self, layer: int, module: torch.nn.Module, query: torch.Tensor, mask: torch.Tensor | None,
               scaling: float | None = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query`` ``(B, Hq, q, D)`` over the kept tokens; then score and evict."""
        _attention.taken(self)
        kept = self.layers[layer]
        assert kept is not None
        b, hq, q, d = query.shape
        h = kept.k.shape[1]
        groups = hq // h
        if self._record is not None:
            self._record(layer, kept.pos.to("cpu").numpy().copy())
        cols = _attention.repeat_mask(mask, kept.pos, groups, q, kept.seq_len)
        keys = kept.k.repeat_interleave(groups, dim=1)
        logits = torch.matmul(query, keys.transpose(2, 3)) * (scaling if scaling is not None else d ** -0.5)
        if cols is not None:
            logits = logits.masked_fill(~cols, float("-inf"))
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).nan_to_num(0.0)
        out = torch.matmul(weights.to(query.dtype), kept.v.repeat_interleave(groups, dim=1))
        kept.score += weights.view(b, h, groups, q, -1).sum((2, 3))
        self.counters["decode_attentions"] += q == 1
        self._evict(layer, kept)
        self.peak_bytes = max(self.peak_bytes, self._bytes())
        return out.transpose(1, 2).contiguous(), weights.to(query.dtype)

    def _evict(self, layer: int, kept: _Kept) -> None:
        """Down to the budget: the most recent half, and the highest scores of the rest."""
        n = kept.k.shape[2]
        budget = max(2, math.ceil(self.page_budget * kept.seq_len))
        if n <= budget:
            return
        recent = budget // 2
        heavy = budget - recent
        old = kept.score[:, :, :n - recent]
        top = old.topk(heavy, dim=-1).indices.sort(dim=-1).values  # keep them in written order
        idx = torch.cat((top, torch.arange(n - recent, n, device=top.device).expand(*top.shape[:2], -1)), -1)
        wide = idx.unsqueeze(-1).expand(-1, -1, -1, kept.k.shape[3])
        self.layers[layer] = _Kept(kept.k.gather(2, wide), kept.v.gather(2, wide), kept.pos.gather(2, idx),
                                   kept.score.gather(2, idx), kept.seq_len)
        self.counters["tokens_evicted"] += kept.k.shape[0] * kept.k.shape[1] * (n - budget)

    def _bytes(self) -> int:
        return sum(t.k.numel() * t.k.element_size() * 2 for t in self.layers if t is not None)

    def close(self) -> None:
        self.layers.clear()

    def stats(self) -> dict[str, int]:
        return dict(self.counters) | {"hbm_peak_bytes": self.peak_bytes, "hbm_bytes": self._bytes()}
