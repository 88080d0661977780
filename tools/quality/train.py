"""Train the yardstick: a small Llama trained to attend to far tokens (``tasks``; what it learned: BENCHMARKS.md).

    python -m tools.cli.main quality train   # rebuilds tools/quality/data/ (430 CPU-s, 1 thread)

Deterministic: one seed for the weights and the data, ``torch.use_deterministic_algorithms``,
a fixed number of threads (the weights' bytes are reproducible on one machine and torch build;
another CPU may round differently, so the shipped file is checked by its sha256, not rebuilt).

Length generalisation (trained on up to 2048 tokens, asked at 8k): RoPE sees only the
relative distances it was trained on, so a share of the sequences is trained with position
skips (PoSE, Zhu et al. 2023): the sequence is cut into chunks and each chunk's positions are
shifted by a random skip, so relative distances up to ``position_span`` occur while every chunk
keeps its local, step-1 positions. A curriculum starts short (the copying heads form first on
cheap 128-token sequences of small phrase books, where attention is not yet spread over
hundreds of tokens) and then mixes ``long_contexts``; a large ``rope_theta`` keeps the content
match of the retrieval heads intact at 8k (BENCHMARKS.md: run R3, the shipped one).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tools.quality.tasks import PAD, PHRASES, RECALL_PAIRS, VOCAB, make_document



@dataclass(frozen=True)
class ModelSpec:
    """The yardstick's shape (a ``LlamaConfig``'s fields)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    rope_theta: float = 1000000.0  # slow rotations: a content match survives 8k distances
    max_positions: int = 16384
    # biases on q/k/v/o: a query and a key bias give attention a content-free part, and through
    # RoPE a purely positional score (the previous-token head copying is built on); without them
    # that head must first grow a shared direction in the embeddings, a long plateau on a CPU budget
    attention_bias: bool = True

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=self.max_positions,
                           rope_theta=self.rope_theta, attention_bias=self.attention_bias, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                           tie_word_embeddings=False)


@dataclass(frozen=True)
class TrainSpec:
    """What one training run does; the same spec gives the same weights (same machine, threads)."""

    seed: int = 0
    steps: int = 5000
    short_steps: int = 4200  # curriculum: short contexts of small phrase books first
    short_contexts: tuple[int, ...] = (128,)  # short: attention not yet diluted, the hops form
    short_batch_tokens: int = 1024
    early_phrases: tuple[int, ...] = (2, 4)
    long_contexts: tuple[int, ...] = (512, 1024, 2048)
    tokens_per_pair: int = 32  # a short document's recall pairs: one per this many tokens
    batch_tokens: int = 2048
    position_span: int = 10240  # PoSE: relative distances trained up to this
    pose_share: float = 0.5
    answer_weight: float = 20.0  # the few answer tokens' loss weight against a filler token's
    filler_weight: float = 1.0
    lr: float = 2e-3
    warmup: int = 30
    threads: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def batch_contexts(spec: TrainSpec, step: int, rng: np.random.Generator) -> list[int]:
    """The contexts of step ``step``'s batch: its tokens split into equal sequences."""
    if step < spec.short_steps:
        context, tokens = int(rng.choice(spec.short_contexts)), spec.short_batch_tokens
    else:
        context, tokens = int(rng.choice(spec.long_contexts)), spec.batch_tokens
    return [context] * max(1, tokens // context)


def pose_positions(n: int, span: int, rng: np.random.Generator, chunks: int = 3) -> np.ndarray:
    """Positions of ``n`` tokens in ``chunks`` runs of consecutive ids, shifted by random skips
    so the last id is < ``span``: distances up to ``span`` with every run's steps of 1."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=chunks - 1, replace=False))
    room = max(0, span - n)
    skips = np.sort(rng.integers(0, room + 1, size=chunks - 1))
    pos = np.arange(n)
    for cut, skip in zip(cuts, skips):
        pos[cut:] = np.arange(cut, n) + skip
    return pos


def make_batch(spec: TrainSpec, step: int, rng: np.random.Generator) -> tuple[Any, Any, Any]:
    """(input ids, position ids, per-position loss weights) of one step, from ``rng`` alone."""
    import torch

    contexts = batch_contexts(spec, step, rng)
    ids, pos, weight = [], [], []
    for n in contexts:
        early = step < spec.short_steps
        # the copying heads form sooner on very repetitive filler: small phrase books first
        phrases = int(rng.choice(spec.early_phrases)) if early else PHRASES
        doc = make_document(n, int(rng.integers(2**62)), pairs=max(2, min(RECALL_PAIRS, n // spec.tokens_per_pair)), tail=8,
                            phrases=phrases)
        w = np.full(n, spec.filler_weight, dtype=np.float32)
        w[list(doc.needle_at) + list(doc.recall_at)] = spec.answer_weight
        w[-1] = 0.0  # the last token has nothing to predict
        ids.append(doc.tokens)
        weight.append(w)
        use_pose = rng.random() < spec.pose_share and step >= spec.short_steps
        pos.append(pose_positions(n, spec.position_span, rng) if use_pose else np.arange(n))
    return (torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(pos)),
            torch.from_numpy(np.stack(weight)))


def lr_at(spec: TrainSpec, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def weighted_loss(logits: Any, ids: Any, weight: Any) -> Any:
    """Mean next-token cross-entropy, each position weighted."""
    import torch.nn.functional as F

    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                          reduction="none")
    w = weight[:, :-1].reshape(-1)
    return (nll * w).sum() / w.sum()


def train(model_spec: ModelSpec, spec: TrainSpec,
          progress: Callable[[int, float, float], None] | None = None,
          monitor: Callable[[int, Any], None] | None = None, monitor_every: int = 500) -> tuple[Any, dict[str, Any]]:
    """Train from ``spec.seed``; returns the model (eval mode) and the run's figures
    (wall and CPU seconds, final loss). ``progress(step, loss, seconds)`` every 50 steps."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(spec.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(model_spec.config())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = np.random.default_rng(spec.seed)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    loss_avg = float("nan")
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(spec, step)
        ids, pos, weight = make_batch(spec, step, rng)
        logits = model(input_ids=ids, position_ids=pos).logits
        loss = weighted_loss(logits, ids, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = float(loss.detach())
        loss_avg = value if math.isnan(loss_avg) else 0.95 * loss_avg + 0.05 * value
        if progress is not None and (step + 1) % 25 == 0:
            progress(step + 1, loss_avg, time.perf_counter() - wall0)
        if monitor is not None and (step + 1) % monitor_every == 0:
            # held-out accuracy while training; no_grad and no draw from the data rng, so the run's
            # weights are the same with or without it
            model.eval()
            monitor(step + 1, model)
            model.train()
    model.eval()
    return model, {"wall_s": round(time.perf_counter() - wall0, 1),
                   "cpu_s": round(time.process_time() - cpu0, 1), "final_loss": round(loss_avg, 4)}
