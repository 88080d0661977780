"""Conformance kit: the invariants every eviction policy must hold, for your own pytest.

    from firmware_model.testing import check_policy

    def test_my_policy_conforms():
        check_policy("mymod:Clock")        # or the class itself; raises PolicyConformanceError

The kit builds the policy through :func:`~firmware_model.policies.resolve_policy` (so the protocol
check comes first), drives it the way cxlemu's callers do — the KV engine's
``insert / touch / remove / evict(protected)``, replay's demand fill (``on_miss`` when the policy
has it, ``evict()`` when full, ``insert``) — with traces hypothesis generates on a simulated clock
(``now`` only ever grows, in steps of 0 to thousands), and checks after every call:

    capacity       never more than ``capacity`` resident; the policy's ``len`` and ``in`` agree
                   with what the caller holds (a victim was resident and is gone, nothing else
                   vanishes or appears)
    protected      ``evict(protected)`` never returns a protected key, and raises
                   ``NoVictimError`` (changing nothing) when every resident key is protected or
                   none is resident; ``protected`` may be any container (only ``in`` is used)
    deterministic  two runs of the same trace choose the same victims, even with keys that hash
                   differently (a decision may depend on the calls and ``now``, never on a set's
                   iteration order, a random draw or the wall clock)
    opt_bound      demand-fill hits (``firmware_model.replay.count_hits``) at or below Belady
                   OPT's on the same keys and capacity

A violation raises :class:`PolicyConformanceError` (an ``AssertionError``) naming the invariant,
the policy, what happened and the operations leading to it (hypothesis shrinks the trace first).
To see each invariant as its own test::

    @pytest.mark.parametrize("invariant", INVARIANTS)
    def test_clock(invariant):
        check_policy("mymod:Clock", invariants=[invariant])

The other two plug-in points have their own checks:

    check_window("mymod:window")   # a prefetch window function: an int in [0, max_window] for
                                   # hypothesis-generated links, point sizes and compute times, and
                                   # the same result for the same arguments
    check_scorer("mymod:Heat")     # a heat scorer: the hotness policy, with it plugged in (and fed
                                   # hotlist counts, host hints and frequent cooling), holds INVARIANTS

Needs ``hypothesis`` (``pip install -e '.[test]'``).
"""
from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - hypothesis is a test dependency
    raise ImportError("firmware_model.testing needs hypothesis: pip install 'hypothesis>=6.100' "
                      "(or pip install -e '.[test]' in the cxlemu checkout)") from exc

from firmware_model.link import LinkParams
from firmware_model.policies import (
    EvictionPolicy,
    NoVictimError,
    PolicySpec,
    policy_label,
    resolve_policy,
)
from firmware_model.policies.base import check_policy_instance, spec_label
from firmware_model.policies.hotness import HotnessPolicy, ScorerSpec, resolve_scorer
from firmware_model.prefetch import WindowSpec, resolve_window
from firmware_model.replay import count_hits, opt_hit_count

__all__ = [
    "INVARIANTS",
    "MAX_CAPACITY",
    "WINDOW_INVARIANTS",
    "Op",
    "PolicyConformanceError",
    "Scenario",
    "check_policy",
    "check_scenario",
    "check_scorer",
    "check_window",
    "scenarios",
]

INVARIANTS: tuple[str, ...] = ("capacity", "protected", "deterministic", "opt_bound")
"""The invariants :func:`check_policy` runs, in order."""

MAX_CAPACITY = 6
"""Largest capacity the generated traces use: small, so evictions and all-protected cases abound."""


class PolicyConformanceError(AssertionError):
    """A policy broke one of the kit's invariants; the message says which, and how."""


@dataclass(frozen=True, slots=True)
class Op:
    """One call on the simulated clock: ``access`` (hit: touch; miss: make room, insert),
    ``remove`` (a resident key leaves) or ``evict`` (the caller frees one block)."""

    kind: str
    key: int
    protected: frozenset[int]
    now: int

    def __str__(self) -> str:
        shown = f" protected={sorted(self.protected)}" if self.protected else ""
        return f"{self.kind}({self.key}){shown} @{self.now}" if self.kind != "evict" else f"evict(){shown} @{self.now}"


@dataclass(frozen=True, slots=True)
class Scenario:
    """A capacity and a sequence of operations on it."""

    capacity: int
    ops: tuple[Op, ...]

    @property
    def keys(self) -> list[int]:
        """The accessed keys in order: the demand-fill trace replayed against OPT."""
        return [op.key for op in self.ops if op.kind == "access"]


@st.composite
def _scenario(draw: Any, max_ops: int) -> Scenario:
    capacity = draw(st.integers(1, MAX_CAPACITY))
    key = st.integers(0, 2 * capacity + 1)  # enough keys to miss, few enough to hit
    kinds = st.sampled_from(("access",) * 6 + ("remove", "evict"))
    steps = st.one_of(st.integers(0, 2), st.integers(0, 5000))
    raw = draw(st.lists(st.tuples(kinds, key, st.frozensets(key, max_size=capacity + 1), steps),
                        max_size=max_ops))
    now, ops = 0, []
    for kind, k, protected, step in raw:
        now += step
        ops.append(Op(kind, k, protected, now))
    return Scenario(capacity, tuple(ops))


def scenarios(max_ops: int = 60) -> st.SearchStrategy[Scenario]:
    """The kit's hypothesis strategy: capacities 1..:data:`MAX_CAPACITY`, up to ``max_ops`` calls."""
    return _scenario(max_ops)


class _SaltedKey(int):
    """An int key whose hash is not the int's: arithmetic and order as the int, but a policy that
    follows a set's (hash) order, or ``hash(key)``, decides differently than with plain ints."""

    def __hash__(self) -> int:
        return hash((int(self), 0x9E3779B97F4A7C15))

    __eq__ = int.__eq__
    __repr__ = int.__repr__


class _OnlyContains:
    """A protected set that answers ``in`` and nothing else, as the prefetching replay passes."""

    def __init__(self, keys: Container[Hashable]) -> None:
        self._keys = keys

    def __contains__(self, key: object) -> bool:
        return key in self._keys


class _Run:
    """One drive of a fresh policy through a scenario, checking as it goes."""

    def __init__(self, factory: Callable[..., EvictionPolicy], label: str, scenario: Scenario, salt: int,
                 checks: frozenset[str]) -> None:
        self.policy = check_policy_instance(factory(scenario.capacity), label)
        self.label, self.scenario, self.salt, self.checks = label, scenario, salt, checks
        self.resident: set[int] = set()
        self.done: list[str] = []  # the ops so far, for the message
        self.victims: list[Hashable | None] = []  # None: NoVictimError

    def fail(self, invariant: str, what: str) -> PolicyConformanceError:
        trail = "\n".join(f"    {line}" for line in self.done[-25:])
        return PolicyConformanceError(
            f"policy {self.label} breaks '{invariant}' at capacity {self.scenario.capacity}: {what}\n"
            f"  after these calls (the last {min(25, len(self.done))} of {len(self.done)}):\n{trail}")

    def key(self, i: int) -> Hashable:
        return _SaltedKey(i) if self.salt else i

    def run(self) -> list[Hashable | None]:
        for n, op in enumerate(self.scenario.ops):
            self.done.append(str(op))
            try:
                self.step(n, op)
            except PolicyConformanceError:
                raise
            except Exception as exc:  # the policy refused a call its protocol says it must take
                invariant = min(self.checks, key=INVARIANTS.index) if self.checks else "deterministic"
                raise self.fail(invariant, f"{op} raised {type(exc).__name__}: {exc}") from exc
            self.check_residency()
        return self.victims

    def step(self, n: int, op: Op) -> None:
        on_miss = getattr(self.policy, "on_miss", None)
        protected = frozenset(self.key(k) for k in op.protected)
        container = _OnlyContains(protected) if n % 2 else protected
        if op.kind == "access":
            key = self.key(op.key)
            if op.key in self.resident:
                self.policy.touch(key, op.now)
            else:
                if on_miss is not None:
                    on_miss(key, op.now)
                if len(self.resident) >= self.scenario.capacity and not self.evict(op, container):
                    return  # all protected: the caller cannot make room, the access bypasses
                self.policy.insert(key, op.now)
                self.resident.add(op.key)
        elif op.kind == "remove" and op.key in self.resident:
            self.policy.remove(self.key(op.key))
            self.resident.discard(op.key)
        elif op.kind == "evict":
            self.evict(op, container)

    def evict(self, op: Op, protected: Container[Hashable]) -> bool:
        evictable = self.resident - op.protected
        before = len(self.policy)
        try:
            victim = self.policy.evict(protected)
        except NoVictimError:
            self.victims.append(None)
            if evictable and "protected" in self.checks:
                raise self.fail("protected", f"evict raised NoVictimError with {sorted(evictable)} "
                                             "resident and unprotected") from None
            if len(self.policy) != before and "protected" in self.checks:
                raise self.fail("protected", "a refused evict changed the policy's length "
                                             f"({before} -> {len(self.policy)})") from None
            return False
        got = int(victim) if isinstance(victim, _SaltedKey) else victim
        self.victims.append(got)
        if not evictable and "protected" in self.checks:
            raise self.fail("protected", f"evict returned {got!r} though every resident key "
                                         f"{sorted(self.resident)} was protected (expected NoVictimError)")
        if got in op.protected and "protected" in self.checks:
            raise self.fail("protected", f"evict returned the protected key {got!r}")
        if got not in self.resident:
            if "capacity" in self.checks:
                raise self.fail("capacity", f"evict returned {got!r}, which was not resident "
                                            f"(resident: {sorted(self.resident)})")
            return True
        self.resident.discard(got)
        if "capacity" in self.checks and self.key(got) in self.policy:
            raise self.fail("capacity", f"the victim {got!r} is still 'in' the policy after evict")
        return True

    def check_residency(self) -> None:
        if "capacity" not in self.checks:
            return
        size, cap = len(self.policy), self.scenario.capacity
        if size > cap:
            raise self.fail("capacity", f"{size} keys resident, capacity {cap}")
        if size != len(self.resident):
            raise self.fail("capacity", f"len(policy) is {size} but the caller holds "
                                        f"{len(self.resident)}: {sorted(self.resident)}")
        lost = [k for k in sorted(self.resident) if self.key(k) not in self.policy]
        if lost:
            raise self.fail("capacity", f"resident keys {lost} are not 'in' the policy")


def check_scenario(spec: PolicySpec, scenario: Scenario, invariants: Iterable[str] = INVARIANTS) -> None:
    """Check ``invariants`` on one scenario (what :func:`check_policy` does for each example)."""
    _check_scenario(resolve_policy(spec), policy_label(spec), scenario, _invariants(invariants))


def _invariants(invariants: Iterable[str]) -> frozenset[str]:
    checks = frozenset(invariants)
    unknown = checks - set(INVARIANTS)
    if unknown:
        raise ValueError(f"unknown invariant {min(unknown)!r}: choose from {', '.join(INVARIANTS)}")
    return checks


def _check_scenario(factory: Callable[..., EvictionPolicy], label: str, scenario: Scenario,
                    checks: frozenset[str]) -> None:
    first = _Run(factory, label, scenario, 0, checks)
    victims = first.run()
    if "deterministic" in checks:
        for salt in (0, 1):  # the same keys again, then keys that hash differently
            again = _Run(factory, label, scenario, salt, frozenset())
            other = again.run()
            if other != victims:
                i = next((j for j, (a, b) in enumerate(zip(victims, other)) if a != b), min(len(victims), len(other)))
                raise PolicyConformanceError(
                    f"policy {label} breaks 'deterministic' at capacity {scenario.capacity}: two runs of "
                    f"the same trace chose different victims ({'same' if salt == 0 else 'differently hashed'} "
                    f"keys): eviction {i} was {_at(victims, i)} then {_at(other, i)}; victims "
                    f"{_show(victims)} vs {_show(other)}\n  trace: {', '.join(str(op) for op in scenario.ops)}")
    if "opt_bound" in checks and scenario.keys:
        keys = scenario.keys
        hits, _ = count_hits(check_policy_instance(factory(scenario.capacity), label), keys, scenario.capacity)
        opt = opt_hit_count(keys, scenario.capacity)
        if hits > opt:
            raise PolicyConformanceError(
                f"policy {label} breaks 'opt_bound' at capacity {scenario.capacity}: {hits} demand-fill "
                f"hits, more than OPT's {opt} on the same {len(keys)} accesses {keys}")


def check_policy(spec: PolicySpec, *, examples: int = 200, invariants: Sequence[str] = INVARIANTS,
                 max_ops: int = 60, seed: int | None = None, shrink: bool = True) -> None:
    """Run the kit's ``invariants`` on ``examples`` hypothesis-generated scenarios.

    ``spec`` is anything :func:`~firmware_model.policies.resolve_policy` takes (a built-in name,
    ``"module:Class"``, the class). Raises :class:`PolicyConformanceError` on the first (shrunk)
    violation; ``ValueError`` / ``PolicyProtocolError`` if the policy does not resolve. ``seed``
    makes the examples reproducible (hypothesis' database is not used either way);
    ``shrink=False`` reports the first failing trace as found, without minimising it (faster).
    """
    factory = resolve_policy(spec)  # a protocol mismatch is reported as such, before any trace
    _drive(factory, policy_label(spec), examples=examples, invariants=invariants, max_ops=max_ops,
           seed=seed, shrink=shrink)


def _settings(examples: int, shrink: bool) -> Any:
    phases = tuple(p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain))
    return settings(max_examples=examples, deadline=None, database=None, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), print_blob=False, phases=phases)


def _drive(factory: Callable[..., EvictionPolicy], label: str, *, examples: int, invariants: Iterable[str],
           max_ops: int, seed: int | None, shrink: bool) -> None:
    checks = _invariants(invariants)

    @_settings(examples, shrink)
    @given(scenarios(max_ops))
    def run(scenario: Scenario) -> None:
        _check_scenario(factory, label, scenario, checks)

    if seed is not None:
        run = _seeded(run, seed)
    run()


# -- the prefetch window ---------------------------------------------------------------------------
WINDOW_INVARIANTS: tuple[str, ...] = ("range", "deterministic")
"""What :func:`check_window` checks: the result is an int in [0, max_window]; the same arguments
give the same result."""


@st.composite
def _window_args(draw: Any) -> tuple[LinkParams, int, float, int]:
    link = LinkParams(lat_ns=(draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))),
                      fs_per_byte=(draw(st.integers(0, 10**5)), draw(st.integers(0, 10**5))),
                      txn_bytes=draw(st.sampled_from((64, 128, 256, 4096))))
    nbytes = draw(st.one_of(st.integers(1, 4096), st.integers(1, 1 << 30)))
    # 0 (not measured) or at least 1 ns: the engine measures whole ns, replay multiplies ints
    compute = draw(st.one_of(st.just(0.0), st.integers(1, 10**7).map(float),
                             st.floats(1.0, 1e9, allow_nan=False, allow_infinity=False)))
    return link, nbytes, compute, draw(st.integers(1, 256))


def check_window(spec: WindowSpec, *, examples: int = 200, seed: int | None = None,
                 shrink: bool = True) -> None:
    """Check a prefetch window function (``"module:function"`` or the callable, see
    :func:`~firmware_model.prefetch.resolve_window`) on ``examples`` hypothesis-generated
    ``(link, bytes_per_point, compute_ns_per_point, max_window)`` (links up to 1 ms latency and
    100 ns per byte, points of 1 B to 1 GiB, compute 0 or 1 ns to 1 s, windows of 1 to 256): the result is an int in
    ``[0, max_window]`` (``range``) and a second call with equal arguments returns the same
    (``deterministic``). Raises :class:`PolicyConformanceError` naming the invariant and the
    arguments; ``ValueError`` / ``PolicyProtocolError`` if the function does not resolve."""
    checked = resolve_window(spec)  # a wrong signature is reported as such, before any example
    fn = getattr(checked, "fn", checked)
    label = spec_label(spec)

    def fail(invariant: str, args: tuple[LinkParams, int, float, int], what: str) -> PolicyConformanceError:
        link, nbytes, compute, max_window = args
        return PolicyConformanceError(
            f"window function {label} breaks '{invariant}': {what}\n  called as f({link!r}, "
            f"bytes_per_point={nbytes}, compute_ns_per_point={compute!r}, max_window={max_window})")

    @_settings(examples, shrink)
    @given(_window_args())
    def run(args: tuple[LinkParams, int, float, int]) -> None:
        try:
            got = fn(*args)
        except Exception as exc:
            raise fail("range", args, f"raised {type(exc).__name__}: {exc}") from exc
        if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got <= args[3]:
            raise fail("range", args, f"returned {got!r}, not an int in [0, max_window={args[3]}]")
        again = fn(LinkParams(lat_ns=args[0].lat_ns, fs_per_byte=args[0].fs_per_byte,
                              txn_bytes=args[0].txn_bytes), *args[1:])
        if again != got:
            raise fail("deterministic", args, f"returned {got!r}, then {again!r} for equal arguments")

    if seed is not None:
        run = _seeded(run, seed)
    run()


# -- the hotness policy's heat scorer -------------------------------------------------------------
class _HintedHotness(HotnessPolicy):
    """The hotness policy as a device drives it: besides the kit's calls, hotlist counts on touch,
    host hints on insert and on keys that left, and cooling every 4 accesses, so each of the
    scorer's methods decides."""

    def __init__(self, capacity: int, scorer: ScorerSpec | None = None) -> None:
        super().__init__(capacity, cooling=4, scorer=scorer)

    def insert(self, key: Hashable, now: int = 0) -> None:
        super().insert(key, now)
        if now % 3 == 1:
            self.hint_heat(key, 1 + now % 5)

    def touch(self, key: Hashable, now: int = 0) -> None:
        super().touch(key, now)
        self.feed_hotlist([(key, now % 4)])

    def remove(self, key: Hashable) -> None:
        super().remove(key)
        self.hint_heat(key, 2)  # a key not resident: its remembered heat


def check_scorer(spec: ScorerSpec, *, examples: int = 200, invariants: Sequence[str] = INVARIANTS,
                 max_ops: int = 60, seed: int | None = None, shrink: bool = True) -> None:
    """Check a heat scorer for the hotness policy (``"module:Class"``, the class, a factory or an
    instance; see :func:`~firmware_model.policies.hotness.resolve_scorer`): the hotness policy with
    it plugged in, fed hotlist counts and host hints and cooled every 4 accesses, must hold every
    policy invariant (:data:`INVARIANTS`) on hypothesis-generated traces, as :func:`check_policy`
    checks them. A class is built afresh for each policy."""
    resolve_scorer(spec)  # a protocol mismatch is reported as such, before any trace

    def factory(capacity: int) -> EvictionPolicy:
        return _HintedHotness(capacity, scorer=spec)

    _drive(factory, f"hotness(scorer={spec_label(spec)})", examples=examples, invariants=invariants,
           max_ops=max_ops, seed=seed, shrink=shrink)


def _seeded(test: Callable[[], None], seed: int) -> Callable[[], None]:
    from hypothesis import seed as hypothesis_seed

    return hypothesis_seed(seed)(test)  # type: ignore[no-any-return]


def _at(victims: list[Hashable | None], i: int) -> str:
    if i >= len(victims):
        return "<no eviction>"
    return "NoVictimError" if victims[i] is None else repr(victims[i])


def _show(victims: list[Hashable | None]) -> str:
    return "[" + ", ".join("-" if v is None else repr(v) for v in victims) + "]"
