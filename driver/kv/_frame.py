"""One layer's attention buffer for one decode step: the pages a DMA reads land where attention reads them.

A frame is K and V ``(2, B, H, capacity, D)`` in host memory::

    tokens   0 .. sink        sink .. sink + slots * bt                 then
             [ sink pages ]   [ slot 0 | slot 1 | ... page slots ... ]  [ recent window ]
             copied in        read by DMA, straight from the device     copied in

Reading a page into slot ``s`` of row ``(b, h)`` is two descriptors, its K chunk to the K half
and its V chunk to the V half, so a page crosses the link once and is not copied again on the
host (no staging image, no gather): what a GPU does with a DMA into HBM slots. The predicted
pages of a layer are read into a frame during the previous layer (slots in prediction order);
when the layer's own choice is known (:meth:`arrange`), chosen pages already there stay in
their slots and the others are read into the slots of the predicted pages that were not chosen,
so the first ``k`` slots hold exactly the chosen pages. Attention does not depend on the order
of its keys (their positions travel with them when a mask needs them).
"""
from __future__ import annotations

import numpy as np
import torch

from driver.kv._layout import KVLayout
from driver.kv._pages import extents
from driver.kv._store import BlockStore, Transfer
from emulator.dma import PinnedHosts

__all__ = ["PageFrame"]


class PageFrame:
    """K and V of sink | ``slots`` page slots | window for one layer (see the module docstring)."""

    def __init__(self, lay: KVLayout, sink: int, slots: int, window: int, dtype: torch.dtype) -> None:
        self.lay, self.sink, self.slots = lay, sink, slots
        self.capacity = sink + slots * lay.block_tokens + window
        self.kv = torch.empty((2, lay.batch, lay.kv_heads, self.capacity, lay.head_dim), dtype=dtype)
        self.host = self.kv.view(-1).view(torch.uint8).numpy()  # what the DMA writes
        self.page = np.full((lay.batch, lay.kv_heads, slots), -1, np.int64)  # the page in each slot
        self._pinned: PinnedHosts | None = None  # the buffer pinned for DMA once (a frame takes two reads)

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    def read(self, store: BlockStore, ids: np.ndarray, rows: np.ndarray, slots: np.ndarray, pages: np.ndarray,
             urgent: bool = False) -> Transfer:
        """Read page ``pages[i]`` of row ``rows[i]`` (``b * H + h``) into slot ``slots[i]``:
        its K chunk (``ids[b, h, page]``) and V chunk (``ids[b, H + h, page]``) straight into
        the frame. ``urgent``: the caller waits at once (issued in its thread where the store can)."""
        lay = self.lay
        h = lay.kv_heads
        b, head = np.divmod(rows, h)
        chunks = np.stack((ids[b, head, pages], ids[b, head + h, pages]), axis=-1)
        row_bytes = self.capacity * lay.head_dim * lay.itemsize
        k_at = rows * row_bytes + (self.sink + slots * lay.block_tokens) * lay.head_dim * lay.itemsize
        offsets = np.stack((k_at, k_at + lay.batch * h * row_bytes), axis=-1)
        # one extent a chunk: no two can merge (a page's K and V go to different halves, and the
        # next page of a head is not the next chunk on the media: the other heads' are between)
        arrays = (chunks.reshape(-1), offsets.reshape(-1), np.full(chunks.size, lay.chunk_bytes, np.int64))
        self.page.reshape(-1)[rows * self.slots + slots] = pages
        read_runs = getattr(store, "read_runs", None)
        if read_runs is not None:
            if self._pinned is None:  # a store that takes arrays issues them with the C data path
                self._pinned = PinnedHosts([self.host])
            return read_runs(*arrays, self.host, urgent=urgent, pinned=self._pinned)  # type: ignore[no-any-return]
        return store.read(extents(arrays), self.host)

    @staticmethod
    def in_order(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``pages`` ``(B, H, m)`` as :meth:`read`'s flat (rows, slots, pages): slots ``0 .. m``
        of every row, in order."""
        b, h, m = pages.shape
        return np.repeat(np.arange(b * h), m), np.tile(np.arange(m), b * h), pages.reshape(-1)

    def read_rows(self, store: BlockStore, ids: np.ndarray, pages: np.ndarray, urgent: bool = False) -> Transfer:
        """Read ``pages`` ``(B, H, m)`` into slots ``0 .. m`` of every row, in order."""
        return self.read(store, ids, *self.in_order(pages), urgent=urgent)

    def arrange(self, pages: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Make slots ``0 .. k`` hold the chosen ``pages`` ``(B, H, k)``: those in a slot below
        ``k`` stay; a chosen page in a slot at or past ``k`` moves down (a copy); the rest are
        to be read. Returns (which chosen pages were here already ``(B, H, k)``, the reads still
        owed as flat (rows, slots, pages) for :meth:`read`)."""
        b, h, k = pages.shape
        eq = pages[..., :, None] == self.page[..., None, :]  # (B, H, k, slots)
        have = eq.any(-1)
        slot = eq.argmax(-1)
        stay = have & (slot < k)
        taken = np.zeros((b, h, k), bool)
        sb, sh, _ = np.nonzero(stay)
        taken[sb, sh, slot[stay]] = True
        rr, jj = np.nonzero((~stay).reshape(b * h, k))  # row-major: the pages to place, per row in order
        fr, free = np.nonzero(~taken.reshape(b * h, k))  # the free slots below k, per row in order
        assert (rr == fr).all()
        placed = pages.reshape(b * h, k)[rr, jj]
        moved = have.reshape(b * h, k)[rr, jj]
        if moved.any():  # a predicted page past k (more were predicted than chosen): copy it down
            src = slot.reshape(b * h, k)[rr, jj][moved]
            self._move(rr[moved], src, free[moved])
            self.page.reshape(-1)[rr[moved] * self.slots + free[moved]] = placed[moved]
        self.page[:, :, k:] = -1
        need = ~moved
        return have, (rr[need], free[need], placed[need])

    def _move(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        bt, lay = self.lay.block_tokens, self.lay
        kv = self.kv.view(2, lay.batch * lay.kv_heads, self.capacity, lay.head_dim)
        for r, s, d in zip(rows.tolist(), src.tolist(), dst.tolist(), strict=True):
            a, z = self.sink + s * bt, self.sink + d * bt
            kv[:, r, z:z + bt] = kv[:, r, a:a + bt]

    def grown(self, slots: int, window: int) -> PageFrame:
        """A frame of ``slots`` slots holding this one's pages in the same slots (a choice of more
        pages than were predicted)."""
        out = PageFrame(self.lay, self.sink, slots, window, self.kv.dtype)
        span = self.slots * self.lay.block_tokens
        out.kv[:, :, :, self.sink:self.sink + span] = self.kv[:, :, :, self.sink:self.sink + span]
        out.page[:, :, :self.slots] = self.page
        return out

    def attention_kv(self, sink: torch.Tensor | None, window: torch.Tensor, k: int) -> torch.Tensor:
        """K and V ``(2, B, H, L, D)`` of sink | slots ``0 .. k`` | ``window`` (the sink and window
        copied in): a view of the frame."""
        end = self.sink + k * self.lay.block_tokens
        if self.sink:
            assert sink is not None
            self.kv[:, :, :, :self.sink] = sink
        self.kv[:, :, :, end:end + window.shape[3]] = window
        return self.kv[:, :, :, :end + window.shape[3]]

    def positions(self, k: int, window_start: int, window: int) -> torch.Tensor:
        """The token position of every column of :meth:`attention_kv`, ``(B, H, L)``."""
        lay = self.lay
        bt = lay.block_tokens
        b, h = lay.batch, lay.kv_heads
        tokens = torch.from_numpy(np.ascontiguousarray(self.page[:, :, :k])).unsqueeze(-1) * bt + torch.arange(bt)
        return torch.cat((torch.arange(self.sink).expand(b, h, -1), tokens.reshape(b, h, k * bt),
                          torch.arange(window_start, window_start + window).expand(b, h, -1)), dim=2)
