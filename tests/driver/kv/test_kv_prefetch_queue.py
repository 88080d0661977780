"""The firmware's prefetch queue drives the shim's loads: the hints and progress the shim gives it,
what it issues, and its accounting (useful / late / wasted), exact on stores whose transfers
complete at once or only when waited for."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kv_support import LAYERS, frame_bytes, generate
from transformers import DynamicCache

from driver.kv import CxlCache
from driver.kv._store import MemoryBlockStore
from driver.kv.testing import GatedStore, padded_batch
from firmware_model.prefetch import PrefetchQueue

PROMPT, NEW, CAP = 12, 10, 32
DECODE_STEPS = NEW - 1  # forward 0 is the prefill; forwards 1..9 decode


@pytest.fixture(scope="module")
def prompt(model):
    ids, mask = padded_batch([PROMPT])
    return ids, mask, generate(model, ids, mask, DynamicCache(), NEW)


def two_frames(store: MemoryBlockStore, depth: int | str = 1) -> CxlCache:
    """The minimum budget (two frames of CAP tokens), LRU, one layer ahead, no regrow."""
    return CxlCache(hbm_budget_bytes=2 * frame_bytes(1, CAP, block_tokens=4), policy="lru", block_tokens=4,
                    store=store, max_seq_len=CAP, prefetch_depth=depth)


def stats_of_run(model, prompt, store: MemoryBlockStore, depth: int | str = 1) -> dict[str, int]:
    """Generate with ``two_frames(store, depth)``, check the tokens, close, return the stats."""
    ids, mask, ref = prompt
    cache = two_frames(store, depth)
    out = generate(model, ids, mask, cache, NEW)
    cache.close()
    assert torch.equal(out, ref)
    return cache.stats()


def test_the_shim_hints_each_point_once_and_reports_every_layer(model, prompt, monkeypatch) -> None:
    """From the first decode forward on (the layer count is known after the prefill), each layer
    computed is a progress point of the batch (sequence 0), and the point one window ahead is
    hinted once, with its layer as the block: (step, layer) -> point step * 4 + layer."""
    progress, hints = [], []
    real_progress, real_hint = PrefetchQueue.progress, PrefetchQueue.hint

    def spy_progress(self, seq, step, layer):
        progress.append((seq, step, layer))
        return real_progress(self, seq, step, layer)

    def spy_hint(self, seq, step, layer, blocks, priority=0):
        hints.append((seq, step * LAYERS + layer, tuple(blocks)))
        return real_hint(self, seq, step, layer, blocks, priority)

    monkeypatch.setattr(PrefetchQueue, "progress", spy_progress)
    monkeypatch.setattr(PrefetchQueue, "hint", spy_hint)
    ids, mask, ref = prompt
    cache = two_frames(MemoryBlockStore(1 << 20))
    out = generate(model, ids, mask, cache, NEW)
    cache.close()
    assert torch.equal(out, ref)
    assert progress == [(0, t, layer) for t in range(1, NEW) for layer in range(LAYERS)]
    first, last = 1 * LAYERS + 1, DECODE_STEPS * LAYERS + LAYERS  # one ahead of (1, 0) .. (9, 3)
    assert hints == [(0, p, (p % LAYERS,)) for p in range(first, last + 1)]


def test_prefetches_that_land_in_time_are_useful(model, prompt) -> None:
    """Transfers complete at once: every hinted layer is loaded by the queue into the frame the
    policy frees and found there (useful); the last hint (step 10, never run) is wasted; the one
    miss is layer 0 of the first decode forward, before the queue existed."""
    s = stats_of_run(model, prompt, MemoryBlockStore(1 << 20))
    issued = DECODE_STEPS * LAYERS  # points 5 .. 40
    assert (s["prefetch_issued"], s["prefetch_useful"], s["prefetch_late"], s["prefetch_wasted"]) == (
        issued, issued - 1, 0, 1)
    assert (s["misses"], s["hits"], s["loads"]) == (1, issued - 1, issued + 1)


def test_prefetches_still_in_flight_are_late(model, prompt) -> None:
    """Reads land only when the compute waits for them: the same prefetches, every one late
    (the compute stalled on it), none useful, the same one wasted, tokens unchanged."""
    s = stats_of_run(model, prompt, GatedStore(1 << 20))
    issued = DECODE_STEPS * LAYERS
    assert (s["prefetch_issued"], s["prefetch_useful"], s["prefetch_late"], s["prefetch_wasted"]) == (
        issued, 0, issued - 1, 1)
    assert (s["misses"], s["hits"], s["loads"]) == (1, 0, issued + 1)


def test_no_prefetch_depth_issues_nothing(model, prompt) -> None:
    """prefetch_depth=0: the queue gets progress but a window of 0, so every layer is a miss."""
    s = stats_of_run(model, prompt, MemoryBlockStore(1 << 20), depth=0)
    assert s["prefetch_issued"] == 0
    assert s["misses"] == s["loads"] == DECODE_STEPS * LAYERS
