"""Eviction policies behind one protocol, and a factory by name.

Every policy implements :class:`EvictionPolicy` (``insert / touch / remove / evict(protected)``).
Wherever a policy is named, a class of your own is too: ``"package.module:Class"`` or the class
itself, checked against the protocol (:func:`resolve_policy`); ``firmware_model.testing``
checks its behaviour. The hotness policy's heat scoring plugs in the same way
(``make_policy("hotness", capacity, scorer="package.module:Class")``, see
:func:`~firmware_model.policies.hotness.resolve_scorer`), as does the prefetch window
(:func:`firmware_model.prefetch.resolve_window`); all three load through
:func:`~firmware_model.policies.base.import_spec`.
``opt`` (Belady) is offline: it needs ``future=`` (the whole access sequence) and is meant for
scoring, not for running a cache.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from firmware_model.policies.arc import ARCPolicy
from firmware_model.policies.base import (
    EvictionPolicy,
    NoVictimError,
    PolicyProtocolError,
    check_capacity,
    check_policy_class,
    check_policy_factory,
    check_policy_instance,
    import_spec,
    protocol_summary,
    spec_label,
)
from firmware_model.policies.hotness import (
    CountingScorer,
    HeatScorer,
    HotnessPolicy,
    resolve_scorer,
)
from firmware_model.policies.lfu import DecayedLFUPolicy, LFUPolicy
from firmware_model.policies.lru import LRUPolicy
from firmware_model.policies.opt import BeladyPolicy, next_use_positions
from firmware_model.policies.reuse import ReusePolicy
from firmware_model.policies.s3fifo import S3FIFOPolicy

__all__ = [
    "ONLINE_POLICY_NAMES",
    "POLICY_NAMES",
    "ARCPolicy",
    "BeladyPolicy",
    "CountingScorer",
    "DecayedLFUPolicy",
    "EvictionPolicy",
    "HeatScorer",
    "HotnessPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "NoVictimError",
    "PolicyProtocolError",
    "PolicySpec",
    "ReusePolicy",
    "S3FIFOPolicy",
    "make_policy",
    "next_use_positions",
    "policy_label",
    "resolve_policy",
    "resolve_scorer",
]

_FACTORIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "lfu-decay": DecayedLFUPolicy,
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


PolicySpec = str | type | Callable[..., EvictionPolicy]
"""What names a policy: a built-in name (``"lru"``), ``"package.module:Class"`` (a class of your
own, importable from ``sys.path``), or the class (or a factory ``f(capacity, **options)``) itself."""


def policy_label(spec: PolicySpec) -> str:
    """The name reports use for ``spec``: the string as given, ``module:Class`` for a class."""
    return spec_label(spec)


def resolve_policy(spec: PolicySpec) -> Callable[..., EvictionPolicy]:
    """What builds the policy ``spec`` names (see :data:`PolicySpec`), checked against the protocol.

    Every place that takes a policy resolves it here: :func:`make_policy`, ``cxlemu trace replay
    --policy``, ``cxlemu bench kv --policy``, ``CxlCache(policy=...)``. Raises ``ValueError``
    for an unknown name or a module path that does not import (naming the module and the reason),
    and :class:`~firmware_model.policies.base.PolicyProtocolError` (a ``TypeError`` and a
    ``ValueError``) for a class that does not fit, naming each missing piece and the signature
    expected.
    """
    if isinstance(spec, str):
        factory = _FACTORIES.get(spec)
        if factory is not None:
            return factory
        if ":" not in spec:
            raise ValueError(f"unknown eviction policy {spec!r}: choose one of {', '.join(POLICY_NAMES)}, "
                             "or name your own class as 'package.module:Class'")
        obj = _import_policy(spec)
    else:
        obj = spec
    label = policy_label(spec)
    if isinstance(obj, type):
        return check_policy_class(obj, label)
    return check_policy_factory(obj, label)  # type: ignore[return-value]


def _import_policy(spec: str) -> object:
    return import_spec(spec, "eviction policy", "'package.module:Class'")


def make_policy(spec: PolicySpec, capacity: int, **kwargs: Any) -> EvictionPolicy:
    """Build the policy ``spec`` names (:func:`resolve_policy`) for ``capacity`` blocks; ``kwargs``
    go to its constructor.

    Raises ``ValueError`` naming the known policies for an unknown name, for a module path that
    does not import, for a class that does not fit the protocol, and for ``"opt"`` without
    ``future=``.
    """
    factory = resolve_policy(spec)
    if spec == "opt" and "future" not in kwargs:
        raise ValueError("policy 'opt' is offline: pass future=<the whole access sequence>")
    if isinstance(spec, str) and spec in _FACTORIES:
        return factory(capacity, **kwargs)
    check_capacity(capacity)
    label = policy_label(spec)
    try:
        built = factory(capacity, **kwargs)
    except TypeError as exc:  # a callable that takes one argument but is no policy factory (os:getenv)
        raise PolicyProtocolError(f"eviction policy {label}: calling it as f({capacity}) raised TypeError: {exc}; "
                                  f"expected {protocol_summary()}") from exc
    return check_policy_instance(built, label)
