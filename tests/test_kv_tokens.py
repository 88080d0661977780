"""CxlCache gives exactly DynamicCache's greedy tokens, for every policy and budget down to the
minimum working set, batches 1-4 with padding, block sizes dividing the prompt or not."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache

from driver.kv import BudgetTooSmall, CxlCache, KVLayout, MemoryBlockStore
from driver.kv.testing import padded_batch, tiny_llama
from firmware_model.policies import ONLINE_POLICY_NAMES

NEW = 8
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(layers=LAYERS, hidden=64, heads=4, kv_heads=KV_HEADS)


def generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: object) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              past_key_values=cache)


def layer_bytes(batch: int, tokens: int) -> int:
    return KVLayout(batch=batch, kv_heads=KV_HEADS, head_dim=HEAD_DIM, itemsize=4,
                    block_tokens=1).frame_bytes(tokens)


_REFS: dict[tuple, torch.Tensor] = {}


def reference(model: torch.nn.Module, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = padded_batch(lengths)
    key = tuple(lengths)
    if key not in _REFS:
        _REFS[key] = generate(model, ids, mask, DynamicCache())
    return ids, mask, _REFS[key]


# (prompt lengths, block_tokens): batches 1-4 with padding; 4 divides the 16-token prompts of
# some rows (and the padded width), 5 and 3 divide none
SHAPES = [([16], 5), ([16, 9], 4), ([13, 16, 7], 3), ([16, 11, 16, 5], 4)]


@pytest.mark.parametrize("policy", ONLINE_POLICY_NAMES)
@pytest.mark.parametrize("lengths,block_tokens", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("fraction", ["min", "half", "all"])
def test_tokens_equal_dynamic_cache(model, policy, lengths, block_tokens, fraction) -> None:
    """Same greedy tokens as DynamicCache; the budget is never exceeded; offloaded blocks really
    come back from the store."""
    ids, mask, ref = reference(model, lengths)
    final = ids.shape[1] + NEW - 1  # the last generated token is never cached
    total = LAYERS * layer_bytes(len(lengths), final)
    budget = {"min": 2 * layer_bytes(len(lengths), final), "half": total // 2, "all": total + (1 << 16)}[fraction]
    cache = CxlCache(hbm_budget_bytes=budget, policy=policy, block_tokens=block_tokens,
                     store=MemoryBlockStore(4 << 20))
    out = generate(model, ids, mask, cache)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["hbm_peak_bytes"] <= budget
    if fraction != "all":
        assert stats["loads"] > 0 and stats["offloads"] > 0


@pytest.mark.parametrize("policy", ["lru", "reuse"])
@pytest.mark.parametrize("lengths,block_tokens", [([16], 5), ([13, 16, 7], 3)], ids=lambda x: str(x))
@pytest.mark.parametrize("device_backed", [False, True])
def test_tokens_equal_without_prefix_sharing(model, policy, lengths, block_tokens, device_backed) -> None:
    """Private chunks (the benchmark's setting): whole-block write-backs from each layer's kept
    tail image, decode steps crossing block boundaries, over memory or the device's DMA: still
    DynamicCache's tokens, and nothing left allocated."""
    ids, mask, ref = reference(model, lengths)
    final = ids.shape[1] + NEW - 1
    store = None if device_backed else MemoryBlockStore(4 << 20)
    cache = CxlCache(hbm_budget_bytes=2 * layer_bytes(len(lengths), final), policy=policy,
                     block_tokens=block_tokens, store=store, prefix_sharing=False)
    out = generate(model, ids, mask, cache)
    stats, engine = cache.stats(), cache._engine
    assert any(st.tail is not None for st in engine.layers)  # saves reused their tail images
    cache.close()
    assert torch.equal(out, ref)
    assert stats["loads"] > 0 and stats["offloads"] > 0
    assert engine.staging.in_use == 0 and engine.staging.total == 0 and engine.arena.allocated == 0


def test_budget_below_working_set_names_the_minimum(model) -> None:
    """Two layers of the batch's KV is the minimum; one byte less is refused with that number."""
    ids, mask = padded_batch([16, 12])
    minimum = 2 * layer_bytes(2, 16)
    cache = CxlCache(hbm_budget_bytes=minimum - 1, store=MemoryBlockStore(1 << 20))
    with pytest.raises(BudgetTooSmall, match=f"at least {minimum}"):
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
    cache.close()


def test_cache_keyword_of_transformers_5_24(model) -> None:
    """transformers >= 5.24 takes the cache as ``cache=``; the tokens are the same."""
    if "cache" not in __import__("inspect").signature(model.forward).parameters:
        pytest.skip("transformers < 5.24 has no cache= argument")
    ids, mask, ref = reference(model, [16, 9])
    cache = CxlCache(hbm_budget_bytes=3 * layer_bytes(2, 40), store=MemoryBlockStore(1 << 20))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache=cache)
    assert torch.equal(out, ref)
    assert cache.stats()["loads"] > 0
    cache.close()


def test_close_releases_everything(model) -> None:
    """After close() no frame, staging buffer or device chunk is left."""
    ids, mask, _ = reference(model, [16, 9])
    cache = CxlCache(hbm_budget_bytes=2 * layer_bytes(2, 40), store=MemoryBlockStore(1 << 20))
    generate(model, ids, mask, cache)
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
    model = tiny_llama(layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
                       kv_heads=shape["kv_heads"], dtype=dtype, seed=3)
    ids, mask = padded_batch([12, 7, 10], seed=4)
    ref = generate(model, ids, mask, DynamicCache())
    lay = KVLayout(batch=3, kv_heads=shape["kv_heads"], head_dim=shape["hidden"] // shape["heads"],
                   itemsize=torch.empty(0, dtype=dtype).element_size(), block_tokens=1)
    budget = 2 * lay.frame_bytes(ids.shape[1] + NEW - 1) + 100
    cache = CxlCache(hbm_budget_bytes=budget, block_tokens=shape["block_tokens"], store=MemoryBlockStore(4 << 20))
    out = generate(model, ids, mask, cache)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["loads"] > 0 and stats["hbm_peak_bytes"] <= budget
