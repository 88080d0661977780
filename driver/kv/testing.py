"""Seeded random tiny Llamas fed token ids: no hub, no tokenizer (for tests, bench and demo);
``GatedStore``, a block store whose reads land only when waited for (for prefetch tests); and
``check_selector``, the conformance kit of hot attention's page selectors:

    from driver.kv.testing import check_selector

    def test_my_selector_conforms():
        check_selector("mymod:MySelector")    # or the class; raises SelectorConformanceError

It builds the selector through ``driver.kv.selectors.resolve_selector`` (the protocol check comes
first) and calls it on seeded random cases (batch, KV heads, query heads per KV head, pages,
candidates, k from 0 to all, hotness counts with ties), checking every answer: shape
``(B, Hkv, k)`` and int64; each row ``k`` distinct candidates, ascending; the inputs unchanged;
the same answer for the same inputs."""
from __future__ import annotations

from typing import Any

import torch

from driver.kv._store import CompletedTransfer, MemoryBlockStore

__all__ = ["GatedStore", "SelectorConformanceError", "check_selector", "padded_batch", "tiny_llama"]


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


class SelectorConformanceError(AssertionError):
    """A page selector broke the contract of ``driver.kv.selectors.PageSelector``."""


def check_selector(spec: Any, *, examples: int = 50, seed: int = 0) -> None:
    """Check the selector ``spec`` names against its contract (see the module docstring)."""
    from driver.kv.selectors import resolve_selector
    from firmware_model.policies.base import spec_label

    selector = resolve_selector(spec)
    label = spec_label(spec)
    g = torch.Generator().manual_seed(seed)
    for case in range(examples):
        args = _selector_case(g, case)
        kept = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = selector.select(*args)
        what = (f"page selector {label}, case {case} (batch {args[0].shape[0]}, kv heads {args[0].shape[1]}, "
                f"pages {args[1].shape[2]}, candidates {args[3].tolist()}, k {args[4]})")
        _check_choice(got, args, what)
        for before, after in zip(kept, args, strict=True):
            if isinstance(before, torch.Tensor) and not torch.equal(before, after):
                raise SelectorConformanceError(f"{what}: select changed its inputs")
        if not torch.equal(selector.select(*args), got):
            raise SelectorConformanceError(f"{what}: two calls with the same inputs chose different pages")


def _selector_case(g: torch.Generator, case: int) -> tuple[Any, ...]:
    """Seeded inputs: small shapes, integer-valued keys and hotness (ties happen)."""
    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    b, h, groups, d, pages = draw(1, 3), draw(1, 3), draw(1, 3), draw(1, 8), draw(1, 12)
    query = torch.randint(-3, 4, (b, h, groups, d), generator=g).float()
    a, c = torch.randint(-4, 5, (2, b, h, pages, d), generator=g).float()
    lo, hi = torch.minimum(a, c), torch.maximum(a, c)
    first = draw(0, pages - 1)
    candidates = torch.arange(first, draw(first + 1, pages))
    k = [0, candidates.numel()][case % 2] if case < 4 else draw(0, candidates.numel())
    hotness = torch.randint(0, 3, (b, h, pages), generator=g)
    return query, lo, hi, candidates, k, hotness


def _check_choice(got: Any, args: tuple[Any, ...], what: str) -> None:
    query, _, _, candidates, k, _ = args
    want = (query.shape[0], query.shape[1], k)
    if not isinstance(got, torch.Tensor) or got.dtype != torch.int64 or tuple(got.shape) != want:
        shown = f"{got.dtype} tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
        raise SelectorConformanceError(f"{what}: returned {shown}, expected an int64 tensor of shape {want}")
    allowed = set(candidates.tolist())
    for row in (got.reshape(-1, k).tolist() if k else []):
        if any(p not in allowed for p in row):
            raise SelectorConformanceError(f"{what}: chose {row}, not all of them candidates")
        if len(set(row)) != k or row != sorted(row):
            raise SelectorConformanceError(f"{what}: chose {row}: expected {k} distinct pages, ascending")
