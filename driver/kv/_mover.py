"""Copies between the chunk-ordered staging buffers the device DMAs into and the layer frames.

Chunk order (device and staging): ``(batch, block, K|V, kv_heads, block_tokens, head_dim)``.
Frame order (accelerator): ``(K|V, batch, kv_heads, tokens, head_dim)``.

On CPU the frame is host memory, so one strided torch copy per direction does it. On CUDA the
host first permutes between chunk order and a pinned frame-ordered mirror, then the mirror and
the frame exchange ``2 x batch x kv_heads`` contiguous pieces asynchronously on a side stream
(contiguous on both sides, so torch needs no device-side temporary that the budget would not
see). Events order everything: a load into a frame waits until compute released the frame, and
compute waits until the load landed — the race transformers' users hit when a wait is missing.
"""
from __future__ import annotations

from typing import Any

import torch

from driver.kv._arena import Frame, StagingPool

__all__ = ["CpuMover", "CudaMover", "chunks_to_frame", "frame_to_chunks", "make_mover"]


def chunks_to_frame(stage: torch.Tensor, frame: torch.Tensor, j0: int, j1: int,
                    seq_len: int, bt: int, off: int = 0) -> None:
    """Copy blocks ``[j0, j1)`` (tokens below ``seq_len``) from chunk order into frame order.

    ``stage`` is ``(B, j1 - j0, 2, H, bt, D)``; ``frame`` is ``(2, B, H, C, D)`` holding tokens
    from ``off`` on."""
    full_end = max(j0, min(j1, seq_len // bt))
    m = full_end - j0
    for kv in (0, 1):
        if m:
            dst = frame[kv][:, :, j0 * bt - off:full_end * bt - off].unflatten(2, (m, bt))
            dst.copy_(stage[:, :m, kv].permute(0, 2, 1, 3, 4))
        if j1 > full_end:
            r = seq_len - full_end * bt
            frame[kv][:, :, full_end * bt - off:seq_len - off].copy_(stage[:, m, kv, :, :r])


def frame_to_chunks(frame: torch.Tensor, stage: torch.Tensor, j0: int, j1: int,
                    seq_len: int, bt: int, off: int = 0) -> None:
    """Inverse of :func:`chunks_to_frame`; the unused tail of a partial block is zeroed so that
    equal KV always gives equal chunk bytes (prefix sharing hashes them)."""
    full_end = max(j0, min(j1, seq_len // bt))
    m = full_end - j0
    for kv in (0, 1):
        if m:
            src = frame[kv][:, :, j0 * bt - off:full_end * bt - off].unflatten(2, (m, bt))
            stage[:, :m, kv].copy_(src.permute(0, 2, 1, 3, 4))
        if j1 > full_end:
            r = seq_len - full_end * bt
            stage[:, m, kv, :, :r].copy_(frame[kv][:, :, full_end * bt - off:seq_len - off])
            stage[:, m, kv, :, r:].zero_()


class CpuMover:
    """The accelerator is the CPU: copies are synchronous and nothing needs fencing."""

    cuda = False

    def __init__(self, staging: StagingPool) -> None:
        self.staging = staging

    def load_start(self, stage: torch.Tensor, frame: Frame, nblk: int, seq_len: int, bt: int) -> None:
        chunks_to_frame(stage, frame.data, 0, nblk, seq_len, bt)

    def load_done(self, frame: Frame) -> bool:
        return True

    def before_compute(self, frame: Frame) -> None:
        """Nothing to wait for: the copy already happened on this thread."""

    def before_overwrite(self, frame: Frame) -> None:
        """Nothing to wait for: saves copy out synchronously on CPU."""

    def save_start(self, frame: Frame, j0: int, j1: int, seq_len: int, bt: int) -> Any:
        return (frame.data, j0, j1, seq_len, bt)

    def save_ready(self, token: Any) -> bool:
        return True

    def save_finish(self, token: Any, stage: torch.Tensor) -> None:
        data, j0, j1, seq_len, bt = token
        frame_to_chunks(data, stage, j0, j1, seq_len, bt)

    def release(self, frame: Frame) -> None:
        """The frame may be reused at once: compute on CPU is already done with it."""


class CudaMover:
    """GPU frames fed from pinned host mirrors on a side stream, ordered by events."""

    cuda = True

    def __init__(self, staging: StagingPool, device: torch.device) -> None:
        self.staging = staging
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def _pieces(self, frame: torch.Tensor, mirror: torch.Tensor, t0: int, t1: int, to_frame: bool) -> None:
        _, b, h, _, _ = frame.shape
        for kv in range(2):
            for i in range(b):
                for j in range(h):
                    if to_frame:
                        frame[kv, i, j, t0:t1].copy_(mirror[kv, i, j], non_blocking=True)
                    else:
                        mirror[kv, i, j].copy_(frame[kv, i, j, t0:t1], non_blocking=True)

    def _mirror(self, frame: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        two, b, h, _, d = frame.shape
        nbytes = two * b * h * tokens * d * frame.element_size()
        buf = self.staging.get(nbytes)
        view = buf[:nbytes].view(frame.dtype).view(two, b, h, tokens, d)
        return buf, view

    def load_start(self, stage: torch.Tensor, frame: Frame, nblk: int, seq_len: int, bt: int) -> None:
        buf, mirror = self._mirror(frame.data, seq_len)
        chunks_to_frame(stage, mirror, 0, nblk, seq_len, bt)
        with torch.cuda.stream(self.stream):
            if frame.free_event is not None:
                self.stream.wait_event(frame.free_event)
            self._pieces(frame.data, mirror, 0, seq_len, to_frame=True)
            frame.ready_event = torch.cuda.Event()
            frame.ready_event.record(self.stream)
        frame.extra["mirror"] = buf

    def load_done(self, frame: Frame) -> bool:
        ev = frame.ready_event
        if ev is not None and not ev.query():
            return False
        buf = frame.extra.pop("mirror", None)
        if buf is not None:
            self.staging.put(buf)
        return True

    def before_compute(self, frame: Frame) -> None:
        if frame.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(frame.ready_event)

    def before_overwrite(self, frame: Frame) -> None:
        """A frame reused for new tokens (no load) must not be written before its last save's
        copies out of it finished: those were queued on the side stream."""
        if frame.free_event is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def save_start(self, frame: Frame, j0: int, j1: int, seq_len: int, bt: int) -> Any:
        t0 = j0 * bt
        buf, mirror = self._mirror(frame.data, seq_len - t0)
        done = torch.cuda.Event()
        compute_done = torch.cuda.Event()
        compute_done.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(compute_done)
            self._pieces(frame.data, mirror, t0, seq_len, to_frame=False)
            done.record(self.stream)
        return (buf, mirror, done, j0, j1, seq_len, bt)

    def save_ready(self, token: Any) -> bool:
        return bool(token[2].query())

    def save_finish(self, token: Any, stage: torch.Tensor) -> None:
        buf, mirror, done, j0, j1, seq_len, bt = token
        done.synchronize()
        frame_to_chunks(mirror, stage, j0, j1, seq_len, bt, off=j0 * bt)
        self.staging.put(buf)

    def release(self, frame: Frame) -> None:
        """Record where compute is now: the next load into this frame waits for it."""
        frame.free_event = torch.cuda.Event()
        frame.free_event.record(torch.cuda.current_stream(self.device))
        # the save's D2H copies were queued on the side stream before any later load: stream order
        # keeps them ahead of a reuse of the frame
        load_done = frame.extra.pop("mirror", None)
        if load_done is not None:
            self.staging.put(load_done)
        frame.ready_event = None


def make_mover(device: torch.device, staging: StagingPool) -> CpuMover | CudaMover:
    if device.type == "cuda":
        return CudaMover(staging, device)
    return CpuMover(staging)
