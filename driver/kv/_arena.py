"""The accelerator side: a byte budget carved into layer frames, and host staging buffers.

A frame holds one layer of the whole batch, ``(2, batch, kv_heads, capacity, head_dim)``, so the
tensors handed to attention are zero-copy views of it and the working set is exactly what the
frames hold: no hidden concatenation buffer. ``peak_bytes`` is the high-water mark of frame
memory ever allocated, which is what the accelerator really held; allocation never passes the
budget because at most ``budget // frame_bytes`` frames exist at once, and never more than one per
layer once the layer count is known (:meth:`Arena.limit_frames`), however large the budget. When
the sequences outgrow the frames and the budget holds every layer's frame at the larger size
(beside one old frame while they are copied), :meth:`Arena.grow` re-carves them in place: nothing
goes through the device.

Staging buffers live in host memory (pinned on CUDA when the host allows it, with a one-line
notice and pageable memory otherwise); they are where the device's DMA lands and are counted
separately (``staging_peak_bytes``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from driver.kv._layout import BudgetTooSmall, KVLayout

__all__ = ["Arena", "Frame", "StagingPool"]

_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)  # bfloat16 has no numpy twin


@dataclass(eq=False)
class Frame:
    """One layer's slot on the accelerator.

    ``k`` / ``v`` are its two halves, ``np_kv`` their numpy twins (CPU frames of a dtype numpy
    has) and ``host`` (CPU only, set by the mover) its flat byte view: made once per frame,
    since every decode step of every layer would otherwise build them again (a torch view
    costs microseconds, and they add up on the compute thread)."""

    data: torch.Tensor  # (2, batch, kv_heads, capacity, head_dim)
    free_event: Any = None  # CUDA: compute finished reading it (set when it is released)
    ready_event: Any = None  # CUDA: a load into it has landed
    extra: dict[str, Any] = field(default_factory=dict)
    k: torch.Tensor = field(init=False, repr=False)
    v: torch.Tensor = field(init=False, repr=False)
    host: np.ndarray | None = field(default=None, init=False, repr=False)
    np_kv: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.k, self.v = self.data[0], self.data[1]
        if self.data.device.type == "cpu" and self.data.dtype in _NUMPY_DTYPES:
            self.np_kv = (self.k.numpy(), self.v.numpy())


class Arena:
    """Frames of one capacity within ``budget`` bytes."""

    def __init__(self, budget: int, device: torch.device, dtype: torch.dtype) -> None:
        self.budget = budget
        self.device = device
        self.dtype = dtype
        self.layout: KVLayout | None = None
        self.capacity = 0
        self.max_frames = 0
        self.frame_limit: int | None = None  # frames ever usable (one per layer), once known
        self._free: list[Frame] = []
        self.allocated = 0
        self.peak_bytes = 0
        self.ran_out = False  # take() has found every frame in use: layers are being evicted

    def configure(self, layout: KVLayout, needed: int, headroom: int, when: str = "") -> None:
        """Choose a per-sequence token capacity >= ``needed``; all frames must be released.
        ``BudgetTooSmall`` if two frames of ``needed`` tokens do not fit (``when``: its detail)."""
        assert self.allocated == len(self._free), "configure() with frames in use"
        if needed > layout.max_capacity(self.budget):
            raise BudgetTooSmall(self.budget, layout.min_budget(needed), layout.batch, needed, when)
        self.layout = layout
        self.capacity = self._capacity_for(layout, needed, headroom)
        self._limit()
        self._free.clear()
        self.allocated = 0

    def _capacity_for(self, layout: KVLayout, needed: int, headroom: int) -> int:
        # with headroom the capacity grows in whole blocks; without (the caller gave the final
        # length) it is exactly what is needed, so no budget byte is lost to rounding
        bt = layout.block_tokens
        want = -(-(needed + headroom) // bt) * bt if headroom else needed
        return max(needed, min(want, layout.max_capacity(self.budget)))

    def grow(self, needed: int, headroom: int, in_use: int) -> bool:
        """Re-carve for ``needed`` tokens keeping the ``in_use`` frames, each then copied into a
        larger one by :meth:`regrown`, if they all fit in the budget at the new size beside one
        of today's (an old frame is dropped once copied); False, nothing changed, if not."""
        assert self.layout is not None and self.allocated - len(self._free) == in_use
        capacity = self._capacity_for(self.layout, needed, headroom)
        new_bytes, old_bytes = self.layout.frame_bytes(capacity), self.frame_bytes
        if capacity < needed or in_use * new_bytes + old_bytes > self.budget:
            return False
        self.capacity = capacity
        self._limit()
        self._free.clear()
        self.allocated = in_use
        self.peak_bytes = max(self.peak_bytes, in_use * new_bytes + old_bytes)
        return True

    def regrown(self, old: Frame) -> Frame:
        """A frame of the capacity :meth:`grow` chose holding ``old``'s tokens (the caller drops
        ``old``)."""
        frame = self._new_frame()
        frame.data.narrow(3, 0, old.data.shape[3]).copy_(old.data)
        return frame

    def limit_frames(self, frames: int) -> None:
        """At most ``frames`` frames, however many the budget affords: a cache uses one frame per
        layer, so a budget beyond the model's KV (``hbm_budget_bytes=1 << 62``) keeps every layer
        resident, and nothing (the eviction policy, the telemetry) is sized by its quotient."""
        self.frame_limit = frames
        if self.layout is not None:
            self._limit()

    def _limit(self) -> None:
        affordable = self.budget // self.frame_bytes
        self.max_frames = affordable if self.frame_limit is None else min(affordable, self.frame_limit)

    @property
    def frame_bytes(self) -> int:
        assert self.layout is not None
        return self.layout.frame_bytes(self.capacity)

    @property
    def bytes_in_use(self) -> int:
        return self.allocated * self.frame_bytes if self.layout else 0

    def take(self) -> Frame | None:
        """A free frame, allocating one while under the budget; None when all are in use."""
        if self._free:
            return self._free.pop()
        if self.allocated >= self.max_frames:
            self.ran_out = True
            return None
        self.allocated += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
        return self._new_frame()

    def _new_frame(self) -> Frame:
        lay = self.layout
        assert lay is not None
        return Frame(torch.empty((2, lay.batch, lay.kv_heads, self.capacity, lay.head_dim),
                                 dtype=self.dtype, device=self.device))

    def give(self, frame: Frame) -> None:
        self._free.append(frame)

    def release_all(self) -> None:
        """Drop every frame (all must have been given back)."""
        assert self.allocated == len(self._free), f"{self.allocated - len(self._free)} frames still in use"
        self._free.clear()
        self.allocated = 0


class StagingPool:
    """Reusable host byte buffers (pinned for CUDA); pinning failure falls back with a notice.

    Each buffer's numpy view (what the DMA engine addresses) is made once, when the buffer is
    allocated, and kept beside it (:meth:`array`)."""

    GRANULE = 1 << 16

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._arrays: dict[int, np.ndarray] = {}
        self.in_use = 0
        self.total = 0
        self.peak_bytes = 0
        self.notice: str | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of at least ``nbytes`` (best fit from the free list)."""
        best = None
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes and (best is None or buf.numel() < self._free[best].numel()):
                best = i
        if best is not None:
            buf = self._free.pop(best)
        else:
            size = -(-nbytes // self.GRANULE) * self.GRANULE
            buf = self._alloc(size)
            self._arrays[id(buf)] = buf.numpy()
            self.total += size
            self.peak_bytes = max(self.peak_bytes, self.total)
        self.in_use += 1
        return buf

    def _alloc(self, size: int) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:  # small hosts: pinning GBs fails (the locked-memory limit, RLIMIT_MEMLOCK)
                self.pin = False
                self.notice = f"pinned host memory unavailable ({exc}); staging in pageable memory"
                warnings.warn(self.notice, RuntimeWarning, stacklevel=3)
        return torch.empty(size, dtype=torch.uint8)

    def array(self, buf: torch.Tensor) -> np.ndarray:
        """The flat uint8 numpy view of a buffer from :meth:`get`."""
        return self._arrays[id(buf)]

    def put(self, buf: torch.Tensor) -> None:
        self.in_use -= 1
        self._free.append(buf)

    def clear(self) -> None:
        assert self.in_use == 0, f"{self.in_use} staging buffers still in flight"
        self._free.clear()
        self._arrays.clear()
        self.total = 0
