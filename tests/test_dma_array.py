"""DescriptorArray: a descriptor list as arrays, issued by the DMA engine in one C call."""
from __future__ import annotations

import numpy as np
import pytest

from driver import MemDev
from emulator.device import DeviceConfig, serve
from emulator.dma import DescriptorArray, DmaEngine, PinnedHosts
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
