"""The other two plug-in points: a prefetch window function and the hotness policy's heat scorer,
written in the user's own module (the README's ``myfw.py``, outside the repository), named wherever
the window or the policy's options are chosen, refused with the signature expected when they do
not fit, and checked by the conformance kit."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import ROOT

from firmware_model.dma import TransferCost
from firmware_model.link import LinkParams
from firmware_model.policies import (
    CountingScorer,
    HotnessPolicy,
    PolicyProtocolError,
    make_policy,
    resolve_scorer,
)
from firmware_model.prefetch import resolve_window, window_points
from firmware_model.prefetch_replay import replay_with_prefetch
from firmware_model.testing import PolicyConformanceError, check_scorer, check_window

LINK = LinkParams.from_rates(read_latency_ns=1000, read_bandwidth_gbps=1)


def readme_module(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"```python\n(# {name}\.py\n.*?)```", text, re.DOTALL)
    assert found, f"README.md lost its '# {name}.py' example"
    return found.group(1)


EXTRA = '''
CALLS = []


def logged(link, bytes_per_point, compute_ns_per_point, max_window):
    CALLS.append((bytes_per_point, compute_ns_per_point, max_window))
    return min(2, max_window)


def too_few(link, bytes_per_point):
    return 1


def negative(link, bytes_per_point, compute_ns_per_point, max_window):
    return -1


NOT_A_FUNCTION = 3


class NoCool:
    def access(self, key, heat, now):
        return heat + 1

    def hint(self, key, heat, amount):
        return heat + amount


class AccessWithoutNow(NoCool):
    def access(self, key, heat):
        return heat + 1

    def cool(self, key, heat):
        return heat


class Strings(NoCool):
    def cool(self, key, heat):
        return "cold"
'''


@pytest.fixture
def myfw(tmp_path, monkeypatch) -> Path:
    """The README's ``myfw.py`` (plus a few misfits) outside the repository, importable as ``myfw``."""
    (tmp_path / "myfw.py").write_text(readme_module("myfw") + EXTRA)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("myfw", None)
    yield tmp_path
    sys.modules.pop("myfw", None)


# -- the window function: resolution and refusal ------------------------------------------------
def test_resolve_window_names_auto_module_paths_and_callables(myfw) -> None:
    import myfw as mod

    assert resolve_window("auto") is window_points
    for spec in ("myfw:window", mod.window):
        fn = resolve_window(spec)
        # 1000 ns + 1024 B (whole 64-B transactions) at 1 ns/B: ceil(2024 / 1000) + 1
        assert fn(LINK, 1000, 1000.0, 8) == mod.window(LINK, 1000, 1000.0, 8) == 4
        assert fn(LINK, 1000, 0.0, 8) == 8


def test_window_refused_with_the_signature_expected(myfw) -> None:
    expected = "expected f(link, bytes_per_point, compute_ns_per_point, max_window) -> int >= 0"
    with pytest.raises(PolicyProtocolError) as refused:
        resolve_window("myfw:too_few")
    assert str(refused.value) == ("prefetch window function myfw:too_few(link, bytes_per_point) cannot be called "
                                  f"as f(link, bytes_per_point, compute_ns_per_point, max_window) ({expected})")
    with pytest.raises(PolicyProtocolError) as refused:
        resolve_window("myfw:NOT_A_FUNCTION")
    assert str(refused.value) == ("prefetch window function myfw:NOT_A_FUNCTION is 3: expected a function "
                                  "f(link, bytes_per_point, compute_ns_per_point, max_window) -> int >= 0")
    with pytest.raises(ValueError, match="cannot import prefetch window function 'myfw:nope': module 'myfw'"):
        resolve_window("myfw:nope")
    with pytest.raises(ValueError, match="cannot import prefetch window function 'no_such_mod:f'.*PYTHONPATH"):
        resolve_window("no_such_mod:f")
    with pytest.raises(ValueError, match="unknown prefetch window 'fast'"):
        resolve_window("fast")


def test_window_result_checked_at_run_time(myfw) -> None:
    with pytest.raises(PolicyProtocolError, match=r"prefetch window function myfw:negative returned -1 .*"
                                                  r"expected an int >= 0"):
        resolve_window("myfw:negative")(LINK, 100, 10.0, 4)
    with pytest.raises(PolicyProtocolError, match=r"returned 1\.5 .*expected an int >= 0"):
        resolve_window(lambda link, b, c, m: 1.5)(LINK, 100, 10.0, 4)


# -- the window function through each entry point -----------------------------------------------
def _trace():
    from tools.trace.gen import KINDS

    return KINDS["multiturn"]()


def test_prefetch_replay_takes_a_window_function(myfw) -> None:
    """``replay_with_prefetch(window=)``: the function's window is the one used (the same result as
    that int), called once with the trace's mean point; ``None`` is ``"auto"``."""
    import myfw as mod

    trace = _trace()
    cost = TransferCost(read_latency_ns=2000, write_latency_ns=2000, block_bytes=4096)

    def run(window):
        return replay_with_prefetch(trace, make_policy("lru", 24), 24, cost=cost, compute_ns=100,
                                    window=window).to_dict()

    mod.CALLS.clear()
    by_function = run("myfw:logged")
    assert len(mod.CALLS) == 1 and mod.CALLS[0][2] == 64
    assert by_function == run(2) and by_function["prefetch"]["window"] == 2
    assert run(None) == run("auto") == run(window_points)
    assert run(mod.window)["prefetch"]["window"] != 2  # a different window, a different run
    with pytest.raises(PolicyProtocolError, match="myfw:negative returned -1"):
        run("myfw:negative")


def _engine_steps(depth):
    """The decisions of the residency engine (tests/driver/kv/test_kv_engine_decisions.py's model) on a
    manual clock for ``prefetch_depth=depth``."""
    torch = pytest.importorskip("torch")
    from kv_support import frame_bytes

    from driver.kv import MemoryBlockStore
    from driver.kv._engine import ResidencyEngine
    from firmware_model.clock import ManualClock

    decisions: list = []
    clock = ManualClock()
    engine = ResidencyEngine(budget=3 * frame_bytes(1, 16, block_tokens=4), policy="lru", block_tokens=4,
                             store=MemoryBlockStore(1 << 20), device=torch.device("cpu"), dtype=torch.float32,
                             max_seq_len=16, prefetch_depth=depth, link=LINK, clock=clock,
                             record=decisions.append)
    for layer in range(4):
        engine.update(layer, torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16))
    for _ in range(3):
        for layer in range(4):
            clock.advance(1000)
            engine.update(layer, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    return decisions


def test_engine_sizes_its_window_with_the_users_function(myfw) -> None:
    """The engine calls the function where ``"auto"`` calls ``window_points`` (link, layer bytes,
    measured compute per layer, layer count; one layer ahead until compute is measured), so a
    function returning window_points' answer decides exactly as ``"auto"``; another answer, otherwise."""
    import myfw as mod

    mod.CALLS.clear()
    with_function = _engine_steps("myfw:logged")
    assert mod.CALLS and all(m == 4 and c == 1000 for _, c, m in mod.CALLS)
    auto = _engine_steps("auto")
    assert _engine_steps(lambda link, b, c, m: window_points(link, b, c, m)) == auto
    assert _engine_steps(window_points) == auto
    assert with_function == auto  # 2 as well: window_points' 4 capped by the three frames
    prefetches = [d for d in _engine_steps(lambda link, b, c, m: 0) if d[1] == "prefetch"]
    assert prefetches and all(step == 1 for step, _, _ in prefetches)  # only before compute is measured


def test_cxlcache_checks_the_window_function_where_it_is_named(myfw) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from driver.kv import CxlCache, MemoryBlockStore
    from emulator.spec.errors import ConfigError

    with pytest.raises(PolicyProtocolError, match="myfw:too_few"):
        CxlCache(hbm_budget_bytes=1 << 20, prefetch_depth="myfw:too_few", store=MemoryBlockStore(1 << 20))
    with pytest.raises(ValueError, match="cannot import prefetch window function 'myfw:nope'"):
        CxlCache(hbm_budget_bytes=1 << 20, prefetch_depth="myfw:nope", store=MemoryBlockStore(1 << 20))
    with pytest.raises(ConfigError, match="an int >= 0, 'auto', or a window function"):
        CxlCache(hbm_budget_bytes=1 << 20, prefetch_depth="fast", store=MemoryBlockStore(1 << 20))
    with pytest.raises(ConfigError, match="an int >= 0, 'auto', or a window function"):
        CxlCache(hbm_budget_bytes=1 << 20, prefetch_depth=True, store=MemoryBlockStore(1 << 20))
    CxlCache(hbm_budget_bytes=1 << 20, prefetch_depth="myfw:window", store=MemoryBlockStore(1 << 20)).close()


@pytest.mark.slow
def test_cxlcache_runs_the_users_window_and_scorer(myfw) -> None:
    """``CxlCache(policy="myfw:HotHeat", prefetch_depth="myfw:logged")`` on a tiny seeded Llama at
    the minimum budget, over a store with a timed link: the window function sizes the prefetch,
    the scorer's policy evicts, and the tokens equal DynamicCache's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import myfw as mod
    from kv_support import frame_bytes, generate, tiny_model
    from transformers import DynamicCache

    from driver.kv import CxlCache, MemoryBlockStore
    from driver.kv.testing import padded_batch

    class TimedStore(MemoryBlockStore):
        class timing:  # what a device store's TimingConfig offers the cache
            @staticmethod
            def link_params() -> LinkParams:
                return LINK

    model = tiny_model()
    ids, mask = padded_batch([12])
    new = 4
    layer = frame_bytes(1, 12 + new - 1)
    mod.CALLS.clear()
    ref = generate(model, ids, mask, DynamicCache(), new)
    cache = CxlCache(hbm_budget_bytes=2 * layer, policy="myfw:HotHeat", prefetch_depth="myfw:logged",
                     block_tokens=4, store=TimedStore(1 << 20))
    out = generate(model, ids, mask, cache, new)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert stats["loads"] > 0 and stats["evictions"] > 0
    assert mod.CALLS and all(m == 4 for _, _, m in mod.CALLS)


# -- the heat scorer ---------------------------------------------------------------------------
def test_resolve_scorer_names_module_paths_classes_factories_and_instances(myfw) -> None:
    import myfw as mod

    for spec in ("myfw:Heat", mod.Heat, lambda: mod.Heat(), mod.Heat()):
        scorer = resolve_scorer(spec)
        assert isinstance(scorer, mod.Heat)
    p = make_policy("hotness", 4, scorer="myfw:Heat")
    p.insert("a"), p.insert("b")
    p.feed_hotlist([("a", 2)])
    assert p.heat("a") == 1 + 4 * 2 and p.heat("b") == 1


def test_scorer_refused_naming_each_misfit(myfw) -> None:
    with pytest.raises(PolicyProtocolError) as refused:
        make_policy("hotness", 4, scorer="myfw:NoCool")
    assert str(refused.value) == ("heat scorer myfw:NoCool does not fit the HeatScorer protocol "
                                  "(firmware_model.policies.hotness): no method cool "
                                  "(expected cool(self, key, heat) -> heat)")
    with pytest.raises(PolicyProtocolError, match=re.escape(
            "access(self, key, heat) cannot be called as access(self, key, heat, now) "
            "(expected access(self, key, heat, now) -> heat)")):
        make_policy("hotness", 4, scorer="myfw:AccessWithoutNow")
    with pytest.raises(ValueError, match="cannot import heat scorer 'myfw:Nope'"):
        make_policy("hotness", 4, scorer="myfw:Nope")
    with pytest.raises(PolicyProtocolError, match="no method access"):
        resolve_scorer(3)
    p = make_policy("hotness", 2, cooling=2, scorer="myfw:Strings")
    p.insert(1)
    with pytest.raises(PolicyProtocolError, match="heat scorer myfw:Strings: cool returned 'cold': expected a number"):
        p.insert(2)


def _drive(policy: HotnessPolicy, seed: int) -> list:
    """Accesses, hints, hotlists and removals at capacity 8; returns the victims and final heats."""
    rng = random.Random(seed)
    out: list = []
    for now in range(3000):
        key = rng.randrange(24)
        r = rng.random()
        if r < 0.1:
            policy.hint_heat(key, rng.randrange(4))
        elif r < 0.15:
            policy.feed_hotlist([(rng.randrange(24), rng.randrange(1, 9)) for _ in range(3)])
        elif r < 0.2 and key in policy:
            policy.remove(key)
        elif key in policy:
            policy.touch(key, now)
        else:
            if len(policy) >= 8:
                out.append(policy.evict({rng.randrange(24)}))
            policy.insert(key, now)
    return out + [policy.heat(k) for k in range(24)]


def test_counting_scorer_is_the_default_bit_for_bit() -> None:
    for seed in range(3):
        base = _drive(HotnessPolicy(8, cooling=37), seed)
        assert _drive(HotnessPolicy(8, cooling=37, scorer=CountingScorer), seed) == base
        assert _drive(make_policy("hotness", 8, cooling=37, scorer="firmware_model.policies:CountingScorer"),
                      seed) == base


def test_a_scorer_changes_what_is_evicted(myfw) -> None:
    """Heat (hotlist counts weigh 4) ranks a hinted key above a more often accessed one."""
    for scorer, victim in ((None, "hinted"), ("myfw:Heat", "touched")):
        p = HotnessPolicy(2, window=0, scorer=scorer)
        p.insert("touched"), p.insert("hinted")
        p.touch("touched"), p.touch("touched")  # heat 3
        p.feed_hotlist([("hinted", 1)])  # 2 by counting, 5 by Heat
        assert p.evict() == victim


def test_trace_replay_runs_the_scorer_policy_and_window_function(myfw) -> None:
    """``cxlemu trace replay --policy myfw:HotHeat --prefetch --prefetch-window myfw:window`` in a
    subprocess that finds ``myfw`` through PYTHONPATH only."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(myfw), str(ROOT)])}
    trace = myfw / "multiturn.jsonl"
    cli = [sys.executable, "-m", "tools.cli.main", "trace"]
    subprocess.run([*cli, "gen", "multiturn", "--out", str(trace)], check=True, cwd=myfw, env=env,
                   capture_output=True)
    args = [*cli, "replay", str(trace), "--capacity", "24", "--prefetch", "--latency-ns", "2000",
            "--compute-ns", "100", "--json"]
    done = subprocess.run([*args, "--policy", "myfw:HotHeat", "--prefetch-window", "myfw:logged"],
                          check=False, cwd=myfw, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["policy"] == "hotness-heat" and doc["prefetch"]["window"] == 2 and doc["hits"] > 0
    refused = subprocess.run([*args, "--prefetch-window", "myfw:too_few"], check=False, cwd=myfw, env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2
    assert "argument --prefetch-window: prefetch window function myfw:too_few(link, bytes_per_point)" in refused.stderr


def test_cli_window_option_in_process(myfw, capsys) -> None:
    from tools.cli.main import main

    path = myfw / "t.jsonl"
    path.write_text('{"t": 0, "block": 1}\n{"t": 1, "block": 2}\n')
    base = ["trace", "replay", str(path), "--capacity", "2", "--latency-ns", "100", "--json"]
    assert main([*base, "--prefetch", "--prefetch-window", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["prefetch"]["window"] == 3
    assert main([*base, "--prefetch-window", "3"]) == 2
    assert "give --prefetch too" in capsys.readouterr().err
    assert main([*base, "--prefetch", "--prefetch-window", "-1"]) == 2
    assert "expected an int >= 0, 'auto' or module:function" in capsys.readouterr().err
    assert main([*base, "--prefetch", "--prefetch-window", "myfw:negative"]) == 2
    assert "myfw:negative returned -1" in capsys.readouterr().err


# -- the conformance kit -----------------------------------------------------------------------
def test_kit_passes_the_defaults_and_the_readme_plugins(myfw) -> None:
    check_window("auto", examples=100, seed=0)
    check_window("myfw:window", examples=100, seed=0)
    check_scorer(CountingScorer, examples=60, seed=0)
    check_scorer("myfw:Heat", examples=60, seed=0)


@pytest.mark.parametrize("fn,invariant,what", [
    (lambda link, b, c, m: -1, "range", "returned -1, not an int in [0, max_window="),
    (lambda link, b, c, m: m + 1, "range", "returned 2, not an int in [0, max_window=1]"),
    (lambda link, b, c, m: float(m), "range", "returned 1.0, not an int"),
    (lambda link, b, c, m: random.randint(0, m), "deterministic", "for equal arguments"),
])
def test_kit_fails_a_broken_window(fn, invariant, what) -> None:
    with pytest.raises(PolicyConformanceError) as failed:
        check_window(fn, examples=200, seed=0, shrink=False)
    assert str(failed.value).startswith(f"window function {__name__}:<lambda> breaks '{invariant}': ")
    assert what in str(failed.value)


class RandomHeat(CountingScorer):
    def access(self, key, heat, now):
        return random.randrange(100)


class HashedHeat(CountingScorer):
    def access(self, key, heat, now):
        return hash(key) % 7


class NoneOnHint(CountingScorer):
    def hint(self, key, heat, amount):
        return None


@pytest.mark.parametrize("scorer,invariant,what", [
    (RandomHeat, "deterministic", "two runs of the same trace chose different victims"),
    (HashedHeat, "deterministic", "differently hashed keys"),
    (NoneOnHint, "capacity", "hint returned None: expected a number"),
])
def test_kit_fails_a_broken_scorer(scorer, invariant, what) -> None:
    with pytest.raises(PolicyConformanceError) as failed:
        check_scorer(scorer, examples=200, seed=0, shrink=False)
    message = str(failed.value)
    assert message.startswith(f"policy hotness(scorer={__name__}:{scorer.__qualname__}) breaks '{invariant}'")
    assert what in message


def test_kit_refuses_a_misfit_before_any_trace(myfw) -> None:
    with pytest.raises(PolicyProtocolError, match="no method cool"):
        check_scorer("myfw:NoCool")
    with pytest.raises(PolicyProtocolError, match="myfw:too_few"):
        check_window("myfw:too_few")
