"""Seeded random tiny Llamas fed token ids: no hub, no tokenizer (for tests, bench and demo); and
``GatedStore``, a block store whose reads land only when waited for (for prefetch tests)."""
from __future__ import annotations

from typing import Any

import torch

from driver.kv._store import CompletedTransfer, MemoryBlockStore

__all__ = ["GatedStore", "padded_batch", "tiny_llama"]


def tiny_llama(*, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               vocab: int = 256, intermediate: int = 128, max_positions: int = 1024,
               seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random ``LlamaForCausalLM`` (GQA when ``kv_heads < heads``), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(cfg)
    model = model.to(dtype=dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # never stop early: every run makes all its tokens
    return model


def padded_batch(lengths: list[int], *, vocab: int = 256, seed: int = 1,
                 prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and attention mask for prompts of ``lengths`` (ids >= 3).

    With ``prefix`` > 0 every prompt starts with the same ``prefix`` tokens."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    common = torch.randint(3, vocab, (prefix,), generator=g)
    for row, n in enumerate(lengths):
        toks = torch.randint(3, vocab, (n,), generator=g)
        toks[:min(prefix, n)] = common[:min(prefix, n)]
        ids[row, width - n:] = toks
        mask[row, width - n:] = 1
    return ids, mask


class GatedStore(MemoryBlockStore):
    """Reads land only when waited for: every prefetch is still in flight when its layer runs."""

    def read(self, extents: Any, host: Any) -> CompletedTransfer:
        super().read(extents, host)
        return _Gated()


class _Gated(CompletedTransfer):
    def __init__(self) -> None:
        super().__init__()
        self.waited = False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:
        self.waited = True
