"""CxlCache with the arena in GPU memory: tokens equal DynamicCache's on CUDA, including when
every side-stream copy is delayed on the GPU (no copy / compute race), and pinned-memory failure
falls back with a notice. Run on a GPU host: ``python -m pytest -m gpu tests/test_kv_*``."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kv_support import frame_bytes, generate, tiny_model
from transformers import DynamicCache

from driver.kv import CxlCache, MemoryBlockStore
from driver.kv._arena import StagingPool
from driver.kv._mover import CudaMover
from driver.kv.testing import padded_batch

NEW = 10
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def gpu_model():
    return tiny_model().to("cuda")


@pytest.fixture(scope="module")
def gpu_batch(gpu_model):
    ids, mask = padded_batch([16, 11, 14])
    ids, mask = ids.cuda(), mask.cuda()
    return ids, mask, generate(gpu_model, ids, mask, DynamicCache(), NEW)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("policy", ["lru", "hotness", "s3fifo"])
@pytest.mark.parametrize("fraction", ["min", "half"])
@pytest.mark.parametrize("device_backed", [False, True])
def test_cuda_tokens_equal_dynamic_cache(gpu_model, gpu_batch, policy, fraction, device_backed) -> None:
    """GPU frames, pinned staging, side stream: DynamicCache's tokens at every budget."""
    ids, mask, ref = gpu_batch
    final = ids.shape[1] + NEW - 1
    budget = 2 * frame_bytes(3, final) if fraction == "min" else 4 * frame_bytes(3, final) // 2
    store = None if device_backed else MemoryBlockStore(4 << 20)
    cache = CxlCache(hbm_budget_bytes=budget, policy=policy, block_tokens=5, store=store)
    out = generate(gpu_model, ids, mask, cache, NEW)
    stats = cache.stats()
    engine = cache._engine
    assert engine.arena.device.type == "cuda" and engine.mover.cuda
    cache.close()
    assert torch.equal(out, ref)
    assert stats["loads"] > 0 and stats["hbm_peak_bytes"] <= budget
    assert engine.staging.total == 0 and engine.arena.allocated == 0


@pytest.mark.gpu
@cuda
def test_cuda_frames_grow_in_place_when_every_layer_fits(gpu_model, gpu_batch) -> None:
    """A budget beyond all the KV, no max_seq_len: the outgrown GPU frames are copied into larger
    ones on the GPU, nothing goes through the store, and the tokens are DynamicCache's."""
    ids, mask, ref = gpu_batch
    store = MemoryBlockStore(4 << 20)
    cache = CxlCache(hbm_budget_bytes=10**30, block_tokens=4, store=store)  # 16 + 4 tokens, then 25
    out = generate(gpu_model, ids, mask, cache)
    stats = cache.stats()
    cache.close()
    assert torch.equal(out, ref)
    assert (stats["regrows"], stats["loads"], stats["evictions"]) == (1, 0, 0)
    assert (store.bytes_read, store.bytes_written) == (0, 0)


def _delayed_run(gpu_model, ids, mask, mover_cls, delay_cycles: int):
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(3, ids.shape[1] + NEW - 1), block_tokens=4,
                     store=MemoryBlockStore(4 << 20), prefetch_depth=1)
    # the engine is built at the first update: build it now so its mover can be replaced
    cache._engine_for(torch.zeros(3, 2, 1, 16, device="cuda"))
    engine = cache._engine
    engine.mover = mover_cls(engine.staging, torch.device("cuda"), delay_cycles=delay_cycles)
    out = generate(gpu_model, ids, mask, cache, NEW)
    cache.close()
    return out


@pytest.mark.gpu
@cuda
def test_delayed_copies_do_not_race(gpu_model, gpu_batch) -> None:
    """Every side-stream copy sleeps ~2 ms on the GPU first; compute waits on the load's event
    and loads wait on compute's, so the tokens are still DynamicCache's."""
    ids, mask, ref = gpu_batch
    assert torch.equal(_delayed_run(gpu_model, ids, mask, CudaMover, 4_000_000), ref)


class _NoWaitMover(CudaMover):
    """The bug the test above guards against: compute does not wait for the load's event."""

    def before_compute(self, frame) -> None:
        pass


@pytest.mark.gpu
@cuda
def test_the_race_test_can_fail(gpu_model, gpu_batch) -> None:
    """Control: with the compute-side wait removed, the delayed copies corrupt the tokens — so
    the test above would catch a missing wait."""
    ids, mask, ref = gpu_batch
    assert not torch.equal(_delayed_run(gpu_model, ids, mask, _NoWaitMover, 4_000_000), ref)


def test_pinned_memory_failure_falls_back_with_a_notice(monkeypatch) -> None:
    """If the host cannot pin (small hosts: the locked-memory limit), staging is pageable and says so."""
    real_empty = torch.empty

    def no_pinning(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("cannot pin 64 KiB: out of locked memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
    pool = StagingPool(pin=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = pool.get(1000)
    assert not buf.is_pinned() and buf.numel() == StagingPool.GRANULE
    assert pool.pin is False and "pinned host memory unavailable" in pool.notice
    assert any("staging in pageable memory" in str(w.message) for w in caught)
    pool.put(buf)
    pool.clear()
