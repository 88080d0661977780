"""Staging: KV blocks the DMA engine cannot address move through a bounce buffer of host memory.

The device's DMA engine moves bytes between its media and host memory. vLLM's KV tensors on a
GPU are not host memory, so the tier stages them, as a host driver does for an accelerator with no
peer-to-peer path to the memory expander:

- a store copies the job's blocks from the KV tensors into slots of the bounce buffer (on CUDA:
  pinned memory, a side stream ordered after the forward that wrote them, an event), then the DMA
  engine moves the slots to the device chunks on the timed link;
- a load has the DMA engine move the chunks into slots, then copies the slots into the KV blocks
  (on CUDA: host-to-device on the side stream, an event); the job is reported finished only once
  that copy has completed, so vLLM never schedules a forward on blocks still in flight;
- a layer-wise load (``CxlConnector``) issues its layers' DMA as the unstaged one does, and
  ``wait_layer(l)`` copies layer l's slots on the forward's own stream once its DMA has arrived:
  attention on layer l is ordered after its copy, with no host synchronisation.

The bounce buffer holds ``slots`` blocks of every layer (``staging_bytes`` of
``kv_connector_extra_config``); a job larger than the free slots is cut into pieces that take slots
as earlier pieces give them back, in submission order. A piece whose DMA failed is not copied
into the KV tensors (its blocks are reported failed, and vLLM recomputes them). Everything but
the GPU copies (the slots, the pieces, the order, the failures) is the same code on a CPU, where
``staging=True`` forces this path for CPU tensors and the copies are synchronous: that is how the
path is tested without a GPU.
"""
from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Piece", "Pump", "Slots", "Staging", "stage_state"]


class Slots:
    """First-fit allocation of contiguous runs of ``count`` slots (a contiguous run keeps one
    descriptor per layer for consecutive device chunks, and one host copy per layer)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a staging buffer needs at least one slot, got {count}")
        self.count = count
        self._free: list[tuple[int, int]] = [(0, count)]  # (start, length), sorted, never adjacent

    def alloc(self, n: int) -> int | None:
        """The start of ``n`` free consecutive slots, or None if no run is that long."""
        if n < 1 or n > self.count:
            raise ValueError(f"slots for {n} blocks: take 1 to {self.count}")
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def release(self, start: int, n: int) -> None:
        i = bisect.bisect(self._free, (start, n))
        if (i and self._free[i - 1][0] + self._free[i - 1][1] > start) or \
                (i < len(self._free) and start + n > self._free[i][0]):
            raise RuntimeError(f"slots {start}..{start + n - 1} released twice")
        if i < len(self._free) and start + n == self._free[i][0]:  # merge with the next run
            n += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == start:  # ... and the previous
            start, n = self._free[i - 1][0], self._free[i - 1][1] + n
            i -= 1
            del self._free[i]
        self._free.insert(i, (start, n))

    def free(self) -> int:
        return sum(length for _, length in self._free)


class Staging:
    """The bounce buffer (one ``(slots, page)`` int8 tensor per KV tensor) and the copies
    between it and the KV tensors. On CUDA: pinned, copies on a side stream, each ending in an
    event; elsewhere the copies are synchronous and return None."""

    def __init__(self, tensors: Sequence[torch.Tensor], pages: Sequence[int], slots: int) -> None:
        self.tensors = list(tensors)
        self.device = self.tensors[0].device
        self.cuda = self.device.type == "cuda"
        self.slots = Slots(slots)
        self.widths = [int(t.shape[1]) for t in self.tensors]  # a block's bytes in its tensor row
        self.bounce = [torch.zeros((slots, int(page)), dtype=torch.int8, pin_memory=self.cuda) for page in pages]
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None

    def _index(self, blocks: np.ndarray) -> torch.Tensor:
        idx = torch.from_numpy(np.ascontiguousarray(blocks, np.int64))
        return idx.to(self.device, non_blocking=False) if self.cuda else idx

    def gather(self, blocks: np.ndarray, start: int) -> Any:
        """KV blocks ``blocks`` -> slots ``start..``: a store's first half. On CUDA the copies run
        on the side stream after what the forward's stream has queued (the KV it wrote)."""
        n = len(blocks)
        if not self.cuda:
            idx = self._index(blocks)
            for t, b, w in zip(self.tensors, self.bounce, self.widths):
                b[start:start + n, :w].copy_(t.index_select(0, idx))
            return None
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            idx = self._index(blocks)
            for t, b, w in zip(self.tensors, self.bounce, self.widths):
                b[start:start + n, :w].copy_(t.index_select(0, idx), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def scatter(self, blocks: np.ndarray, start: int, layers: Sequence[int] | None = None,
                on_forward_stream: bool = False) -> Any:
        """Slots ``start..`` -> KV blocks ``blocks`` for ``layers`` (all: None): a load's second
        half. On CUDA: on the side stream, or on the forward's own stream (a layer-wise load:
        ordered before that layer's attention), ending in an event on that stream: the slots are
        given back only once it completed."""
        n = len(blocks)
        which = range(len(self.tensors)) if layers is None else layers
        if not self.cuda:
            idx = self._index(blocks)
            for i in which:
                self.tensors[i].index_copy_(0, idx, self.bounce[i][start:start + n, :self.widths[i]])
            return None
        stream = torch.cuda.current_stream(self.device) if on_forward_stream else self.stream
        with torch.cuda.stream(stream):
            idx = self._index(blocks)
            for i in which:
                src = self.bounce[i][start:start + n, :self.widths[i]].to(self.device, non_blocking=True)
                self.tensors[i].index_copy_(0, idx, src)
            event = torch.cuda.Event()
            event.record(stream)
        return event


def events_done(events: list[Any]) -> bool:
    return all(e is None or bool(e.query()) for e in events)


def events_wait(events: list[Any]) -> None:
    for e in events:
        if e is not None:
            e.synchronize()


class stage_state(enum.Enum):
    NEW = "new"  # waiting for slots
    GATHERING = "gathering"  # store: KV -> slots in flight
    DMA = "dma"  # the DMA engine moving it (store: slots -> device; load: device -> slots)
    SCATTERING = "scattering"  # load: slots -> KV in flight
    DONE = "done"  # slots given back


class Piece:
    """Part of a staged job that holds slots at once: its KV blocks and device chunks."""

    __slots__ = ("blocks", "chunks", "events", "handles", "scattered", "start", "state")

    def __init__(self, blocks: np.ndarray, chunks: np.ndarray) -> None:
        self.blocks, self.chunks = blocks, chunks
        self.start = -1
        self.state = stage_state.NEW
        self.events: list[Any] = []  # the copies in flight (CUDA events; None: done)
        self.handles: list[Any] = []
        self.scattered: set[int] = set()  # layer-wise: layers already copied on the forward's stream


class Pump:
    """Moves the staged jobs' pieces through their states, in submission order: a piece takes
    slots only when every piece before it has them (no job starves), and gives them back once
    its bytes are where they go. ``submit(array, is_load)`` hands a DescriptorArray to the DMA
    engine; ``issue_all(job)`` issues a layer-wise job's layers not issued yet; ``lost(exc)`` is
    told of a device gone (the job fails, its slots come back)."""

    def __init__(self, staging: Staging, plan: Callable[[str, np.ndarray, np.ndarray], Any],
                 submit: Callable[[Any, bool], Any], issue_all: Callable[[Any], None],
                 lost: Callable[[BaseException], None], gone: type[BaseException]) -> None:
        self.staging, self._plan, self._submit, self._issue_all = staging, plan, submit, issue_all
        self._lost, self._gone = lost, gone
        self.jobs: list[Any] = []  # staged jobs with a piece not done, in submission order

    def add(self, job: Any, blocks: np.ndarray, chunks: np.ndarray, layerwise: bool) -> None:
        """Stage ``job``. A layer-wise load that fits the free slots now takes them at once, its
        layers planned for the worker to issue by the window (``job.pending_layers``); any other
        job, or one that does not fit, goes piece by piece (its layers all waited at once)."""
        slots = self.staging.slots
        if not len(blocks):
            job.pieces = []
            return
        if layerwise and len(blocks) <= slots.count:
            start = slots.alloc(len(blocks))
            if start is not None:
                piece = Piece(blocks, chunks)
                piece.start, piece.state, piece.handles = start, stage_state.DMA, job.handles
                arr = self._plan("read", np.arange(start, start + len(blocks), dtype=np.int64), chunks)
                job.pending_layers.extend(enumerate(arr.split(len(self.staging.tensors))))
                job.pieces = [piece]
                self.jobs.append(job)
                return
        job.pieces = cut(blocks, chunks, slots.count)
        self.jobs.append(job)

    @staticmethod
    def done(job: Any) -> bool:
        return all(p.state is stage_state.DONE for p in job.pieces)

    def pump(self, until: Any = None) -> None:
        """Advance every piece as far as it goes without waiting; with ``until`` (a job), go on,
        waiting for the oldest piece in flight, until that job is done."""
        while True:
            moved, may_alloc = False, True
            for job in self.jobs:
                for p in job.pieces:
                    moved |= self._advance(job, p, may_alloc)
                    may_alloc = may_alloc and p.state is not stage_state.NEW
            self.jobs = [j for j in self.jobs if not self.done(j)]
            if until is not None and self.done(until):
                return
            if not moved:  # nothing more moves without waiting
                if until is None:
                    return
                self._wait_oldest()

    def _wait_oldest(self) -> None:
        for job in self.jobs:
            for p in job.pieces:
                if p.state in (stage_state.GATHERING, stage_state.SCATTERING):
                    events_wait(p.events)
                    return
                if p.state is stage_state.DMA:
                    if job.pending_layers:  # layers the forward did not ask for: issue them now
                        self._issue_all(job)
                    for h in p.handles:
                        h.wait()
                    return
        raise RuntimeError("staging: a job waits for slots while none are in flight")

    def _release(self, p: Piece) -> bool:
        self.staging.slots.release(p.start, len(p.blocks))
        p.state = stage_state.DONE
        return True

    def _dma(self, job: Any, p: Piece, direction: str) -> None:
        slots = np.arange(p.start, p.start + len(p.blocks), dtype=np.int64)
        try:
            h = self._submit(self._plan(direction, slots, p.chunks), job.is_load)
        except self._gone as exc:
            self._lost(exc)
            job.error = str(exc)
            return
        p.handles.append(h)
        job.handles.append(h)
        p.state = stage_state.DMA

    def _advance(self, job: Any, p: Piece, may_alloc: bool) -> bool:
        state = p.state
        if state is stage_state.DONE:
            return False
        if state is stage_state.NEW:
            if job.error is not None:  # the device was lost: nothing more moves
                p.state = stage_state.DONE
                return True
            if not may_alloc or (start := self.staging.slots.alloc(len(p.blocks))) is None:
                return False
            p.start = start
            if job.is_load:
                self._dma(job, p, "read")
                return True if p.state is stage_state.DMA else self._release(p)
            p.events = [self.staging.gather(p.blocks, start)]
            p.state = stage_state.GATHERING
            return True
        if state is stage_state.GATHERING or state is stage_state.SCATTERING:  # a copy in flight
            if not events_done(p.events):
                return False
            p.events = []
            if state is stage_state.SCATTERING or job.error is not None:  # loaded, or nothing to store
                return self._release(p)
            self._dma(job, p, "write")
            return True if p.state is stage_state.DMA else self._release(p)
        if state is stage_state.DMA:
            if job.pending_layers or not all(h.done() for h in p.handles):
                return False
            if job.is_load and not any(h.errors for h in p.handles):
                rest = [i for i in range(len(self.staging.tensors)) if i not in p.scattered]
                if rest:  # besides the layers copied on the forward's stream, already in p.events
                    p.events.append(self.staging.scatter(p.blocks, p.start, rest))
            # a store is on the device; a failed load copies no more (its layers copied already,
            # if any, are waited for before the slots are reused)
            if not p.events:
                return self._release(p)
            p.state = stage_state.SCATTERING
            return True
        return False

    def layer_arrived(self, job: Any, layer: int) -> None:
        """Layer-wise: ``layer``'s DMA has arrived (the worker waited for it): copy it into the
        KV tensors on the forward's stream, unless it failed."""
        p = job.pieces[0]
        h = job.layer_handles.get(layer)
        if h is None or layer in p.scattered:
            return
        h.wait()
        if h.errors:
            return
        p.events.append(self.staging.scatter(p.blocks, p.start, [layer], on_forward_stream=True))
        p.scattered.add(layer)


def cut(blocks: np.ndarray, chunks: np.ndarray, most: int) -> list[Piece]:
    """A job's pieces of at most ``most`` blocks, in order."""
    return [Piece(blocks[i:i + most], chunks[i:i + most]) for i in range(0, len(blocks), most)]
