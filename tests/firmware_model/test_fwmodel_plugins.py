"""A policy of the user's own plugs in wherever a policy is named, is refused with what is missing
when it does not fit, and the conformance kit passes the built-ins and fails broken ones."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from cli_support import ROOT

from firmware_model.policies import (
    ONLINE_POLICY_NAMES,
    LRUPolicy,
    NoVictimError,
    PolicyProtocolError,
    make_policy,
    policy_label,
    resolve_policy,
)
from firmware_model.testing import (
    INVARIANTS,
    Op,
    PolicyConformanceError,
    Scenario,
    check_policy,
    check_scenario,
)


def readme_policy_module() -> str:
    """The README's ``mymod.py``, as written there."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"```python\n(# mymod\.py\n.*?)```", text, re.DOTALL)
    assert found, "README.md lost its '# mymod.py' example"
    return found.group(1)


@pytest.fixture
def mymod(tmp_path, monkeypatch) -> Path:
    """The README's module in a directory outside the repository, importable as ``mymod``."""
    (tmp_path / "mymod.py").write_text(readme_policy_module())
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mymod", None)
    yield tmp_path
    sys.modules.pop("mymod", None)


# -- broken policies: each breaks one invariant ------------------------------------------------
class _Base:
    name = "broken"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[object, None] = OrderedDict()

    def insert(self, key, now=0):
        self._order[key] = None

    def touch(self, key, now=0):
        self._order.move_to_end(key)

    def remove(self, key):
        del self._order[key]

    def __contains__(self, key):
        return key in self._order

    def __len__(self):
        return len(self._order)


class Overfills(_Base):
    """Names a victim but keeps it: more resident than the capacity."""

    def evict(self, protected=()):
        for key in self._order:
            if key not in protected:
                return key
        raise NoVictimError("all protected")


class EvictsProtected(_Base):
    """LRU that ignores ``protected``."""

    def evict(self, protected=()):
        if not self._order:
            raise NoVictimError("empty")
        return self._order.popitem(last=False)[0]


class Nondeterministic(_Base):
    """Picks a random unprotected victim."""

    def evict(self, protected=()):
        choices = [k for k in self._order if k not in protected]
        if not choices:
            raise NoVictimError("all protected")
        victim = random.choice(choices)
        del self._order[victim]
        return victim


class HashOrdered(_Base):
    """Evicts in a set's iteration order: the same victims for small ints every run, others when
    the keys hash differently (as strings do across processes)."""

    def evict(self, protected=()):
        for key in set(self._order):
            if key not in protected:
                del self._order[key]
                return key
        raise NoVictimError("all protected")


# -- the resolver -------------------------------------------------------------------------------
def test_resolve_names_module_paths_and_classes() -> None:
    """A built-in name, 'module:Class' and the class itself all build the same policy."""
    assert resolve_policy("lru") is LRUPolicy
    assert resolve_policy("firmware_model.policies.lru:LRUPolicy") is LRUPolicy
    assert resolve_policy(LRUPolicy) is LRUPolicy
    for spec in ("lru", "firmware_model.policies.lru:LRUPolicy", LRUPolicy):
        p = make_policy(spec, 2)
        p.insert("a"), p.insert("b"), p.touch("a")
        assert p.evict() == "b"
    assert policy_label(LRUPolicy) == "firmware_model.policies.lru:LRUPolicy"
    assert policy_label("pkg.mod:Cls") == "pkg.mod:Cls"


def test_factory_functions_are_checked_when_they_build() -> None:
    """A factory f(capacity) works; what it returns is checked against the protocol."""
    assert len(make_policy(lambda capacity: LRUPolicy(capacity), 3)) == 0
    with pytest.raises(PolicyProtocolError, match="no method insert"):
        make_policy(lambda capacity: object(), 3)
    with pytest.raises(ValueError, match="positive number of blocks"):
        make_policy(Overfills, 0)


def test_import_errors_name_the_module_and_the_reason(tmp_path, monkeypatch) -> None:
    """A missing module, a missing class, a module that raises, a malformed path."""
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('no licence file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"importing module 'no_such_pkg\.mod' failed: ModuleNotFoundError: "
                                         r".*no_such_pkg.*PYTHONPATH"):
        make_policy("no_such_pkg.mod:Clock", 4)
    with pytest.raises(ValueError, match=r"module 'json' \(.*\) has no attribute 'Clock'"):
        make_policy("json:Clock", 4)
    with pytest.raises(ValueError, match="importing module 'raises_on_import' failed: RuntimeError: no licence file"):
        make_policy("raises_on_import:Clock", 4)
    with pytest.raises(ValueError, match="expected 'package.module:Class'"):
        make_policy("json:", 4)
    with pytest.raises(ValueError, match="or name your own class as 'package.module:Class'"):
        make_policy("clock", 4)


class NoEvict(_Base):
    pass


class TouchNotCallable(Overfills):
    touch = 3


class NoCapacity(Overfills):
    def __init__(self) -> None:
        super().__init__(1)


class EvictNeedsProtected(_Base):
    def evict(self, protected):
        raise NoVictimError


class InsertWithoutNow(Overfills):
    def insert(self, key):
        self._order[key] = None


class NameNotStr(Overfills):
    name = 7


class NoLen:
    name = "nolen"

    def __init__(self, capacity: int) -> None: ...
    def insert(self, key, now=0): ...
    def touch(self, key, now=0): ...
    def remove(self, key): ...
    def evict(self, protected=()): ...
    def __contains__(self, key): return False


@pytest.mark.parametrize("cls,missing", [
    (NoEvict, "no method evict (expected evict(self, protected=()) -> key, raising NoVictimError when none)"),
    (TouchNotCallable, "touch is not callable (expected touch(self, key, now=0) -> None)"),
    (NoCapacity, "its constructor NoCapacity() does not take capacity (expected __init__(self, capacity, **options))"),
    (EvictNeedsProtected, ("evict(self, protected) cannot be called as evict(self) "
                           "(expected evict(self, protected=()) -> key, raising NoVictimError when none)")),
    (InsertWithoutNow, ("insert(self, key) cannot be called as insert(self, key, now) "
                        "(expected insert(self, key, now=0) -> None)")),
    (NameNotStr, "its name is 7, not a str"),
    (NoLen, "no method __len__ (expected __len__(self) -> int)"),
])
def test_protocol_check_names_what_is_missing(cls, missing) -> None:
    """Each misfit is refused naming the class, the missing piece and the expected signature;
    the error is a TypeError and a ValueError (the CLI and CxlCache report it like a bad name)."""
    with pytest.raises(PolicyProtocolError) as refused:
        make_policy(cls, 4)
    message = str(refused.value)
    assert f"eviction policy {__name__}:{cls.__qualname__} does not fit the EvictionPolicy protocol" in message
    assert missing in message
    assert isinstance(refused.value, TypeError) and isinstance(refused.value, ValueError)


def test_protocol_check_lists_every_problem_at_once() -> None:
    class Empty:
        pass

    with pytest.raises(PolicyProtocolError) as refused:
        resolve_policy(Empty)
    for piece in ("constructor", "insert", "touch", "remove", "evict", "__contains__", "__len__"):
        assert piece in str(refused.value)


def test_cli_refuses_a_policy_that_does_not_resolve(tmp_path, capsys) -> None:
    from tools.cli.main import main

    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "block": 1}\n')
    assert main(["trace", "replay", str(path), "--capacity", "2", "--policy", "no_such_pkg:Clock"]) == 2
    assert "argument --policy: cannot import eviction policy 'no_such_pkg:Clock'" in capsys.readouterr().err
    assert main(["trace", "replay", str(path), "--capacity", "2", "--policy", f"{__name__}:NoEvict"]) == 2
    assert "no method evict" in capsys.readouterr().err


# -- the conformance kit ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ONLINE_POLICY_NAMES)
def test_kit_passes_every_builtin_policy(name: str) -> None:
    check_policy(name, examples=80, seed=0)


@pytest.mark.parametrize("cls,invariant,what", [
    (Overfills, "capacity", "still 'in' the policy after evict"),
    (EvictsProtected, "protected", "evict returned"),
    (Nondeterministic, "deterministic", "two runs of the same trace chose different victims"),
    (HashOrdered, "deterministic", "differently hashed keys"),
])
def test_kit_fails_a_broken_policy_saying_how(cls, invariant, what) -> None:
    """The first failing trace, as found (shrinking it takes long on a busy host)."""
    with pytest.raises(PolicyConformanceError) as failed:
        check_policy(cls, examples=200, seed=0, shrink=False)
    message = str(failed.value)
    assert message.startswith(f"policy {__name__}:{cls.__qualname__} breaks '{invariant}' at capacity ")
    assert what in message


@pytest.mark.slow
def test_kit_shrinks_the_failing_trace() -> None:
    """With shrinking (the default), the trace reported is the smallest: two accesses at capacity 1."""
    with pytest.raises(PolicyConformanceError) as failed:
        check_policy(Overfills, examples=200, seed=0)
    assert str(failed.value) == (
        f"policy {__name__}:Overfills breaks 'capacity' at capacity 1: the victim 0 is still 'in' the policy "
        "after evict\n  after these calls (the last 2 of 2):\n    access(0) @0\n    access(1) @0")


def test_kit_catches_more_hits_than_opt() -> None:
    """Keeping its victims, a policy beats OPT in demand fill: the opt_bound check says so."""
    with pytest.raises(PolicyConformanceError, match=r"breaks 'opt_bound' .* demand-fill hits, more than OPT's"):
        check_policy(Overfills, invariants=["opt_bound"], examples=200, seed=0, shrink=False)


def test_kit_exact_scenario_message() -> None:
    """One hand-made scenario: the message names the call and lists the calls before it."""
    ops = (Op("access", 1, frozenset(), 0), Op("access", 2, frozenset(), 3),
           Op("access", 3, frozenset({1}), 5))
    with pytest.raises(PolicyConformanceError) as failed:
        check_scenario(EvictsProtected, Scenario(2, ops), ["protected"])
    assert str(failed.value) == (
        f"policy {__name__}:EvictsProtected breaks 'protected' at capacity 2: evict returned the protected key 1\n"
        "  after these calls (the last 3 of 3):\n"
        "    access(1) @0\n    access(2) @3\n    access(3) protected=[1] @5")
    with pytest.raises(ValueError, match="unknown invariant 'speed'"):
        check_scenario("lru", Scenario(2, ops), ["speed"])
    assert INVARIANTS == ("capacity", "protected", "deterministic", "opt_bound")


# -- the README's policy, from outside the repository -------------------------------------------
def test_readme_policy_passes_the_kit(mymod) -> None:
    check_policy("mymod:Clock", examples=100, seed=0)


def test_readme_policy_replays_against_opt_in_the_cli(mymod) -> None:
    """``cxlemu trace replay --policy mymod:Clock`` on a ``trace gen`` trace, in a subprocess
    that finds ``mymod`` through PYTHONPATH only."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mymod), str(ROOT)])}
    trace = mymod / "multiturn.jsonl"
    cli = [sys.executable, "-m", "tools.cli.main", "trace"]
    subprocess.run([*cli, "gen", "multiturn", "--out", str(trace)],
                   check=True, cwd=mymod, env=env, capture_output=True)
    done = subprocess.run([*cli, "replay", str(trace), "--policy", "mymod:Clock", "--capacity", "24", "--json"],
                          check=False, cwd=mymod, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    import json

    doc = json.loads(done.stdout)
    assert doc["policy"] == "mymod:Clock" and doc["accesses"] > 0 and 0 < doc["hits"] <= doc["opt_hits"]


@pytest.mark.slow
def test_readme_policy_runs_a_cxl_cache(mymod) -> None:
    """``CxlCache(policy="mymod:Clock")`` on a tiny seeded Llama, at the minimum budget: it evicts
    and loads, and the tokens equal DynamicCache's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kv_support import frame_bytes, generate, tiny_model
    from transformers import DynamicCache

    from driver.kv import CxlCache, MemoryBlockStore
    from driver.kv.testing import padded_batch

    model = tiny_model()
    ids, mask = padded_batch([12])
    new = 4
    layer = frame_bytes(1, 12 + new - 1)
    ref = generate(model, ids, mask, DynamicCache(), new)
    cache = CxlCache(hbm_budget_bytes=2 * layer, policy="mymod:Clock", block_tokens=4, store=MemoryBlockStore(1 << 20))
    out = generate(model, ids, mask, cache, new)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["loads"] > 0 and stats["evictions"] > 0
    with pytest.raises(ValueError, match="cannot import eviction policy 'mymod:Nope'"):
        CxlCache(hbm_budget_bytes=2 * layer, policy="mymod:Nope", store=MemoryBlockStore(1 << 20))


def test_kit_s3fifo_evicts_the_one_unprotected_key() -> None:
    """Found by ``check_policy("s3fifo", examples=500)``: key 2 is resident and unprotected, yet
    ``evict(protected={0, 1})`` raises NoVictimError (with or without ``on_miss``)."""
    ops = tuple([Op("access", 0, frozenset(), 0)] * 17 + [Op("access", k, frozenset(), 0) for k in (1, 2, 2)]
                + [Op("access", 3, frozenset({0, 1}), 0)])
    check_scenario("s3fifo", Scenario(3, ops), ["protected"])
