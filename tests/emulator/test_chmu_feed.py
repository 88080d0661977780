"""Host accesses reach the device's CHMU through the access feed, and show on its hotlist."""
from __future__ import annotations

import time

from driver import MemDev
from driver.chmu import ChmuRegs
from emulator.chmu_feed import FEED_ENTRIES, AccessFeed
from emulator.spec.registers import CHMU_OFFSET, CHMU_SIZE


def wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_hot_page_reaches_the_hotlist(memdev: MemDev, served) -> None:
    """Always-on, threshold 8: the page read 10 times is listed with its count, the one read 3 times is not."""
    chmu = ChmuRegs(memdev.regs.region(CHMU_OFFSET, CHMU_SIZE))
    chmu.configure(unit_size=4096, threshold=8, mode="always_on")
    wait_for(lambda: chmu.status().enabled, "the firmware never enabled the CHMU")
    for _ in range(10):
        memdev.read(0x5000 + 64, 64)
    for _ in range(3):
        memdev.read(0x9000, 64)
    memdev.access_feed.flush()
    wait_for(lambda: served.firmware.access_feed.drained == 13, "the firmware never drained the feed")
    wait_for(lambda: chmu.status().entries > 0, "no hotlist entry")
    assert chmu.read_hotlist() == [(0x5000, 10)]  # one drained batch: counted together


def test_nothing_is_fed_while_the_chmu_is_disabled(memdev: MemDev, served) -> None:
    memdev.write(0, bytes(8192))
    memdev.access_feed.flush()
    time.sleep(0.05)
    assert served.firmware.access_feed.drained == 0


def test_a_full_ring_drops_and_counts(served) -> None:
    """With the firmware not draining, a host feeding more than the ring holds loses the rest, counted."""
    served.firmware.services.remove(served.firmware.access_feed.service)
    fw_chmu = ChmuRegs(served.firmware.regs.region(CHMU_OFFSET, CHMU_SIZE))
    fw_chmu.configure(unit_size=4096, threshold=1, mode="always_on")
    wait_for(lambda: fw_chmu.status().enabled, "the firmware never enabled the CHMU")
    feed = AccessFeed(served.files.bar, served.files.path / "chmu.lock")
    feed.note(0, (FEED_ENTRIES + 100) * 4096, False)  # one entry per 4 KiB page
    feed.close()
    assert served.firmware.access_feed.dropped == 100


def test_note_many_feeds_what_note_would(served) -> None:
    """The array form feeds the ring exactly the entries one note per transfer would, in order:
    exact DPAs for single-granule accesses, one per 4 KiB granule otherwise (0x2ff0 + 32 B
    straddles two), write bit set."""
    import numpy as np

    served.firmware.services.remove(served.firmware.access_feed.service)  # keep the entries in the ring
    fw_chmu = ChmuRegs(served.firmware.regs.region(CHMU_OFFSET, CHMU_SIZE))
    fw_chmu.configure(unit_size=4096, threshold=1, mode="always_on")
    wait_for(lambda: fw_chmu.status().enabled, "the firmware never enabled the CHMU")
    dpas, sizes = [0x5040, 0x1000, 0x2ff0, 0x8000, 0x9000], [64, 0, 0x20, 3 * 4096, 4096]
    rings = []
    for many in (False, True):
        feed = AccessFeed(served.files.bar, served.files.path / "chmu.lock")
        start = int(feed._header[1])
        if many:
            feed.note_many(np.array(dpas), np.array(sizes), True)
        else:
            for dpa, n in zip(dpas, sizes, strict=True):
                feed.note(dpa, n, True)
        feed.close()
        rings.append(feed._ring[start:int(feed._header[1])].copy())
    top = np.uint64(1 << 63)
    assert rings[0].tolist() == rings[1].tolist() == [
        int(x | top) for x in np.array([0x5040, 0x2000, 0x3000, 0x8000, 0x9000, 0xA000, 0x9000], np.uint64)]
