"""What hot-page attention keeps resident whatever its page budget: one home for the KV shim
(``driver.kv._hot``, which runs it) and the serving simulator (``tools.sim.hot``, which models it),
so the simulator's working set is the shim's.

A page is a KV block (``block_tokens`` tokens). The first ``SINK_PAGES`` pages hold the attention
sinks (StreamingLLM: the first tokens draw attention whatever the query), and the last
``WINDOW_PAGES`` complete pages, with the partial page being filled, are the recent window; both
are read at every step beside the pages the selector chooses.

:func:`quest_topk` is Quest's page choice in C (``_hotpages.c``, built into the replay loops'
cffi module): the KV shim's built-in selector calls it once a layer where a dozen tensor
operations cost the decode step more than their arithmetic.
"""
from __future__ import annotations

from typing import Any

__all__ = ["SINK_PAGES", "WINDOW_PAGES", "quest_topk"]

SINK_PAGES = 1
WINDOW_PAGES = 2


def quest_topk(q: Any, kmin: Any, kmax: Any, hot: Any, c0: int, c1: int, k: int) -> Any:
    """Quest's choice in C (``_hotpages.c``): for every row (a KV head of a sequence) the ``k``
    pages of ``[c0, c1)`` with the highest (bound, ``hot`` count, page), ascending, ``(R, k)``
    int64. ``q``: ``(R, G, D)`` float32 C-contiguous, the row's queries; ``kmin`` / ``kmax``:
    ``(R, P, D)`` float32, each channel contiguous (any row and page strides, the same for
    both); ``hot``: ``(R, P)`` int64, pages contiguous. None when the C library is not built or an
    array does not fit that layout (the caller then computes it with tensors)."""
    import numpy as np

    try:
        from firmware_model._fastreplay_c import ffi, lib  # type: ignore[import-not-found]
    except ImportError:
        return None
    f4, i8 = np.dtype(np.float32), np.dtype(np.int64)
    if (q.dtype != f4 or kmin.dtype != f4 or kmax.dtype != f4 or hot.dtype != i8 or not q.flags.c_contiguous
            or kmin.strides != kmax.strides or kmin.strides[2] != 4 or hot.strides[1] != 8
            or q.shape[0] != kmin.shape[0] or kmin.shape != kmax.shape or hot.shape[0] != q.shape[0]):
        return None
    rows, groups, dim = q.shape
    n = c1 - c0
    out = np.empty((rows, k), np.int64)
    score, order = np.empty(max(n, 1), np.float32), np.empty(max(n, 1), np.int64)

    def ptr(ctype: str, a: Any) -> Any:
        return ffi.cast(ctype, a.ctypes.data)
    rc = lib.cxl_quest_topk(ptr("float *", q), groups, dim, groups * dim, ptr("float *", kmin), ptr("float *", kmax),
                            kmin.strides[0] // 4, kmin.strides[1] // 4, ptr("int64_t *", hot), hot.strides[0] // 8,
                            rows, c0, c1, k, ptr("float *", score), ptr("int64_t *", order), ptr("int64_t *", out))
    if rc:
        raise ValueError(f"quest_topk: k={k} of pages [{c0}, {c1}) for {rows} rows of {groups} x {dim} queries")
    return out
