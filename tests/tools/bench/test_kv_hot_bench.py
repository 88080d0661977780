"""`cxlemu bench kv --attention hot`: its goals from rows, its flags, and one tiny run."""
from __future__ import annotations

import pytest

from tools.bench.kv_hot import KvHotRow, goals


def _row(mode: str, step: float, read: float, peak: int = 10, budget: int = 0) -> KvHotRow:
    return KvHotRow(context=4096, batch=2, mode=mode, page_budget=0.1 if mode == "hot" else 1.0,
                    hbm_budget_bytes=budget, kv_bytes=90, hbm_peak_bytes=peak, step_ms=step, bytes_per_step=read,
                    attended_per_step=100.0, stall_ms=0.0, predicted_used=0.5, tokens_agree=1.0)


def test_goals_compare_hot_with_dense_from_the_device_and_resident() -> None:
    """bytes: 12 of the 100 dense attention reads (and 12 of the dense mode's 60); step: 11 over
    the faster all-resident mode's 10; KV 90 over a budget of 30, peak 25 within it."""
    from tools.cli.bench.kv_hot import markdown

    rows = [_row("resident", 14.0, 0.0, peak=90), _row("in-hbm", 10.0, 0.0, peak=90, budget=360),
            _row("dense", 30.0, 60.0, peak=29, budget=30),
            _row("hot", 11.0, 12.0, peak=25, budget=30)]
    (g,) = goals(rows)
    assert (g.bytes_ratio, g.bytes_vs_dense, g.step_ratio, g.kv_over_hbm, g.within_budget) == (0.12, 0.2, 1.1, 3.0, True)
    assert g.met == (True, True, True)
    assert markdown(rows).splitlines()[-1] == "| 4096 | 0.120 (met) | 0.200 | 1.100 (met) | 3.00, yes (met) |"
    over = goals([*rows[:3], _row("hot", 12.0, 16.0, peak=31, budget=30)])[0]
    assert over.met == (False, False, False)


@pytest.mark.parametrize("argv,message", [
    (["--page-budget", "0.5"], "--page-budget: only with --attention hot"),
    (["--attention", "hot", "--page-budget", "0"], "--page-budget is a fraction in (0, 1], got 0.0"),
    (["--attention", "hot", "--budget", "50"], "--budget, --policy and --kv-format are dense mode's"),
    (["--attention", "hot", "--kv-format", "int8"], "--budget, --policy and --kv-format are dense mode's"),
    (["--attention", "hot", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["--attention", "hot", "--kv-over-hbm", "0.5"], "--kv-over-hbm must be >= 1, got 0.5"),
    (["--attention", "hot", "--steps", "2"], "--steps must be > 2"),
    (["--plot", "x.png"], "--plot: only with --attention hot"),
    (["--in-process"], "--in-process: only with --attention hot"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.cli.main import main

    assert main(["bench", "kv", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cxlemu: error: ") and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_tiny_run_reads_a_share_of_the_kv(tmp_path) -> None:
    """Six layers (the dense mode's two frames are a third of the KV), a 512-token context, 2
    sequences: every mode runs on one device (`cxlemu serve` in its own process); dense from the
    device has the resident tokens; hot reads its chosen pages (at most the budget's share) and the
    mispredicted ones (at most as many again), and stays within its HBM budget; the plot is drawn."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from emulator import presets
    from tools.bench.kv_hot import plot, run

    rows = run(layers=6, hidden=32, heads=2, kv_heads=1, contexts=[512], batch=2, steps=4, page_budget=0.2,
               block_tokens=8, kv_over_hbm=3.0, timing=presets.load("leo-x16").timing, repeat=1,
               serve_args=("--preset", "leo-x16"))
    assert [r.mode for r in rows] == ["resident", "in-hbm", "dense", "hot"]
    assert rows[1].tokens_agree == rows[2].tokens_agree == 1.0
    assert rows[1].bytes_per_step == 0 and rows[2].bytes_per_step > 0
    (g,) = goals(rows)
    assert 0 < rows[3].bytes_per_step <= 2 * 0.2 * rows[3].attended_per_step
    assert g.within_budget and g.kv_over_hbm >= 3.0
    plot(rows, str(tmp_path / "hot.png"))
    assert (tmp_path / "hot.png").read_bytes()[:4] == b"\x89PNG"
