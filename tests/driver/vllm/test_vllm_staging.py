"""The tier's staged path (KV tensors the DMA engine cannot address: CUDA), through a host bounce
buffer: on the CPU with ``staging=True`` (the same code but the copies), and on CUDA (marked gpu)."""
from __future__ import annotations

import os
import types
from collections.abc import Iterator
from typing import Any

import pytest

from driver.vllm._staging import Slots

L, PAGE, NB = 4, 256, 32  # layers, bytes per layer page, KV blocks


def test_slots_are_first_fit_runs_merged_when_given_back() -> None:
    s = Slots(8)
    assert [s.alloc(3), s.alloc(3), s.alloc(3)] == [0, 3, None]
    s.release(0, 3)
    assert s.alloc(2) == 0 and s.alloc(2) == 6 and s.alloc(1) == 2 and s.free() == 0
    for start, n in ((0, 2), (6, 2), (3, 3), (2, 1)):
        s.release(start, n)
    assert s.free() == 8 and s.alloc(8) == 0  # every run merged back into one
    with pytest.raises(RuntimeError, match="released twice"):
        s.release(0, 8) or s.release(4, 1)
    with pytest.raises(ValueError, match="take 1 to 8"):
        s.alloc(9)


torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]', see README)")


@pytest.fixture
def device() -> Iterator[Any]:
    from driver.vllm._stats import reset_tier_stats
    from emulator.device import DeviceConfig, serve

    name = f"stg{os.getpid() % 100000}"
    reset_tier_stats(name)
    with serve(DeviceConfig(name=name, capacity=256 << 20)) as dev:
        yield dev
    reset_tier_stats(name)


def _worker(name: str, tensors: list[Any], **tier: Any) -> Any:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from driver.vllm._config import TierConfig
    from driver.vllm._stats import tier_stats
    from driver.vllm._worker import CxlOffloadingWorker

    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                           [[CanonicalKVCacheRef(i, PAGE) for i in range(L)]])
    spec = types.SimpleNamespace(tier=TierConfig(device=name, policy="lru", cxl_bytes_to_use=64 * L * PAGE, **tier),
                                 stats=tier_stats(name), num_chunks=64, device_name=name, device_capacity=None,
                                 codec=None)  # CxlOffloadingSpec.codec: native KV
    return CxlOffloadingWorker(spec, kv)


def _specs(kv: list[int], chunks: list[int]) -> tuple[Any, Any]:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return GPULoadStoreSpec(kv, [len(kv)], [0]), CPULoadStoreSpec(chunks)


def _roundtrip(name: str, where: str, slots: int) -> tuple[list[Any], list[Any], Any, dict[str, int]]:
    """Store two jobs (5 and 3 blocks) and load them back into other KV blocks, one of them
    layer-wise; the staging buffer holds ``slots`` blocks."""
    from driver.vllm._stats import tier_stats

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-128, 127, (NB, PAGE), dtype=torch.int8, generator=g).to(where) for _ in range(L)]
    before = [t.clone() for t in tensors]
    w = _worker(name, tensors, **({"staging": True} if where == "cpu" else {}), staging_bytes=slots * L * PAGE)
    try:
        assert w.staging is not None and w.staging.slots.count == slots
        for job, (kv, chunks) in enumerate([(list(range(5)), list(range(10, 15))), ([7, 9, 11], [20, 21, 22])]):
            gpu, dev = _specs(kv, chunks)
            w.submit_store(job, gpu, dev)
        w.wait({0, 1})
        stored = sorted((r.job_id, r.success) for r in w.get_finished())
        gpu, dev = _specs(list(range(16, 21)), list(range(10, 15)))
        w.submit_load(2, dev, gpu)
        gpu, dev = _specs([24, 25, 26], [20, 21, 22])
        w.submit_load(3, dev, gpu, layerwise=True)
        for layer in range(L):  # the forward's waits, layer by layer
            w.wait_layer([3], layer)
        piece = w._open_jobs[3].pieces[0]
        if slots >= 3:  # job 2 gave its slots back at once (an untimed device): each layer copied
            # when the forward waited for it
            assert len(w._open_jobs[3].pieces) == 1 and piece.scattered == set(range(L))
        else:  # 3 blocks in 1 slot: waited whole at layer 0, in pieces
            assert not w._open_jobs[3].layer_handles and not piece.scattered
        w.wait({2, 3})
        loaded = sorted((r.job_id, r.success) for r in w.get_finished())
        assert stored == [(0, True), (1, True)] and loaded == [(2, True), (3, True)]
        assert w.staging.slots.free() == slots and not w._pump.jobs
        return tensors, before, w, tier_stats(name).as_dict()
    finally:
        w.shutdown()


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_staged_blocks_come_back_into_other_kv_blocks_byte_for_byte(device: Any, slots: int) -> None:
    """One slot: every job cut into one-block pieces, the layer-wise load waited whole at its first
    layer; three: the 5-block jobs in two pieces, the 3-block layer-wise load copied layer by
    layer; eight: every job at once."""
    tensors, before, _, stats = _roundtrip(device.name, "cpu", slots)
    for t, b in zip(tensors, before):
        assert torch.equal(t[16:21], b[0:5]) and torch.equal(t[24:27], b[[7, 9, 11]])
        assert torch.equal(t[:16], b[:16]) and torch.equal(t[21:24], b[21:24]) and torch.equal(t[27:], b[27:])
    assert stats["blocks_stored"] == 8 and stats["blocks_loaded"] == 8 and stats["layer_waits"] == L
    assert (stats["store_jobs"], stats["load_jobs"]) == (2, 2)


def test_a_poisoned_piece_fails_its_job_and_is_not_copied_into_the_kv(device: Any) -> None:
    from driver import MemDev

    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(-128, 127, (NB, PAGE), dtype=torch.int8, generator=g) for _ in range(L)]
    w = _worker(device.name, tensors, staging=True, staging_bytes=2 * L * PAGE)  # two slots: pieces of two
    try:
        gpu, dev = _specs([0, 1, 2, 3], [30, 31, 32, 33])
        w.submit_store(0, gpu, dev)
        w.wait({0})
        assert [r.success for r in w.get_finished()] == [True]
        with MemDev.open(device.name) as md:
            md.inject_poison(w.chunk_dpa(33, layer=2))  # the second piece's last chunk, layer 2
        before = [t.clone() for t in tensors]
        gpu, dev = _specs([10, 11, 12, 13], [30, 31, 32, 33])
        w.submit_load(1, dev, gpu)
        w.wait({1})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, False)]
        for t, b in zip(tensors, before):
            assert torch.equal(t[10:12], b[0:2])  # the clean piece arrived
            assert torch.equal(t[12:14], b[12:14])  # the poisoned one was not copied at all
        assert w.stats.failed_loads == 1 and w.staging.slots.free() == 2
    finally:
        w.shutdown()


def test_cpu_kv_is_not_staged_unless_asked(device: Any) -> None:
    tensors = [torch.zeros((NB, PAGE), dtype=torch.int8) for _ in range(L)]
    w = _worker(device.name, tensors)
    try:
        assert w.staging is None and w._pump is None
    finally:
        w.shutdown()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("slots", [1, 3, 8])
def test_cuda_kv_is_staged_through_pinned_memory_and_comes_back(device: Any, slots: int) -> None:
    tensors, before, w, stats = _roundtrip(device.name, "cuda", slots)
    torch.cuda.synchronize()
    assert w.staging.cuda and all(b.is_pinned() for b in w.staging.bounce)
    for t, b in zip(tensors, before):
        assert t.is_cuda and torch.equal(t[16:21], b[0:5]) and torch.equal(t[24:27], b[[7, 9, 11]])
        assert torch.equal(t[:16], b[:16]) and torch.equal(t[27:], b[27:])
    assert stats["blocks_loaded"] == 8


@pytest.mark.gpu
@cuda
def test_cuda_kv_with_staging_off_is_refused_saying_what_to_change(device: Any) -> None:
    from emulator.spec.errors import ConfigError

    tensors = [torch.zeros((NB, PAGE), dtype=torch.int8, device="cuda") for _ in range(L)]
    with pytest.raises(ConfigError, match="leave kv_connector_extra_config\\['staging'\\] absent"):
        _worker(device.name, tensors, staging=False)


@pytest.mark.gpu
@cuda
def test_cuda_copies_held_back_on_the_gpu_still_arrive_whole(device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy between the GPU and the bounce buffer queued behind ~2 ms of GPU work: the DMA
    of a store must wait for its gather's event, and slots must not be reused before a load's
    copies (side stream and forward stream) completed, or the blocks come back wrong."""
    from driver.vllm import _staging

    def held_back(copy: Any) -> Any:
        def run(self: Any, *args: Any, **kw: Any) -> Any:
            stream = torch.cuda.current_stream(self.device) if kw.get("on_forward_stream") else self.stream
            with torch.cuda.stream(stream):
                torch.cuda._sleep(5_000_000)
            return copy(self, *args, **kw)
        return run

    monkeypatch.setattr(_staging.Staging, "gather", held_back(_staging.Staging.gather))
    monkeypatch.setattr(_staging.Staging, "scatter", held_back(_staging.Staging.scatter))
    for slots in (1, 3):
        tensors, before, _, _ = _roundtrip(device.name, "cuda", slots)
        torch.cuda.synchronize()
        for t, b in zip(tensors, before):
            assert torch.equal(t[16:21], b[0:5]) and torch.equal(t[24:27], b[[7, 9, 11]])
