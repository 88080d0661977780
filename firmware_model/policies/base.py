"""The one seam every eviction policy sits behind.

The shape follows vLLM's offloading policy API (``insert / touch / remove / evict(protected)``) and
LMCache's (``update_on_put / update_on_hit / update_on_force_evict / get_evict_candidates``): the
cache owner decides *when* something becomes resident or leaves, the policy only keeps order and
answers "who goes next". ``protected`` carries the keys the caller must not lose right now (pinned
blocks, blocks of the step being computed), so a policy never has to know about pins.

Times (``now``) are simulated integers supplied by the caller; no policy reads a clock.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Container, Hashable
from typing import Protocol, TypeVar, runtime_checkable

__all__ = [
    "PROTOCOL_METHODS",
    "EvictionPolicy",
    "NoVictimError",
    "PolicyProtocolError",
    "check_capacity",
    "check_policy_class",
    "check_policy_factory",
    "check_policy_instance",
    "import_spec",
    "spec_label",
]


class NoVictimError(LookupError):
    """Every resident key is protected (or nothing is resident): no victim can be chosen."""


@runtime_checkable
class EvictionPolicy(Protocol):
    """Order of resident keys and the choice of the next victim.

    A class of your own that has these members plugs in wherever a policy is named
    (``"module:Class"``, see ``firmware_model.policies.resolve_policy``), built as
    ``Class(capacity)``; :func:`check_policy_class` says what it lacks, and
    ``firmware_model.testing.check_policy`` checks how it behaves.
    """

    name: str  # a label for reports

    def insert(self, key: Hashable, now: int = 0) -> None:
        """``key`` became resident (after a miss, a prefetch, or a store)."""

    def touch(self, key: Hashable, now: int = 0) -> None:
        """A resident ``key`` was accessed (a hit)."""

    def remove(self, key: Hashable) -> None:
        """``key`` left for a reason other than :meth:`evict` (freed, invalidated)."""

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        """Choose a resident key not in ``protected``, forget it, and return it.

        Raises :class:`NoVictimError` (a ``LookupError``) when there is none.
        """

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


def spec_label(spec: object) -> str:
    """The name reports use for a plug-in ``spec``: the string as given, ``module:name`` for a
    class or function, ``repr`` for anything else."""
    if isinstance(spec, str):
        return spec
    if not hasattr(spec, "__qualname__"):
        return repr(spec)
    return f"{getattr(spec, '__module__', '?')}:{spec.__qualname__}"


def import_spec(spec: str, kind: str = "eviction policy", form: str = "'package.module:Class'") -> object:
    """The object ``"package.module:attr"`` names (``attr`` may be dotted), imported from ``sys.path``.

    The one loader behind every plug-in point (eviction policies, prefetch window functions, heat
    scorers). Raises ``ValueError`` naming ``kind``, the spec, the module and the reason: a
    malformed spec (expected ``form``), a module that does not import (with a PYTHONPATH hint when
    the module is not found), a missing attribute.
    """
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{kind} {spec!r}: expected {form}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the user's module raised while importing
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            hint = " (put the directory that holds it on PYTHONPATH)"
        raise ValueError(f"cannot import {kind} {spec!r}: importing module {module_name!r} "
                         f"failed: {type(exc).__name__}: {exc}{hint}") from exc
    obj: object = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"cannot import {kind} {spec!r}: module {module_name!r} "
                             f"({getattr(module, '__file__', '?')}) has no attribute {attr_path!r}") from None
    return obj


def check_capacity(capacity: int) -> int:
    """Validate a policy capacity (in blocks); returns it."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive number of blocks, got {capacity!r}")
    return capacity


def missing(policy_name: str, key: Hashable) -> KeyError:
    """The error every policy raises when asked to touch or remove a key it does not hold."""
    return KeyError(f"{policy_name}: key {key!r} is not resident (insert it before touch/remove)")


def duplicate(policy_name: str, key: Hashable) -> KeyError:
    """The error every policy raises when a resident key is inserted again."""
    return KeyError(f"{policy_name}: key {key!r} is already resident (use touch for a hit)")


class PolicyProtocolError(TypeError, ValueError):
    """A class (or factory) named as an eviction policy does not fit :class:`EvictionPolicy`
    (or a prefetch window function or heat scorer does not fit its protocol).

    A ``TypeError`` (the object has the wrong shape) that is also a ``ValueError``, so every caller
    that validates a policy *name* (the CLI, ``CxlCache``) reports it as it reports an unknown name.
    """


#: What cxlemu's callers rely on (replay, prefetch replay, the KV engine): each method, the
#: argument lists they call it with, and the signature a policy should declare.
PROTOCOL_METHODS: dict[str, tuple[tuple[tuple[object, ...], ...], str]] = {
    "insert": (((0, 0),), "insert(self, key, now=0) -> None"),
    "touch": (((0, 0),), "touch(self, key, now=0) -> None"),
    "remove": (((0,),), "remove(self, key) -> None"),
    "evict": (((), ((),)), "evict(self, protected=()) -> key, raising NoVictimError when none"),
    "__contains__": (((0,),), "__contains__(self, key) -> bool"),
    "__len__": (((),), "__len__(self) -> int"),
}
#: Called when present: ``on_miss(key, now)`` before the evict that makes room for ``key``.
OPTIONAL_METHODS: dict[str, tuple[tuple[tuple[object, ...], ...], str]] = {
    "on_miss": (((0, 0),), "on_miss(self, key, now=0) -> None"),
}
CONSTRUCTOR = "__init__(self, capacity, **options)"


def _signature(obj: object) -> inspect.Signature | None:
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    bare = inspect.Parameter.empty  # shown in messages as the parameters alone
    return sig.replace(parameters=[p.replace(annotation=bare) for p in sig.parameters.values()],
                       return_annotation=bare)


def _method_problems(cls: type, method: str, calls: tuple[tuple[object, ...], ...], expected: str,
                     required: bool) -> list[str]:
    attr = getattr(cls, method, None)
    if attr is None:
        return [f"no method {method} (expected {expected})"] if required else []
    if not callable(attr):
        return [f"{method} is not callable (expected {expected})"]
    sig = _signature(attr)
    if sig is None:
        return []
    # a plain function or a slot wrapper read from the class still takes self; a bound
    # classmethod and a staticmethod do not
    takes_self = not inspect.ismethod(attr) and not isinstance(inspect.getattr_static(cls, method), staticmethod)
    for args in calls:
        try:
            sig.bind(*((None,) if takes_self else ()), *args)
        except TypeError:
            shown = ", ".join(["self", *("protected" if method == "evict" else ("key", "now")[i]
                                         for i in range(len(args)))])
            return [f"{method}{sig} cannot be called as {method}({shown}) (expected {expected})"]
    return []


def _shape_problems(cls: type) -> list[str]:
    problems: list[str] = []
    for table, required in ((PROTOCOL_METHODS, True), (OPTIONAL_METHODS, False)):
        for method, (calls, expected) in table.items():
            problems += _method_problems(cls, method, calls, expected, required)
    name = getattr(cls, "name", "")
    if not isinstance(name, str):
        problems.append(f"its name is {name!r}, not a str (expected name = \"a label for reports\")")
    return problems


def protocol_summary() -> str:
    """What a policy must be, in one sentence: the class, its members and its constructor, or a factory."""
    members = "; ".join(expected for _, expected in PROTOCOL_METHODS.values())
    return (f"a class implementing EvictionPolicy (firmware_model.policies.base) with name: str; {members}; "
            f"built as {CONSTRUCTOR}, or a factory f(capacity, **options) returning one")


def check_policy_factory(factory: object, label: str) -> object:
    """Refuse a non-class object named as a policy that cannot be called as ``factory(capacity)``
    (a module, a constant, a function taking other arguments), saying what a policy must be;
    returns ``factory``. A callable without a readable signature passes: what it builds is
    checked by :func:`check_policy_instance`."""
    if not callable(factory):
        raise PolicyProtocolError(f"eviction policy {label} is {factory!r}, not callable: expected "
                                  f"{protocol_summary()}")
    sig = _signature(factory)
    if sig is not None:
        try:
            sig.bind(1)
        except TypeError:
            raise PolicyProtocolError(f"eviction policy {label} is {factory!r}, which cannot be called as "
                                      f"f(capacity) (its signature is {sig}): expected {protocol_summary()}") from None
    return factory


def _refuse(label: str, problems: list[str]) -> PolicyProtocolError:
    return PolicyProtocolError(f"eviction policy {label} does not fit the EvictionPolicy protocol "
                               f"(firmware_model.policies.base): {'; '.join(problems)}")


def check_policy_class(cls: type, label: str | None = None) -> type:
    """Refuse a class that does not fit :class:`EvictionPolicy`, naming every missing piece.

    Checks what can be checked without building one: the methods of :data:`PROTOCOL_METHODS`
    exist, are callable and accept the arguments cxlemu passes; an ``on_miss`` hook, if any, too;
    the constructor takes ``capacity`` (one positional int); a class attribute ``name``, if any, is
    a str (an instance's is checked by :func:`check_policy_instance`). Returns ``cls``.
    """
    label = label or f"{cls.__module__}:{cls.__qualname__}"
    problems: list[str] = []
    sig = _signature(cls)
    if sig is not None:
        try:
            sig.bind(1)
        except TypeError:
            problems.append(f"its constructor {cls.__name__}{sig} does not take capacity "
                            f"(expected {CONSTRUCTOR})")
    problems += _shape_problems(cls)
    if problems:
        raise _refuse(label, problems)
    return cls


_P = TypeVar("_P")


def check_policy_instance(policy: _P, label: str) -> _P:
    """Refuse a built policy that lacks a protocol method or a str ``name``; returns ``policy``."""
    problems = _shape_problems(type(policy))
    name = getattr(policy, "name", None)
    if not isinstance(name, str) and not problems:
        problems.append(f"it has no str attribute name (expected name = \"a label for reports\", got {name!r})")
    if problems:
        raise _refuse(label, problems)
    return policy
