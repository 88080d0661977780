"""`cxlemu bench serve`'s pure parts: workload, time scale, metrics, checks (no vLLM started)."""
from __future__ import annotations

import math

import pytest

from tools.bench.serve import checks
from tools.sim.hardware import time_scale
from tools.sim.metrics import LevelResult, RequestRecord, max_concurrency, mismatches, outputs_vary, percentile
from tools.sim.workload import FIRST_TOKEN_ID, WorkloadConfig, clients, system_prompt

SMALL = WorkloadConfig(system_tokens=8, user_tokens=5, output_tokens=3, turns=3, doc_tokens=12, vocab=64, seed=1)


def test_clients_are_seeded_and_shaped():
    """Same config, same tokens; every doc_every-th client is a document client."""
    a, b = clients(SMALL, 6), clients(SMALL, 6)
    assert a == b
    assert [c.kind for c in a] == ["session", "session", "session", "doc", "session", "session"]
    assert [len(c.prefix) for c in a] == [8, 8, 8, 12, 8, 8]
    assert all(c.prefix == system_prompt(SMALL) for c in a if c.kind == "session")
    assert all(len(u) == 5 for c in a for u in c.user) and all(c.turns == 3 for c in a)
    assert all(FIRST_TOKEN_ID <= t < 64 for c in a for u in (c.prefix, *c.user) for t in u)
    assert clients(SMALL, 6)[0].user != clients(SMALL, 5)[0].user  # levels are independent draws
    assert clients(WorkloadConfig(seed=2), 1)[0].prefix != clients(WorkloadConfig(seed=1), 1)[0].prefix


def test_session_prompt_resends_the_conversation():
    c = clients(SMALL, 1)[0]
    outs = [[1, 2, 3], [7, 8, 9]]
    p = c.prompt(2, outs)
    assert p == [*c.prefix, *c.user[0], 1, 2, 3, *c.user[1], 7, 8, 9, *c.user[2]]
    assert len(p) == 8 + 2 * (5 + 3) + 5
    assert c.prompt(0, []) == [*c.prefix, *c.user[0]]
    assert c.request_id(2) == "c1-k0-t2"
    with pytest.raises(ValueError, match="needs the outputs"):
        c.prompt(2, outs[:1])
    with pytest.raises(IndexError):
        c.prompt(3, outs)


def test_arrivals_are_seeded_fractions_of_the_think_time():
    c = clients(SMALL, 2)[1]
    assert 0 <= c.start < 1 and len(c.think) == 2 and all(0.5 <= t < 1.5 for t in c.think)
    assert c.arrival_after(0, 2.0) == 2.0 * c.start and c.arrival_after(2, 2.0) == 2.0 * c.think[1]
    assert clients(SMALL, 2)[1].think == c.think


def test_doc_prompt_is_document_plus_question():
    d = clients(SMALL, 4)[3]
    assert d.prompt(1, []) == [*d.prefix, *d.user[1]]


def test_context_and_blocks_of_the_default_workload():
    cfg = WorkloadConfig()
    assert cfg.context_tokens == 256 + 4 * (120 + 16) == 800
    assert cfg.blocks_per_client(128) == 7
    assert SMALL.context_tokens == max(8 + 3 * 8, 12 + 5 + 3) == 32
    with pytest.raises(ValueError, match="turns must be >= 1"):
        WorkloadConfig(turns=0)


def test_time_scale_keeps_the_reference_link_to_compute_ratio():
    ts = time_scale(kv_bytes_per_token=12288, compute_s_per_token=0.001, links_gbps={"leo-x16": 50.0})
    ref_s = 0.2 / 4096
    assert ts["reference_s_per_token"] == pytest.approx(ref_s, rel=1e-15)
    assert ts["reference_kv_bytes_per_s_of_compute"] == pytest.approx(524288 / ref_s, rel=1e-15)
    assert ts["kv_bytes_per_s_of_compute"] == pytest.approx(12_288_000, rel=1e-15)
    assert ts["time_scale"] == pytest.approx(10_737_418_240 / 12_288_000, rel=1e-12)  # 873.81...
    assert ts["reference_flop_estimate_s_per_token"] == pytest.approx(35e-6, rel=1e-12)
    leo = ts["links"]["leo-x16"]
    assert leo["link_to_compute"] == pytest.approx(0.2147483648, rel=1e-12)
    # the scaled link here moves a context in the same fraction of its compute time
    here_link_s = 12288 / (leo["effective_gbps_here"] * 1e9)
    assert here_link_s / 0.001 == pytest.approx(leo["link_to_compute"], rel=1e-12)
    with pytest.raises(ValueError):
        time_scale(kv_bytes_per_token=0, compute_s_per_token=1.0)


def test_percentile_is_linear_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert (percentile(xs, 0), percentile(xs, 50), percentile(xs, 100)) == (1.0, 2.5, 4.0)
    assert percentile(xs, 99) == pytest.approx(3.97, abs=1e-12)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_max_concurrency_stops_at_the_first_level_over_twice_level_one():
    assert max_concurrency({1: 1.0, 2: 1.5, 4: 2.0, 6: 2.1, 8: 1.9}) == 4
    assert max_concurrency({1: 1.0, 2: 3.0}) == 1
    assert max_concurrency({2: 1.0, 4: math.nan, 6: 1.0}) == 2
    assert max_concurrency({}) == 0
    assert max_concurrency({1: 1.0, 2: 1.4}, factor=1.2) == 1


def _rec(rid: str, client: int, turn: int, arrival: float, first: float, finish: float, n: int,
         kind: str = "session", cached: int = 0, preempt: int = 0) -> RequestRecord:
    return RequestRecord(rid, client, kind, turn, 100, arrival, first, finish, list(range(n)), cached, preempt)


def test_level_summary_on_fixed_records():
    recs = [_rec("a", 0, 0, 0.0, 0.5, 1.5, 5, cached=128), _rec("b", 0, 1, 1.5, 1.7, 2.5, 5, preempt=1),
            _rec("c", 1, 0, 0.0, 1.0, 3.0, 5, kind="doc")]
    s = LevelResult("m", 2, recs, {"blocks_loaded": 3, "bytes_loaded": 1000, "stall_ns": 2_500_000_000}).summary()
    assert (s["ttft_p50_s"], s["returning_ttft_p50_s"]) == (0.5, pytest.approx(0.2))
    assert s["ttft_p99_s"] == pytest.approx(0.99)
    assert s["warm_ttft_p99_s"] == pytest.approx(0.2)  # the one later turn
    assert s["tpot_s"] == pytest.approx(0.25)  # (1.5-0.5)/4, (2.5-1.7)/4, (3-1)/4 -> 0.25, 0.2, 0.5
    assert (s["output_tokens"], s["output_tokens_per_s"]) == (15, 5.0)
    assert (s["cached_tokens"], s["tier_tokens"], s["preemptions"], s["stall_s"]) == (128, 384, 1, 2.5)


def test_outputs_vary_refuses_constant_references():
    assert outputs_vary([[5, 5, 5], [1, 2, 3]]) == (False, "1 of 2 outputs are one token repeated")
    assert outputs_vary([[1, 2], [1, 2]]) == (False, "all 2 outputs are the same sequence")
    assert outputs_vary([[1, 2], [2, 3]]) == (True, "2 outputs, 3 distinct tokens")
    assert mismatches({"x": [1], "y": [2], "z": [3]}, {"x": [1], "y": [9]}) == ["y", "z"]


def _summary(ttft99: list[float], tps: list[float], ret50: list[float], stall: float = 0.0) -> dict:
    return {lv: {"warm_ttft_p99_s": t, "output_tokens_per_s": p, "returning_ttft_p50_s": r, "stall_s": stall}
            for lv, t, p, r in zip((1, 2, 4, 8), ttft99, tps, ret50, strict=True)}


def test_checks_judge_measured_numbers():
    summary = {
        "all-resident": _summary([1, 1, 1, 1], [10, 20, 40, 80], [0.1] * 4),
        "none": _summary([1, 1.5, 3, 9], [10, 20, 20, 20], [0.1, 0.1, 0.9, 3.0]),
        "host-lru": _summary([1, 1.5, 3, 3], [10, 20, 30, 50], [0.1] * 4),
        "cxl-lru": _summary([1, 1.5, 1.9, 3], [10, 20, 38, 60], [0.1] * 4),
        "cxl-arc-forward": _summary([1, 1.5, 1.9, 1.9], [10, 20, 38, 70], [0.1, 0.1, 0.2, 0.5], stall=2.0),
        "cxl-smart": _summary([1, 1.5, 1.8, 1.9], [10, 20, 38, 75], [0.1, 0.1, 0.2, 0.4], stall=1.0),
    }
    found = {c.name: c for c in checks(summary, {"none": [], "cxl-smart": ["c8-k0-t1"]})}
    conc = found["cxl-smart max concurrency >= 1.75x none's"]
    assert (conc.passed, conc.detail) == (True, "cxl-smart 8 vs none 2 (goal >= 3.5)")
    tput = found["cxl-smart tokens/s at its max concurrency within 10% of all-resident"]
    assert tput.passed is True and tput.detail.startswith("at c=8: cxl-smart 75.0 tok/s vs all-resident 80.0 (94%")
    assert found["cxl-smart ahead of host-lru"].passed is True
    assert found["cxl-smart ahead of cxl-lru"].passed is True
    ret = found["returning sessions: cxl-smart TTFT p50 <= 1/3 of none's"]
    assert ret.passed is True and "400 ms vs none 3000 ms" in ret.detail
    assert found["layer-wise prefetch (cxl-smart) vs load-before-forward (cxl-arc-forward)"].passed is True
    assert found["tokens of none equal all-resident's"].passed is True
    assert found["tokens of cxl-smart equal all-resident's"].detail == "1 requests differ, e.g. c8-k0-t1"


def test_checks_name_the_mode_that_did_not_run():
    summary = {"all-resident": _summary([1] * 4, [1] * 4, [1] * 4), "none": _summary([1] * 4, [1] * 4, [1] * 4)}
    found = checks(summary, {"none": []}, {"cxl-smart": "ConfigError: no device"})
    first = found[0]
    assert first.passed is None and first.detail == "not run: cxl-smart (ConfigError: no device)"
    assert [c.passed for c in found][-1] is True  # none's tokens still compared


def test_plan_modes_sizes_kv_space_and_tier():
    from tools.bench.serve import MODES, plan_modes

    specs = {s.name: s for s in plan_modes(list(MODES), c0=4, levels=[1, 2, 4, 6, 8, 10], blocks_per_client=6,
                                           block_bytes=3 << 20, time_scale_k=650.0)}
    assert (specs["none"].kv_blocks, specs["all-resident"].kv_blocks, specs["cxl-smart"].kv_blocks) == (24, 62, 24)
    assert specs["cxl-smart"].tier_bytes == 96 * (3 << 20)  # 4 KV spaces (> 10 clients x 6 blocks)
    assert specs["cxl-smart"].device_capacity == 3 * (256 << 20)  # 288 MiB rounded up, + 256 MiB
    assert (specs["host-lru"].preset, specs["host-lru"].policy, specs["host-lru"].prefetch) == ("pcie-host", "lru", "forward")
    assert (specs["cxl-smart"].preset, specs["cxl-smart"].policy, specs["cxl-smart"].prefetch) == ("leo-x16", "arc", "layer")
    assert specs["cxl-arc-forward"].prefetch == "forward" and specs["none"].preset is None


def test_terminal_chart_renders_bars_and_values():
    from rich.console import Console

    from tools.cli.bench.serving import render_chart

    analysis = {"summary": {"none": {1: {"output_tokens_per_s": 10.0}, 2: {"output_tokens_per_s": 20.0}},
                            "cxl-smart": {1: {"output_tokens_per_s": 5.0}, 2: {"output_tokens_per_s": math.nan}}}}
    console = Console(record=True, width=100)
    console.print(render_chart(analysis, "output_tokens_per_s", "tok/s", width=4))
    text = console.export_text()
    assert "██   10" in text and "████ 20" in text and "█    5" in text and "c=2" in text


def test_cli_without_vllm_is_one_line_exit_2(monkeypatch, capsys):
    import sys

    from tools.cli.main import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm: ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "driver.vllm._compat", raising=False)
    assert main(["bench", "serve", "--quick"]) == 2
    assert capsys.readouterr().err == \
        ("cxlemu: error: `cxlemu bench serve` needs the vllm extra: pip install torch==2.13.0 --index-url "
         "https://download.pytorch.org/whl/cpu && pip install -e '.[vllm]' (in the cxlemu checkout)\n")


def test_pcie_host_preset_cites_its_numbers():
    from emulator import presets

    p = presets.load("pcie-host")
    assert (p.timing.read_bandwidth_gbps, p.timing.read_latency_ns) == (25, 8000)
    assert "PCIe 4.0 x16" in p.source and "cudaMemcpyAsync" in p.source


def test_scheduled_batch_reads_a_scheduler_output():
    """New requests' and running requests' computed-before counts, in num_scheduled_tokens' order;
    an id in neither list gets -1; the name mapping applies to the ids only."""
    from types import SimpleNamespace as NS

    from tools.bench._serve_engine import scheduled_batch

    out = NS(num_scheduled_tokens={"a-1": 1, "b-2": 48, "c-3": 16, "d-4": 2},
             scheduled_new_reqs=[NS(req_id="b-2", num_computed_tokens=32)],
             scheduled_cached_reqs=NS(req_ids=["a-1", "c-3"], num_computed_tokens=[90, 64]))
    assert scheduled_batch(out) == [["a-1", 1, 90], ["b-2", 48, 32], ["c-3", 16, 64], ["d-4", 2, -1]]
    assert scheduled_batch(out, lambda rid: rid.split("-")[0]) == [["a", 1, 90], ["b", 48, 32], ["c", 16, 64],
                                                                   ["d", 2, -1]]
    empty = NS(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=NS(req_ids=[],
                                                                                         num_computed_tokens=[]))
    assert scheduled_batch(empty) == []


def test_step_recorder_wraps_and_restores_schedule():
    """The wrapper hands each schedule()'s batch to take() once, with the external id or else the id
    less vLLM's "-<random>" suffix, and close() puts the class's schedule back."""
    from types import SimpleNamespace as NS

    from tools.bench._serve_engine import StepRecorder

    class Sched:
        def __init__(self):
            self.requests = {"r0-x": NS(external_req_id="r0"), "r1-y": NS(external_req_id=None)}

        def schedule(self, throttle=False):
            return NS(num_scheduled_tokens={"r0-x": 5, "r1-y": 1}, scheduled_new_reqs=[NS(req_id="r0-x",
                                                                                        num_computed_tokens=16)],
                      scheduled_cached_reqs=NS(req_ids=["r1-y"], num_computed_tokens=[40]))

    sched = Sched()
    engine = NS(engine_core=NS(engine_core=NS(scheduler=sched)))
    rec = StepRecorder(engine)
    assert rec.take() == []
    out = sched.schedule(True)
    assert out.num_scheduled_tokens == {"r0-x": 5, "r1-y": 1}
    assert rec.take() == [["r0", 5, 16], ["r1", 1, 40]]
    assert rec.take() == []
    rec.close()
    assert "schedule" not in vars(sched)
    sched.schedule()
    assert rec.take() == []
    assert StepRecorder(NS()).take() == []
