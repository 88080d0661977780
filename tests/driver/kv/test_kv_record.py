"""``CxlCache(record=...)``: what each sparse attention read, for diagnostics (``bench quality``):
hot attention's chosen pages at every decode attention, H2O's kept tokens at every attention;
refused with dense attention."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kv_support import KV_HEADS, LAYERS, generate  # noqa: E402

from driver.kv import CxlCache, MemoryBlockStore  # noqa: E402
from driver.kv.testing import padded_batch  # noqa: E402
from emulator.spec.errors import ConfigError  # noqa: E402

NEW, PROMPT = 6, 37


def test_hot_records_the_pages_it_chose_at_every_decode_attention(model) -> None:
    seen: list[tuple[int, np.ndarray]] = []
    cache = CxlCache(1 << 30, block_tokens=4, model=model, attention="hot", page_budget=0.3,
                     store=MemoryBlockStore(1 << 24), record=lambda layer, pages: seen.append((layer, pages)))
    ids, mask = padded_batch([120])
    generate(model, ids, mask, cache, NEW)
    chosen = cache.stats()["pages_chosen"]
    cache.close()
    assert [layer for layer, _ in seen] == list(range(LAYERS)) * (NEW - 1)  # the prefill reads every token
    assert all(p.dtype == np.int64 and p.shape[:2] == (1, KV_HEADS) for _, p in seen)
    # 121-125 tokens: ceil(0.3 * 31 or 32 pages) = 10 a step, less the 3 or 4 resident (sink, window, partial)
    assert {p.shape[2] for _, p in seen} == {6, 7} and sum(p.size for _, p in seen) == chosen


def test_h2o_records_the_positions_of_the_tokens_it_reads(model) -> None:
    seen: list[tuple[int, np.ndarray]] = []
    cache = CxlCache(1 << 30, model=model, attention="h2o", page_budget=0.5,
                     record=lambda layer, pos: seen.append((layer, pos)))
    ids, mask = padded_batch([PROMPT])
    generate(model, ids, mask, cache, NEW)
    cache.close()
    assert [layer for layer, _ in seen] == list(range(LAYERS)) * NEW
    assert seen[0][1].tolist() == [[list(range(PROMPT))] * KV_HEADS]  # the prefill reads the prompt
    last = seen[-1][1]  # the last step: half of the 42 tokens kept before it, and its own
    assert last.shape == (1, KV_HEADS, 21 + 1) and (last[..., -1] == PROMPT + NEW - 2).all()


def test_record_is_refused_with_dense_attention(model) -> None:
    with pytest.raises(ConfigError, match="record applies to attention='hot' or 'h2o'"):
        CxlCache(1 << 30, model=model, record=print)
