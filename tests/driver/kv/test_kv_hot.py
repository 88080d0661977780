"""Hot-page attention (``CxlCache(attention="hot")``) and H2O eviction (``attention="h2o"``):
exact page choices on hand-made keys, the tokens of dense attention at ``page_budget=1.0``, the
window and sink always read, the bytes read within the budget, the prediction counted, H2O
keeping its heavy hitters, the selector plug point and its conformance kit."""
from __future__ import annotations

import sys
import time
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kv_support import generate, tiny_model
from transformers import DynamicCache, LogitsProcessor

from driver.kv import CxlCache, MemoryBlockStore
from driver.kv._attention import AttentionNotRouted
from driver.kv._h2o import H2OEngine
from driver.kv._hot import HotEngine
from driver.kv.selectors import (QuestSelector, SelectorProtocolError, of_candidates, quest_bound, resolve_selector,
                                 top_pages)
from driver.kv.testing import SelectorConformanceError, check_selector, padded_batch
from emulator.spec.errors import ConfigError

NEW = 8
MODULE = types.SimpleNamespace(num_key_value_groups=1, is_causal=True, layer_idx=0)  # what sdpa reads


def hot(model, **kw) -> CxlCache:
    return CxlCache(1 << 30, block_tokens=4, model=model, attention="hot", store=MemoryBlockStore(1 << 24), **kw)


# ------------------------------------------------------------------------- the selector
# Three pages of 2-channel keys; page p's box is [kmin, kmax]:
#   page 1: (1, 0) (3, 0)   -> kmin (1, 0),  kmax (3, 0)
#   page 2: (-1, 2) (0, 4)  -> kmin (-1, 2), kmax (0, 4)
#   page 3: (2, -1) (2, 1)  -> kmin (2, -1), kmax (2, 1)
PAGE_KEYS = [[[1.0, 0.0], [3.0, 0.0]], [[-1.0, 2.0], [0.0, 4.0]], [[2.0, -1.0], [2.0, 1.0]]]


def boxes() -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.tensor([[[1.0, 1.0], [1.0, 1.0]]] + PAGE_KEYS)  # page 0 (unused here), 1, 2, 3
    return keys.amin(1).view(1, 1, 4, 2), keys.amax(1).view(1, 1, 4, 2)


def quest(query: list[list[float]], k: int, hotness: list[int] | None = None) -> list[int]:
    kmin, kmax = boxes()
    hot_counts = torch.tensor(hotness or [0, 0, 0, 0]).view(1, 1, 4)
    got = QuestSelector().select(torch.tensor(query).view(1, 1, len(query), 2), kmin, kmax,
                                 torch.tensor([1, 2, 3]), k, hot_counts)
    return got.view(-1).tolist()


def test_quest_picks_the_highest_bound() -> None:
    """q = (1, 1): bounds sum_d max(q_d kmin_d, q_d kmax_d) = page 1: 3 + 0, page 2: 0 + 4,
    page 3: 2 + 1: page 2 first, then 1 and 3 tie at 3 (the later page wins)."""
    assert quest([[1.0, 1.0]], 1) == [2]
    assert quest([[1.0, 1.0]], 2) == [2, 3]


def test_quest_ties_go_to_the_hotter_page_then_the_later() -> None:
    """q = (1, -1): page 1: 3 + 0 = 3, page 2: 0 + (-2) = -2, page 3: 2 + 1 = 3: a tie."""
    assert quest([[1.0, -1.0]], 1) == [3]
    assert quest([[1.0, -1.0]], 1, hotness=[0, 5, 0, 1]) == [1]  # the CHMU counted page 1 more


def test_quest_scores_a_group_by_its_most_interested_head() -> None:
    """Two query heads on one KV head: q = (0, -1) bounds page 1: 0, page 2: -2, page 3: 1;
    q = (-1, 0): page 1: -1, page 2: 1, page 3: -2. The max per page: 0, 1, 1."""
    assert quest([[0.0, -1.0], [-1.0, 0.0]], 1) == [3]
    assert quest([[0.0, -1.0], [-1.0, 0.0]], 2) == [2, 3]


def _three_key_sort(score, hot, candidates, k):
    """The definition top_pages implements: order by score, then count, then page, all
    descending; the first k, ascending."""
    rows = []
    for s_row, h_row in zip(score.reshape(-1, score.shape[-1]).tolist(), hot.reshape(-1, hot.shape[-1]).tolist(),
                            strict=True):
        order = sorted(range(len(s_row)), key=lambda i: (s_row[i], h_row[i], i), reverse=True)[:k]
        rows.append(sorted(candidates[i] for i in order))
    return rows


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_top_pages_is_the_three_key_order(data) -> None:
    """Scores drawn from a few values (many ties), counts too: the two top-k passes choose what
    sorting by (score, count, page) chooses."""
    b, h, c = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    k = data.draw(st.integers(0, c))
    score = torch.tensor(data.draw(st.lists(st.sampled_from([-1.5, 0.0, 0.25, 2.0]), min_size=b * h * c,
                                            max_size=b * h * c))).view(b, h, c)
    hot = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=b * h * c, max_size=b * h * c))).view(b, h, c)
    candidates = list(range(5, 5 + 2 * c, 2))
    got = top_pages(score, hot, torch.tensor(candidates), k)
    assert got.shape == (b, h, k)
    assert got.reshape(b * h, k).tolist() == _three_key_sort(score, hot, candidates, k)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_quest_in_c_chooses_what_the_tensor_path_chooses(data) -> None:
    """Integer keys and queries (every sum exact in float32, many ties) and a run of candidates:
    the C path (one call) and the tensor path (bounds as two products, then top_pages) choose the
    same pages, ties included."""
    from driver.kv.selectors import _quest_in_c

    b, h, g, p, d = (data.draw(st.integers(1, n)) for n in (2, 2, 3, 12, 4))
    ints = st.integers(-3, 3)
    q = torch.tensor(data.draw(st.lists(ints, min_size=b * h * g * d, max_size=b * h * g * d)),
                     dtype=torch.float32).view(b, h, g, d)
    lo = torch.tensor(data.draw(st.lists(ints, min_size=b * h * p * d, max_size=b * h * p * d)),
                      dtype=torch.float32).view(b, h, p, d)
    hi = lo + torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=lo.numel(), max_size=lo.numel())),
                           dtype=torch.float32).view(b, h, p, d)
    hot = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=b * h * p, max_size=b * h * p))).view(b, h, p)
    c0 = data.draw(st.integers(0, p - 1))
    cand = torch.arange(c0, data.draw(st.integers(c0 + 1, p)))
    k = data.draw(st.integers(0, cand.numel()))
    fast = _quest_in_c(q, lo, hi, cand, k, hot)
    assert fast is not None  # the C library is built (setup.py's cffi modules)
    slow = top_pages(of_candidates(quest_bound(q, lo, hi).amax(2), cand), of_candidates(hot, cand), cand, k)
    assert fast.tolist() == slow.tolist()


def test_of_candidates_is_the_candidates_columns_whether_a_run_or_not() -> None:
    t = torch.arange(24).view(2, 12)
    for cand in ([3, 4, 5, 6], [2, 5, 9], [7]):
        got = of_candidates(t, torch.tensor(cand))
        assert got.tolist() == t[:, cand].tolist()


def test_quest_bound_is_the_largest_score_in_the_box() -> None:
    """The bound (two matrix products) equals sum_d max(q_d kmin_d, q_d kmax_d), and no key in a
    page's box scores above it."""
    g = torch.Generator().manual_seed(3)
    query = torch.randn(2, 2, 3, 5, generator=g)
    a, b = torch.randn(2, 2, 2, 7, 5, generator=g)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    per_channel = torch.maximum(query.unsqueeze(3) * kmin.unsqueeze(2), query.unsqueeze(3) * kmax.unsqueeze(2))
    assert torch.allclose(quest_bound(query, kmin, kmax), per_channel.sum(-1), atol=1e-5)
    inside = kmin + torch.rand(kmin.shape, generator=g) * (kmax - kmin)
    assert (torch.einsum("bhgd,bhpd->bhgp", query, inside) <= quest_bound(query, kmin, kmax) + 1e-5).all()


def engine(page_budget: float, record=None, prefetch: bool = False) -> HotEngine:
    return HotEngine(budget=1 << 30, page_budget=page_budget, selector="quest", block_tokens=2,
                     store=MemoryBlockStore(1 << 20), device=torch.device("cpu"), dtype=torch.float32,
                     prefetch=prefetch, record=record)


def hand_made_prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """12 tokens (6 pages of 2): pages 1-3 hold PAGE_KEYS; values are the token's position."""
    keys = torch.tensor([[0.5, 0.5]] * 2 + [t for page in PAGE_KEYS for t in page] + [[0.5, 0.5]] * 4)
    values = torch.arange(12.0).view(12, 1).expand(12, 2)
    return keys.view(1, 1, 12, 2), values.reshape(1, 1, 12, 2).clone()


def test_engine_reads_exactly_the_chosen_page() -> None:
    """13 tokens: sink page 0, window pages 4 and 5 and the partial page 6, candidates 1-3; a
    budget of 0.7 of 7 pages is ceil(4.9) = 5, one page beyond the 4 resident: page 2 for
    q = (1, 1); its two tokens' bytes are what is read."""
    chosen: list[list[int]] = []
    eng = engine(0.7, record=lambda layer, pages: chosen.append(pages.ravel().tolist()))
    k, v = hand_made_prompt()
    eng.update(0, k, v)
    eng.update(0, torch.tensor([[[[0.5, 0.5]]]]), torch.tensor([[[[12.0, 12.0]]]]))
    eng.attend(0, MODULE, torch.tensor([[[[1.0, 1.0]]]]), None, scaling=1.0)
    assert chosen == [[2]]
    assert eng.stats()["bytes_loaded"] == 2 * 2 * 2 * 4  # K and V of 2 tokens of 2 float32 channels
    eng.close()


def test_window_and_sink_are_always_read() -> None:
    """A budget too small for any page beyond the resident ones: the output is attention over
    exactly the sink (tokens 0-1) and the window (tokens 8-12), computed here by hand."""
    eng = engine(0.01)
    k, v = hand_made_prompt()
    eng.update(0, k, v)
    eng.update(0, torch.tensor([[[[0.5, 0.5]]]]), torch.tensor([[[[12.0, 12.0]]]]))
    query = torch.tensor([[[[1.0, 1.0]]]])
    out, _ = eng.attend(0, MODULE, query, None, scaling=1.0)
    kept = [0, 1, 8, 9, 10, 11, 12]
    keys = torch.cat((k[0, 0], torch.tensor([[0.5, 0.5]])))[kept]
    values = torch.arange(13.0)[kept]
    expect = (torch.softmax(keys @ query.view(2), 0) * values).sum()
    assert out.shape == (1, 1, 1, 2)
    assert out[0, 0, 0, 0].item() == pytest.approx(expect.item(), rel=1e-6)
    assert eng.stats()["bytes_loaded"] == 0
    eng.close()


# ------------------------------------------------------------------------- through the model
@pytest.mark.parametrize("lengths,on_device", [([37], True), ([37, 52], False)])
def test_budget_one_gives_the_tokens_of_dense_attention(model, lengths, on_device) -> None:
    """page_budget=1.0 reads every page (left padding included): DynamicCache's greedy tokens,
    over a private device (its DMA engine, descriptor arrays) or a memory store."""
    ids, mask = padded_batch(lengths)
    ref = generate(model, ids, mask, DynamicCache(), NEW)
    cache = (CxlCache(1 << 30, block_tokens=4, model=model, attention="hot", page_budget=1.0) if on_device
             else hot(model, page_budget=1.0))
    out = generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["bytes_loaded"] > 0 and model.config._attn_implementation == "sdpa"  # given back


class Snapshots(LogitsProcessor):
    """The cache's counters after every forward."""

    def __init__(self, cache: CxlCache) -> None:
        self.cache, self.seen = cache, []

    def __call__(self, input_ids, scores):
        self.seen.append(self.cache.stats())
        return scores


def test_bytes_read_per_step_within_the_budget_share(model) -> None:
    """Without prediction every byte read is a chosen page: per decode step at most
    page_budget of what dense attention from the device reads (the whole of every layer)."""
    ids, mask = padded_batch([64, 50])
    cache = hot(model, page_budget=0.25, prefetch_depth=0)
    snaps = Snapshots(cache)
    generate(model, ids, mask, cache, NEW, processors=[snaps])
    cache.close()
    steps = list(zip(snaps.seen, snaps.seen[1:]))
    assert len(steps) == NEW - 1
    for before, after in steps:
        loaded = after["bytes_loaded"] - before["bytes_loaded"]
        dense = after["dense_bytes"] - before["dense_bytes"]
        assert 0 < loaded <= 0.25 * dense


def test_prediction_is_prefetched_and_counted(model) -> None:
    """Layer l+1's pages of the last step are read while layer l computes: every prediction is
    counted, and used or not (what a decode step chose is predicted or read on demand)."""
    ids, mask = padded_batch([64])
    cache = hot(model, page_budget=0.25)
    generate(model, ids, mask, cache, NEW)
    cache.close()  # the prediction made for a step that never came is counted wasted
    s = cache.stats()
    assert s["prefetch_issued"] > 0
    assert s["prefetch_useful"] + s["prefetch_late"] + s["prefetch_wasted"] == s["prefetch_issued"]
    assert 0 < s["pages_predicted_used"] <= s["pages_predicted"]
    assert s["pages_predicted_used"] + s["pages_demand"] == s["pages_chosen"]


def test_a_model_not_routed_is_refused_before_a_token(model) -> None:
    """A hot cache given another model: the first decode forward stops at its second layer."""
    other = tiny_model(seed=1)
    ids, mask = padded_batch([20])
    cache = hot(other, page_budget=0.5)
    with pytest.raises(AttentionNotRouted, match="did not go through driver.kv's attention function"):
        generate(model, ids, mask, cache, 3)
    cache.close()
    assert other.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kw,match", [
    (dict(attention="sparse"), "attention must be one of dense, hot, h2o"),
    (dict(attention="hot", page_budget=0), r"page_budget must be a fraction in \(0, 1\]"),
    (dict(attention="hot", page_budget=True), "page_budget must be"),
    (dict(attention="dense", page_budget=0.5), "page_budget applies to attention='hot' or 'h2o'"),
])
def test_bad_attention_arguments(model, kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        CxlCache(1 << 20, model=model, **kw)


def test_hot_needs_the_model() -> None:
    with pytest.raises(ConfigError, match="attention='hot' needs model="):
        CxlCache(1 << 20, attention="hot", page_budget=0.5)


# ------------------------------------------------------------------------- H2O
def test_h2o_keeps_heavy_hitters_and_the_recent_half() -> None:
    """16 tokens, budget 0.25: 4 kept, 2 recent (14, 15) and the 2 most attended of the rest:
    every query (1, 0) attends most to token 0 (key (10, 0)), then to token 3 (key (5, 0));
    the others' keys are (0, 1)."""
    keys = torch.tensor([[0.0, 1.0]] * 16)
    keys[0], keys[3] = torch.tensor([10.0, 0.0]), torch.tensor([5.0, 0.0])
    eng = H2OEngine(page_budget=0.25)
    eng.update(0, keys.view(1, 1, 16, 2), torch.zeros(1, 1, 16, 2))
    eng.attend(0, MODULE, torch.tensor([1.0, 0.0]).expand(1, 1, 16, 2), None)
    kept = eng.layers[0]
    assert kept is not None and kept.pos.view(-1).tolist() == [0, 3, 14, 15]
    assert eng.stats()["tokens_evicted"] == 12


def test_h2o_at_full_budget_gives_dense_tokens(model) -> None:
    ids, mask = padded_batch([30, 21])
    ref = generate(model, ids, mask, DynamicCache(), NEW)
    cache = CxlCache(1 << 30, model=model, attention="h2o", page_budget=1.0)
    out = generate(model, ids, mask, cache, NEW)
    cache.close()
    assert torch.equal(out, ref)


# ------------------------------------------------------------------------- the plug point
class Earliest:
    """The k earliest candidates (a user's selector)."""

    name = "earliest"

    def select(self, query, kmin, kmax, candidates, k, hotness):
        return candidates[:k].expand(query.shape[0], query.shape[1], k).clone()


class NoSelect:
    name = "broken"


class Duplicates(Earliest):
    def select(self, query, kmin, kmax, candidates, k, hotness):
        return candidates[:1].expand(query.shape[0], query.shape[1], k).clone()


@pytest.fixture
def user_module(monkeypatch):
    mod = types.ModuleType("my_selectors")
    mod.Earliest, mod.NoSelect, mod.Duplicates = Earliest, NoSelect, Duplicates
    monkeypatch.setitem(sys.modules, "my_selectors", mod)
    return mod


def test_user_selector_by_module_path(model, user_module) -> None:
    """A class of the user's, by module path: it chooses (the earliest candidates) and conforms."""
    ids, mask = padded_batch([40])
    cache = hot(model, page_budget=0.5, selector="my_selectors:Earliest")
    generate(model, ids, mask, cache, 3)
    st = cache._engine.layers[0]
    first = st.candidates().start
    assert isinstance(cache._engine.selector, Earliest)
    assert st.last_choice.ravel().tolist() == list(range(first, first + st.last_choice.shape[-1])) * 2
    cache.close()
    check_selector("my_selectors:Earliest")


def test_selector_errors_say_what_is_missing(model, user_module) -> None:
    with pytest.raises(ValueError, match="unknown page selector 'nope': choose from quest"):
        resolve_selector("nope")
    with pytest.raises(SelectorProtocolError, match="no method select"):
        CxlCache(1 << 20, model=model, attention="hot", selector="my_selectors:NoSelect")
    with pytest.raises(SelectorConformanceError, match=r"expected \d+ distinct pages, ascending"):
        check_selector("my_selectors:Duplicates")


def test_quest_conforms() -> None:
    check_selector("quest")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_hot_attention_reads_the_encoded_pages_of_a_compressed_device(model, fmt) -> None:
    """attention='hot' with kv_format: the chosen pages cross the link encoded (the store's own
    byte count), the engine still sees the native bytes it asked for."""
    from firmware_model.kv_codec import PieceCodec

    ids, mask = padded_batch([37])
    inner = MemoryBlockStore(1 << 24)
    cache = CxlCache(1 << 30, block_tokens=4, model=model, attention="hot", page_budget=1.0, kv_format=fmt,
                     store=inner)
    generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    cache.close()
    encoded = PieceCodec(fmt, 4, model.config.head_dim, "f32").encoded_bytes
    assert stats["link_bytes_loaded"] == inner.bytes_read > 0 and stats["link_bytes_loaded"] % encoded == 0
    assert stats["link_bytes_loaded"] < stats["bytes_loaded"] and stats["device_chunk_bytes"] == encoded


def test_h2o_reports_no_link_bytes(model) -> None:
    """H2O keeps no KV off the accelerator: its stats have no link or device figures to add."""
    ids, mask = padded_batch([37])
    cache = CxlCache(1 << 30, model=model, attention="h2o", page_budget=0.5)
    generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    cache.close()
    assert "link_bytes_loaded" not in stats


def test_page_chunks_are_marked_key_or_value_for_a_compressing_store() -> None:
    """Pages take their chunks page-major; the pool's values map (int4 codes K and V apart)
    still says which chunks hold values."""
    eng = engine(1.0)
    k, v = hand_made_prompt()
    eng.update(0, k.expand(2, 3, -1, -1), v.expand(2, 3, -1, -1))
    ids = eng.layers[0].chunks.ids[:, :, :6]
    values = eng.store.pool.values
    assert not values[ids[:, :3]].any() and values[ids[:, 3:]].all()
    eng.close()


def test_tie_break_counts_come_from_the_device_chmu(model) -> None:
    """On a device the counts are its CHMU's: programmed by the engine, fed the page reads by the
    device's access feed, drained from its hotlist; the pages read most have the most counts."""
    from driver.kv._page_heat import DeviceHeat, ModelHeat

    ids, mask = padded_batch([64])
    cache = CxlCache(1 << 30, block_tokens=4, model=model, attention="hot", page_budget=0.3)
    generate(model, ids, mask, cache, NEW)
    heat = cache._engine.heat
    assert isinstance(heat, DeviceHeat)
    deadline = time.monotonic() + 5
    while heat.total() == 0 and time.monotonic() < deadline:  # the epoch ends 10 ms after the reads
        time.sleep(0.02)
        heat.refresh()
    st = cache._engine.layers[0]
    counts = heat.counts(st.chunks.ids[:, :2, :st.complete])
    cache.close()
    assert heat.total() > 0 and counts.sum() > 0
    eng = engine(0.5)
    eng.update(0, *hand_made_prompt())
    assert isinstance(eng.heat, ModelHeat)
    eng.close()
