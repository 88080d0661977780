"""Prefix sharing by chained hash with copy-on-write, and faults that lose nothing."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kv_support import KV_HEADS, LAYERS, frame_bytes, generate, layout
from transformers import DynamicCache

from driver.kv import CxlCache, FaultInjectingStore, MemoryBlockStore
from driver.kv.testing import padded_batch

NEW = 8
PIECES = 2 * KV_HEADS  # K and V of 2 kv heads: a block of one sequence in one layer is 4 chunks


def test_common_prefix_in_a_batch_is_stored_once(model) -> None:
    """Two prompts sharing their first 8 tokens (block 4): blocks 0 and 1 of every layer are
    written once and read once for both sequences; the tokens are DynamicCache's."""
    ids, mask = padded_batch([14, 14], prefix=8)
    ref = generate(model, ids, mask, DynamicCache(), NEW)
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(2, 21), block_tokens=4, store=MemoryBlockStore(1 << 20))
    out = generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["shared_chunks"] == 2 * LAYERS * PIECES
    chunk = layout(2, block_tokens=4).chunk_bytes
    assert stats["dedup_write_bytes"] == 2 * LAYERS * PIECES * chunk
    assert stats["dedup_load_bytes"] > 0 and stats["dedup_load_bytes"] % (2 * PIECES * chunk) == 0


def test_second_generation_reuses_the_first_ones_blocks(model, served) -> None:
    """A second cache on the same device (while the first is open: they share its chunk pool)
    with the same prompt finds every chunk by hash and writes none of them again."""
    ids, mask = padded_batch([14])
    ref = generate(model, ids, mask, DynamicCache(), NEW)
    budget = 2 * frame_bytes(1, 21)
    first = CxlCache(hbm_budget_bytes=budget, block_tokens=4, device=served.name)
    assert torch.equal(generate(model, ids, mask, first, NEW), ref)
    second = CxlCache(hbm_budget_bytes=budget, block_tokens=4, device=served.name)
    assert torch.equal(generate(model, ids, mask, second, NEW), ref)
    stats = second.stats()
    pool = second._engine.pool
    assert pool is first._engine.pool
    second.close()
    first.close()
    assert stats["shared_chunks"] >= 4 * LAYERS * PIECES  # the 14-token prompt: 4 blocks per layer
    assert stats["dedup_write_bytes"] >= 4 * LAYERS * 4 * frame_bytes(1, 1) - LAYERS * frame_bytes(1, 2)
    assert pool.used == 0


def test_divergence_copies_the_shared_block(model) -> None:
    """Two sequences with one prompt share every prompt chunk, the partial last one included;
    sampling makes them diverge, and the shared partial block is copied on write, never
    overwritten: both keep DynamicCache's tokens."""
    ids, mask = padded_batch([14, 14], prefix=14)

    def sample(cache):
        torch.manual_seed(5)
        return generate(model, ids, mask, cache, NEW, do_sample=True, top_k=0)

    ref = sample(DynamicCache())
    assert not torch.equal(ref[0], ref[1])
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(2, 21), block_tokens=4, store=MemoryBlockStore(1 << 20))
    out = sample(cache)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    # every layer shares its 3 full prompt blocks; the layers offloaded before the first decode
    # token (all but the last, still resident then) also share the partial 4th, and copy it
    assert stats["shared_chunks"] == (3 * LAYERS + (LAYERS - 1)) * PIECES, stats
    assert stats["cow_copies"] == (LAYERS - 1) * PIECES, stats


def test_transient_load_failures_are_retried(model) -> None:
    """Failed reads are retried; the tokens do not change and every retry is counted."""
    ids, mask = padded_batch([16, 9])
    ref = generate(model, ids, mask, DynamicCache(), NEW)
    store = FaultInjectingStore(MemoryBlockStore(1 << 20))
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(2, 23), block_tokens=4, store=store, max_retries=2)
    store.fail_next_reads(0)
    out = generate(model, ids, mask, cache, 3)
    store.fail_next_reads(2)  # both retries of the next load fail... the third attempt works
    out = generate(model, out, torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1), cache, NEW - 3)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert store.injected == 2
    assert stats["load_retries"] == 2
    assert stats["recomputed_chunks"] == 0


def test_unreadable_chunk_is_recomputed_from_tokens(model) -> None:
    """A chunk that stays unreadable is recomputed by replaying the recorded forward calls."""
    ids, mask = padded_batch([16, 9])
    ref = generate(model, ids, mask, DynamicCache(), NEW)
    store = FaultInjectingStore(MemoryBlockStore(1 << 20))
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(2, 23), block_tokens=4, store=store, model=model)
    out = generate(model, ids, mask, cache, 3)
    victim = next(st for st in cache._engine.layers if st.frame is None and st.load is None)
    store.poison(int(victim.chunks.ids[1, 3, 2]))
    out = generate(model, out, torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1), cache, NEW - 3)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["recomputed_chunks"] == 1
    assert stats["load_retries"] == 2
