"""The residency engine's decisions as exact sequences on a simulated clock: which layer is a hit,
a late prefetch or a demand miss, what the firmware's prefetch queue issues, what the policy
evicts (vLLM's block-pool tests' shape: ``assert [...] == [...]``).

The model is 4 layers of batch 1, 2 KV heads of 16 fp32 (256 B per token per layer), an 8-token
prompt, frames of 16 tokens; each decode layer computes ``compute_ns`` on a ManualClock the test
advances, so the measured compute per layer — and the ``"auto"`` prefetch window sized from it
and the device's link model — is exact."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kv_support import LAYERS, generate, layout

from driver.kv import MemoryBlockStore
from driver.kv._engine import Decision, ResidencyEngine
from driver.kv.testing import GatedStore
from emulator.timing import WallClock
from firmware_model.clock import ManualClock
from firmware_model.link import READ, LinkParams
from firmware_model.prefetch import window_points

PROMPT, CAP, BLOCK = 8, 16, 4
LAYOUT = layout(1, BLOCK)
LINK = LinkParams.from_rates(read_latency_ns=1000, read_bandwidth_gbps=1)  # 1000 ns + 1 ns per byte


def run(*, frames: int, depth: int | str = 1, compute_ns: int = 1000, steps: int = 3, policy: str = "lru",
        store: MemoryBlockStore | None = None) -> tuple[dict[int, list[tuple[str, int]]], ResidencyEngine]:
    """Prefill, then ``steps`` decode forwards; the decisions grouped by forward (0: the prefill)."""
    decisions: list[Decision] = []
    clock = ManualClock()
    engine = ResidencyEngine(budget=frames * LAYOUT.frame_bytes(CAP), policy=policy, block_tokens=BLOCK,
                             store=store or MemoryBlockStore(1 << 20), device=torch.device("cpu"),
                             dtype=torch.float32, max_seq_len=CAP, prefetch_depth=depth, link=LINK,
                             clock=clock, record=decisions.append)
    for layer in range(LAYERS):
        engine.update(layer, torch.zeros(1, 2, PROMPT, 16), torch.zeros(1, 2, PROMPT, 16))
    for _ in range(steps):
        for layer in range(LAYERS):
            clock.advance(compute_ns)
            engine.update(layer, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    by_step: dict[int, list[tuple[str, int]]] = {}
    for step, kind, layer in decisions:
        by_step.setdefault(step, []).append((kind, layer))
    return by_step, engine


# step 1 (the first decode forward) is the same for every run below: the prefill left layers
# 1, 2, 3 in the three frames (LRU evicted 0 for 3); layer 0 is a demand miss (the prefetch
# queue exists once the layer count is known), then one layer ahead is prefetched, each into
# the frame of the least recently used layer outside the window
STEP1 = [("evict", 1), ("miss", 0), ("evict", 2), ("prefetch", 1), ("hit", 1), ("evict", 3),
         ("prefetch", 2), ("hit", 2), ("evict", 0), ("prefetch", 3), ("hit", 3), ("evict", 1),
         ("prefetch", 0)]


def test_one_layer_ahead_lru_three_frames() -> None:
    """Depth 1: every decode layer is a hit; each prefetch evicts the LRU layer outside
    {computing, next}."""
    steps, engine = run(frames=3, depth=1)
    assert steps[0] == [("evict", 0)]
    assert steps[1] == STEP1
    assert steps[2] == steps[3] == [
        ("hit", 0), ("evict", 2), ("prefetch", 1), ("hit", 1), ("evict", 3), ("prefetch", 2),
        ("hit", 2), ("evict", 0), ("prefetch", 3), ("hit", 3), ("evict", 1), ("prefetch", 0)]
    s = engine.stats()
    assert (s["loads"], s["misses"], s["hits"], s["evictions"], s["prefetch_issued"]) == (13, 1, 11, 14, 12)
    engine.close()


def test_auto_window_from_the_clock_and_the_link_model() -> None:
    """'auto': the window is ceil(one layer's transfer on the link model / the compute per layer
    measured on the clock). 5000 ns of compute hides a layer (1000 ns + its 2560-3072 B at
    1 GB/s): one ahead, the depth-1 sequence; 2000 ns needs two layers ahead."""
    slow_steps, slow = run(frames=3, depth="auto", compute_ns=5000)
    assert slow._layer_ns == 5000 and slow._window[0] == 1
    fixed_steps, _ = run(frames=3, depth=1)
    assert slow_steps == fixed_steps
    steps, fast = run(frames=3, depth="auto", compute_ns=2000)
    transfer = LINK.duration_ns(READ, LAYOUT.frame_bytes(PROMPT + 3))
    assert (fast._layer_ns, transfer, window_points(LINK, LAYOUT.frame_bytes(PROMPT + 3), 2000)) == (2000, 3816, 2)
    assert fast._window[0] == 2
    assert steps[1] == STEP1  # compute is measured from the first decode forward on
    # two ahead: layer 2 is already resident when layer 0 runs, 1 comes in for 3; from then on
    # each layer's window needs only its far end
    assert steps[2] == [
        ("hit", 0), ("evict", 3), ("prefetch", 1), ("hit", 1), ("evict", 0), ("prefetch", 3),
        ("hit", 2), ("evict", 1), ("prefetch", 0), ("hit", 3), ("evict", 2), ("prefetch", 1)]
    assert steps[3] == [
        ("hit", 0), ("evict", 3), ("prefetch", 2), ("hit", 1), ("evict", 0), ("prefetch", 3),
        ("hit", 2), ("evict", 1), ("prefetch", 0), ("hit", 3), ("evict", 2), ("prefetch", 1)]
    slow.close()
    fast.close()


def test_prefetches_in_flight_are_late() -> None:
    """Reads that land only when waited for: the same loads and evictions, each use late."""
    steps, engine = run(frames=3, depth=1, store=GatedStore(1 << 20))
    assert steps[1] == [(("late" if kind == "hit" else kind), layer) for kind, layer in STEP1]
    assert steps[2] == [
        ("late", 0), ("evict", 2), ("prefetch", 1), ("late", 1), ("evict", 3), ("prefetch", 2),
        ("late", 2), ("evict", 0), ("prefetch", 3), ("late", 3), ("evict", 1), ("prefetch", 0)]
    s = engine.stats()
    assert (s["prefetch_issued"], s["prefetch_late"], s["prefetch_useful"], s["hits"]) == (12, 11, 0, 0)
    engine.close()


def test_two_frames_and_no_prefetch() -> None:
    """Two frames, depth 0: nothing is prefetched; every layer is a demand miss evicting the
    one other resident layer."""
    steps, engine = run(frames=2, depth=0, steps=2)
    assert steps[0] == [("evict", 0), ("evict", 1)]
    assert steps[1] == [("evict", 2), ("miss", 0), ("evict", 3), ("miss", 1), ("evict", 0), ("miss", 2),
                        ("evict", 1), ("miss", 3)]
    assert steps[2] == steps[1]
    engine.close()


def test_the_default_clock_is_the_wall_clock() -> None:
    engine = ResidencyEngine(budget=1 << 20, policy="lru", block_tokens=BLOCK, store=MemoryBlockStore(1 << 20),
                             device=torch.device("cpu"), dtype=torch.float32)
    assert isinstance(engine.clock, WallClock) and engine.link is None and engine._depth() == 1
    a = engine.clock.now_ns()
    assert engine.clock.now_ns() >= a > 0
    engine.close()


def test_cxlcache_passes_its_clock_to_the_engine(model) -> None:
    """CxlCache(clock=...) is the engine's clock: on one that never moves, every decode layer
    measures the 1-ns floor, whatever the host's speed."""
    from driver.kv import CxlCache
    from driver.kv.testing import padded_batch

    ids, mask = padded_batch([PROMPT])
    clock = ManualClock(5)
    cache = CxlCache(hbm_budget_bytes=3 * LAYOUT.frame_bytes(CAP), policy="lru", block_tokens=BLOCK,
                     store=MemoryBlockStore(1 << 20), max_seq_len=CAP, clock=clock)
    generate(model, ids, mask, cache, 4)
    engine = cache._engine
    assert engine is not None and engine.clock is clock and engine._layer_ns == 1
    assert engine.link is None and cache.stats()["stall_ns"] == 0
    cache.close()
