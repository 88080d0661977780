"""Hot-page attention: each decode query reads only the KV pages its selector chooses.

Per attention layer of a decode step::

    update(l, k, v) ──► append to the window; a page that completes is written to the device
         │              and its key min / max kept (``_pages.LayerPages``)
         ▼
    attention (through driver.kv's attention function, with the query):
         candidates = pages off the window and the sink; k = what the budget leaves
         selector(query, kmin, kmax, candidates, k, CHMU counts) ──► pages (B, Hkv, k)
         the predicted pages already in the layer's frame (prefetch) + the rest read now into
         the frame's slots of the predicted pages not chosen (a stall; ``_frame.PageFrame``)
         layer l+1's pages chosen for its guessed query; progress to the firmware's prefetch
         queue, which issues their read
         sdpa over  sink | chosen pages | window  (their mask columns), as the frame holds them

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
from driver.kv._frame import PageFrame
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
    """Predicted pages of one layer, read ahead into its frame (the prefetch queue's request)."""

    frame: PageFrame
    transfer: Transfer
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
        self.peak_bytes = self._resident = 0

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
        frame, demand = self._fill(layer, st, pages)
        if q == 1:  # a decode step: while the demand read crosses the link, guess the next layer's
            self._speculate(layer)  # pages and have them read after it
            self._prefetch_after(layer)
        self._wait(demand)
        k = pages.shape[-1]
        window = st.tail[:, :, :, :st.seq_len - st.tail_start]  # type: ignore[index]
        sink = st.sink[:, :, :, :st.sink_end] if st.sink_end else None  # type: ignore[index]
        kv = frame.attention_kv(sink, window, k).to(self.device)
        if mask is not None or q > 1:  # the mask's columns, in the frame's order
            groups = query.shape[1] // lay.kv_heads
            positions = frame.positions(k, st.tail_start, window.shape[3]).to(self.device)
            mask = _attention.repeat_mask(mask, positions, groups, q, st.seq_len)
        self.counters["decode_attentions"] += 1
        self.counters["dense_bytes"] += lay.batch * st.seq_len * lay.token_bytes
        self._note_peak(layer, frame)
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
        if k and self.heat is not None and self.heat.fed_by_engine:  # the CHMU's model counts each chosen page
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
        chosen = self.selector.select(grouped, st.kmin[:, :, :st.complete], st.kmax[:, :, :st.complete],
                                      torch.arange(cand.start, cand.stop), k, self._counts(st))
        return chosen.to("cpu").numpy()

    def _counts(self, st: LayerPages) -> torch.Tensor:
        """The CHMU's count of each complete page of ``st`` ``(B, Hkv, P)``, taken once a step
        and layer (the layer's speculated and its own choice use the same: its pages are not
        read between them, and the device's hotlist is drained once a step)."""
        lay = self.layout
        assert lay is not None and self.heat is not None
        key = (self._step, st.complete)
        if st.heat_key != key:
            st.heat = torch.from_numpy(self.heat.counts(st.chunks.ids[:, :lay.kv_heads, :st.complete]))
            st.heat_key = key
        return st.heat

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
    def _frame(self, st: LayerPages, slots: int) -> PageFrame:
        lay = self.layout
        assert lay is not None and st.tail is not None
        return PageFrame(lay, st.sink_end, slots, st.tail.shape[3], self.dtype)

    def _fill(self, layer: int, st: LayerPages, pages: np.ndarray) -> tuple[PageFrame, Transfer | None]:
        """A frame whose first ``k`` slots will hold the chosen ``pages`` ``(B, Hkv, k)``: the
        predicted ones read ahead into it, the rest being read into the slots of the predicted
        pages not chosen (the returned transfer: :meth:`_wait` for it before attention)."""
        pred: _PageRead | None = st.prefetch
        st.prefetch = None
        k = pages.shape[-1]
        if pred is None:
            frame = self._frame(st, k)
            owed = PageFrame.in_order(pages)
        else:
            self._land(layer, pred)
            frame = pred.frame
            if frame.slots < k:  # more chosen than predicted (and spare slots)
                frame = frame.grown(k, st.tail.shape[3])  # type: ignore[union-attr]
            have, owed = frame.arrange(pages)
            self.counters["pages_predicted_used"] += int(have.sum())
        if not owed[0].size:
            self.counters["hits"] += 1
            return frame, None
        st.wait_writes()
        self._count_read(owed[0].size)
        self.counters["pages_demand"] += owed[0].size
        self.counters["misses"] += 1
        return frame, frame.read(self.store, st.chunks.ids, *owed)

    def _wait(self, demand: Transfer | None) -> None:
        """The demand read has landed; the time waited for it is a stall."""
        if demand is not None and not demand.done():
            t0 = self.clock.now_ns()
            demand.wait()
            self.counters["stall_ns"] += int(self.clock.now_ns() - t0)

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

    def _count_read(self, pages: int) -> None:
        lay = self.layout
        assert lay is not None
        self.counters["loads"] += 1
        self.counters["bytes_loaded"] += 2 * pages * lay.chunk_bytes

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
        frame = self._frame(st, pages.shape[-1] + 1)  # a slot to spare: the next step may choose one more
        st.wait_writes()
        transfer = frame.read_rows(self.store, st.chunks.ids, pages)  # a DMA channel's thread issues it
        self._count_read(pages.size)
        self.counters["pages_predicted"] += pages.size
        st.prefetch = _PageRead(frame, transfer)
        return st.prefetch

    def _sync_prefetch(self) -> None:
        if self._pq is not None:
            s, c = self._pq.stats, self.counters
            c["prefetch_issued"], c["prefetch_useful"] = s.issued, s.useful
            c["prefetch_late"], c["prefetch_wasted"] = s.late, s.wasted

    # ------------------------------------------------------------------------- budget
    def _resident_bytes(self) -> int:
        return sum(st.resident_bytes() for st in self.layers)

    def _note_peak(self, layer: int, frame: PageFrame) -> None:
        """The HBM held now: every layer's resident pages and metadata (summed at a step's first
        and last layer: they grow only in ``update``), the frames read ahead and this one."""
        if layer == 0 or layer == self._num_layers - 1:
            self._resident = self._resident_bytes()
        pending = sum(st.prefetch.frame.nbytes for st in self.layers if st.prefetch is not None)
        self.peak_bytes = max(self.peak_bytes, self._resident + pending + frame.nbytes)

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

