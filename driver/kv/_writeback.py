"""Write-back of the residency engine: an evicted frame's dirty blocks go to the device.

A frame leaves by saving only its dirty blocks (those holding tokens appended since its last
save), copied first to a host staging image laid out like the frame with whole blocks per run,
so the frame can be reused at once; the write of that image is asynchronous and reaped later
(retried on failure, then its keys are published for prefix sharing). A layer's load waits for
its own writes, so it always reads what it saved.

A decode step appends one token per layer, so successive saves of a layer rewrite the same tail
block. On CPU, without prefix sharing, the layer keeps its tail image between saves (``tail``):
the image already holds the tokens of the last save, and only the new ones are copied into it
(a few hundred bytes instead of a block per piece, on every eviction). There, too, a prefill
(many tokens in one update) writes its full blocks through at once, straight from the frame (the
frame is not given up before that write is reaped): the prompt's KV goes to the device while
the next layers compute, and the first eviction of each layer in decode writes only its tail
instead of the whole prompt. The engine does so only once its frames ran out (a layer was
evicted): while every layer has a frame, nothing is written to the device.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from driver.kv._arena import Frame, StagingPool
from driver.kv._chunkio import ChunkTables, LayerChunks
from driver.kv._mover import CpuMover, CudaMover
from driver.kv._store import BlockStore, Extent, Transfer
from emulator.spec.errors import DmaError, PoisonError

__all__ = ["PendingWrite", "SavedLayer", "WriteBack"]


@dataclass
class PendingWrite:
    """A write of a layer's blocks in flight, reaped (retried, published) later."""

    buf: torch.Tensor | None  # the staging buffer, or None for a write straight from a frame
    host: np.ndarray
    transfer: Transfer
    extents: list[Extent]
    keys: list[tuple[int, bytes]]
    attempts: int = 1


class SavedLayer(Protocol):
    """What write-back needs of a layer (the engine's ``_Layer``)."""

    index: int
    chunks: LayerChunks
    frame: Frame | None
    seq_len: int
    clean_upto: int  # tokens [0, clean_upto) are on the device (or on their way)
    saves: list[tuple[Any, int, int, int]]  # (mover token, j0, j1, seq_len)
    writes: list[PendingWrite]
    tail: tuple[Any, int, int, int] | None  # kept tail image: (buffer, j0, j1, tokens in it)


L = TypeVar("L", bound=SavedLayer)


class WriteBack(Generic[L]):
    """The residency engine's save / write / reap path (a part it owns). It places blocks with
    the engine's :class:`ChunkTables`, registers host buffers through ``register`` and marks a
    layer with work in flight in ``pending`` (the engine's, polled by it)."""

    def __init__(self, *, store: BlockStore, chunks: ChunkTables, staging: StagingPool,
                 mover: CpuMover | CudaMover, counters: dict[str, int], register: Callable[[np.ndarray], None],
                 pending: dict[int, L], block_tokens: int, full_writeback: bool,
                 prefix_sharing: bool, max_retries: int) -> None:
        self.store = store
        self.chunks = chunks
        self.staging = staging
        self.mover = mover
        self.counters = counters
        self._register = register
        self._pending = pending
        self.block_tokens = block_tokens
        self.full_writeback = full_writeback
        self.prefix_sharing = prefix_sharing
        self.max_retries = max_retries

    def _keeps_tail(self) -> bool:
        """Whether layers keep their tail image between saves: CPU (the copy is synchronous),
        private chunks (every save writes: no image is dropped unwritten) and not the
        whole-layer baseline (which models rewriting everything)."""
        return not (self.mover.cuda or self.prefix_sharing or self.full_writeback)

    def save(self, st: L) -> None:
        """Save the dirty blocks of ``st``'s frame (it is about to be given up)."""
        layout = self.chunks.layout
        assert layout is not None and st.frame is not None
        bt = self.block_tokens
        j0 = 0 if self.full_writeback else st.clean_upto // bt
        j1 = layout.blocks(st.seq_len)
        if j0 >= j1:
            return
        if st.writes:
            self.reap_writes(st, block=True)  # a chunk freed below must have no write in flight
        tail = st.tail
        if tail is not None and tail[1:3] == (j0, j1) and j0 * bt <= tail[3] <= st.seq_len:
            assert isinstance(self.mover, CpuMover)  # tails are kept on CPU only
            token = self.mover.save_more(st.frame, tail[0], j0 * bt, tail[3], st.seq_len, (j1 - j0) * bt)
        else:
            self._drop_tail(st)
            token = self.mover.save_start(st.frame, j0 * bt, st.seq_len, (j1 - j0) * bt)
        if self._keeps_tail():
            st.tail = (token, j0, j1, st.seq_len)
        st.clean_upto = st.seq_len
        st.saves.append((token, j0, j1, st.seq_len))
        self._pending[st.index] = st
        self.advance_saves(st)

    def write_through(self, st: L) -> None:
        """Write the full blocks not on the device yet straight from the frame (CPU, private
        chunks; see the module docstring)."""
        if not self._keeps_tail():
            return
        bt = self.block_tokens
        j0, j1 = st.clean_upto // bt, st.seq_len // bt
        if j0 >= j1:
            return
        assert st.frame is not None
        host, cap, _ = self.mover.load_image(st.frame, st.seq_len)  # the frame's own bytes
        self._register(host)
        self._issue_write(st, None, host, self.chunks.whole_blocks(st.chunks, j0, j1, 0, cap), [])
        st.clean_upto = max(st.clean_upto, j1 * bt)
        self._pending[st.index] = st

    def release_frame(self, st: L) -> None:
        """Before the frame is given up: wait for writes straight from it (write-through)."""
        if any(w.buf is None for w in st.writes):
            self.reap_writes(st, block=True)

    def _drop_tail(self, st: L) -> None:
        """Give the layer's kept tail image back to the pool (its writes are all reaped)."""
        if st.tail is not None:
            assert not st.writes, "a kept tail image with its write in flight"
            self.staging.put(st.tail[0])
            st.tail = None

    def advance_saves(self, st: L, force: bool = False) -> None:
        while st.saves and (force or self.mover.save_ready(st.saves[0][0])):
            token, j0, j1, seq_len = st.saves.pop(0)
            buf, host = self.mover.save_image(token)
            self._register(host)
            extents, keys = self.chunks.save_plan(st.index, st.chunks, host, j0, j1, seq_len)
            if not extents:
                self.staging.put(buf)
                continue
            self._issue_write(st, buf, host, extents, keys)

    def _issue_write(self, st: L, buf: torch.Tensor | None, host: np.ndarray, extents: list[Extent],
                     keys: list[tuple[int, bytes]]) -> None:
        """Start writing ``extents`` of ``host`` to the device, counted and reaped later."""
        self.counters["offloads"] += 1
        self.counters["bytes_offloaded"] += sum(e.nbytes for e in extents)
        st.writes.append(PendingWrite(buf, host, self.store.write(extents, host), extents, keys))

    def reap_writes(self, st: L, block: bool) -> None:
        """Finish ``st``'s landed writes (all of them with ``block``): retry a failure, give the
        staging back, publish the keys."""
        keep: list[PendingWrite] = []
        kept_tail = st.tail[0] if st.tail is not None else None
        for w in st.writes:
            if not block and not w.transfer.done():
                keep.append(w)
                continue
            while True:
                try:
                    w.transfer.wait()
                    break
                except (DmaError, PoisonError):
                    if w.attempts > self.max_retries:
                        raise
                    w.attempts += 1
                    w.transfer = self.store.write(w.extents, w.host)
            if w.buf is not None and w.buf is not kept_tail:  # None: written from the frame
                self.staging.put(w.buf)
            if w.keys:
                self.chunks.publish(w.keys)
        st.writes = keep

    def drain_writes(self, layers: Iterable[L]) -> None:
        for st in layers:
            self.advance_saves(st, force=True)
            self.reap_writes(st, block=True)

    def drop_tails(self, layers: Iterable[L]) -> None:
        """Every write reaped: give every kept tail image back (close)."""
        for st in layers:
            self._drop_tail(st)
