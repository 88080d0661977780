"""CxlCache on a real (in-process) cxlemu device: KV really lives in the device's media and comes
back through its DMA engine; poisoned media is recovered without changing a token."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kv_support import frame_bytes, generate
from transformers import DynamicCache, LogitsProcessor

from driver.kv import CxlCache, KVLoadError
from driver.kv.testing import padded_batch

NEW = 10


@pytest.fixture(scope="module")
def batch(model):
    ids, mask = padded_batch([16, 11, 14])
    return ids, mask, generate(model, ids, mask, DynamicCache(), NEW)


def test_private_device_tokens_and_media(model, batch) -> None:
    """No device given: a private one is served, KV bytes land in its media, tokens are equal,
    and the device is gone after close()."""
    from emulator.device import list_devices

    ids, mask, ref = batch
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 25), policy="hotness", block_tokens=4)
    out = generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    name = cache.device_name
    assert name in list_devices()
    store = cache._engine.store
    assert store.datapath.counters()["read_bytes"] == stats["bytes_loaded"] > 0
    cache.close()
    assert torch.equal(out, ref)
    assert name not in list_devices()


def test_a_budget_beyond_all_the_kv_moves_nothing_through_the_device(model, batch) -> None:
    """hbm_budget_bytes=10**30 without max_seq_len, prefix sharing off (prefills would be written
    through): the frames regrow in place and the device's link counts zero bytes either way."""
    ids, mask, ref = batch
    cache = CxlCache(hbm_budget_bytes=10**30, block_tokens=4, prefix_sharing=False)
    out = generate(model, ids, mask, cache, NEW)
    stats, link = cache.stats(), cache._engine.store.datapath.counters()
    cache.close()
    assert torch.equal(out, ref)
    assert (stats["regrows"], stats["loads"], stats["offloads"]) == (1, 0, 0)
    assert (link["read_bytes"], link["write_bytes"], link["read_transfers"], link["write_transfers"]) == (0, 0, 0, 0)


def test_named_device(model, batch, served) -> None:
    """device=<name> opens a served device; closing the cache leaves the device up."""
    from emulator.device import list_devices

    ids, mask, ref = batch
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 25), device=served.name, block_tokens=5)
    out = generate(model, ids, mask, cache, NEW)
    assert cache.stats()["loads"] > 0
    cache.close()
    assert torch.equal(out, ref)
    assert served.name in list_devices()


def test_a_latency_only_device_gives_the_all_resident_tokens(model, batch, device_name) -> None:
    """A device served with a read latency and no bandwidth cap (TimingConfig: bandwidth None =
    unthrottled): the engine drives its link model (fs_per_byte 0: unthrottled), layers really
    move over it, and the tokens are DynamicCache's."""
    from emulator.device import DeviceConfig, serve
    from emulator.timing.config import TimingConfig
    from firmware_model.link import LinkParams

    ids, mask, ref = batch
    with serve(DeviceConfig(name=device_name, capacity=256 << 20, timing=TimingConfig(read_latency_ns=300))):
        with CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 25), device=device_name, block_tokens=4) as cache:
            out = generate(model, ids, mask, cache, NEW)
            assert cache._engine.link == LinkParams(lat_ns=(300, 0), fs_per_byte=(0, 0), txn_bytes=64)
            stats = cache.stats()
    assert torch.equal(out, ref)
    assert stats["loads"] > 0 and stats["offloads"] > 0


# the memory-store case (test_kv_tokens) runs by default; on a device it is the same path
@pytest.mark.slow
def test_a_budget_beyond_all_the_kv_on_a_device(model, batch) -> None:
    """hbm_budget_bytes=10**30 (more frames than any integer type holds): every layer stays
    resident (nothing loaded, evicted or regrown: max_seq_len sizes the frames once), one frame
    per layer, the tokens are DynamicCache's, and the device's telemetry page (u8 fields) shows
    the budget saturated and the frames really made."""
    from emulator.telemetry import TelemetryReader

    ids, mask, ref = batch
    cache = CxlCache(hbm_budget_bytes=10**30, block_tokens=4, max_seq_len=ids.shape[1] + NEW - 1)
    out = generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    cache._telemetry.publish(force=True)
    reader = TelemetryReader(cache._engine.store.memdev.bar)
    host = reader.snapshot().host
    reader.close()
    cache.close()
    assert torch.equal(out, ref)
    assert (stats["frames"], stats["loads"], stats["evictions"], stats["regrows"]) == (4, 0, 0, 0)
    assert stats["hbm_peak_bytes"] == 4 * frame_bytes(3, ids.shape[1] + NEW - 1)
    assert stats["hbm_budget_bytes"] == 10**30
    assert (host.hbm_budget_bytes, host.blocks_total, host.blocks_resident) == (2**64 - 1, 4, 4)


class PoisonAt(LogitsProcessor):
    """At decode step ``step``, poison the first chunk of the first offloaded layer."""

    def __init__(self, cache: CxlCache, step: int) -> None:
        self.cache, self.step, self.calls, self.poisoned = cache, step, 0, None

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.step:
            engine = self.cache._engine
            layer = next(st for st in engine.layers if st.frame is None and st.load is None)
            chunk = int(layer.chunks.ids[0, 0, 0])
            self.poisoned = (layer.index, chunk)
            engine.store.memdev.inject_poison(engine.store.dpa(chunk) + 128)
        return scores


def test_poisoned_chunk_is_recomputed(model, batch) -> None:
    """A poisoned device chunk fails its load and every retry; it is recomputed from the recorded
    tokens, scrubbed and rewritten: the tokens do not change and the poison is gone."""
    ids, mask, ref = batch
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 25), block_tokens=4, model=model, max_retries=2)
    hook = PoisonAt(cache, step=4)
    out = generate(model, ids, mask, cache, NEW, [hook])
    stats = cache.stats()
    store = cache._engine.store
    _, chunk = hook.poisoned
    assert store.memdev.first_poisoned(store.dpa(chunk), store.chunk_bytes) is None
    cache.close()
    assert torch.equal(out, ref)
    assert stats["load_retries"] == 2
    assert stats["recomputed_chunks"] == 1


def test_poison_without_model_is_a_clear_error(model, batch) -> None:
    """Without model= there are no tokens to recompute from: a typed error says what to pass."""
    ids, mask, _ = batch
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 25), block_tokens=4, max_retries=1)
    with pytest.raises(KVLoadError, match="pass model= to CxlCache"):
        generate(model, ids, mask, cache, NEW, [PoisonAt(cache, step=3)])
    cache.close()


def test_counters_published_in_the_device_telemetry_page(model, batch) -> None:
    """A monitor reading the device's telemetry page sees the generation's counters; after close
    the host section is released and holds the final totals."""
    from emulator.telemetry import TelemetryReader

    ids, mask, _ = batch
    cache = CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 25), block_tokens=4)
    generate(model, ids, mask, cache, NEW)
    stats = cache.stats()
    md = cache._engine.store.memdev
    reader = TelemetryReader(md.bar)
    cache._telemetry.publish(force=True)
    live = reader.snapshot().host
    assert live.writer_pid == __import__("os").getpid()
    assert (live.loads, live.hits, live.misses) == (stats["loads"], stats["hits"], stats["misses"])
    assert live.tokens_generated == 3 * (ids.shape[1] + NEW - 1)
    assert live.hbm_budget_bytes == 2 * frame_bytes(3, 25)
    reader.close()
    cache.close()


def test_prefetch_accounting_adds_up(model, batch) -> None:
    """On the device's DMA engine (real threads, a timed link): every load is a demand miss or
    a prefetch the firmware's queue issued, and after close() every issued prefetch was useful
    (landed before its compute), late (the compute waited) or wasted (evicted or left unused)."""
    ids, mask, _ = batch
    with CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 16 + NEW + 16), policy="lru", block_tokens=4) as cache:
        generate(model, ids, mask, cache, NEW)
    s = cache.stats()
    assert s["prefetch_issued"] > 0 and s["prefetch_useful"] + s["prefetch_late"] > 0
    assert s["loads"] == s["misses"] + s["prefetch_issued"]
    assert s["prefetch_issued"] == s["prefetch_useful"] + s["prefetch_late"] + s["prefetch_wasted"]


@pytest.mark.slow
def test_a_second_process_is_refused_the_device(model, batch, served) -> None:
    """Two processes keeping KV on one device would overwrite each other's chunks: the second is
    refused by name at construction (not at its first generate), and the device is usable again
    once the first lets go."""
    import subprocess
    import sys
    import textwrap

    from driver.kv import DeviceInUse

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from driver.kv._device_store import open_device_store
        handle, _ = open_device_store({served.name!r}, 0, "unused")
        print("held", flush=True)
        sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        hooks = dict(model._forward_pre_hooks)
        with pytest.raises(DeviceInUse, match=f"device {served.name!r} already holds the KV cache of "
                                              f"process {holder.pid}: serve another device"):
            CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 16 + NEW + 16), device=served.name, model=model)
        assert dict(model._forward_pre_hooks) == hooks  # refused before anything was hooked
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    ids, mask, expected = batch
    with CxlCache(hbm_budget_bytes=2 * frame_bytes(3, 16 + NEW + 16), device=served.name) as cache:
        assert torch.equal(generate(model, ids, mask, cache, NEW), expected)


def test_a_batch_is_one_submission_and_a_failure_stays_in_its_part(served) -> None:
    """Reads and writes issued in ``batched()`` go to the DMA engine as one descriptor list; each
    part's transfer sees only its own descriptors' results (a poisoned read fails the read, not
    the write-back submitted with it)."""
    import numpy as np

    from driver.kv._device_store import DeviceBlockStore
    from driver.kv._store import Extent
    from driver.memdev import MemDev
    from emulator.spec.errors import DmaError

    with MemDev.open(served.name) as md:
        store = DeviceBlockStore(md)
        store.configure(256)
        src = np.arange(1024, dtype=np.uint8)
        dst = np.zeros(1024, dtype=np.uint8)
        submitted: list[int] = []
        real_submit = store.dma.submit
        store.dma.submit = lambda descs, **kw: submitted.append(len(descs)) or real_submit(descs, **kw)
        store.write([Extent(0, 1024, 0)], src).wait()
        md.inject_poison(store.dpa(9) + 64)
        with store.batched():
            wrote = store.write([Extent(4, 512, 0)], src)
            good = store.read([Extent(0, 1024, 0)], dst)
            bad = store.read([Extent(8, 512, 0)], np.zeros(512, dtype=np.uint8))
        assert submitted == [1, 3]
        assert wrote.handle is good.handle is bad.handle
        wrote.wait()
        good.wait()
        with pytest.raises(DmaError):
            bad.wait()
        assert np.array_equal(dst, src)
        store.close()


def test_registered_buffers_reuse_their_descriptors(served) -> None:
    """A registered host buffer's transfers resubmit the descriptors built the first time (same
    objects); an unregistered one gets new descriptors every time."""
    import numpy as np

    from driver.kv._device_store import DeviceBlockStore
    from driver.kv._store import Extent
    from driver.memdev import MemDev

    with MemDev.open(served.name) as md:
        store = DeviceBlockStore(md)
        store.configure(256)
        lists: list[list] = []
        real_submit = store.dma.submit
        store.dma.submit = lambda descs, **kw: lists.append(list(descs)) or real_submit(descs, **kw)
        frame, other = np.zeros(2048, dtype=np.uint8), np.zeros(2048, dtype=np.uint8)
        extents = [Extent(0, 768, 0), Extent(5, 256, 1024)]
        store.register(frame)
        for host in (frame, frame, other, other):
            store.read(extents, host).wait()
        assert all(a is b for a, b in zip(lists[0], lists[1], strict=True))
        assert not any(a is b for a, b in zip(lists[2], lists[3], strict=True))
        store.unregister(frame)
        store.read(extents, frame).wait()
        assert not any(a is b for a, b in zip(lists[0], lists[4], strict=True))
        store.close()


def test_blocks_move_whole_and_close_unregisters_every_buffer(served) -> None:
    """Write-backs are whole chunks (the dirty tail block of every piece: one extent), loads read
    what the counters say, and after close() the store keeps no buffer of the engine."""
    from driver.kv._device_store import DeviceBlockStore
    from driver.kv._engine import ResidencyEngine
    from driver.memdev import MemDev

    with MemDev.open(served.name) as md:
        store = DeviceBlockStore(md)
        engine = ResidencyEngine(budget=2 * frame_bytes(1, 40), policy="lru", block_tokens=8, store=store,
                                 device=torch.device("cpu"), dtype=torch.float32, max_seq_len=40,
                                 prefix_sharing=False)
        g = torch.Generator().manual_seed(3)
        for step in range(10):
            for layer in range(4):
                n = 30 if step == 0 else 1
                k, v = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
                keys, values = engine.update(layer, k, v)
                assert torch.equal(keys[:, :, -n:], k) and torch.equal(values[:, :, -n:], v)
        stats = engine.stats()
        counters = store.datapath.counters()
        assert stats["offloads"] > 0 and counters["write_bytes"] == stats["bytes_offloaded"]
        assert stats["bytes_offloaded"] % store.chunk_bytes == 0
        assert counters["read_bytes"] == stats["bytes_loaded"] > 0
        assert store._regions
        engine.close()
        assert not store._regions and engine.staging.total == 0
        store.close()


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_a_prefill_writes_its_full_blocks_through(prefix_sharing) -> None:
    """With private chunks on CPU, once the frames ran out an update of many tokens writes its
    full blocks to the store at once, straight from the frame, and they hold exactly those tokens;
    the partial block stays dirty. While every layer had a frame nothing was written. (With prefix
    sharing, blocks are hashed and written when the layer leaves.)"""
    import numpy as np

    from driver.kv import MemoryBlockStore
    from driver.kv._engine import ResidencyEngine

    store = MemoryBlockStore(1 << 20)
    engine = ResidencyEngine(budget=2 * frame_bytes(1, 40), policy="lru", block_tokens=8, store=store,
                             device=torch.device("cpu"), dtype=torch.float32, max_seq_len=40,
                             prefix_sharing=prefix_sharing)
    kv = [(torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)) for _ in range(3)]
    for layer in (0, 1):
        engine.update(layer, *kv[layer])
    assert (engine.arena.ran_out, store.bytes_written) == (False, 0)
    engine.update(2, *kv[2])  # no frame left: layer 0 leaves, saving its 30 tokens of 4 pieces
    chunk = 8 * 16 * 4
    st = engine.layers[2]
    if prefix_sharing:  # shared chunks are written as far as their tokens go
        assert (st.clean_upto, store.bytes_written) == (0, 4 * 30 * 16 * 4)
    else:  # private ones whole: layer 0's 4 blocks, then layer 2's 3 full ones written through
        assert st.clean_upto == 24 and store.bytes_written == (4 + 3) * 4 * chunk
        k, v = kv[2]
        for p, piece in enumerate([k[0, 0], k[0, 1], v[0, 0], v[0, 1]]):
            for j in range(3):
                c = int(st.chunks.ids[0, p, j])
                got = np.frombuffer(store._media[c * chunk:(c + 1) * chunk].tobytes(), np.float32)
                assert np.array_equal(got, piece[8 * j:8 * j + 8].reshape(-1).numpy())
    engine.close()
    assert engine.staging.total == 0 and engine.arena.allocated == 0
