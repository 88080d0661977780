"""PageFrame: hot attention's per-layer buffer, pages read by DMA straight into their slots: exact
slot placements on hand-made choices, the K and V halves; the runs a page write merges."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from driver.kv import KVLayout, MemoryBlockStore
from driver.kv._frame import PageFrame
from driver.kv._pages import runs

# 1 sequence, 2 KV heads, head_dim 2, 2-token pages, fp32: a chunk (one head's K or V of a page) is 16 B
LAY = KVLayout(batch=1, kv_heads=2, head_dim=2, itemsize=4, block_tokens=2)
PAGES = 8


def store_and_ids() -> tuple[MemoryBlockStore, np.ndarray]:
    """Head h's K of page p is chunk 2 (h * PAGES + p), its V the next one; chunk c holds the
    floats c, c + 0.25, c + 0.5, c + 0.75."""
    store = MemoryBlockStore(1 << 16)
    store.configure(LAY.chunk_bytes)
    chunks = 2 * 2 * PAGES
    store._media[:chunks * 16] = (np.arange(chunks)[:, None] + np.arange(4) / 4).astype(np.float32).view(np.uint8).ravel()
    ids = np.empty((1, 4, PAGES), np.int64)
    for h in range(2):
        ids[0, h] = 2 * (h * PAGES + np.arange(PAGES))
        ids[0, 2 + h] = ids[0, h] + 1
    return store, ids


def page_kv(h: int, p: int) -> tuple[list[float], list[float]]:
    """What head h's K and V of page p hold, as the frame's (bt * D) values."""
    c = 2 * (h * PAGES + p)
    return [c + i / 4 for i in range(4)], [c + 1 + i / 4 for i in range(4)]


def slot_kv(frame: PageFrame, h: int, slot: int) -> tuple[list[float], list[float]]:
    at = frame.sink + 2 * slot
    k, v = frame.kv[:, 0, h, at:at + 2].reshape(2, 4)
    return k.tolist(), v.tolist()


def test_read_rows_puts_each_page_k_and_v_in_its_slot() -> None:
    store, ids = store_and_ids()
    frame = PageFrame(LAY, sink=2, slots=4, window=2, dtype=torch.float32)
    frame.read_rows(store, ids, np.array([[[3, 5, 7], [1, 2, 4]]])).wait()
    assert frame.page.tolist() == [[[3, 5, 7, -1], [1, 2, 4, -1]]]
    for h, pages in enumerate(([3, 5, 7], [1, 2, 4])):
        for slot, p in enumerate(pages):
            assert slot_kv(frame, h, slot) == page_kv(h, p)


def test_arrange_keeps_the_predicted_pages_chosen_and_reads_the_rest_into_the_others_slots() -> None:
    """Predicted [3 5 7] / [1 2 4], chosen [2 5 7] / [1 4 6]: 5, 7 and 1, 4 stay; 2 goes to
    slot 0 of head 0 (3's), 6 to slot 1 of head 1 (2's)."""
    store, ids = store_and_ids()
    frame = PageFrame(LAY, sink=2, slots=4, window=2, dtype=torch.float32)
    frame.read_rows(store, ids, np.array([[[3, 5, 7], [1, 2, 4]]])).wait()
    have, owed = frame.arrange(np.array([[[2, 5, 7], [1, 4, 6]]]))
    assert have.tolist() == [[[False, True, True], [True, True, False]]]
    assert [a.tolist() for a in owed] == [[0, 1], [0, 1], [2, 6]]
    frame.read(store, ids, *owed).wait()
    assert frame.page.tolist() == [[[2, 5, 7, -1], [1, 6, 4, -1]]]
    for h, pages in enumerate(([2, 5, 7], [1, 6, 4])):
        for slot, p in enumerate(pages):
            assert slot_kv(frame, h, slot) == page_kv(h, p)


def test_arrange_moves_a_chosen_page_down_when_fewer_are_chosen_than_predicted() -> None:
    """Predicted [3 5 7] / [1 2 4], chosen [6 7] / [1 2], k = 2: head 0's 7 sits in slot 2, past
    k, so it is copied down to slot 1, and 6 is read into slot 0; head 1 keeps 1 and 2."""
    store, ids = store_and_ids()
    frame = PageFrame(LAY, sink=2, slots=4, window=2, dtype=torch.float32)
    frame.read_rows(store, ids, np.array([[[3, 5, 7], [1, 2, 4]]])).wait()
    have, owed = frame.arrange(np.array([[[6, 7], [1, 2]]]))
    assert have.tolist() == [[[False, True], [True, True]]]
    assert [a.tolist() for a in owed] == [[0], [0], [6]]
    frame.read(store, ids, *owed).wait()
    assert frame.page.tolist() == [[[6, 7, -1, -1], [1, 2, -1, -1]]]
    assert slot_kv(frame, 0, 0) == page_kv(0, 6) and slot_kv(frame, 0, 1) == page_kv(0, 7)
    assert frame.positions(2, 20, 1).tolist() == [[[0, 1, 12, 13, 14, 15, 20], [0, 1, 2, 3, 4, 5, 20]]]


def test_grown_keeps_the_pages_and_attention_kv_copies_sink_and_window_around_k_slots() -> None:
    store, ids = store_and_ids()
    frame = PageFrame(LAY, sink=2, slots=2, window=2, dtype=torch.float32)
    frame.read_rows(store, ids, np.array([[[3, 5], [1, 2]]])).wait()
    big = frame.grown(3, 2)
    assert big.slots == 3 and big.page.tolist() == [[[3, 5, -1], [1, 2, -1]]]
    assert slot_kv(big, 0, 1) == page_kv(0, 5)
    sink = torch.full((2, 1, 2, 2, 2), -1.0)
    window = torch.full((2, 1, 2, 1, 2), -2.0)
    kv = big.attention_kv(sink, window, 2)
    assert kv.shape == (2, 1, 2, 2 + 4 + 1, 2)
    assert kv[:, :, :, :2].eq(-1).all() and kv[:, :, :, 6:].eq(-2).all()
    assert kv[0, 0, 1, 2:4].reshape(-1).tolist() == page_kv(1, 1)[0]


def test_runs_merge_consecutive_chunk_ids_into_one_extent() -> None:
    """A page write's chunks to consecutive slots of its image: one extent per run of ids."""
    first, at, nbytes = runs(np.array([4, 5, 6, 9, 10, 12]), 16)
    assert first.tolist() == [4, 9, 12] and at.tolist() == [0, 48, 80] and nbytes.tolist() == [48, 32, 16]
