"""Eviction policies behind one protocol, and a factory by name.

Every policy implements :class:`EvictionPolicy` (``insert / touch / remove / evict(protected)``).
Wherever a policy is named, a class of your own is too: ``"package.module:Class"`` or the class
itself, checked against the protocol (:func:`resolve_policy`); ``firmware_model.testing``
checks its behaviour.
``opt`` (Belady) is offline: it needs ``future=`` (the whole access sequence) and is meant for
scoring, not for running a cache.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from firmware_model.policies.arc import ARCPolicy
from firmware_model.policies.base import (
    EvictionPolicy,
    NoVictimError,
    PolicyProtocolError,
    check_capacity,
    check_policy_class,
    check_policy_instance,
)
from firmware_model.policies.hotness import HotnessPolicy
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
    "DecayedLFUPolicy",
    "EvictionPolicy",
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
    if isinstance(spec, str):
        return spec
    if not hasattr(spec, "__qualname__"):
        return repr(spec)
    return f"{getattr(spec, '__module__', '?')}:{spec.__qualname__}"


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
    if not callable(obj):
        raise PolicyProtocolError(f"eviction policy {label} is {obj!r}: expected a class (or a factory "
                                  f"f(capacity, **options)) implementing the EvictionPolicy protocol")
    return obj


def _import_policy(spec: str) -> object:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"eviction policy {spec!r}: expected 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the user's module raised while importing
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            hint = " (put the directory that holds it on PYTHONPATH)"
        raise ValueError(f"cannot import eviction policy {spec!r}: importing module {module_name!r} "
                         f"failed: {type(exc).__name__}: {exc}{hint}") from exc
    obj: object = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"cannot import eviction policy {spec!r}: module {module_name!r} "
                             f"({getattr(module, '__file__', '?')}) has no attribute {attr_path!r}") from None
    return obj


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
    return check_policy_instance(factory(capacity, **kwargs), policy_label(spec))
