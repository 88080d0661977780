"""Hotness-aware eviction for KV blocks: attention sinks + a recent window + heavy hitters.

The StreamingLLM and H2O observations, as an eviction policy over block keys:

* **sinks** — blocks attention always returns to (the first tokens). Hinted by the host
  (:meth:`hint_sink`) or given up front; evicted only when nothing else can go.
* **recent window** — blocks inserted by the last ``window`` insertions (the newest tokens); new
  blocks have no history yet, so they are kept until they have had a chance to earn heat.
* **heavy hitters** — everything else is ranked by heat: one unit per access, plus whatever the
  hotness unit (a CHMU hotlist, :meth:`feed_hotlist`) or the host (:meth:`hint_heat`, e.g. summed
  attention mass) adds. Heat is integer and halves every ``cooling`` accesses (HeMem-style cooling),
  and is remembered for a bounded number of evicted keys so a returning heavy hitter keeps its rank.

The victim is the coldest candidate; among equally cold ones, the most recently used. That tie
rule is what makes the policy safe on a KV layer loop: each block is used once per pass, so every
block is equally hot, and the block just used is the one needed furthest in the future (LRU evicts
exactly the wrong one there and gets no hits at all once the loop exceeds the capacity).

How accesses, hints and cooling turn into heat is a seam of its own, the :class:`HeatScorer`
protocol: ``HotnessPolicy(capacity, scorer="package.module:Class")`` (or the class, a
factory, or an instance) replaces the default counting (:class:`CountingScorer`: +1 per access,
+count per hint, halve on cooling) while the sinks, the window, the heap and the tie rule stay.
"""
from __future__ import annotations

import heapq
import inspect
import itertools
import math
import numbers
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Hashable, Iterable
from typing import Any, Protocol, runtime_checkable

from firmware_model.policies.base import (
    NoVictimError,
    PolicyProtocolError,
    check_capacity,
    duplicate,
    import_spec,
    missing,
    spec_label,
)

__all__ = ["SCORER_METHODS", "CountingScorer", "HeatScorer", "HotnessPolicy", "ScorerSpec", "resolve_scorer"]


@runtime_checkable
class HeatScorer(Protocol):
    """How :class:`HotnessPolicy` turns what it observes into the heat that orders eviction.

    Each method gets a key's current heat and returns its new heat, a number (int or float;
    the coldest goes first, ties to the most recently used). Decisions must depend on the
    arguments only (no random draw, no wall clock, no ``hash(key)``), so replays repeat.
    """

    def access(self, key: Hashable, heat: Any, now: int) -> Any:
        """``key`` was accessed at ``now``: inserted (``heat`` is what was remembered of it, 0 if
        nothing) or touched."""

    def hint(self, key: Hashable, heat: Any, amount: int) -> Any:
        """A hotlist count or a host hint of ``amount`` (> 0) for ``key`` (resident or not)."""

    def cool(self, key: Hashable, heat: Any) -> Any:
        """Every ``cooling`` accesses, for every resident and remembered key."""


class CountingScorer:
    """The default: one unit per access, the count of a hint, halved on cooling (integers)."""

    def access(self, key: Hashable, heat: int, now: int) -> int:
        return heat + 1

    def hint(self, key: Hashable, heat: int, amount: int) -> int:
        return heat + amount

    def cool(self, key: Hashable, heat: int) -> int:
        return heat >> 1


ScorerSpec = str | type | Callable[[], HeatScorer] | HeatScorer
"""What names a scorer: ``"package.module:Class"`` (or ``:factory``), the class, a factory
``f()`` returning one, or an instance."""

#: Each method a scorer needs, the arguments the policy passes, and the signature expected.
SCORER_METHODS: dict[str, tuple[int, str]] = {
    "access": (3, "access(self, key, heat, now) -> heat"),
    "hint": (3, "hint(self, key, heat, amount) -> heat"),
    "cool": (2, "cool(self, key, heat) -> heat"),
}


def _scorer_problems(obj: object) -> list[str]:
    problems = []
    for method, (nargs, expected) in SCORER_METHODS.items():
        attr = getattr(obj, method, None)
        if attr is None:
            problems.append(f"no method {method} (expected {expected})")
            continue
        if not callable(attr):
            problems.append(f"{method} is not callable (expected {expected})")
            continue
        try:
            sig = inspect.signature(attr)
        except (TypeError, ValueError):
            continue
        # read from a class, a plain function still takes self (a classmethod or staticmethod not)
        takes_self = (isinstance(obj, type) and not inspect.ismethod(attr)
                      and not isinstance(inspect.getattr_static(obj, method), staticmethod))
        try:
            sig.bind(*(None,) * (nargs + takes_self))
        except TypeError:
            bare = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                           for p in sig.parameters.values()],
                               return_annotation=inspect.Signature.empty)
            problems.append(f"{method}{bare} cannot be called as {expected.split(' ->')[0]} (expected {expected})")
    return problems


def resolve_scorer(spec: ScorerSpec) -> HeatScorer:
    """The scorer ``spec`` names (see :data:`ScorerSpec`), built and checked against
    :class:`HeatScorer`.

    Raises ``ValueError`` for a malformed name or a module that does not import, and
    :class:`~firmware_model.policies.PolicyProtocolError` (a ``TypeError`` and a ``ValueError``)
    for one that lacks a method or takes the wrong arguments, naming each and the signature
    expected (a class is built with no arguments).
    """
    obj: object = import_spec(spec, "heat scorer", "'package.module:Class'") if isinstance(spec, str) else spec
    label = spec_label(spec)
    if not isinstance(obj, type) and not _scorer_problems(obj):
        return obj  # type: ignore[return-value]  # an instance
    if isinstance(obj, type):
        problems = _scorer_problems(obj)
        if problems:
            raise _refuse_scorer(label, problems)
    if not callable(obj):
        raise _refuse_scorer(label, _scorer_problems(obj))
    try:
        inspect.signature(obj).bind()
    except TypeError:
        built_as = f"{getattr(obj, '__name__', 'f')}{inspect.signature(obj)}"
        raise _refuse_scorer(label, [(f"{built_as} cannot be built with no arguments (expected a class "
                                      "Scorer() or a factory f() -> scorer)")]) from None
    except ValueError:
        pass
    built = obj()
    problems = _scorer_problems(built)
    if problems:
        raise _refuse_scorer(label, problems)
    return built  # type: ignore[no-any-return]


def _refuse_scorer(label: str, problems: list[str]) -> PolicyProtocolError:
    return PolicyProtocolError(f"heat scorer {label} does not fit the HeatScorer protocol "
                               f"(firmware_model.policies.hotness): {'; '.join(problems)}")


class _CheckedScorer:
    """A user's scorer whose every result is checked to be a number (heat orders the heap)."""

    __slots__ = ("label", "scorer")

    def __init__(self, scorer: HeatScorer, label: str) -> None:
        self.scorer, self.label = scorer, label

    def _checked(self, method: str, got: Any) -> Any:
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or math.isnan(got):
            raise PolicyProtocolError(f"heat scorer {self.label}: {method} returned {got!r}: expected a "
                                      f"number (int or float, not NaN), the key's new heat")
        return got

    def access(self, key: Hashable, heat: Any, now: int) -> Any:
        return self._checked("access", self.scorer.access(key, heat, now))

    def hint(self, key: Hashable, heat: Any, amount: int) -> Any:
        return self._checked("hint", self.scorer.hint(key, heat, amount))

    def cool(self, key: Hashable, heat: Any) -> Any:
        return self._checked("cool", self.scorer.cool(key, heat))


class HotnessPolicy:
    """Sinks and a recent window are kept; the coldest (then most recently used) other key goes."""

    name = "hotness"

    def __init__(self, capacity: int, window: int = -1, cooling: int = 0,
                 history: int = 0, sinks: Iterable[Hashable] = (), scorer: ScorerSpec | None = None) -> None:
        """``window``: recent blocks kept (-1 = capacity // 8); ``cooling``: accesses between
        halvings of every heat (0 = 8 x capacity); ``history``: evicted keys whose heat is
        remembered (0 = 4 x capacity); ``scorer``: what turns accesses, hints and cooling into
        heat (:class:`HeatScorer`; None = :class:`CountingScorer`, inlined)."""
        self.capacity = check_capacity(capacity)
        self.window = capacity // 8 if window < 0 else window
        if self.window >= capacity:
            raise ValueError(f"window ({self.window}) must be smaller than capacity ({capacity})")
        if cooling < 0 or history < 0:
            raise ValueError(f"cooling and history must be >= 0 (0 = default), got {cooling}, {history}")
        self.cooling = cooling or 8 * capacity
        self.history = history or 4 * capacity
        self._sinks: set[Hashable] = set(sinks)
        self._scorer = None if scorer is None else _CheckedScorer(resolve_scorer(scorer), spec_label(scorer))
        self._heat: dict[Hashable, int] = {}        # resident key -> heat
        self._last: dict[Hashable, int] = {}        # resident key -> tick of last access
        self._births: OrderedDict[Hashable, int] = OrderedDict()  # residents -> insertion number, oldest first
        self._inserted = 0
        # Keys in the window stay out of the heap (they cannot be victims); they enter it when
        # later insertions push them out of the window.
        self._window_keys: deque[tuple[int, Hashable]] = deque()
        self._ghost_heat: OrderedDict[Hashable, int] = OrderedDict()  # evicted keys -> heat
        self._heap: list[tuple[int, int, Hashable]] = []  # (heat, -last, key)
        self._ticks = itertools.count(1)
        self._tick = 0

    # -- hints --------------------------------------------------------------------------------
    def hint_sink(self, key: Hashable) -> None:
        """Mark ``key`` as an attention sink (resident now or later)."""
        self._sinks.add(key)

    def hint_heat(self, key: Hashable, amount: int) -> None:
        """Add ``amount`` of heat to ``key`` (resident or not), e.g. its attention mass x 100."""
        if amount < 0:
            raise ValueError(f"heat hints must be >= 0, got {amount}")
        if amount == 0:
            return
        scorer = self._scorer
        if key in self._heat:
            if scorer is None:
                self._heat[key] += int(amount)
            else:
                self._heat[key] = scorer.hint(key, self._heat[key], int(amount))
            self._push(key)
        elif scorer is None:
            self._remember(key, self._ghost_heat.pop(key, 0) + int(amount))
        else:
            self._remember(key, scorer.hint(key, self._ghost_heat.pop(key, 0), int(amount)))

    def feed_hotlist(self, entries: Iterable[tuple[Hashable, int]]) -> None:
        """Add the counts of a hotness-unit hotlist, ``(key, count)`` pairs."""
        for key, count in entries:
            self.hint_heat(key, count)

    def heat(self, key: Hashable) -> int:
        """Current heat of a resident or remembered key (0 if unknown)."""
        return self._heat.get(key, self._ghost_heat.get(key, 0))

    # -- the policy protocol ------------------------------------------------------------------
    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self._heat:
            raise duplicate(self.name, key)
        remembered = self._ghost_heat.pop(key, 0)
        self._heat[key] = remembered + 1 if self._scorer is None else self._scorer.access(key, remembered, now)
        self._inserted += 1
        self._births[key] = self._inserted
        self._window_keys.append((self._inserted, key))
        self._access(key)

    def touch(self, key: Hashable, now: int = 0) -> None:
        if key not in self._heat:
            raise missing(self.name, key)
        if self._scorer is None:
            self._heat[key] += 1
        else:
            self._heat[key] = self._scorer.access(key, self._heat[key], now)
        self._access(key)

    def remove(self, key: Hashable) -> None:
        if key not in self._heat:
            raise missing(self.name, key)
        self._forget(key)

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        window_start = self._admit_exited()
        births = self._births
        skipped: list[tuple[int, int, Hashable]] = []
        victim = None
        while self._heap and victim is None:
            item = heapq.heappop(self._heap)
            heat, neg_last, key = item
            if self._heat.get(key) != heat or self._last.get(key) != -neg_last:
                continue  # stale
            skipped.append(item)
            if births[key] <= window_start and key not in protected and key not in self._sinks:
                victim = key
        for item in skipped:
            heapq.heappush(self._heap, item)
        if victim is None:  # only the window and sinks are left: oldest-born window key, then sinks
            victim = next((k for k in self._births if k not in protected and k not in self._sinks),
                          next((k for k in self._births if k not in protected), None))
        if victim is None:
            raise NoVictimError(f"hotness: all {len(self._heat)} resident keys are protected")
        self._remember(victim, self._heat[victim])
        self._forget(victim)
        return victim

    # -- internals ----------------------------------------------------------------------------
    def _access(self, key: Hashable) -> None:
        self._tick = next(self._ticks)
        self._last[key] = self._tick
        self._push(key)
        if self._tick % self.cooling == 0:
            self._cool()

    def _admit_exited(self) -> int:
        """Put keys that left the window into the heap; returns the window's first-excluded number."""
        window_start = self._inserted - self.window  # insertion numbers above it are in the window
        while self._window_keys and self._window_keys[0][0] <= window_start:
            number, key = self._window_keys.popleft()
            if self._births.get(key) == number:
                heapq.heappush(self._heap, (self._heat[key], -self._last[key], key))
        return window_start

    def _in_window(self, key: Hashable) -> bool:
        return self._births[key] > self._inserted - self.window

    def _push(self, key: Hashable) -> None:
        if self._in_window(key):
            return
        heapq.heappush(self._heap, (self._heat[key], -self._last[key], key))
        if len(self._heap) > 4 * len(self._heat) + 64:
            self._rebuild()

    def _cool(self) -> None:
        """Halve every heat (resident and remembered; the scorer's ``cool``): old popularity fades."""
        scorer = self._scorer
        if scorer is None:
            self._heat = {k: h >> 1 for k, h in self._heat.items()}
            for k in self._ghost_heat:
                self._ghost_heat[k] >>= 1
        else:
            self._heat = {k: scorer.cool(k, h) for k, h in self._heat.items()}
            for k in self._ghost_heat:
                self._ghost_heat[k] = scorer.cool(k, self._ghost_heat[k])
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(h, -self._last[k], k) for k, h in self._heat.items() if not self._in_window(k)]
        heapq.heapify(self._heap)

    def _remember(self, key: Hashable, heat: int) -> None:
        self._ghost_heat[key] = heat
        self._ghost_heat.move_to_end(key)
        while len(self._ghost_heat) > self.history:
            self._ghost_heat.popitem(last=False)

    def _forget(self, key: Hashable) -> None:
        del self._heat[key]
        del self._last[key]
        del self._births[key]

    def __contains__(self, key: object) -> bool:
        return key in self._heat

    def __len__(self) -> int:
        return len(self._heat)
