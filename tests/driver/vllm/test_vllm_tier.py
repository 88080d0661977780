"""cxlemu as vLLM's KV offload tier, run on vLLM-CPU in-process (skipped when vLLM is absent).

Each test starts an engine (a 4-layer random Llama, ~3 s) whose KV space holds 10 blocks of 128
tokens, so six 300-token prompts push the first ones out; resending those brings their blocks
back from the device. Tokens are compared with vLLM alone.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from driver.vllm import kv_transfer_config, tier_stats
from driver.vllm._stats import live_manager, reset_tier_stats

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]', see README)")

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from driver.vllm._worker import live_worker
from driver.vllm.testing import model_dir, random_prompts
from emulator.device import DeviceConfig, serve

KV_BLOCKS = 10
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(model_dir(tmp_path_factory.mktemp("llama")))


@contextlib.contextmanager
def engine(model: str, transfer: dict[str, Any] | None = None, **kw: Any) -> Iterator[LLM]:
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=1024, max_num_seqs=4, seed=0,
              num_gpu_blocks_override=KV_BLOCKS, kv_transfer_config=transfer, **kw)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0), use_tqdm=False)


def tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


PROMPTS = random_prompts(6, 300, seed=3)
RETURNING = PROMPTS[:2]  # pushed out of the KV space by the four after them


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[int]]:
    with engine(model) as llm:
        out = tokens(generate(llm, PROMPTS))
    assert len({tuple(t) for t in out}) == len(out) and all(len(set(t)) > NEW_TOKENS // 2 for t in out), \
        "the random model's greedy outputs must vary, or equality proves nothing"
    return out


@pytest.fixture
def device(request: pytest.FixtureRequest) -> Iterator[Any]:
    import re

    name = f"vt{os.getpid() % 100000}-{re.sub('[^A-Za-z0-9]', '', request.node.name)[-20:]}"
    reset_tier_stats(name)
    with serve(DeviceConfig(name=name, capacity=256 << 20)) as dev:
        yield dev
    reset_tier_stats(name)


@pytest.mark.parametrize(("prefetch", "staging_bytes"), [("forward", None), ("layer", None), ("forward", 1),
                                                         ("layer", 64 << 20)])
def test_evicted_prompts_come_back_from_the_device_with_vllms_tokens(model: str, reference: list[list[int]],
                                                                     device: Any, prefetch: str,
                                                                     staging_bytes: int | None) -> None:
    """Also staged, as on CUDA (the KV through a host bounce buffer): one slot (every job cut into
    one-block pieces, layer-wise loads waited whole), and a buffer that holds every job."""
    staged = {} if staging_bytes is None else {"staging": True, "staging_bytes": staging_bytes}
    cfg = kv_transfer_config(device=device.name, policy="arc", prefetch=prefetch, cxl_bytes_to_use=64 << 20,
                             **staged)
    with engine(model, cfg) as llm:
        first = generate(llm, PROMPTS)
        again = generate(llm, RETURNING)
        stats = tier_stats(device.name).as_dict()
        worker = live_worker(device.name)
        assert worker is not None and (worker.staging is None) == (staging_bytes is None)
        if worker.staging is not None:
            assert worker.staging.slots.count == (1 if staging_bytes == 1 else KV_BLOCKS)
    assert tokens(first) == reference
    assert tokens(again) == reference[:2]
    assert [o.num_cached_tokens for o in again] == [256, 256]  # two full blocks each, from the tier
    assert stats["blocks_loaded"] == 4 and stats["failed_loads"] == 0
    assert stats["bytes_loaded"] == 4 * stats["bytes_stored"] // stats["blocks_stored"]
    if prefetch == "layer":
        assert stats["layer_waits"] > 0


def test_the_tier_publishes_to_the_telemetry_page(model: str, device: Any) -> None:
    """What ``cxlemu monitor`` and the exporter read: hits, blocks each way, chunk size; and the
    worker's job log (what ``cxlemu bench serve`` records per level) agrees with them."""
    from driver.memdev import MemDev
    from emulator.telemetry import TelemetryReader

    cfg = kv_transfer_config(device=device.name, policy="lru", cxl_bytes_to_use=64 << 20)
    with engine(model, cfg) as llm:
        worker = live_worker(device.name)
        worker.job_log = []
        generate(llm, PROMPTS)
        generate(llm, RETURNING)
        chunk_bytes = worker.chunk_bytes
        log, worker.job_log = worker.job_log, None
    assert sum(b for _, kind, b, *_ in log if kind == "load") == 4
    assert sum(b for _, kind, b, *_ in log if kind == "store") == 12
    # this device's link is untimed: no completion times, so no link-done moment
    assert all(sub <= seen and done is None and ok for sub, _, _, done, seen, ok in log)
    with MemDev.open(device.name) as md:
        host = TelemetryReader(md.bar).snapshot().host
    stats = tier_stats(device.name).as_dict()
    assert (host.hits, host.loads, host.offloads) == (stats["hits"], 4, stats["blocks_stored"])
    assert host.misses == stats["lookups"] - stats["hits"] and host.offloads == 12
    assert host.chunk_bytes == chunk_bytes and host.blocks_total == (64 << 20) // chunk_bytes


def test_a_multiprocess_run_publishes_the_schedulers_hit_rate(model: str, reference: list[list[int]], device: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's default: the engine core (the scheduler and the tier's manager) and the worker in
    processes of their own, none of them this one. The worker publishes the telemetry page with
    the manager's lookups and hits, read from the manager's page beside the device, so the
    monitor shows the hit rate (it was blank). The one engine start of this kind (~50 s)."""
    from driver.memdev import MemDev
    from driver.vllm import ManagerCounters
    from emulator.telemetry import TelemetryReader

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    cfg = kv_transfer_config(device=device.name, policy="lru", cxl_bytes_to_use=64 << 20)
    with engine(model, cfg) as llm:
        generate(llm, PROMPTS)
        again = generate(llm, RETURNING)
    with MemDev.open(device.name) as md:
        host = TelemetryReader(md.bar).snapshot().host
    counts = ManagerCounters(device.name, writer=False).read()
    assert tokens(again) == reference[:2]
    assert tier_stats(device.name).as_dict()["lookups"] == 0  # nothing of it ran in this process
    assert counts is not None and counts["hits"] >= 4 and counts["lookups"] > counts["hits"]
    assert (host.hits, host.misses) == (counts["hits"], counts["lookups"] - counts["hits"])
    assert (host.loads, host.offloads) == (4, 12)


def test_a_jobs_link_done_is_its_last_completion_on_the_links_clock() -> None:
    """Completion times are on the link's clock (ns); the job log wants perf_counter seconds:
    the last one, 1 s before the link's now of 6e9 ns, is 1 s before perf_counter's now."""
    from types import SimpleNamespace

    from driver.vllm._worker import _link_done
    from emulator.spec.errors import DmaError

    def job(*results: list) -> Any:
        return SimpleNamespace(handles=[SimpleNamespace(wait=lambda r=r: r) for r in results])

    assert _link_done(job([4_000_000_000, 5_000_000_000], [3_000_000_000]), 100.0, 6_000_000_000) == 99.0
    assert _link_done(job([0, 0]), 100.0, 6_000_000_000) is None  # an untimed link
    assert _link_done(job([DmaError(0, "poisoned")]), 100.0, 6_000_000_000) is None


def test_hotness_is_fed_by_the_devices_chmu(model: str, reference: list[list[int]], device: Any) -> None:
    """policy "hotness" on a served device: the tier's accesses reach the device's CHMU, whose
    hotlist (DPA, count) the manager maps back to blocks and adds to their heat."""
    import time

    # the manager reads the hotlist every 8 scheduler steps here (a run takes 38-67): what it
    # took then counts, as what the test's own reads take at the end
    cfg = kv_transfer_config(device=device.name, policy="hotness", cxl_bytes_to_use=64 << 20, hotlist_every=8)
    with engine(model, cfg) as llm:
        generate(llm, PROMPTS)
        again = generate(llm, RETURNING)
        manager = live_manager(device.name)
        worker = live_worker(device.name)
        chunk_of = manager._hotlist.chunk_of
        assert all(chunk_of(worker.chunk_dpa(c, t) + off) == c for c in (0, 1, worker.num_chunks - 1)
                   for t in range(len(worker.pages)) for off in (0, 4096, worker.pages[t] - 1))
        assert manager._hotlist.unit == 64 << 10  # a page: 128 tokens x 2 KV heads x 32 x (K, V) x 4 B
        # an epoch (10 ms) must end for the last entries: on a busy 2-vCPU host the firmware's
        # thread may take longer
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            manager.feed_hotlist()
            if tier_stats(device.name).hotlist_entries:
                break
            time.sleep(0.02)
        used = tier_stats(device.name).hotlist_entries
        heat = {k: manager.firmware_policy.policy.heat(k) for k in manager.firmware_policy.chunks}
        fw, feed = device.firmware, worker.memdev.access_feed
        unit = fw.chmu.unit
        why = (f"CHMU feed enabled {feed.enabled}, {feed._count} accesses pending in the worker, "
               f"{fw.access_feed.drained} drained ({fw.access_feed.dropped} dropped) by the firmware, whose "
               f"runner is {'alive' if device._thread is not None and device._thread.is_alive() else 'gone'}; "
               f"unit enabled {unit.enabled}, {unit.status}, last error {fw.chmu.last_error!r}; "
               f"{manager._steps} scheduler steps, hotlist now {manager._hotlist.regs.read_hotlist(consume=False)[:4]}, "
               f"{len(manager.firmware_policy.chunks)} chunks held, tier {tier_stats(device.name).as_dict()}")
    assert tokens(again) == reference[:2]
    assert used > 0 and max(heat.values()) > 1, why  # more than the insert's own unit of heat
    assert not unit.status.overflow, why  # 4 KiB units overflowed the 1023 entries in this run


@pytest.mark.parametrize("prefetch", ["forward", "layer"])
def test_a_returning_conversation_loads_its_prefix_and_stores_what_it_adds(
        model: str, device: Any, prefetch: str) -> None:
    """Multi-turn: the prompt comes back longer. Its old blocks load from the tier and its new
    blocks are stored in the same step (layer-wise, the load is synchronous: vLLM's offloading
    scheduler must not find it pending when the step's store is prepared); vLLM's stat loggers
    on, as `vllm serve` runs them."""
    grown = [p + random_prompts(1, 280, seed=11 + i)[0] for i, p in enumerate(RETURNING)]
    with engine(model) as alone:
        expect = tokens(generate(alone, grown))
    cfg = kv_transfer_config(device=device.name, policy="arc", prefetch=prefetch, cxl_bytes_to_use=64 << 20)
    with engine(model, cfg, disable_log_stats=False) as llm:
        generate(llm, PROMPTS)
        stored_before = tier_stats(device.name).as_dict()["blocks_stored"]
        again = generate(llm, grown)
        third = generate(llm, grown)
    stats = tier_stats(device.name).as_dict()
    assert tokens(again) == expect and tokens(third) == expect
    assert [o.num_cached_tokens for o in again] == [256, 256]
    assert stats["blocks_stored"] - stored_before >= 4 and stats["failed_loads"] == 0


def test_the_stock_offloading_connector_runs_the_spec(model: str, reference: list[list[int]], device: Any) -> None:
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"spec_name": "CxlOffloadingSpec", "spec_module_path": "driver.vllm",
                                         "device": device.name, "policy": "s3fifo", "cxl_bytes_to_use": 64 << 20}}
    with engine(model, cfg) as llm:
        generate(llm, PROMPTS)
        again = generate(llm, RETURNING)
    assert tokens(again) == reference[:2]
    assert tier_stats(device.name).as_dict()["blocks_loaded"] == 4


@pytest.mark.parametrize(("fmt", "prefetch"), [("int8", "forward"), ("int4", "layer")])
def test_a_compressed_tier_holds_and_moves_encoded_blocks(model: str, reference: list[list[int]], device: Any,
                                                          fmt: str, prefetch: str) -> None:
    """kv_format: the device holds each layer's page encoded (2 kv heads x key and value pieces
    of 128 tokens x 32 float32), the link moves those bytes, the chunk count grows by the ratio,
    and the returning prompts' blocks come back decoded (their tokens compared with vLLM alone)."""
    from driver.memdev import MemDev
    from firmware_model.kv_codec import PieceCodec

    piece = PieceCodec(fmt, 128, 32, "f32")
    cfg = kv_transfer_config(device=device.name, policy="lru", prefetch=prefetch, cxl_bytes_to_use=64 << 20,
                             kv_format=fmt)
    with engine(model, cfg) as llm:
        first = generate(llm, PROMPTS)
        worker = live_worker(device.name)
        kv_pages = worker.blocks(0).copy()  # layer 0 of every KV block, as vLLM-CPU keeps them
        chunk = _stored_chunks(worker)[0]
        page = bytes(worker.memdev.media[worker.chunk_dpa(chunk, 1):][:worker.device_pages[1]])
        again = generate(llm, RETURNING)
        link = worker.store.datapath.counters()
        num_chunks = worker.num_chunks
    stats = tier_stats(device.name).as_dict()
    assert worker.device_pages == [4 * piece.encoded_bytes] * 4
    assert num_chunks == (64 << 20) // (16 * piece.encoded_bytes)
    assert tokens(first) == reference
    assert stats["blocks_loaded"] == 4 and stats["failed_loads"] == 0
    assert stats["link_bytes_stored"] == stats["blocks_stored"] * 16 * piece.encoded_bytes == link["write_bytes"]
    assert stats["link_bytes_loaded"] == 4 * 16 * piece.encoded_bytes == link["read_bytes"]
    assert stats["bytes_loaded"] == 4 * 16 * piece.native_bytes
    enc = np.frombuffer(page, np.uint8).reshape(4, piece.encoded_bytes)
    if fmt == "int4":  # the header: 128 valid tokens, keys per channel, values per token
        assert enc[:, :4].copy().view(np.uint16).tolist() == [[128, 1], [128, 0]] * 2
    assert np.isfinite(piece.dequantize(enc)).all() and np.abs(piece.dequantize(enc)).max() > 0
    if fmt == "int8":  # int8 keeps every token of this model; int4 changes the first of one prompt
        assert tokens(again) == reference[:2]
    # the layout the codec assumes: keys [head_size][block_size], then values [block_size][head_size]
    keys, values = _hf_kv(model, PROMPTS[-1][:128])  # (kv heads, 128, 32) of layer 0
    pages = kv_pages.view(np.float32).reshape(len(kv_pages), 2, 2, 32 * 128)
    hit = [b for b in range(len(pages)) if np.allclose(pages[b, 0, 1].reshape(128, 32), values[0], atol=1e-5)]
    assert len(hit) == 1 and np.allclose(pages[hit[0], :, 0].reshape(2, 32, 128), keys.transpose(0, 2, 1), atol=1e-5)


def _hf_kv(model: str, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0's keys and values of ``prompt`` by transformers, from the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(torch.tensor([prompt]), past_key_values=cache)
    return cache.layers[0].keys[0].numpy(), cache.layers[0].values[0].numpy()


def _stored_chunks(worker: Any) -> list[int]:
    manager = live_manager(worker.spec.device_name)
    return sorted(c.chunk_id for c in manager.firmware_policy.chunks.values())


def test_a_corrupted_device_copy_changes_the_output(model: str, reference: list[list[int]], device: Any) -> None:
    """The negative control: the loaded KV really drives generation."""
    cfg = kv_transfer_config(device=device.name, policy="lru", cxl_bytes_to_use=64 << 20)
    with engine(model, cfg) as llm:
        generate(llm, PROMPTS)
        worker = live_worker(device.name)
        rng = np.random.default_rng(0)
        for chunk in _stored_chunks(worker):
            for layer, page in enumerate(worker.pages):
                worker.memdev.write_untimed(worker.chunk_dpa(chunk, layer),
                                            rng.standard_normal(page // 4).astype(np.float32))
        again = generate(llm, RETURNING)
    assert tier_stats(device.name).as_dict()["blocks_loaded"] == 4
    assert tokens(again) != reference[:2]


@pytest.mark.parametrize("prefetch", ["forward", "layer"])
def test_a_poisoned_block_is_recomputed_not_attended(model: str, reference: list[list[int]], device: Any,
                                                     prefetch: str) -> None:
    cfg = kv_transfer_config(device=device.name, policy="lru", prefetch=prefetch, cxl_bytes_to_use=64 << 20)
    with engine(model, cfg) as llm:
        generate(llm, PROMPTS)
        worker = live_worker(device.name)
        for chunk in _stored_chunks(worker):  # every stored block: whichever comes back fails
            worker.memdev.inject_poison(worker.chunk_dpa(chunk, 2) + 128)
        again = generate(llm, RETURNING)
    stats = tier_stats(device.name).as_dict()
    assert tokens(again) == reference[:2]
    assert stats["failed_loads"] == 2 and stats["failed_blocks"] == 4 and stats["blocks_loaded"] == 0


def test_capacity_is_honoured_and_nothing_is_left_after_shutdown(model: str, reference: list[list[int]],
                                                                 device: Any) -> None:
    with engine(model) as probe:  # the bytes of one block on this model
        del probe
    cfg = kv_transfer_config(device=device.name, policy="lru", cxl_bytes_to_use=3 * (256 << 10))
    with engine(model, cfg) as llm:
        worker = live_worker(device.name)
        assert worker.num_chunks == 3 and worker.chunk_bytes == 256 << 10
        out = generate(llm, PROMPTS)
        manager = live_manager(device.name)
        assert manager.chunks_in_use() <= 3 and len(manager.firmware_policy.chunks) <= 3
        assert worker.region_bytes == 3 * (256 << 10)
    stats = tier_stats(device.name).as_dict()
    assert tokens(out) == reference
    assert stats["evictions"] > 0 and stats["blocks_stored"] == 12 - 3 + 3  # every offer stored, 9 evicted
    assert live_worker(device.name) is None
    lock = device.files.path / "kv.lock"  # released: another process may take the device now
    import fcntl
    with open(lock, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_private_device_is_served_and_removed(model: str, reference: list[list[int]]) -> None:
    cfg = kv_transfer_config(policy="hotness", cxl_bytes_to_use=32 << 20)
    with engine(model, cfg) as llm:
        generate(llm, PROMPTS)
        again = generate(llm, RETURNING)
        (name,) = [n for n in _live_names() if n.startswith("vllm")]
        path = live_worker(name).memdev.files.path
        assert path.exists()
    assert tokens(again) == reference[:2]
    assert not path.exists()


def _live_names() -> list[str]:
    from driver.vllm import _worker

    return list(_worker._LIVE)


@contextlib.contextmanager
def warnings_logged() -> Iterator[list[logging.LogRecord]]:
    """Every record at WARNING or above, from vLLM's loggers (which do not propagate to the root)
    and from the rest (the tier's), while the block runs."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record not in records:
                records.append(record)

    handler = Keep(logging.WARNING)
    loggers = [logging.getLogger("vllm"), logging.getLogger()]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@contextlib.contextmanager
def served_process(name: str) -> Iterator[Any]:
    """``cxlemu serve`` in a process of its own (so a test can kill -9 its firmware)."""
    import subprocess
    import sys
    import time

    from emulator.device import destroy, firmware_pid

    proc = subprocess.Popen([sys.executable, "-m", "tools.cli.main", "serve", "--name", name, "--capacity", "256M"],
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while firmware_pid(name) != proc.pid:
            assert proc.poll() is None and time.monotonic() < deadline, "cxlemu serve did not come up"
            time.sleep(0.02)
        yield proc
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(Exception):
            destroy(name)


LOST_ROUNDS = 20


def test_a_device_whose_firmware_is_killed_is_reported_once_and_serving_goes_on(
        model: str, reference: list[list[int]]) -> None:
    """kill -9 of the device's server mid-run: the tier says so once, and over 20 rounds after it
    stores nothing and loads nothing, quietly (each store vLLM offered was refused as an
    allocation failure, one `cannot store chunks` warning per request and step: 495 lines here);
    vLLM recomputes and its tokens do not change."""
    import signal
    import time

    name = f"vtdie{os.getpid() % 100000}"
    reset_tier_stats(name)
    with served_process(name) as proc:
        cfg = kv_transfer_config(device=name, policy="lru", cxl_bytes_to_use=64 << 20)
        with engine(model, cfg) as llm:
            generate(llm, PROMPTS)
            loaded = tier_stats(name).blocks_loaded
            with warnings_logged() as logged:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                time.sleep(0.1)  # the host's watcher finds it within 20 ms
                rounds = []
                for r in range(LOST_ROUNDS):  # two prompts a round, each back every third round
                    batch = [(2 * r) % len(PROMPTS), (2 * r + 1) % len(PROMPTS)]
                    rounds.append((batch, tokens(generate(llm, [PROMPTS[i] for i in batch]))))
    stats = tier_stats(name).as_dict()
    for batch, got in rounds:
        assert got == [reference[i] for i in batch]
    assert stats["device_lost"] == 1 and stats["blocks_loaded"] == loaded
    lines = [f"{r.name}: {r.getMessage()}" for r in logged]
    assert sum("is gone" in line for line in lines) == 1
    assert len(lines) <= 5, f"{len(lines)} warnings after the device was lost, e.g. " + "; ".join(lines[:3])


def test_a_manager_in_its_own_process_finds_the_firmware_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's default runs the scheduler (the manager) in a process of its own, with counters of
    its own: the worker's finding never reaches it. It looks at the firmware itself (once every
    LIVENESS_S), says so once, and from then on looks up and stores nothing."""
    import signal

    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    from driver.vllm import _spec
    from driver.vllm._config import parse_extra_config
    from driver.vllm._stats import TierStats

    monkeypatch.setattr(_spec, "LIVENESS_S", 0.0)
    name = f"vtmgr{os.getpid() % 100000}"
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(3)]
    with served_process(name) as proc, warnings_logged() as logged:
        tier = parse_extra_config({"device": name, "policy": "lru", "cxl_bytes_to_use": 64 << 20})
        manager = _spec.CxlOffloadingManager(8, tier, TierStats(), name)
        try:
            ctx = ReqContext(req_id="r0")
            manager.check_device()
            assert manager.prepare_store(keys[:2], ctx).keys_to_store == keys[:2]
            manager.complete_store(keys[:2], ctx)
            assert manager.lookup(keys[0], ctx) is LookupResult.HIT and logged == []
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            for _ in range(3):
                manager.check_device()
            out = manager.prepare_store(keys[2:], ReqContext(req_id="r1"))
            assert manager.lookup(keys[0], ctx) is LookupResult.MISS
        finally:
            manager.shutdown()
    assert out.keys_to_store == [] and out.evicted_keys == [] and manager.stats.device_lost == 1
    assert [r.getMessage() for r in logged] == [
        f"cxlemu tier: device {name} is gone (its firmware (pid {proc.pid}) is no longer running); nothing more is "
        "looked up on it or stored to it: serving goes on without the tier"]


def test_the_readme_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from driver.vllm import example

    assert example.main(["--rounds", "2", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert "tokens identical to vLLM alone" in out and "0 failed loads" in out
