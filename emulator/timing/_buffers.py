"""Host buffers as flat byte views: what the data path accepts and the errors it gives."""
from __future__ import annotations

import operator
from typing import Any


def host_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat byte view of a host buffer: bytes-likes, numpy arrays, CPU torch tensors
    (through ``.numpy()``).  Non-contiguous or read-only-where-written buffers are refused."""
    if not isinstance(buf, (bytes, bytearray, memoryview)) and hasattr(buf, "numpy") \
            and hasattr(buf, "is_contiguous"):
        if getattr(getattr(buf, "device", None), "type", "cpu") != "cpu":
            raise ValueError("host buffer is a tensor on an accelerator: copy it to (pinned) CPU "
                             "memory first, or pass a CPU tensor")
        buf = buf.detach().numpy()
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"host buffer must support the buffer protocol (bytes, bytearray, numpy "
                        f"array, CPU torch tensor), got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError("host buffer must be C-contiguous: use numpy.ascontiguousarray or "
                         "tensor.contiguous()")
    if writable and mv.readonly:
        raise ValueError(f"host buffer of type {type(buf).__name__} is read-only; a read needs a "
                         "writable one (bytearray, numpy array)")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def non_negative_int(value: Any) -> int | None:
    """``value`` as an int when it is one >= 0 (numpy integers too; bools not), else None: the
    data path's check of a DPA or size argument, each caller raising its own error."""
    try:
        n = operator.index(value)
    except TypeError:
        return None
    return None if isinstance(value, bool) or n < 0 else n
