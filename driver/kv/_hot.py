"""Hot-page attention: each decode query reads only the KV pages its selector chooses.

Per attention layer of a decode step::

    update(l, k, v) ──► append to the window; a page that completes is written to the device
         │              and its key min / max kept (``_pages.LayerPages``)
         ▼
    attention (through driver.kv's attention function, with the query):
         candidates = pages off the window and the sink; k = what the budget leaves
         selector(query, kmin, kmax, candidates, k, CHMU counts) ──► pages (B, Hkv, k)
         the predicted pages already read (prefetch) + the rest read now (a stall)
         layer l+1's pages chosen for its guessed query; progress to the firmware's prefetch
         queue, which issues their read
         sdpa over  sink | chosen pages | window  (their mask columns), in token order

The budget: a step of a layer attends to ``max(resident, ceil(page_budget * pages))`` pages of
the sequence's ``pages``, the resident ones (sink, window, partial page) first; so the bytes read
per layer are at most ``page_budget`` of what dense attention from the device reads (the whole
layer), and ``page_budget=1.0`` reads every page: the same keys in the same order, the tokens of
dense attention. A prefill (no KV on the device yet) is dense attention itself; a later forward
of several tokens reads every page.

Prediction (InfiniGen, OSDI'24): layer l+1's query is guessed from layer l's input
(``_speculate.Speculator``: layer l+1's own ``q_proj`` and rotary embedding) and its pages chosen
for it; for layer 0 of the next step, the pages it chose at this one. The prefetch queue
(``firmware_model.prefetch``, one block per layer as the residency engine uses it) issues that read
during layer l's attention, so it crosses the link while layer l computes; the pages chosen but not
predicted are read on demand. Counted: pages predicted, predicted and used, read on demand, and the
queue's useful / late / wasted prefetches. The CHMU counts (``_page_heat``) are the device's.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from driver.kv import _attention
from driver.kv._chunkio import ChunkTables
from driver.kv._engine import _Landed  # a prefetch's completion, as the residency engine fires it
from driver.kv._layout import BudgetTooSmall, KVLayout
from driver.kv._page_heat import DeviceHeat, ModelHeat, page_heat
from driver.kv._pages import LayerPages
from driver.kv._speculate import Speculator
from driver.kv._store import BlockStore, Transfer
from driver.kv.selectors import PageSelector, resolve_selector
from emulator.timing.clock import WallClock
from firmware_model.clock import Clock
from firmware_model.hot_pages import SINK_PAGES, WINDOW_PAGES
from firmware_model.prefetch import PrefetchQueue

__all__ = ["SINK_PAGES", "WINDOW_PAGES", "HotBudgetTooSmall", "HotEngine"]



class HotBudgetTooSmall(BudgetTooSmall):
    """The HBM budget cannot hold hot-page attention's working set."""

    def __init__(self, budget: int, minimum: int, batch: int, seq_len: int) -> None:
        self.budget, self.minimum, self.batch, self.seq_len = budget, minimum, batch, seq_len
        Exception.__init__(self, f"hbm_budget_bytes={budget} is below hot-page attention's working set of "
                                 f"{minimum} bytes for batch {batch} x {seq_len} tokens (the page metadata, sink "
                                 f"and recent window of every layer, and the chosen pages of two layers); raise "
                                 f"hbm_budget_bytes to at least {minimum}, or lower page_budget")


@dataclass(eq=False)
class _PageRead:
    """Predicted pages of one layer, read ahead (the prefetch queue's request)."""

    pages: np.ndarray  # (B, H, K)
    transfer: Transfer
    image: np.ndarray
    done: _Landed = field(default_factory=_Landed)


class _PredictedReads:
    """The DMA side of the prefetch queue: issuing block ``tag`` (a layer) reads its predicted pages."""

    def __init__(self, engine: HotEngine) -> None:
        self._engine = engine

    def submit(self, direction: str, nbytes: int, *, priority: Any = 0, tag: Any = None) -> _PageRead:
        return self._engine._issue_prediction(tag)

    def cancel(self, request: _PageRead) -> bool:
        return False  # a read in flight cannot be cancelled


class HotEngine:
    """KV pages on a store, attention over the chosen ones; see the module docstring."""

    COUNTERS = ("loads", "bytes_loaded", "bytes_offloaded", "dense_bytes", "stall_ns", "tokens_generated",
                "decode_attentions", "pages_chosen", "pages_predicted", "pages_predicted_used", "pages_demand",
                "prefetch_issued", "prefetch_useful", "prefetch_late", "prefetch_wasted", "hits", "misses")

    def __init__(self, *, budget: int, page_budget: float, selector: str | type, block_tokens: int,
                 store: BlockStore, device: torch.device, dtype: torch.dtype, prefetch: bool = True,
                 max_seq_len: int | None = None, clock: Clock | None = None,
                 sink_pages: int = SINK_PAGES, window_pages: int = WINDOW_PAGES,
                 model: torch.nn.Module | None = None,
                 record: Callable[[int, np.ndarray], None] | None = None) -> None:
        """``model``: the model whose attention this serves (its next layer's query is guessed
        from it, :class:`Speculator`); ``record(layer, pages)``: called with every decode choice
        ``(B, Hkv, k)`` (tests)."""
        self.budget, self.page_budget = budget, page_budget
        self.selector: PageSelector = resolve_selector(selector)
        self.block_tokens, self.store, self.device, self.dtype = block_tokens, store, device, dtype
        self.prefetch, self.max_seq_len = prefetch, max_seq_len
        self.clock: Clock = clock if clock is not None else WallClock()
        self.sink_pages, self.window_pages = sink_pages, window_pages
        self.layout: KVLayout | None = None
        self.layers: list[LayerPages] = []
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.tables = ChunkTables(prefix_sharing=False, counters=self.counters)
        self.heat: DeviceHeat | ModelHeat | None = None  # the CHMU's counts of page reads
        self._record = record
        self.speculator = Speculator(model) if model is not None and prefetch else None
        self._step, self._num_layers, self._checked = -1, 0, False
        self._pq: PrefetchQueue | None = None
        self._hinted = -1
        self.peak_bytes = 0

    # ---------------------------------------------------------------- the path attention takes
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k`` / ``v`` ``(B, Hkv, n, D)`` to ``layer``. A prefill returns them (dense
        attention over the prompt); a later forward leaves its attention to :meth:`attend` (the
        tensors returned are then the new tokens only: the attention function reads the pages)."""
        if self.layout is None:
            self._setup(k)
        lay = self.layout
        assert lay is not None
        while len(self.layers) <= layer:
            self.layers.append(LayerPages(lay, self.sink_pages, self.window_pages))
        self._num_layers = max(self._num_layers, layer + 1)
        self._step += layer == 0
        if layer == 0:
            self.counters["tokens_generated"] += k.shape[0] * k.shape[2]
        st = self.layers[layer]
        first = st.seq_len == 0
        st.update(k, v, self.store, self.tables, self.counters, layer)
        st.reap_writes()
        if layer == 0 and self._step == 1 and not self._checked:
            self._check_budget()
        if layer == 0 and self._step and self.heat is not None:
            self.heat.refresh()  # the hotlist the device's CHMU published since the last step
        if first:
            _attention.check(self)
            return k, v
        _attention.expect(self, layer, lambda module, query, mask, **kw: self.attend(layer, module, query, mask, **kw))
        return k, v

    def seq_length(self, layer: int = 0) -> int:
        return self.layers[layer].seq_len if layer < len(self.layers) else 0

    def _setup(self, k: torch.Tensor) -> None:
        b, h, _, d = k.shape
        self.layout = KVLayout(batch=b, kv_heads=h, head_dim=d, itemsize=k.element_size(),
                               block_tokens=self.block_tokens)
        self.store.configure(self.layout.chunk_bytes)
        self.tables.configure(self.layout, self.store.pool)
        self.heat = page_heat(self.store, self.layout.chunk_bytes)

    def attend(self, layer: int, module: torch.nn.Module, query: torch.Tensor, mask: torch.Tensor | None,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``layer``'s attention for ``query`` ``(B, Hq, q, D)`` over the chosen pages."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _attention.taken(self)
        st, lay = self.layers[layer], self.layout
        assert lay is not None
        q = query.shape[2]
        pages = self._choose(layer, st, query)
        kv, positions = self._gather(layer, st, pages)
        if q == 1:  # a decode step: guess the next layer's pages and have them read meanwhile
            self._speculate(layer)
            self._prefetch_after(layer)
        groups = query.shape[1] // lay.kv_heads
        mask = _attention.repeat_mask(mask, positions, groups, q, st.seq_len)
        self.counters["decode_attentions"] += 1
        self.counters["dense_bytes"] += lay.batch * st.seq_len * lay.token_bytes
        self._note_peak(kv)
        return sdpa_attention_forward(module, query, kv[0], kv[1], mask, **kwargs)

    # ------------------------------------------------------------------------- choice
    def _choose(self, layer: int, st: LayerPages, query: torch.Tensor) -> np.ndarray:
        """The pages to read, ``(B, Hkv, k)`` ascending, within the budget."""
        lay = self.layout
        assert lay is not None
        cand = st.candidates()
        k = len(cand) if query.shape[2] > 1 else self._k(st.seq_len, len(cand))
        if k == len(cand):
            pages = np.broadcast_to(np.arange(cand.start, cand.stop), (lay.batch, lay.kv_heads, k))
        else:
            pages = self._select(st, query[:, :, -1], cand, k)
        if k and self.heat is not None:  # the CHMU counts a read of each chosen page
            self.heat.read(st.chunks.ids[:, :lay.kv_heads][np.arange(lay.batch)[:, None, None],
                                                           np.arange(lay.kv_heads)[None, :, None], pages])
        self.counters["pages_chosen"] += pages.size
        if self._record is not None:
            self._record(layer, pages.copy())
        st.last_choice = pages if 0 < k < len(cand) else None  # none or all pages: nothing to predict
        return pages

    def _k(self, seq_len: int, candidates: int) -> int:
        """Pages to read beyond the resident ones: the budget's share of the sequence's pages."""
        total = -(-seq_len // self.block_tokens)
        resident = total - candidates
        return min(candidates, max(0, math.ceil(self.page_budget * total) - resident))

    def _select(self, st: LayerPages, query: torch.Tensor, cand: range, k: int) -> np.ndarray:
        """The selector's ``k`` pages of ``cand`` for ``query`` ``(B, Hq, D)``."""
        lay = self.layout
        assert lay is not None and st.kmin is not None and st.kmax is not None and self.heat is not None
        b, hq, d = query.shape
        grouped = query.reshape(b, lay.kv_heads, hq // lay.kv_heads, d).to(st.kmin.dtype)
        ids = st.chunks.ids[:, :lay.kv_heads, :st.complete]
        counts = self.heat.counts(ids)
        chosen = self.selector.select(grouped, st.kmin[:, :, :st.complete], st.kmax[:, :, :st.complete],
                                      torch.arange(cand.start, cand.stop), k, torch.from_numpy(counts))
        return chosen.to("cpu").numpy()

    def _speculate(self, layer: int) -> None:
        """Layer ``layer + 1``'s pages for its guessed query (:class:`Speculator`), kept for
        the prefetch queue to read; nothing when there is no guess or nothing to choose."""
        nxt = layer + 1
        if self.speculator is None or nxt >= len(self.layers):
            return
        st = self.layers[nxt]
        cand = st.candidates()
        k = self._k(self.layers[layer].seq_len, len(cand))
        query = self.speculator.query(nxt, layer) if 0 < k < len(cand) else None
        if query is not None:
            st.predicted = self._select(st, query[:, :, -1], cand, k)

    # ------------------------------------------------------------------------- reads
    def _gather(self, layer: int, st: LayerPages, pages: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``(2, B, Hkv, L, D)`` of sink | chosen pages | window, and their token
        positions ``(B, Hkv, L)``."""
        lay = self.layout
        assert lay is not None and st.tail is not None
        bt = lay.block_tokens
        b, h, k = pages.shape
        parts, pos = [], []
        if st.sink_end:
            assert st.sink is not None
            parts.append(st.sink[:, :, :, :st.sink_end])
            pos.append(torch.arange(st.sink_end).expand(b, h, -1))
        if k:
            parts.append(self._load(layer, st, pages))
            tokens = torch.from_numpy(np.ascontiguousarray(pages)).unsqueeze(-1) * bt + torch.arange(bt)
            pos.append(tokens.reshape(b, h, k * bt))
        parts.append(st.tail[:, :, :, :st.seq_len - st.tail_start])
        pos.append(torch.arange(st.tail_start, st.seq_len).expand(b, h, -1))
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
        return kv, torch.cat(pos, dim=2).to(self.device)

    def _load(self, layer: int, st: LayerPages, pages: np.ndarray) -> torch.Tensor:
        """The chosen pages ``(2, B, Hkv, k * bt, D)``: the predicted ones from their prefetch,
        the rest read now (the compute waits)."""
        lay = self.layout
        assert lay is not None
        pred: _PageRead | None = st.prefetch
        st.prefetch = None
        slots: list[torch.Tensor] = []
        have = np.zeros(pages.shape, bool)
        index = np.zeros(pages.shape, np.int64)
        if pred is not None:
            self._land(layer, pred)
            have, index = _match(pages, pred.pages)
            self.counters["pages_predicted_used"] += int(have.sum())
            slots.append(st.tensor(pred.image, pred.pages, self.dtype, self.device))
        missing = ~have
        if missing.any():
            need = _pad_rows(pages, missing)  # (B, H, m): each row's missing pages (padded)
            t0 = self.clock.now_ns()
            transfer, image = st.read(self.store, need)
            transfer.wait()
            self.counters["stall_ns"] += int(self.clock.now_ns() - t0)
            self._count_read(image)
            self.counters["pages_demand"] += int(missing.sum())
            self.counters["misses"] += 1
            base = sum(s.shape[3] for s in slots) // lay.block_tokens
            index[missing] = base + _match(pages, need)[1][missing]
            slots.append(st.tensor(image, need, self.dtype, self.device))
        else:
            self.counters["hits"] += 1
        pool = slots[0] if len(slots) == 1 else torch.cat(slots, dim=3)
        bt = lay.block_tokens
        tok = torch.from_numpy(index).unsqueeze(-1) * bt + torch.arange(bt)  # (B, H, k, bt)
        tok = tok.reshape(1, *pages.shape[:2], -1, 1).expand(2, -1, -1, -1, lay.head_dim).to(self.device)
        return pool.gather(3, tok)

    def _land(self, layer: int, pred: _PageRead) -> None:
        """Wait for a prefetch (a stall if it is late) and tell the queue it was used."""
        done = pred.transfer.done()
        if done:
            pred.done.fire()  # arrived before its compute
        if self._pq is not None:
            self._pq.demand(layer)
        if not done:
            t0 = self.clock.now_ns()
            pred.transfer.wait()
            self.counters["stall_ns"] += int(self.clock.now_ns() - t0)
            pred.done.fire()
        self._sync_prefetch()

    def _count_read(self, image: np.ndarray) -> None:
        self.counters["loads"] += 1
        self.counters["bytes_loaded"] += image.nbytes

    # ------------------------------------------------------------------------- prediction
    def _prefetch_after(self, layer: int) -> None:
        """Progress to the prefetch queue; it issues the next layer's predicted pages."""
        if not self.prefetch or self._step < 1:
            return
        n = self._num_layers
        pq = self._pq
        if pq is None or pq.layers != n:
            pq = self._pq = PrefetchQueue(_PredictedReads(self), block_bytes=1, window=1, layers=n,
                                          is_resident=self._nothing_to_read, on_arrival=lambda _layer: True)
            self._hinted = -1
        here = self._step * n + layer
        pq.progress(0, self._step, layer)
        nxt = here + 1
        if nxt > self._hinted:
            pq.hint(0, nxt // n, nxt % n, (nxt % n,))
            self._hinted = nxt

    def _nothing_to_read(self, layer: int) -> bool:
        st = self.layers[layer] if layer < len(self.layers) else None
        return st is None or (st.predicted is None and st.last_choice is None) or st.prefetch is not None

    def _issue_prediction(self, layer: int) -> _PageRead:
        """Read the pages predicted for ``layer``: those chosen for its guessed query, else those
        it chose at the last step."""
        st = self.layers[layer]
        pages = st.predicted if st.predicted is not None else st.last_choice
        assert pages is not None
        st.predicted = None
        cand = st.candidates()
        pages = np.where((pages >= cand.start) & (pages < cand.stop), pages, cand.start)
        transfer, image = st.read(self.store, pages)
        self._count_read(image)
        self.counters["pages_predicted"] += pages.size
        st.prefetch = _PageRead(pages, transfer, image)
        return st.prefetch

    def _sync_prefetch(self) -> None:
        if self._pq is not None:
            s, c = self._pq.stats, self.counters
            c["prefetch_issued"], c["prefetch_useful"] = s.issued, s.useful
            c["prefetch_late"], c["prefetch_wasted"] = s.late, s.wasted

    # ------------------------------------------------------------------------- budget
    def _resident_bytes(self) -> int:
        return sum(st.resident_bytes() for st in self.layers)

    def _note_peak(self, kv: torch.Tensor) -> None:
        pending = sum(st.prefetch.image.nbytes for st in self.layers if st.prefetch is not None)
        self.peak_bytes = max(self.peak_bytes, self._resident_bytes() + pending + kv.numel() * kv.element_size())

    def _check_budget(self) -> None:
        """After the first forward (the layer count known): the working set at the final length
        (``max_seq_len``, else now) fits the budget, or ``HotBudgetTooSmall``."""
        self._checked = True
        lay = self.layout
        assert lay is not None
        n = max(self.max_seq_len or 0, self.layers[0].seq_len)
        pages = -(-n // lay.block_tokens)
        meta = 2 * lay.batch * lay.kv_heads * pages * lay.head_dim * lay.itemsize
        kept = (self.sink_pages + self.window_pages + 2) * lay.block_tokens
        chosen = max(kept, math.ceil(self.page_budget * pages) * lay.block_tokens)
        need = self._num_layers * (meta + lay.frame_bytes(kept)) + 2 * lay.frame_bytes(chosen)
        if need > self.budget:
            raise HotBudgetTooSmall(self.budget, need, lay.batch, n)

    # ------------------------------------------------------------------------- end
    def close(self) -> None:
        for st in self.layers:
            if st.prefetch is not None:
                st.prefetch.transfer.wait()
                st.prefetch.done.fire()
                st.prefetch = None
            st.release(self.tables)
        if self._pq is not None:
            self._pq.end_sequence(0)
            self._sync_prefetch()
            self._pq = None
        if self.speculator is not None:
            self.speculator.remove()
        self.layers.clear()

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["hbm_peak_bytes"] = self.peak_bytes
        out["hbm_bytes"] = self._resident_bytes()
        out["hbm_budget_bytes"] = self.budget
        out["device_chunks_used"] = self.store.pool.used if self.store.pool else 0
        return out


def _match(pages: np.ndarray, have: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each page of ``pages`` ``(B, H, k)``: is it in its row of ``have`` ``(B, H, m)``, and at
    which slot."""
    eq = pages[..., :, None] == have[..., None, :]  # (B, H, k, m)
    if not have.shape[-1]:
        return np.zeros(pages.shape, bool), np.zeros(pages.shape, np.int64)
    return eq.any(-1), eq.argmax(-1)


def _pad_rows(pages: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """Each row's missing pages, rows padded to the longest with their first missing page (or
    their first page): one rectangular read."""
    counts = missing.sum(-1)
    width = int(counts.max())
    out = np.empty((*pages.shape[:2], width), np.int64)
    for b, h in np.ndindex(*pages.shape[:2]):
        row = pages[b, h][missing[b, h]]
        if row.size == 0:
            row = pages[b, h, :1]
        out[b, h] = np.concatenate([row, np.repeat(row[:1], width - row.size)])
    return out
