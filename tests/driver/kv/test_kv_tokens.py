"""CxlCache gives exactly DynamicCache's greedy tokens, for every policy and budget down to the
minimum working set, batches 1-4 with padding, block sizes dividing the prompt or not.

Each policy, shape, budget and feature is run once by default; the rest of the cross product is
marked ``slow`` (``pytest -m "not slow"`` leaves it out; the full suite runs it). The engine's
decisions themselves are asserted exactly in test_kv_engine_decisions.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kv_support import LAYERS, frame_bytes, generate, tiny_model
from transformers import DynamicCache, LogitsProcessor

from driver.kv import BudgetTooSmall, CxlCache, KVLayout, MemoryBlockStore
from driver.kv.testing import padded_batch
from firmware_model.policies import ONLINE_POLICY_NAMES

NEW = 8


_REFS: dict[tuple, torch.Tensor] = {}


def reference(model: torch.nn.Module, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = padded_batch(lengths)
    key = tuple(lengths)
    if key not in _REFS:
        _REFS[key] = generate(model, ids, mask, DynamicCache(), NEW)
    return ids, mask, _REFS[key]


# (prompt lengths, block_tokens): batches 1-4 with padding; 4 divides the 16-token prompts of
# some rows (and the padded width), 5 and 3 divide none
SHAPES = [([16], 5), ([16, 9], 4), ([13, 16, 7], 3), ([16, 11, 16, 5], 4)]


FRACTIONS = ["min", "half", "all"]


def _matrix(quick: list[tuple], full: list[tuple]) -> list:
    """``quick`` as they are, the rest of ``full`` marked slow (the full suite still runs them)."""
    def name(case: tuple) -> str:
        return "-".join(str(x) for x in case)

    return ([pytest.param(*case, id=name(case)) for case in quick]
            + [pytest.param(*case, id=name(case), marks=pytest.mark.slow) for case in full if case not in quick])


# What proves equality: every policy once under the least budget (the most evictions and
# loads), which spreads them over every shape; every other budget once.
TOKEN_CASES = _matrix(
    [(policy, *SHAPES[i % len(SHAPES)], "min") for i, policy in enumerate(ONLINE_POLICY_NAMES)]
    + [("reuse", *SHAPES[1], "half"), ("lru", *SHAPES[3], "all")],
    [(policy, *shape, fraction) for fraction in FRACTIONS for shape in SHAPES for policy in ONLINE_POLICY_NAMES])


@pytest.mark.parametrize("policy,lengths,block_tokens,fraction", TOKEN_CASES)
def test_tokens_equal_dynamic_cache(model, policy, lengths, block_tokens, fraction) -> None:
    """Same greedy tokens as DynamicCache; the budget is never exceeded; offloaded blocks really
    come back from the store."""
    ids, mask, ref = reference(model, lengths)
    final = ids.shape[1] + NEW - 1  # the last generated token is never cached
    total = LAYERS * frame_bytes(len(lengths), final)
    budget = {"min": 2 * frame_bytes(len(lengths), final), "half": total // 2, "all": total + (1 << 16)}[fraction]
    cache = CxlCache(hbm_budget_bytes=budget, policy=policy, block_tokens=block_tokens,
                     store=MemoryBlockStore(4 << 20))
    out = generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["hbm_peak_bytes"] <= budget
    if fraction != "all":
        assert stats["loads"] > 0 and stats["offloads"] > 0


@pytest.mark.parametrize("policy,lengths,block_tokens,device_backed", _matrix(
    [("lru", [13, 16, 7], 3, False), ("reuse", [16], 5, True)],  # over memory, over the device
    [(policy, *shape, backed) for backed in (False, True) for shape in (([16], 5), ([13, 16, 7], 3))
     for policy in ("lru", "reuse")]))
def test_tokens_equal_without_prefix_sharing(model, policy, lengths, block_tokens, device_backed) -> None:
    """Private chunks (the benchmark's setting): whole-block write-backs from each layer's kept
    tail image, decode steps crossing block boundaries, over memory or the device's DMA: still
    DynamicCache's tokens, and nothing left allocated."""
    ids, mask, ref = reference(model, lengths)
    final = ids.shape[1] + NEW - 1
    store = None if device_backed else MemoryBlockStore(4 << 20)
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(len(lengths), final), policy=policy,
                     block_tokens=block_tokens, store=store, prefix_sharing=False)
    out = generate(model, ids, mask, cache, NEW)
    stats, engine = cache.stats(), cache._engine
    assert any(st.tail is not None for st in engine.layers)  # saves reused their tail images
    cache.close()
    assert torch.equal(out, ref)
    assert stats["loads"] > 0 and stats["offloads"] > 0
    assert engine.staging.in_use == 0 and engine.staging.total == 0 and engine.arena.allocated == 0


def test_tokens_equal_with_whole_layer_writeback(model) -> None:
    """full_writeback=True (the benchmark's "layerwise" baseline: an evicted layer is rewritten
    whole): the same tokens; the clean blocks it saves again are found on the device (the same
    bytes after the same prefix) and not rewritten."""
    ids, mask, ref = reference(model, [16, 9])
    offloaded, found = [], []
    for full in (False, True):
        cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(2, ids.shape[1] + NEW - 1), policy="lru",
                         block_tokens=4, store=MemoryBlockStore(4 << 20), prefetch_depth=1, full_writeback=full)
        out = generate(model, ids, mask, cache, NEW)
        stats = cache.stats()
        offloaded.append(stats["bytes_offloaded"])
        found.append(stats["dedup_write_bytes"])
        cache.close()
        assert torch.equal(out, ref)
    assert offloaded[1] == offloaded[0] > 0 and found[1] > found[0]


def test_budget_below_working_set_names_the_minimum(model) -> None:
    """Two layers of the batch's KV is the minimum; one byte less is refused with that number,
    at the prefill, for the prompt (no max_seq_len)."""
    ids, mask = padded_batch([16, 12])
    minimum = 2 * frame_bytes(2, 16)
    cache = CxlCache(hbm_budget_bytes=minimum - 1, store=MemoryBlockStore(1 << 20))
    with pytest.raises(BudgetTooSmall, match=f"found at the prefill, before any token was produced, for the "
                                             f"16-token prompt .*; raise hbm_budget_bytes to at least {minimum}$"):
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
    cache.close()


class CountTokens(LogitsProcessor):
    """Counts the tokens generate() produced (one call per step)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def test_budget_too_small_for_the_final_length_is_found_when_it_can_be(model) -> None:
    """A budget holding the prompt but not the final length: with max_seq_len it is refused at
    the prefill's first layer, before any token; without, only the prompt can be checked there,
    so it is found when the sequences outgrow the budget, and the error says so and what to pass."""
    ids, mask, _ = reference(model, [16, 9])
    final = ids.shape[1] + NEW - 1  # 23
    budget = 2 * frame_bytes(2, 20)  # holds 20 tokens per sequence
    tokens = CountTokens()
    cache = CxlCache(hbm_budget_bytes=budget, store=MemoryBlockStore(1 << 20), max_seq_len=final)
    with pytest.raises(BudgetTooSmall) as refused:
        generate(model, ids, mask, cache, NEW, [tokens])
    assert (tokens.calls, cache.stats()["tokens_generated"]) == (0, 0)
    assert (refused.value.minimum, refused.value.seq_len) == (2 * frame_bytes(2, final), final)
    assert str(refused.value) == (
        f"hbm_budget_bytes={budget} is below the working set of {2 * frame_bytes(2, final)} bytes (two layers "
        f"of KV for batch 2 x {final} tokens: the layer computing and the one loading); found at the prefill, "
        f"before any token was produced, for max_seq_len={final}; raise hbm_budget_bytes to at least "
        f"{2 * frame_bytes(2, final)}")
    cache.close()

    cache = CxlCache(hbm_budget_bytes=budget, store=MemoryBlockStore(1 << 20))
    with pytest.raises(BudgetTooSmall) as outgrown:
        generate(model, ids, mask, cache, NEW, [tokens])
    assert tokens.calls == 5  # the prompt + 4 tokens fit 20; the 5th token's KV is the 21st
    assert str(outgrown.value) == (
        f"hbm_budget_bytes={budget} is below the working set of {2 * frame_bytes(2, 21)} bytes (two layers "
        "of KV for batch 2 x 21 tokens: the layer computing and the one loading); the sequences grew to 21 "
        "tokens, after tokens were produced (the budget holds 20 per sequence): without max_seq_len= only the "
        "prompt is checked at the prefill; pass max_seq_len=<prompt + max_new_tokens> to have this found "
        f"there, before any token is produced; raise hbm_budget_bytes to at least {2 * frame_bytes(2, 21)}")
    cache.close()


@pytest.mark.parametrize("policy", _matrix([("reuse",)], [(p,) for p in ONLINE_POLICY_NAMES]))
def test_a_budget_beyond_all_the_kv_keeps_every_layer_resident(model, policy) -> None:
    """hbm_budget_bytes of 2**62 or 10**30 bytes: nothing is sized by the budget (one frame per
    layer, the policy built for those frames), the tokens are DynamicCache's, and no layer leaves
    the accelerator: the frames the sequences outgrew (no max_seq_len given) grow in place."""
    ids, mask, ref = reference(model, [16, 9])
    for budget in (1 << 62, 10**30):
        store = MemoryBlockStore(1 << 20)
        cache = CxlCache(hbm_budget_bytes=budget, policy=policy, block_tokens=4, store=store)
        out = generate(model, ids, mask, cache, NEW)
        stats, engine = cache.stats(), cache._engine
        cache.close()
        assert torch.equal(out, ref)
        assert (stats["frames"], engine.policy.capacity, stats["hbm_budget_bytes"]) == (LAYERS, LAYERS, budget)
        assert (stats["regrows"], engine.arena.capacity) == (1, 28)  # 16 tokens + 4 of headroom, then 21 + 5
        assert (stats["evictions"], stats["loads"], store.bytes_read, store.bytes_written) == (0, 0, 0, 0)
        # the four frames of 28 tokens beside one of 20 while it was copied
        assert stats["hbm_peak_bytes"] == LAYERS * frame_bytes(2, 28) + frame_bytes(2, 20)


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_no_device_traffic_while_every_layer_fits(model, prefix_sharing: bool) -> None:
    """No max_seq_len, so the frames regrow: a budget holding every layer moves exactly zero bytes
    through the store (no round trip at the regrow, no prompt written through at the prefill);
    one holding two layers moves bytes both ways, and the tokens are DynamicCache's in both."""
    ids, mask, ref = reference(model, [16, 9])
    moved = {}
    for layers in (LAYERS + 1, 2):
        store = MemoryBlockStore(1 << 20)
        cache = CxlCache(hbm_budget_bytes=layers * frame_bytes(2, 28), block_tokens=4, store=store,
                         prefix_sharing=prefix_sharing)
        out = generate(model, ids, mask, cache, NEW)
        stats = cache.stats()
        cache.close()
        assert torch.equal(out, ref) and stats["regrows"] >= 1
        assert (stats["bytes_loaded"], stats["bytes_offloaded"]) == (store.bytes_read, store.bytes_written)
        moved[layers] = (store.bytes_read, store.bytes_written)
    assert moved[LAYERS + 1] == (0, 0)
    assert moved[2][0] > 0 and moved[2][1] > 0


@pytest.mark.parametrize("policy", ONLINE_POLICY_NAMES)
def test_a_policy_built_late_is_the_policy_built_first(policy) -> None:
    """The engine records policy calls until it knows how many frames there are (the layer count,
    or the frames allocated when they run out), then builds the policy and replays them: it then
    chooses exactly the victims of a policy built for that capacity at the start."""
    from driver.kv._engine import _UnsizedPolicy
    from firmware_model.policies import make_policy

    calls = [("insert", (k, k + 1)) for k in range(6)] + [("touch", (2, 7)), ("remove", (4,)),
                                                          ("touch", (0, 8)), ("insert", (9, 9))]
    late, first = _UnsizedPolicy(policy), make_policy(policy, 5)
    for method, args in calls:
        getattr(late, method)(*args)
        getattr(first, method)(*args)
    assert len(late) == 6 and 4 not in late and 9 in late
    built = late.build(5)
    assert built.capacity == 5
    assert [built.evict({1}) for _ in range(5)] == [first.evict({1}) for _ in range(5)]


def test_cache_keyword_of_transformers_5_24(model) -> None:
    """transformers >= 5.24 takes the cache as ``cache=``; the tokens are the same."""
    if "cache" not in __import__("inspect").signature(model.forward).parameters:
        pytest.skip("transformers < 5.24 has no cache= argument")
    ids, mask, ref = reference(model, [16, 9])
    cache = CxlCache(hbm_budget_bytes=3 * frame_bytes(2, 40), store=MemoryBlockStore(1 << 20))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache=cache)
    assert torch.equal(out, ref)
    assert cache.stats()["loads"] > 0
    cache.close()


def test_close_releases_everything(model) -> None:
    """After close() no frame, staging buffer or device chunk is left."""
    ids, mask, _ = reference(model, [16, 9])
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(2, 40), store=MemoryBlockStore(1 << 20))
    generate(model, ids, mask, cache, NEW)
    engine = cache._engine
    assert engine is not None and engine.pool is not None and engine.pool.used > 0
    cache.close()
    assert engine.pool.used == 0
    assert engine.arena.allocated == 0
    assert engine.staging.in_use == 0 and engine.staging.total == 0


def test_bad_arguments_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="hbm_budget_bytes must be a positive int"):
        CxlCache(hbm_budget_bytes=0, store=MemoryBlockStore(1 << 20))
    with pytest.raises(ValueError, match="unknown eviction policy 'belady'"):
        CxlCache(hbm_budget_bytes=1 << 20, policy="belady", store=MemoryBlockStore(1 << 20))
    with pytest.raises(ValueError, match="block_tokens must be an int >= 1, got 0"):
        CxlCache(hbm_budget_bytes=1 << 20, block_tokens=0, store=MemoryBlockStore(1 << 20))
    with pytest.raises(ValueError, match="block_tokens must be an int >= 1, got 2.5"):
        CxlCache(hbm_budget_bytes=1 << 20, block_tokens=2.5, store=MemoryBlockStore(1 << 20))
    with pytest.raises(ValueError, match="max_seq_len must be None or an int >= 1"):
        CxlCache(hbm_budget_bytes=1 << 20, max_seq_len=0, store=MemoryBlockStore(1 << 20))
    with pytest.raises(ValueError, match="give device= or store=, not both"):
        CxlCache(hbm_budget_bytes=1 << 20, device="mem0", store=MemoryBlockStore(1 << 20))
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match=rf"max_retries must be an int >= 0 \(retries of a failed load "
                                             rf"before its chunks are recomputed; 0 = none\), got {bad!r}$"):
            CxlCache(hbm_budget_bytes=1 << 20, max_retries=bad, store=MemoryBlockStore(1 << 20))
    CxlCache(hbm_budget_bytes=1 << 20, max_retries=0, store=MemoryBlockStore(1 << 20)).close()


def test_a_device_that_does_not_exist_is_refused_at_construction() -> None:
    """Not at the first forward, deep inside generate(): the name and the runtime dir."""
    from driver import DeviceNotFound

    with pytest.raises(DeviceNotFound, match="no device named 'no-such-dev'"):
        CxlCache(hbm_budget_bytes=1 << 20, device="no-such-dev")


@pytest.mark.parametrize("shape", [
    dict(layers=3, hidden=48, heads=6, kv_heads=6, dtype="float32", block_tokens=7),   # MHA, odd block
    dict(layers=5, hidden=64, heads=8, kv_heads=1, dtype="bfloat16", block_tokens=16),  # MQA, bf16
    dict(layers=2, hidden=96, heads=4, kv_heads=2, dtype="float16", block_tokens=1),    # fp16, 1-token blocks
], ids=["mha-fp32", "mqa-bf16", "gqa-fp16"])
def test_shapes_the_issue_does_not_name(shape) -> None:
    """Other head layouts, dtypes and block sizes: same tokens, blocks really loaded from the
    store, peak accelerator bytes within the budget."""
    dtype = getattr(torch, shape["dtype"])
    model = tiny_model(layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
                       kv_heads=shape["kv_heads"], dtype=dtype, seed=3)
    ids, mask = padded_batch([12, 7, 10], seed=4)
    ref = generate(model, ids, mask, DynamicCache(), NEW)
    lay = KVLayout(batch=3, kv_heads=shape["kv_heads"], head_dim=shape["hidden"] // shape["heads"],
                   itemsize=torch.empty(0, dtype=dtype).element_size(), block_tokens=1)
    budget = 2 * lay.frame_bytes(ids.shape[1] + NEW - 1) + 100
    cache = CxlCache(hbm_budget_bytes=budget, block_tokens=shape["block_tokens"], store=MemoryBlockStore(4 << 20))
    out = generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["loads"] > 0 and stats["hbm_peak_bytes"] <= budget
