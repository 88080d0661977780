"""`cxlemu bench quality`: its flags refused in one line, a mode this checkout's CxlCache lacks
refused (never approximated), and the goals computed against dense (pure)."""
from __future__ import annotations

import pytest
from cli_support import cli

from tools.bench import quality
from tools.bench.quality import MODES, Mode, ModeUnavailable, QualityRow, check_modes, goals


@pytest.mark.parametrize("argv,message", [
    (["--context", "100"], "--context 100: a context of 100 tokens has no room"),
    (["--examples", "0"], "--examples must be >= 1, got 0"),
    (["--page-budget", "0"], "--page-budget is a fraction in (0, 1], got 0.0"),
    (["--page-budget", "1.5"], "--page-budget is a fraction in (0, 1], got 1.5"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--mode", "sparse"], "unknown mode 'sparse': choose from dense, hot, h2o, int8, int4"),
    (["--context", "x"], "argument --context: invalid int value: 'x'"),
    (["--block-tokens", "0"], "--block-tokens must be >= 1, got 0"),
    (["--selector", "nope"], "--selector nope: unknown page selector 'nope': choose from quest"),
    (["--selector", "no_such_module:X"], "--selector no_such_module:X: cannot import page selector"),
])
def test_bad_flags_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, out, err = cli(capsys, "bench", "quality", *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("cxlemu: error: ") and message in err


def test_a_mode_whose_keyword_cxlcache_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keyword is looked up in CxlCache's signature: a mode needing one it lacks is an error."""
    pytest.importorskip("transformers")
    monkeypatch.setitem(MODES, "zip", Mode("zip", {"kv_format": "zip"}, needs=("kv_format", "no_such_keyword")))
    with pytest.raises(ModeUnavailable, match=r"mode 'zip' needs CxlCache\(no_such_keyword=\.\.\.\)"):
        check_modes(["dense", "zip"])
    check_modes(["dense"])


def test_the_modes_each_name_their_cxlcache_keywords() -> None:
    assert {n: (m.kwargs, m.needs, m.budgeted, m.kv_format) for n, m in MODES.items()} == {
        "dense": ({}, (), False, "native"),
        "hot": ({"attention": "hot"}, ("attention",), True, "native"),
        "h2o": ({"attention": "h2o"}, ("attention",), True, "native"),
        "int8": ({"kv_format": "int8", "attention": "hot", "page_budget": 1.0}, ("kv_format", "attention"), False,
                 "int8"),
        "int4": ({"kv_format": "int4", "attention": "hot", "page_budget": 1.0}, ("kv_format", "attention"), False,
                 "int4"),
    }


def _row(mode: str, needle: float, recall: float, ppl: float, context: int = 2048) -> QualityRow:
    return QualityRow(mode, 0.1, "native", context, 8, needle, recall, ppl, 1.0, 0.0, 1.0)


def test_goals_against_dense() -> None:
    rows = [_row("dense", 1.0, 0.96, 2.0), _row("hot", 1.0, 0.955, 2.018), _row("h2o", 0.0, 0.1, 9.0),
            _row("int8", 1.0, 0.96, 2.011), _row("int4", 0.5, 0.5, 2.06)]
    found = {g.mode: g for g in goals(rows)}
    assert set(found) == {"hot", "int8", "int4"}
    assert (found["hot"].recall_ratio, found["hot"].ppl_ratio, found["hot"].met) == (
        pytest.approx(0.955 / 0.96), pytest.approx(1.009), True)
    assert (found["int8"].met, found["int4"].met) == (False, True)  # int8: ppl +0.55 %; int4: ppl only
    assert quality.GOALS["hot"] == (0.99, 1.01)


def test_an_accuracy_goal_is_not_met_where_dense_answers_nothing() -> None:
    """0 / 0 is unmeasured (NaN), not "as good as dense"; a perplexity-only goal still counts."""
    import math

    rows = [_row("dense", 0.0, 0.5, 2.0), _row("hot", 0.0, 0.5, 2.0), _row("int4", 0.0, 0.0, 2.0)]
    found = {g.mode: g for g in goals(rows)}
    assert math.isnan(found["hot"].needle_ratio) and not found["hot"].met
    assert math.isnan(found["int4"].needle_ratio) and found["int4"].met


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--check", "--out", "x"], "give --check or --out, not both"),
])
def test_quality_train_bad_flags_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                      message: str) -> None:
    rc, out, err = cli(capsys, "quality", "train", *argv)
    assert (rc, out, err) == (2, "", f"cxlemu: error: {message}\n")


@pytest.mark.parametrize("argv,message", [
    (["--examples", "0"], "--examples must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--context", "100"], "--context 100: a context of 100 tokens has no room"),
])
def test_quality_probe_bad_flags_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                      message: str) -> None:
    rc, out, err = cli(capsys, "quality", "probe", *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith(f"cxlemu: error: {message}")
