"""`cxlemu bench tier`: the whole path, the copies alone and the emulator's own cost, per block."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]', see README)")


def test_the_own_cost_is_the_whole_path_less_the_copies_measured_beside_it() -> None:
    from tools.bench import tier

    result = tier.run(layers=4, page=4096, blocks=(4,), jobs=8, reps=1)
    rows = result["rows"]
    assert [(r["page_bytes"], r["pattern"], r["direction"]) for r in rows] == [
        (64, "runs", "store"), (64, "runs", "load"), (64, "scattered", "store"), (64, "scattered", "load"),
        (4096, "runs", "store"), (4096, "runs", "load"), (4096, "scattered", "store"), (4096, "scattered", "load")]
    for r in rows:
        assert r["descriptors_per_job"] == (4 if r["pattern"] == "runs" else 16)
        assert r["copies_us_per_block"] > 0 and r["cpu_us_per_block"] > 0
        # one pass each: own is exactly the difference (each figure rounded to the ns)
        assert abs(r["own_us_per_block"] - (r["cpu_us_per_block"] - r["copies_us_per_block"])) <= 0.002
        assert r["pass"] == (r["own_us_per_block"] <= 2.0 if r["page_bytes"] == 64 else None)
    assert result["ok"] == all(r["pass"] for r in rows[:2])
