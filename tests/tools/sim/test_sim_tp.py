"""Tensor parallelism: the weights, the KV and the FLOPs split over tp accelerators, two ring
all-reduces a layer over NVLink. Every expected value is the arithmetic written out by hand."""
from __future__ import annotations

import pytest

from tools.sim import hardware as hw
from tools.sim.grid import SweepError, expand
from tools.sim.pricing import Prices, cost_per_token
from tools.sim.run import Point, simulate

H100 = hw.ACCELERATORS["h100"]
L70 = hw.MODELS["llama-3-70b"]
# llama-3-70b, by hand: a layer 2 x 8192^2 (Q, O) + 2 x 8192 x 1024 (K, V) + 3 x 8192 x 28672 (MLP)
# + 2 x 8192 (norms) = 855,654,400; dense 80 x that + 8192 = 68,452,360,192; embeddings and LM head
# 2 x 128256 x 8192 = 2,101,346,304; 70,553,706,496 parameters = 141,107,412,992 bytes
WEIGHTS_70B = 141_107_412_992
KV_PER_GPU_TP4 = 2 * 80 * 2 * 128 * 2  # 8 KV heads / 4 = 2 on each accelerator: 81,920 B a token


def test_the_70b_shape_is_the_one_written_out():
    assert L70.weight_bytes == WEIGHTS_70B
    assert L70.kv_bytes_per_token_per_gpu(4) == KV_PER_GPU_TP4
    assert L70.kv_bytes_per_token_per_gpu(1) == L70.kv_bytes_per_token == 327_680  # Mooncake's 320 KB
    # more accelerators than KV heads: each holds one KV head (vLLM replicates them)
    assert hw.MODELS["llama-3-8b"].kv_bytes_per_token_per_gpu(16) == 2 * 32 * 1 * 128 * 2


def test_ring_allreduce_is_bandwidth_plus_a_latency_a_step():
    # 2(N-1)/N x bytes / 450 GB/s (H100's NVLink, each way) + 2(N-1) steps x 1.9 us
    assert hw.allreduce_ns(H100, 1, 10**6) == 0.0
    assert hw.allreduce_ns(H100, 4, 10**6) == pytest.approx(1.5e6 / 450 + 6 * 1900, rel=1e-12)  # 14,733.3 ns
    assert hw.allreduce_ns(H100, 8, 10**6) == pytest.approx(1.75e6 / 450 + 14 * 1900, rel=1e-12)
    a100 = hw.ACCELERATORS["a100-80gb"]
    assert hw.allreduce_ns(a100, 2, 3 * 10**6) == pytest.approx(3e6 / 300 + 2 * 1900, rel=1e-12)


def test_a_steps_tp_traffic_is_two_allreduces_a_layer_of_the_tokens_hidden_states():
    # one token: 8192 x 2 B = 16,384 B; 160 all-reduces of 1.5 x 16384 / 450 + 6 x 1900 ns
    assert hw.tp_comm_ns(L70, H100, 4, 1) == pytest.approx(160 * (1.5 * 16384 / 450 + 11400), rel=1e-12)
    assert hw.tp_comm_ns(L70, H100, 4, 1) == pytest.approx(1_832_738.133, rel=1e-9)


def test_roofline_splits_the_work_and_adds_the_allreduces():
    r = hw.Roofline(L70, H100, mfu=0.5, mbu=0.8, overhead_us=2000, tp=4)
    b = hw.Batch()
    b.add(1, 999, True)  # a decode step at context 1000
    # memory-bound: 141,107,412,992 / 4 + 81,920 x 1000 = 35,358,773,248 B at 3350 x 0.8 GB/s
    assert r.bytes(b) == 35_358_773_248
    # FLOPs 2 x 68,452,360,192 + 4 x 80 x 8192 x 1000 + 2 x 8192 x 128256 = 141,627,506,688, / 4
    # / (989e12 x 0.5) = 71.6 us: well under the 13.2 ms of memory
    assert r.flops(b) == 141_627_506_688
    expected = 35_358_773_248 / 2.68e12 * 1e9 + 160 * (1.5 * 16384 / 450 + 11400) + 2e6
    assert r.step_ns(b) == pytest.approx(expected, rel=1e-12)  # 17.03 ms
    one = hw.Roofline(L70, H100, mfu=0.5, mbu=0.8, overhead_us=2000)
    assert one.step_ns(b) == pytest.approx((WEIGHTS_70B + 327_680 * 1000) / 2.68e12 * 1e9 + 2e6, rel=1e-12)


def test_kv_capacity_per_accelerator_and_tokens_per_instance():
    cap = hw.kv_capacity(L70, H100, max_num_batched_tokens=8192, tp=4)
    # 80 GB x 0.9 = 72e9; weights 141,107,412,992 / 4 = 35,276,853,248; activations 8192 x (4 x 8192 +
    # 2 x 28672 / 4) x 2 + 8192 x 128256 / 4 x 4 / 8 = 771,751,936 + 131,334,144; reserve 1 GiB
    kv = 72e9 - 35_276_853_248 - (771_751_936 + 131_334_144) - 2**30
    assert kv == 34_746_318_848
    assert (cap["weight_bytes"], cap["activation_bytes"], cap["kv_bytes"]) == (35_276_853_248, 903_086_080, kv)
    assert cap["kv_tokens"] == kv / 81_920  # 424,149 tokens
    assert hw.kv_capacity(L70, H100, max_num_batched_tokens=8192)["kv_bytes"] == 0.0  # 141 GB of weights on 80


def test_llama3_70b_runs_on_4_and_8_h100s_and_is_refused_on_one():
    wl = {"kind": "fixed", "context": 1024, "output_tokens": 8, "requests": 1}
    with pytest.raises(ValueError, match="leaves no KV space on h100"):
        simulate(Point(model="llama-3-70b", accelerator="h100", workload=wl))
    for tp in (4, 8):
        out = simulate(Point(model="llama-3-70b", accelerator="h100", tp=tp, concurrency=2, workload=wl))
        assert (out["requests"], out["tp"], out["output_tokens"]) == (2, tp, 16)
        assert out["kv_tokens"] == Point(model="llama-3-70b", tp=tp).kv_space()[0] * 16
    four = Point(model="llama-3-70b", accelerator="h100", tp=4)
    assert four.kv_space()[0] == int(34_746_318_848 / 81_920 // 16)  # 26,509 blocks
    assert four.instance == "4 x h100"


def test_a_model_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="does not split over 3 accelerators"):
        Point(model="llama-3-70b", tp=3)
    with pytest.raises(ValueError, match="does not split over 64"):
        Point(model="llama-2-7b", tp=64)  # 32 heads


def test_the_sweep_varies_tp_and_prices_every_accelerator():
    grid = {"models": ["llama-3-70b"], "accelerators": ["h100"], "tp": [4, 8], "workloads": ["fixed"],
            "modes": ["none"], "concurrency": [1]}
    assert [(p.tp, p.instance) for p in expand(grid)] == [(4, "4 x h100"), (8, "8 x h100")]
    with pytest.raises(SweepError, match="does not split") as e:
        expand({**grid, "tp": [3]})
    assert e.value.key == "tp"
    rows = [{"accelerator": "h100", "tp": 4, "mode": "none", "output_tokens_per_s": 1000.0},
            {"accelerator": "h100", "mode": "none", "output_tokens_per_s": 1000.0}]
    cost_per_token(rows, Prices(accelerator={"h100": 2.5}))
    # 4 x 2.5 USD an hour over 3.6 M tokens an hour; one accelerator when the row has no tp
    assert rows[0]["usd_per_million_tokens"] == pytest.approx(10 / 3.6, rel=1e-12)
    assert rows[1]["usd_per_million_tokens"] == pytest.approx(2.5 / 3.6, rel=1e-12)
