"""`--cost profile`: step times from Vidur's measured operators (tools/sim/data/vidur), the roofline
where Vidur profiled nothing, and `cxlemu sim check`. Expected values are the data files' rows
summed by hand."""
from __future__ import annotations

import json

import pytest
from cli_support import cli

from tools.sim import hardware as hw
from tools.sim.check import PUBLISHED, check
from tools.sim.profile import ProfileCost, load_allreduce, load_profile, step_cost
from tools.sim.run import Point, simulate

L7 = hw.MODELS["llama-2-7b"]
A100 = hw.ACCELERATORS["a100-80gb"]
# compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv, tp 1, the nine operators of a row summed (ms)
AT_128 = 0.005 + 0.0745 + 0.007 + 0.032 + 0.005 + 0.157 + 0.011 + 0.088 + 0.003  # 0.3825
AT_136 = 0.005 + 0.132 + 0.01 + 0.038 + 0.005 + 0.205 + 0.0125 + 0.139 + 0.003  # 0.5495
AT_2048 = ((0.053 + 0.979 + 0.076 + 0.301 + 0.055 + 1.694 + 0.135 + 0.851 + 0.028)  # two rows: averaged
           + (0.053 + 0.9795 + 0.076 + 0.301 + 0.054 + 1.693 + 0.135 + 0.85 + 0.028)) / 2
AT_4096 = ((0.105 + 1.911 + 0.149 + 0.611 + 0.104 + 3.3655 + 0.266 + 1.604 + 0.055)
           + (0.104 + 1.8865 + 0.1485 + 0.603 + 0.104 + 3.324 + 0.2645 + 1.585 + 0.055)) / 2


def test_a_layer_is_its_operators_summed_and_interpolated_over_tokens():
    prof = load_profile("llama-2-7b", "a100-80gb", 1)
    assert prof.layer_ns(128) == pytest.approx(AT_128 * 1e6, rel=1e-12)
    assert prof.layer_ns(2048) == pytest.approx(AT_2048 * 1e6, rel=1e-12)
    assert prof.layer_ns(132) == pytest.approx((AT_128 + AT_136) / 2 * 1e6, rel=1e-12)  # halfway: linear
    assert prof.layer_ns(8192) == pytest.approx(AT_4096 * 2 * 1e6, rel=1e-12)  # past 4,096: in proportion
    assert load_profile("llama-3-8b", "h100", 1) is None  # Vidur has no H100 profile of Llama-3


def test_a_prefill_step_is_the_profiled_layers_plus_the_roofline_of_the_rest():
    cost = step_cost("profile", "llama-2-7b", L7, "a100-80gb")
    assert isinstance(cost, ProfileCost)
    b = hw.Batch()
    b.add(128, 0, True)
    flops_s, bytes_s = 312e12 * 0.5, 2039e9 * 0.8
    # attention: 4 x 32 x 4096 x (128 x 129 / 2) FLOPs against 512 KiB x 128 tokens of KV: the KV wins
    attention = max(4 * 32 * 4096 * 8256 / flops_s, 524_288 * 128 / bytes_s)
    head = max(2 * 4096 * 32000 / flops_s, 4096 * 32000 * 2 / bytes_s)  # the LM head's weights: 160.7 us
    expected = 32 * AT_128 * 1e6 + (attention + head) * 1e9 + 2e6
    assert cost.step_ns(b) == pytest.approx(expected, rel=1e-12)  # 14.44 ms
    assert cost.parts_ns(b)["allreduce"] == 0.0


def test_tensor_parallel_steps_use_the_measured_allreduce():
    sizes, ms = load_allreduce("a100-80gb", 4)
    cost = step_cost("profile", "llama-2-70b", hw.MODELS["llama-2-70b"], "a100-80gb", tp=4)
    assert cost.allreduce_ns(1_048_576) == pytest.approx(0.064e6, rel=1e-12)  # network/a100_dgx: 4,1048576,0.064
    assert cost.allreduce_ns(1000) == pytest.approx(0.061e6, rel=1e-12)  # below the smallest (2,048 B): its time
    assert cost.allreduce_ns(2 * 67_108_864) == pytest.approx(2 * 0.603e6, rel=1e-12)  # past 64 MiB: in proportion
    b = hw.Batch()
    b.add(64, 0, True)  # 64 x 8192 x 2 B = 1 MiB a layer, twice a layer, 80 layers
    assert cost.parts_ns(b)["allreduce"] == pytest.approx(160 * 0.064e6, rel=1e-12)
    assert load_allreduce("h200", 4) is None


def test_profile_falls_back_to_the_roofline_where_nothing_was_profiled():
    assert isinstance(step_cost("profile", "llama-2-7b", L7, "h200"), hw.Roofline)
    assert isinstance(step_cost("profile", "", L7, "a100-80gb"), hw.Roofline)  # a shape of one's own
    assert isinstance(step_cost("roofline", "llama-2-7b", L7, "a100-80gb"), hw.Roofline)
    with pytest.raises(ValueError, match="unknown cost model 'measured'"):
        step_cost("measured", "llama-2-7b", L7, "a100-80gb")
    with pytest.raises(ValueError, match="unknown cost model"):
        Point(cost_model="measured")
    wl = {"kind": "fixed", "context": 512, "output_tokens": 4, "requests": 1}
    on = simulate(Point(accelerator="a100-80gb", cost_model="profile", workload=wl))
    off = simulate(Point(accelerator="h200", cost_model="profile", workload=wl))
    assert (on["cost"], off["cost"], on["requests"]) == ("profile", "roofline", 1)


def test_check_sets_both_cost_models_beside_the_published_rows():
    rows = check()
    assert [(r["model"], r["tp"], r["input_tokens"], r["published_ms"]) for r in rows] == [
        ("llama-2-7b", 1, 128, 16.0), ("llama-2-7b", 1, 2048, 133.0), ("llama-2-70b", 4, 128, 47.0),
        ("llama-2-70b", 4, 2048, 377.0)]
    b = hw.Batch()
    b.add(128, 0, True)
    assert rows[0]["profile_ms"] == step_cost("profile", "llama-2-7b", L7, "a100-80gb").step_ns(b) / 1e6
    assert rows[0]["roofline_ms"] == hw.Roofline(L7, A100).step_ns(b) / 1e6
    for r in rows:
        assert r["profile_used"] == "profile" and r["batch"] == 1
        assert r["profile_ratio"] == r["profile_ms"] / r["published_ms"]
    assert len(rows) == len(PUBLISHED)


def test_sim_check_and_cost_on_the_command_line(capsys):
    code, out, _ = cli(capsys, "sim", "check", "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) == 4
    assert set(rows[0]) >= {"model", "accelerator", "tp", "input_tokens", "batch", "published_ms", "profile_ms",
                            "roofline_ms"}
    code, out, _ = cli(capsys, "sim", "check")
    assert code == 0 and "llama-2-70b" in out and "377" in out
    code, out, _ = cli(capsys, "sim", "serve", "--accelerator", "a100-80gb", "--cost", "profile", "--context", "512",
                       "--output-tokens", "4", "--requests", "1", "--concurrency", "1", "--offload", "none", "--json")
    assert code == 0 and json.loads(out)["cost"] == "profile"
    code, _, err = cli(capsys, "sim", "serve", "--cost", "measured")
    assert code == 2 and "invalid choice: 'measured'" in err
