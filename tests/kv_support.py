"""Helpers for the KV-cache tests: the tiny seeded Llama they run (`tiny_model`), its KV layout
(`layout`, `frame_bytes`) and one `generate` through a cache. Import after
``pytest.importorskip("torch")``; transformers is imported only when a model is built or run."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from driver.kv import KVLayout

LAYERS, HIDDEN, HEADS, KV_HEADS = 4, 64, 4, 2  # the tiny model's shape
HEAD_DIM = HIDDEN // HEADS  # 16
ITEMSIZE = 4  # float32


def tiny_model(**shape: Any) -> torch.nn.Module:
    """`driver.kv.testing.tiny_llama` (seeded, offline, no hub) of the shape above; ``shape``
    overrides any of its arguments (layers, hidden, heads, kv_heads, dtype, seed, ...)."""
    from driver.kv.testing import tiny_llama

    return tiny_llama(**{"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, **shape})


def layout(batch: int, block_tokens: int = 1) -> KVLayout:
    """The tiny model's KV layout for ``batch`` sequences."""
    return KVLayout(batch=batch, kv_heads=KV_HEADS, head_dim=HEAD_DIM, itemsize=ITEMSIZE, block_tokens=block_tokens)


def frame_bytes(batch: int, tokens: int, block_tokens: int = 1) -> int:
    """One layer's KV frame (K and V) of the tiny model for ``batch`` sequences of ``tokens``."""
    return layout(batch, block_tokens).frame_bytes(tokens)


def generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: object, new: int,
             processors: Iterable[Any] = (), **kw: Any) -> torch.Tensor:
    """``new`` tokens after the prompt ``ids``, the KV in ``cache``: greedy unless ``kw`` says
    ``do_sample=True``; ``processors`` see every step's logits."""
    from transformers import LogitsProcessorList

    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, past_key_values=cache,
                              logits_processor=LogitsProcessorList(list(processors)),
                              **{"do_sample": False, **kw})
