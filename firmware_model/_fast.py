"""Demand-fill replay in C (``firmware_model._fastreplay_c``, built from ``_fastreplay.c``).

The C loops are the twins of the Python policies driven by :func:`firmware_model.replay.count_hits`
(``lru``, plain ``lfu``, ``arc``, ``s3fifo`` and Belady's ``opt``): the same hit on every access, checked by
``tests/firmware_model/test_fwmodel_fastreplay.py`` on hypothesis-generated traces. They replay dense integer ids;
:func:`dense_ids` maps any keys to them (an integer array that is already dense is used as it is).
Without the extension (a source checkout never built, or built from older sources:
``python -m firmware_model._fast_build``) :data:`AVAILABLE` is false and replay runs the Python
policies.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from firmware_model.policies.base import check_capacity
from firmware_model.policies.s3fifo import S3FIFOPolicy

_ENTRY_POINTS = ("cxl_dense_ids", "cxl_replay_lru", "cxl_replay_lfu", "cxl_replay_arc", "cxl_replay_s3fifo", "cxl_replay_opt")
try:
    from firmware_model._fastreplay_c import ffi, lib  # type: ignore[import-not-found]
except ImportError:  # not built
    ffi = lib = None
if lib is not None and not all(hasattr(lib, f) for f in _ENTRY_POINTS):  # a stale build: rebuild it
    ffi = lib = None

__all__ = ["AVAILABLE", "FAST_POLICIES", "dense_ids", "fast_hits", "next_use_array"]

AVAILABLE: bool = lib is not None
FAST_POLICIES: tuple[str, ...] = ("lru", "lfu", "arc", "s3fifo", "opt")
_DENSE_SLACK = 4  # an int array with ids below 4 x its length (or 64 Ki) is used without remapping


def dense_ids(keys: Sequence[Hashable] | np.ndarray) -> tuple[np.ndarray, int]:
    """``(ids, n_ids)``: int64 ids in ``[0, n_ids)``, equal where the keys are equal."""
    if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
        arr = np.ascontiguousarray(keys, dtype=np.int64)
        if arr.size == 0:
            return arr, 0
        lo, hi = int(arr.min()), int(arr.max())
        if lo >= 0 and hi < max(_DENSE_SLACK * arr.size, 1 << 16):
            return arr, hi + 1
        ids = np.empty_like(arr)
        if lib is not None:  # a hash map in C, ids in order of first appearance: O(n)
            n_ids = lib.cxl_dense_ids(ffi.from_buffer("int64_t[]", arr), arr.size, ffi.from_buffer("int64_t[]", ids))
            if n_ids < 0:
                raise MemoryError(f"dense ids of {arr.size} keys: out of memory")
            return ids, int(n_ids)
        uniq, inverse = np.unique(arr, return_inverse=True)
        return inverse.astype(np.int64).reshape(-1), len(uniq)
    index: dict[Hashable, int] = {}
    ids = np.fromiter((index.setdefault(k, len(index)) for k in keys), dtype=np.int64, count=len(keys))
    return ids, len(index)


def next_use_array(ids: np.ndarray) -> np.ndarray:
    """``out[i]`` = the next j > i with ``ids[j] == ids[i]``, else ``len(ids)`` (vectorised)."""
    n = len(ids)
    out = np.full(n, n, dtype=np.int64)
    if n < 2:
        return out
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


def fast_hits(policy: str, keys: Sequence[Hashable] | np.ndarray, capacity: int, *,
              hit_sequence: bool = False, **policy_kwargs: Any) -> tuple[int, int, np.ndarray | None]:
    """Demand-fill ``keys`` through the C twin of ``policy``: ``(hits, evictions, hit per access)``.

    The per-access array (uint8, 1 = hit) comes back only with ``hit_sequence=True``. Raises
    ``RuntimeError`` when the extension is not built, ``ValueError`` for a policy without a C twin
    or options it does not take (``s3fifo``'s ``small_ratio``, ``ghost_ratio``, ``fill_main_first``;
    ``opt``'s ``future``, which must be ``keys``).
    """
    if lib is None:
        raise RuntimeError("firmware_model._fastreplay_c is not built: python -m firmware_model._fast_build")
    if policy not in FAST_POLICIES:
        raise ValueError(f"no C replay for policy {policy!r}: it has {', '.join(FAST_POLICIES)}")
    check_capacity(capacity)
    if policy == "opt":
        policy_kwargs.pop("future", None)
    if policy_kwargs and policy != "s3fifo":
        raise ValueError(f"policy {policy!r} takes no options in the C replay, got {sorted(policy_kwargs)}")
    ids, n_ids = dense_ids(keys)
    n = len(ids)
    hits_out = np.empty(n, dtype=np.uint8) if hit_sequence else None
    c_ids = ffi.from_buffer("int64_t[]", ids)
    c_hit = ffi.from_buffer("uint8_t[]", hits_out) if hits_out is not None else ffi.NULL
    evictions = ffi.new("int64_t *")
    if policy == "lru":
        hits = lib.cxl_replay_lru(c_ids, n, n_ids, capacity, c_hit, evictions)
    elif policy == "lfu":
        hits = lib.cxl_replay_lfu(c_ids, n, n_ids, capacity, c_hit, evictions)
    elif policy == "arc":
        hits = lib.cxl_replay_arc(c_ids, n, n_ids, capacity, c_hit, evictions)
    elif policy == "s3fifo":
        shape = S3FIFOPolicy(capacity, **policy_kwargs)  # validates the options, sizes the queues
        hits = lib.cxl_replay_s3fifo(c_ids, n, n_ids, capacity, shape.small_target, shape.ghost_limit,
                                     int(shape.fill_main_first), c_hit, evictions)
    else:
        nxt = next_use_array(ids)
        hits = lib.cxl_replay_opt(c_ids, ffi.from_buffer("int64_t[]", nxt), n, n_ids, capacity, c_hit, evictions)
    if hits < 0:
        raise MemoryError(f"C replay of {n} accesses over {n_ids} keys: out of memory")
    return int(hits), int(evictions[0]), hits_out
