"""Replay a block-access trace through an eviction policy (and optionally the prefetcher).

Demand fill: an access hits when its block is resident; a miss makes it resident, evicting the
policy's victim first when the cache is full. Belady's OPT replays the same accesses for the
``opt_hits`` bound. With a :class:`~firmware_model.dma.TransferCost`, every miss stalls for one
block transfer on the simulated clock; ``compute_ns`` per access is the work that overlaps it.

Demand fill of ``lru``, ``lfu``, ``arc``, ``s3fifo`` and ``opt`` runs in C when the extension is built
(:mod:`firmware_model._fast`, the twins of the Python policies, equal hit for hit); every other
policy, every policy object and the prefetching replay run the Python policies.

The policies announce a miss before the victim is chosen: :func:`count_hits` calls the optional
``on_miss(key, now)`` hook before ``evict()`` (ARC adapts there, S3-FIFO consults its ghosts).

Pure: the caller loads the trace and times the run (events per second is a wall-clock figure
and belongs to the tool, not to the model).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from firmware_model import _fast
from firmware_model._replay_types import Access, ReplayResult
from firmware_model.dma import TransferCost
from firmware_model.policies import EvictionPolicy, make_policy
from firmware_model.policies.base import check_capacity
from firmware_model.prefetch_replay import replay_with_prefetch

__all__ = ["IMPLS", "Access", "ReplayResult", "count_hits", "opt_hit_count", "replay", "replay_keys", "replays_in_c"]

IMPLS = ("auto", "c", "py")


def count_hits(policy: EvictionPolicy, keys: Sequence[Hashable], capacity: int) -> tuple[int, int]:
    """Demand-fill ``keys`` through ``policy`` at ``capacity``; returns ``(hits, evictions)``."""
    hits = evictions = 0
    resident = policy.__contains__
    on_miss = getattr(policy, "on_miss", None)
    for now, key in enumerate(keys):
        if resident(key):
            hits += 1
            policy.touch(key, now)
            continue
        if on_miss is not None:
            on_miss(key, now)
        if len(policy) >= capacity:
            policy.evict()
            evictions += 1
        policy.insert(key, now)
    return hits, evictions


def _use_c(policy: object, impl: str, policy_kwargs: dict[str, Any]) -> bool:
    """Whether this demand-fill replay runs the C twin (``impl``: "auto", "c" or "py")."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "py":
        return False
    fits = isinstance(policy, str) and policy in _fast.FAST_POLICIES and (
        not policy_kwargs or policy in ("s3fifo", "opt"))
    if impl == "c":
        if not _fast.AVAILABLE:
            raise RuntimeError("impl='c': firmware_model._fastreplay_c is not built "
                               "(python -m firmware_model._fast_build)")
        if not fits:
            raise ValueError(f"impl='c': no C replay for policy {policy!r} with options "
                             f"{sorted(policy_kwargs)}; C replays {', '.join(_fast.FAST_POLICIES)}")
    return fits and _fast.AVAILABLE


def replays_in_c(policy: str) -> bool:
    """Whether ``impl="auto"`` replays ``policy`` (without options) on the C twin here."""
    return _use_c(policy, "auto", {})


def opt_hit_count(keys: Sequence[Hashable] | np.ndarray, capacity: int, *, impl: str = "auto") -> int:
    """Belady's demand-fill hits on ``keys`` at ``capacity``: the bound every policy is scored by."""
    if _use_c("opt", impl, {}):
        return _fast.fast_hits("opt", keys, capacity)[0]
    keys = keys.tolist() if isinstance(keys, np.ndarray) else keys
    return count_hits(make_policy("opt", capacity, future=keys), keys, capacity)[0]


def replay_keys(keys: Sequence[Hashable] | np.ndarray, policy: str, capacity: int, *,
                cost: TransferCost | None = None, compute_ns: int = 0,
                policy_kwargs: dict[str, Any] | None = None, with_opt: bool = True,
                impl: str = "auto") -> ReplayResult:
    """Demand-fill replay of the block keys alone (a list, or an integer array as a binary trace
    holds them); see :func:`replay`."""
    check_capacity(capacity)
    kwargs = dict(policy_kwargs or {})
    use_c = _use_c(policy, impl, kwargs)
    seq: Sequence[Hashable] | np.ndarray
    if use_c or isinstance(keys, np.ndarray):
        seq, n_ids = _fast.dense_ids(keys)
        unique = int(np.count_nonzero(np.bincount(seq, minlength=n_ids))) if len(seq) else 0
    else:
        seq, unique = keys, len(set(keys))
    if use_c:
        hits, evictions, _ = _fast.fast_hits(policy, seq, capacity, **kwargs)
    else:
        py_keys: Sequence[Hashable] = seq.tolist() if isinstance(seq, np.ndarray) else seq
        if policy == "opt":
            kwargs.setdefault("future", py_keys)
        hits, evictions = count_hits(make_policy(policy, capacity, **kwargs), py_keys, capacity)
    opt_hits = opt_hit_count(seq, capacity, impl="py" if impl == "py" else "auto") if with_opt else 0
    n = len(keys)
    misses = n - hits
    miss_ns = cost.read_ns(cost.block_bytes) if cost is not None else 0
    stall = round(misses * miss_ns)
    return ReplayResult(policy=policy, capacity=capacity, accesses=n, hits=hits, misses=misses,
                        opt_hits=opt_hits, evictions=evictions, unique_blocks=unique, stall_ns=stall,
                        sim_ns=n * compute_ns + stall)


def replay(trace: Sequence[Access], policy: str, capacity: int, *,
           cost: TransferCost | None = None, compute_ns: int = 0, prefetch: bool = False,
           policy_kwargs: dict[str, Any] | None = None, with_opt: bool = True,
           impl: str = "auto") -> ReplayResult:
    """Replay ``trace`` under ``policy`` with ``capacity`` resident blocks.

    ``prefetch`` needs ``cost``: the replayer then feeds the host hints of the trace's own
    (step, sequence, layer) progress points to a :class:`~firmware_model.prefetch.PrefetchQueue`
    (see :func:`firmware_model.prefetch_replay.replay_with_prefetch`). ``with_opt=False`` skips
    the OPT pass (``opt_hits`` stays 0), e.g. to time the policy alone. ``impl``: demand fill of
    ``lru``, ``lfu``, ``arc``, ``s3fifo`` and ``opt`` runs their C twins when built (``"auto"``), always
    (``"c"``) or never (``"py"``): the same hits either way.
    """
    check_capacity(capacity)
    if not prefetch:
        return replay_keys([a.block for a in trace], policy, capacity, cost=cost, compute_ns=compute_ns,
                           policy_kwargs=policy_kwargs, with_opt=with_opt, impl=impl)
    if policy == "opt":
        raise ValueError("policy 'opt' scores demand fill (it needs the exact access sequence): "
                         "replay it without prefetch")
    if cost is None:
        raise ValueError("prefetch replay needs a transfer cost model (cost=TransferCost(...))")
    result = replay_with_prefetch(trace, make_policy(policy, capacity, **(policy_kwargs or {})),
                                  capacity, cost=cost, compute_ns=compute_ns)
    result.opt_hits = opt_hit_count([a.block for a in trace], capacity) if with_opt else 0
    return result
