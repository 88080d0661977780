"""Eviction policies behind one protocol, and a factory by name.

Every policy implements :class:`EvictionPolicy` (``insert / touch / remove / evict(protected)``).
``opt`` (Belady) is offline: it needs ``future=`` (the whole access sequence) and is meant for
scoring, not for running a cache.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from firmware_model.policies.arc import ARCPolicy
from firmware_model.policies.base import EvictionPolicy, NoVictimError
from firmware_model.policies.hotness import HotnessPolicy
from firmware_model.policies.lfu import LFUPolicy
from firmware_model.policies.lru import LRUPolicy
from firmware_model.policies.opt import BeladyPolicy, next_use_positions
from firmware_model.policies.reuse import ReusePolicy
from firmware_model.policies.s3fifo import S3FIFOPolicy

__all__ = [
    "ONLINE_POLICY_NAMES",
    "POLICY_NAMES",
    "ARCPolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "HotnessPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "NoVictimError",
    "ReusePolicy",
    "S3FIFOPolicy",
    "make_policy",
    "next_use_positions",
]

_FACTORIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "hotness": HotnessPolicy,
    "reuse": ReusePolicy,
    "opt": BeladyPolicy,
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
"""Every policy ``make_policy`` knows, online ones first and ``"opt"`` last."""

ONLINE_POLICY_NAMES: tuple[str, ...] = tuple(n for n in POLICY_NAMES if n != "opt")
"""The policies that can run a cache (everything but the offline oracle)."""


def make_policy(name: str, capacity: int, **kwargs: Any) -> EvictionPolicy:
    """Build the policy called ``name`` for ``capacity`` blocks; ``kwargs`` go to its constructor.

    Raises ``ValueError`` naming the known policies for an unknown name, and for ``"opt"``
    without ``future=``.
    """
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICY_NAMES)}") from None
    if name == "opt" and "future" not in kwargs:
        raise ValueError("policy 'opt' is offline: pass future=<the whole access sequence>")
    return factory(capacity, **kwargs)
