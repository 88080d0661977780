"""Record a real block-access trace from the attention weights of a seeded random tiny Llama.

No hub, no tokenizer: the model is built from a ``LlamaConfig`` with ``torch.manual_seed(seed)``
and fed random token ids, then decodes greedily. At every decode step and layer, the last query's
attention row (eager attention, ``output_attentions=True``) is averaged over heads and summed per
block of ``block_tokens`` tokens; a block whose share of the attention mass is at least
``threshold`` is an access, and so is the block the new token's K/V is appended to. Keys are
``(seq, layer, block)``. Sequences decode in lock step (step-major order), as in a batch.

``init_range`` is larger than a trained model's initializer (0.02) so that random weights give
peaked, uneven attention rather than a near-uniform smear.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from firmware_model.replay import Access

__all__ = ["RecordSpec", "record"]


@dataclass(frozen=True, kw_only=True)
class RecordSpec:
    """What to record; every field is a CLI flag of ``cxlemu trace record``."""

    seed: int = 0
    seqs: int = 2
    prompt_tokens: int = 96
    steps: int = 96
    block_tokens: int = 8
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    init_range: float = 0.2
    threshold: float = 0.05

    def __post_init__(self) -> None:
        for name in ("seqs", "prompt_tokens", "steps", "block_tokens", "layers", "hidden", "heads",
                     "kv_heads", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"--hidden ({self.hidden}) must divide by --heads ({self.heads}), and "
                             f"--heads by --kv-heads ({self.kv_heads})")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"--threshold is a share of attention mass in (0, 1], got {self.threshold}")
        if not self.init_range > 0:
            raise ValueError(f"--init-range must be > 0, got {self.init_range}")

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}


def _model(spec: RecordSpec) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    fields: dict[str, Any] = {
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": 2 * spec.hidden,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "max_position_embeddings": spec.prompt_tokens + spec.steps + 8,
        "initializer_range": spec.init_range, "attn_implementation": "eager",  # eager: attentions returned
    }
    config = LlamaConfig(**fields)
    return LlamaForCausalLM(config).eval()


def _block_mass(row: Any, block_tokens: int) -> Any:
    """Attention row over kv positions -> mass per block (last block may be partial)."""
    import torch.nn.functional as F

    kv = row.shape[-1]
    nblocks = -(-kv // block_tokens)
    return F.pad(row, (0, nblocks * block_tokens - kv)).view(nblocks, block_tokens).sum(-1)


def record(spec: RecordSpec) -> list[Access]:
    """Run the model and return the trace (step-major, then sequence, layer, block)."""
    import torch

    model = _model(spec)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    gen = torch.Generator().manual_seed(spec.seed + 1)
    prompts = torch.randint(0, spec.vocab, (spec.seqs, spec.prompt_tokens), generator=gen)
    per_seq: list[list[list[Access]]] = []  # [seq][step] -> accesses
    with torch.no_grad():
        for s in range(spec.seqs):
            out = model(input_ids=prompts[s:s + 1], use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            steps: list[list[Access]] = []
            for t in range(spec.steps):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                out = model(input_ids=nxt, use_cache=True, output_attentions=True, **{cache_arg: cache})
                cache = getattr(out, "cache", None) or out.past_key_values
                steps.append(_step_accesses(spec, s, t, out.attentions))
            per_seq.append(steps)
    return [a for t in range(spec.steps) for s in range(spec.seqs) for a in per_seq[s][t]]


def _step_accesses(spec: RecordSpec, seq: int, t: int, attentions: Any) -> list[Access]:
    out: list[Access] = []
    for layer, attn in enumerate(attentions):
        mass = _block_mass(attn[0, :, -1].float().mean(0), spec.block_tokens)
        hot = set((mass >= spec.threshold).nonzero().flatten().tolist())
        hot.add(mass.shape[0] - 1)  # the block the new token's K/V was appended to
        out += [Access(t, (seq, layer, b), seq, layer) for b in sorted(hot)]
    return out
