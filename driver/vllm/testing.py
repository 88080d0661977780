"""A seeded random Llama that vLLM loads offline (no hub), for tests, the bench and examples.

``bare_worker(...)`` builds the tier's worker over given KV tensors without a vLLM engine (the
tier bench, the staging tests): the one place that says what the worker reads of its spec.

``model_dir(path)`` saves ``driver.kv.testing.tiny_llama`` with ``save_pretrained`` and a
tokenizer built locally (a byte-level BPE trained on a few sentences), so ``LLM(model=path)``
runs on a machine with no network. Prompts are token ids (``vllm.inputs.TokensPrompt``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["bare_worker", "model_dir", "random_prompts"]

_CORPUS = ["the device holds the blocks the accelerator cannot", "a memory expander with a smart controller",
           "prefetch what attention needs next and move it by DMA", "hot blocks stay, cold blocks go"]


def model_dir(path: str | Path, *, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
              vocab: int = 512, intermediate: int = 256, max_positions: int = 2048, seed: int = 0,
              init_std: float = 0.1) -> Path:
    """Save a random Llama (float32) and a local tokenizer into ``path``; returns it.

    ``init_std`` above the default 0.02 makes greedy outputs vary from token to token (a random
    model at 0.02 tends to repeat one token, and a test comparing constant outputs proves
    nothing)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from driver.kv.testing import tiny_llama

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model: Any = tiny_llama(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                            intermediate=intermediate, max_positions=max_positions, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
    model.config.eos_token_id = None
    model.save_pretrained(path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=min(vocab, 300),
                                                         special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def random_prompts(n: int, length: int, *, vocab: int = 512, seed: int = 1, prefix: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids (>= 4: clear of the special tokens); the first
    ``prefix`` tokens shared by all."""
    import random

    rng = random.Random(seed)
    common = [rng.randrange(4, vocab) for _ in range(prefix)]
    return [common + [rng.randrange(4, vocab) for _ in range(length - prefix)] for _ in range(n)]


def bare_worker(name: str, tensors: list[Any], page: int, num_chunks: int, **tier: Any) -> Any:
    """A ``CxlOffloadingWorker`` on device ``name`` (served already, or None in ``tier``'s
    ``device`` for a private one) over ``tensors`` (one per layer, pages of ``page`` bytes), with a
    tier of ``num_chunks`` chunks; ``tier``: more ``TierConfig`` fields. What it reads of its spec
    is what ``CxlOffloadingSpec`` gives it: the tier, its stats, the chunk count, the device, and
    the codec of a compressed ``kv_format`` (None: native, the only one without an engine)."""
    import types

    from driver.vllm._compat import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    from driver.vllm._config import TierConfig
    from driver.vllm._stats import tier_stats
    from driver.vllm._worker import CxlOffloadingWorker

    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                           [[CanonicalKVCacheRef(i, page) for i in range(len(tensors))]])
    config = TierConfig(**({"device": name, "policy": "lru", "cxl_bytes_to_use": num_chunks * len(tensors) * page}
                           | tier))
    spec = types.SimpleNamespace(tier=config, stats=tier_stats(name), num_chunks=num_chunks, device_name=name,
                                 device_capacity=None, codec=None)
    return CxlOffloadingWorker(spec, kv)
