"""DescriptorArray: a descriptor list as arrays, issued by the DMA engine in one C call."""
from __future__ import annotations

import numpy as np
import pytest

from driver import MemDev
from emulator.device import DeviceConfig, serve
from emulator.dma import BlockRuns, DescriptorArray, DmaEngine, PinnedHosts
from emulator.spec.errors import DmaError, PoisonError
from emulator.timing import TimingConfig


@pytest.fixture
def md():
    timing = TimingConfig(read_latency_ns=200, read_bandwidth_gbps=5, write_bandwidth_gbps=5)
    with serve(DeviceConfig(name="dmaarray", capacity=256 << 20, timing=timing)), MemDev.open("dmaarray") as md:
        yield md


def test_an_array_moves_what_the_same_descriptor_list_moves_and_reports_per_descriptor(md) -> None:
    a = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)  # 256 KiB of distinct words
    b = np.full(1 << 12, 7, np.uint8)
    out = np.zeros(3 << 12, np.uint8)
    with DmaEngine(md.datapath, channels=2) as eng:
        w = DescriptorArray("write", [a, b], [0, 0, 1], [0, 8192, 1 << 20], [0, 4096, 0], [4096, 4096, 4096])
        assert len(w) == 3 and w.total == 3 * 4096
        done = eng.submit(w).wait()
        assert all(isinstance(c, int) and c > 0 for c in done)
        md.inject_poison((1 << 20) + 64)
        r = DescriptorArray("read", PinnedHosts([out]), [0, 0, 0], [0, 8192, 1 << 20], [0, 4096, 8192],
                            [4096, 4096, 4096])
        got = eng.submit(r, channel=1).wait()
    assert (out[:4096] == a[:4096]).all() and (out[4096:8192] == a[4096:8192]).all()
    assert isinstance(got[2], DmaError) and isinstance(got[2].__cause__, PoisonError)
    assert got[2].index == 2 and "0x100040" in str(got[2])
    assert (out[8192:] == 0).all()  # the failed descriptor moved no byte


def test_bad_arrays_are_refused_before_anything_moves(md) -> None:
    host = np.zeros(4096, np.uint8)
    with pytest.raises(ValueError, match=r"descriptor 1's host range \[0xff0, 0x1010\) runs past host buffer 0"):
        DescriptorArray("read", [host], [0, 0], [0, 64], [0, 4080], [64, 32])
    with pytest.raises(ValueError, match="one of each per descriptor"):
        DescriptorArray("read", [host], [0], [0, 64], [0], [64])
    with pytest.raises(ValueError, match="within the 1 host buffers"):
        DescriptorArray("write", [host], [1], [0], [0], [64])
    with pytest.raises(ValueError, match="writable=True"):
        DescriptorArray("read", PinnedHosts([host], writable=False), [0], [0], [0], [64])


def test_block_runs_plan_one_descriptor_per_run_and_buffer_and_move_the_blocks(md) -> None:
    """Blocks [2, 3, 4, 7, 8] <-> chunks [10, 11, 12, 13, 14] of 2 layers of 256-B pages: two runs
    where both lists advance by one (blocks 2-4 -> chunks 10-12, blocks 7-8 -> chunks 13-14), so 2
    descriptors a layer, layer 0's first, each at its layer's offset; read back, layer 1's chunks
    12-14 hold its blocks 4, 7 and 8."""
    layers = [np.random.default_rng(t).integers(0, 256, 16 * 256, dtype=np.uint8) for t in range(2)]
    arr = BlockRuns(PinnedHosts(layers, writable=False), 64, [256, 256], [0, 1 << 20], [256, 256]).plan(
        "write", [2, 3, 4, 7, 8], [10, 11, 12, 13, 14])
    rec = arr.records
    assert rec["dpa"].tolist() == [10 * 256, 13 * 256, (1 << 20) + 10 * 256, (1 << 20) + 13 * 256]
    assert rec["len"].tolist() == [3 * 256, 2 * 256, 3 * 256, 2 * 256] and arr.total == 10 * 256
    assert [len(p) for p in arr.split(2)] == [2, 2] and arr.split(2)[1].records["dpa"][0] == (1 << 20) + 10 * 256
    out = np.zeros(16 * 256, np.uint8)
    with DmaEngine(md.datapath, channels=2) as eng:
        eng.submit(arr).check()
        back = BlockRuns(PinnedHosts([out]), 64, [256], [1 << 20], [256]).plan("read", [0, 1, 2], [12, 13, 14])
        eng.submit(back).check()
    assert (out[:768] == np.concatenate([layers[1][4 * 256:5 * 256], layers[1][7 * 256:9 * 256]])).all()


def test_padded_blocks_move_one_descriptor_each_and_bad_pairs_are_named(md) -> None:
    """A buffer whose stride exceeds its page (a padded block) cannot merge runs: one descriptor
    per block. A block past its buffer or a chunk out of range is refused, naming the pair."""
    host = np.zeros(4 * 512, np.uint8)
    pins = PinnedHosts([host])
    arr = BlockRuns(pins, 8, [512], [0], [256]).plan("read", [0, 1, 2], [0, 1, 2])
    assert arr.records["len"].tolist() == [256, 256, 256] and arr.records["dpa"].tolist() == [0, 256, 512]
    assert arr.records["host"].tolist() == [int(pins.bases[0]) + 512 * i for i in range(3)]
    with pytest.raises(ValueError, match=r"block 4 <-> chunk 1 \(pair 1\) is out of range"):
        BlockRuns(PinnedHosts([host]), 8, [512], [0], [256]).plan("read", [0, 4], [0, 1])
    with pytest.raises(ValueError, match=r"block 0 <-> chunk 8 \(pair 0\)"):
        BlockRuns(PinnedHosts([host]), 8, [512], [0], [256]).plan("read", [0], [8])
    with pytest.raises(ValueError, match=r"block 4611686018427387904 <-> chunk 0"):  # 2**62 x 512 wraps
        BlockRuns(PinnedHosts([host]), 8, [512], [0], [256]).plan("read", [1 << 62], [0])
    with pytest.raises(ValueError, match=r"block -1 <-> chunk 0"):
        BlockRuns(PinnedHosts([host]), 8, [512], [0], [256]).plan("read", [-1], [0])
    with pytest.raises(ValueError, match="writable=True"):
        BlockRuns(PinnedHosts([host], writable=False), 8, [512], [0], [256]).plan("read", [0], [0])
    with pytest.raises(ValueError, match="2 blocks for 1 chunks"):
        BlockRuns(PinnedHosts([host]), 8, [512], [0], [256]).plan("write", [0, 1], [0])


def test_one_block_runs_planner_plans_every_job_of_its_layout() -> None:
    """The layout is checked and handed to C once; each plan is one job's descriptors."""
    host = np.zeros(8 * 64, np.uint8)
    planner = BlockRuns(PinnedHosts([host]), 8, [64], [4096], [64])
    a, b = planner.plan("read", [0, 1], [3, 4]), planner.plan("write", [5], [0])
    assert (a.records["dpa"].tolist(), a.total, len(a)) == ([4096 + 192], 128, 1)
    assert (b.records["dpa"].tolist(), b.total, b.records["dir"].tolist()) == ([4096], 64, [1])
    with pytest.raises(ValueError, match="a stride, an offset and a page"):
        BlockRuns(PinnedHosts([host]), 8, [64, 64], [0], [64])
    with pytest.raises(ValueError, match="one chunk per block"):
        planner.plan("read", [0, 1], [3])


def test_a_channels_results_stay_per_descriptor_when_a_longer_array_follows_a_shorter_one(md) -> None:
    src = np.arange(200 * 64 // 8, dtype=np.uint64).view(np.uint8)  # 200 lines of distinct words
    back = np.zeros_like(src)
    at = [i * 64 for i in range(200)]
    with DmaEngine(md.datapath, channels=1) as eng:
        eng.submit(DescriptorArray("write", [src], [0] * 3, at[:3], at[:3], [64] * 3)).wait()  # 64 results
        eng.submit(DescriptorArray("write", [src], [0] * 200, at, at, [64] * 200)).wait()  # grown to 200
        md.inject_poison(150 * 64)  # a failure past the channel's first results buffer (64)
        short = DescriptorArray("read", PinnedHosts([back]), [0] * 3, at[:3], at[:3], [64] * 3)
        assert all(isinstance(r, int) for r in eng.submit(short).wait())
        got = eng.submit(DescriptorArray("read", PinnedHosts([back]), [0] * 200, at, at, [64] * 200)).wait()
    assert len(got) == 200 and [i for i, r in enumerate(got) if isinstance(r, DmaError)] == [150]
    assert isinstance(got[150].__cause__, PoisonError) and got[150].index == 150
    assert (back[:150 * 64] == src[:150 * 64]).all() and (back[151 * 64:] == src[151 * 64:]).all()
    assert (back[150 * 64:151 * 64] == 0).all()


def test_an_inline_array_is_issued_by_its_caller_whatever_its_size_on_an_idle_channel(md, monkeypatch) -> None:
    """Above INLINE_BYTES an array goes to a channel's thread; with inline=True its caller issues
    it (no hand-off), on the first idle channel when the next one is busy, and it moves the same
    bytes."""
    import threading
    import time

    from emulator.dma import INLINE_BYTES

    src = np.arange(INLINE_BYTES, dtype=np.uint32).view(np.uint8)  # 4 x INLINE_BYTES of distinct words
    size = src.size
    issued: list[tuple[str, int]] = []
    with DmaEngine(md.datapath, channels=2) as eng:
        eng.submit(DescriptorArray("write", [src], [0], [0], [0], [size])).wait()
        real = eng._issue_array

        def spy(ch, arr):
            issued.append((threading.current_thread().name, eng._chans.index(ch)))
            return real(ch, arr)

        monkeypatch.setattr(eng, "_issue_array", spy)
        def claim(ch) -> None:  # its thread may still be retiring the read waited for before
            deadline = time.monotonic() + 5
            while not ch.state.try_claim():
                assert time.monotonic() < deadline, "the channel never went idle"
                time.sleep(0.001)

        outs = [np.zeros(size, np.uint8) for _ in range(3)]
        eng.submit(DescriptorArray("read", [outs[0]], [0], [0], [0], [size]), channel=0).wait()
        claim(eng._chans[0])
        eng._chans[0].state.release()
        eng.submit(DescriptorArray("read", [outs[1]], [0], [0], [0], [size]), inline=True, channel=0).wait()
        claim(eng._chans[0])  # channel 0 busy: an inline caller takes channel 1
        claim(eng._chans[1])
        eng._chans[1].state.release()
        try:
            eng.submit(DescriptorArray("read", [outs[2]], [0], [0], [0], [size]), inline=True).wait()
        finally:
            eng._chans[0].state.release()
    me = threading.current_thread().name
    assert issued[0][0] != me and issued[1:] == [(me, 0), (me, 1)]
    assert all((o == src).all() for o in outs)
