"""`cxlemu bench kv`: its OPT transfer bound against a brute-force reference, and one tiny run."""
from __future__ import annotations

import pytest

from tools.bench.kv import opt_misses_per_step


def brute_force_opt_misses(layers: int, frames: int, cycles: int = 12) -> float:
    """Belady by definition: on a miss with a full cache, evict the key used furthest ahead."""
    seq = list(range(layers)) * cycles
    resident: set[int] = set()
    late = 0
    for i, key in enumerate(seq):
        if key in resident:
            continue
        if len(resident) >= frames:
            def next_use(k: int, now: int = i) -> int:
                return next((j for j in range(now + 1, len(seq)) if seq[j] == k), len(seq))
            resident.remove(max(sorted(resident), key=next_use))
        resident.add(key)
        if i >= layers * (cycles // 2):
            late += 1
    return late / (cycles - cycles // 2)


@pytest.mark.parametrize("layers,frames", [(4, 2), (8, 2), (8, 3), (8, 4), (8, 6), (16, 8), (8, 8), (8, 9)])
def test_opt_bound_matches_brute_force(layers: int, frames: int) -> None:
    assert opt_misses_per_step(layers, frames) == pytest.approx(brute_force_opt_misses(layers, frames))


def test_opt_bound_is_zero_when_everything_fits() -> None:
    assert opt_misses_per_step(16, 16) == 0.0


def test_tiny_run_covers_every_mode_with_equal_tokens() -> None:
    """Two layers, a 64-token context: every mode runs, on the same device, with the tokens of
    the resident run; the offloading modes really load."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from emulator import presets
    from tools.bench.kv import run

    rows = run(layers=3, hidden=32, heads=2, kv_heads=1, contexts=[64], budgets=[50], steps=4,
               block_tokens=16, policies=["lru", "reuse"], timing=presets.load("leo-x16").timing,
               prefetch_depth=1, repeat=1)
    assert [r.mode for r in rows] == ["resident", "demand", "layerwise", "cxlemu:lru", "cxlemu:reuse"]
    assert all(r.tokens_equal for r in rows)
    assert all(r.gb_loaded > 0 for r in rows[1:])
    assert rows[0].ratio == 1.0


@pytest.mark.parametrize("argv,message", [
    (["--steps", "2"], "--steps must be > 2"),
    (["--policy", "belady"], "unknown policy 'belady'"),
    (["--prefetch-depth", "deep"], "--prefetch-depth must be a number of layers or 'auto'"),
    (["--preset", "none"], "has an unthrottled link"),
    (["--context", "-5"], "--context must be >= 1, got -5"),
    (["--budget", "0"], "--budget is a percentage of the KV in (0, 100], got 0"),
    (["--budget", "50", "--budget", "150"], "got 150"),
    (["--layers", "1"], "--layers must be >= 2"),
    (["--heads", "0"], "--heads must be >= 1"),
    (["--block-tokens", "0"], "--block-tokens must be >= 1"),
    (["--time-scale", "0"], "--time-scale must be > 0"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.cli.main import main

    assert main(["bench", "kv", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cxlemu: error: ") and message in err
