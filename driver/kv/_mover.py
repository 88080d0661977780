"""Moving bytes between the frames on the accelerator and the host images the DMA engine uses.

A *host image* is frame-ordered, ``(2, batch, kv_heads, tokens, head_dim)``, so every chunk of
the device is one contiguous run of it (see ``_layout``).

* CPU: the frame *is* host memory, so a load's DMA lands straight in it (zero copy); a save
  copies the dirty tokens to a staging image so the frame can be reused at once.
* CUDA: loads land in a pinned mirror, then ``2 x batch x kv_heads`` contiguous pieces go to
  the frame on a side stream; saves come back the same way. Events order everything: a load
  into a frame waits until compute released the frame, compute waits until the load landed,
  and a frame reused for new tokens waits until its last save was copied out — the missing
  waits behind the copy / compute races that transformers' and vLLM's users report.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from driver.kv._arena import Frame, StagingPool

__all__ = ["CpuMover", "CudaMover", "make_mover"]


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (what the DMA engine addresses)."""
    return t.view(torch.uint8).reshape(-1).numpy()


def _image(staging: StagingPool, like: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    two, b, h, _, d = like.shape
    nbytes = two * b * h * tokens * d * like.element_size()
    buf = staging.get(nbytes)
    return buf, buf[:nbytes].view(like.dtype).view(two, b, h, tokens, d)


class CpuMover:
    """The accelerator is the CPU: frames are host memory, moved with numpy on flat byte views
    (made once per frame and per staging buffer), so a save costs one copy and no torch view."""

    cuda = False

    def __init__(self, staging: StagingPool) -> None:
        self.staging = staging

    @staticmethod
    def _host(frame: Frame) -> np.ndarray:
        if frame.host is None:
            frame.host = host_bytes(frame.data)
        return frame.host

    def load_image(self, frame: Frame, seq_len: int) -> tuple[np.ndarray, int, Any]:
        """Where a load's DMA lands: the frame itself (capacity = the frame's)."""
        return self._host(frame), frame.data.shape[3], None

    def land(self, frame: Frame, token: Any, seq_len: int) -> None:
        """Nothing to do: the DMA wrote the frame."""

    def before_compute(self, frame: Frame) -> None:
        """Nothing to wait for: a load is complete when its DMA is."""

    def before_overwrite(self, frame: Frame) -> None:
        """Nothing to wait for: saves copy out synchronously."""

    def save_start(self, frame: Frame, t0: int, t1: int, tokens: int) -> Any:
        """Copy tokens ``[t0, t1)`` of every (K/V, row, head) run to the head of that run in a
        staging image laid out like the frame with ``tokens`` (>= ``t1 - t0``) per run: one
        strided numpy copy."""
        two, b, h, cap, d = frame.data.shape
        tb = d * frame.data.element_size()
        runs = two * b * h
        nbytes = runs * tokens * tb
        buf = self.staging.get(nbytes)
        image = self.staging.array(buf)[:nbytes].reshape(runs, tokens * tb)
        image[:, :(t1 - t0) * tb] = self._host(frame).reshape(runs, cap * tb)[:, t0 * tb:t1 * tb]
        return buf

    def save_more(self, frame: Frame, buf: torch.Tensor, t0: int, have: int, t1: int, tokens: int) -> Any:
        """:meth:`save_start` into ``buf``, an image of the same shape that already holds tokens
        ``[t0, have)``: copy only tokens ``[have, t1)``."""
        two, b, h, cap, d = frame.data.shape
        tb = d * frame.data.element_size()
        runs = two * b * h
        image = self.staging.array(buf)[:runs * tokens * tb].reshape(runs, tokens * tb)
        image[:, (have - t0) * tb:(t1 - t0) * tb] = self._host(frame).reshape(runs, cap * tb)[:, have * tb:t1 * tb]
        return buf

    def save_ready(self, token: Any) -> bool:
        return True

    def save_image(self, token: Any) -> tuple[torch.Tensor, np.ndarray]:
        """The staging buffer (returned to the pool after the write) and its bytes."""
        return token, self.staging.array(token)

    def release(self, frame: Frame) -> None:
        """The frame may be reused at once: compute on CPU is done with it."""


class CudaMover:
    """GPU frames fed from pinned host images on a side stream, ordered by events."""

    cuda = True

    def __init__(self, staging: StagingPool, device: torch.device, *, delay_cycles: int = 0) -> None:
        self.staging = staging
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # test hook: a GPU-side sleep before every copy on the side stream, so that a missing
        # wait would let compute read a frame before its bytes land (tests/driver/kv/test_kv_cuda.py)
        self.delay_cycles = delay_cycles

    def _delay(self) -> None:
        if self.delay_cycles:
            torch.cuda._sleep(self.delay_cycles)

    @staticmethod
    def _pieces(frame: torch.Tensor, image: torch.Tensor, t0: int, t1: int, to_frame: bool) -> None:
        """Tokens ``[t0, t1)`` of the frame <-> the head of each run of the image."""
        _, b, h, _, _ = frame.shape
        n = t1 - t0
        for kv in range(2):
            for i in range(b):
                for j in range(h):  # contiguous on both sides: no device temporary
                    if to_frame:
                        frame[kv, i, j, t0:t1].copy_(image[kv, i, j, :n], non_blocking=True)
                    else:
                        image[kv, i, j, :n].copy_(frame[kv, i, j, t0:t1], non_blocking=True)

    def load_image(self, frame: Frame, seq_len: int) -> tuple[np.ndarray, int, Any]:
        buf, image = _image(self.staging, frame.data, seq_len)
        return self.staging.array(buf), seq_len, (buf, image)

    def land(self, frame: Frame, token: Any, seq_len: int) -> None:
        buf, image = token
        with torch.cuda.stream(self.stream):
            if frame.free_event is not None:
                self.stream.wait_event(frame.free_event)
            self._delay()
            self._pieces(frame.data, image, 0, seq_len, to_frame=True)
            frame.ready_event = torch.cuda.Event()
            frame.ready_event.record(self.stream)
        frame.extra["mirror"] = buf  # kept until the copy is known done

    def before_compute(self, frame: Frame) -> None:
        if frame.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(frame.ready_event)

    def before_overwrite(self, frame: Frame) -> None:
        if frame.free_event is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def save_start(self, frame: Frame, t0: int, t1: int, tokens: int) -> Any:
        buf, image = _image(self.staging, frame.data, tokens)
        compute_done = torch.cuda.Event()
        compute_done.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(compute_done)
            self._delay()
            self._pieces(frame.data, image, t0, t1, to_frame=False)
            done.record(self.stream)
        return (buf, done)

    def save_ready(self, token: Any) -> bool:
        return bool(token[1].query())

    def save_image(self, token: Any) -> tuple[torch.Tensor, np.ndarray]:
        buf, done = token
        done.synchronize()
        return buf, self.staging.array(buf)

    def release(self, frame: Frame) -> None:
        """Record where compute is: the next load into this frame waits for it."""
        frame.free_event = torch.cuda.Event()
        frame.free_event.record(torch.cuda.current_stream(self.device))
        mirror = frame.extra.pop("mirror", None)
        if mirror is not None:  # compute waited on ready_event before using the frame: copy done
            frame.ready_event.synchronize()
            self.staging.put(mirror)
        frame.ready_event = None


def make_mover(device: torch.device, staging: StagingPool) -> CpuMover | CudaMover:
    if device.type == "cuda":
        return CudaMover(staging, device)
    return CpuMover(staging)
