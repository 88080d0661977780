"""Host-side HDM programming (driver.hdm) and regions (driver.region) over devices whose firmware
(emulator.component.HdmDecoderBlock) runs in a thread, as it does under `cxlemu serve`.

`FakeMemDev` stands in for driver.memdev.MemDev (another package's object): a BAR and media in
memory with the three members a region uses. The firmware half is the real one.
"""
from __future__ import annotations

import contextlib
import mmap
import random
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driver.hdm import DecoderError, DecoderTimeout, HdmDecoders
from driver.region import Region, RegionPoisonError, destroy_region, program_region
from emulator.component import HdmDecoderBlock, init_component_registers
from emulator.hdm import DecoderSettings
from emulator.spec.errors import ConfigError, PoisonError
from emulator.spec.registers import BAR_SIZE

SZ_256M = 256 << 20
BASE = 1 << 40


class FakeMemDev:
    """bar + read(dpa, size) + write(dpa, data) over lazily allocated anonymous memory."""

    def __init__(self, capacity: int) -> None:
        self.bar = bytearray(BAR_SIZE)
        init_component_registers(self.bar)
        self.firmware = HdmDecoderBlock(self.bar, capacity)
        self.media = mmap.mmap(-1, capacity)
        self.poisoned: set[int] = set()  # DPAs of poisoned 64-B lines

    def read(self, dpa: int, size: int) -> bytes:
        for line in range(dpa // 64 * 64, dpa + size, 64):
            if line in self.poisoned:
                raise PoisonError(line)
        return self.media[dpa:dpa + size]

    def write(self, dpa: int, data: bytes | memoryview) -> None:
        self.media[dpa:dpa + len(data)] = bytes(data)


@contextlib.contextmanager
def firmware_thread(devs: list[FakeMemDev]) -> Iterator[None]:
    """One thread servicing the devices' decoders, as the firmware runner does."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            for dev in devs:
                dev.firmware.service()
            stop.wait(0.0005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture
def devices() -> Iterator[list[FakeMemDev]]:
    """Three 1 GiB devices with their firmware running."""
    devs = [FakeMemDev(4 * SZ_256M) for _ in range(3)]
    with firmware_thread(devs):
        yield devs


def test_commit_round_trip_reads_back_what_was_programmed(devices: list[FakeMemDev]) -> None:
    hdm = HdmDecoders(devices[0].bar)
    settings = DecoderSettings(base=BASE, size=2 * SZ_256M, ig=4, iw=1)
    hdm.commit(0, settings)
    [state] = hdm.committed()
    assert (state.index, state.settings, state.locked) == (0, settings, False)
    assert state.ctrl == 4 | 1 << 4 | 1 << 9 | 1 << 10 | 1 << 12  # IG, IW, COMMIT, COMMITTED, TYPE


def test_reprogramming_a_committed_decoder_is_refused(devices: list[FakeMemDev]) -> None:
    hdm = HdmDecoders(devices[0].bar)
    hdm.commit(0, DecoderSettings(base=BASE, size=SZ_256M))
    with pytest.raises(DecoderError, match=r"decoder 0: out of order commit, expected decoder 1"):
        hdm.commit(0, DecoderSettings(base=BASE, size=SZ_256M))
    with pytest.raises(DecoderError, match=r"out of order commit, expected decoder 1"):
        hdm.commit(2, DecoderSettings(base=BASE + SZ_256M, size=SZ_256M))


@pytest.mark.parametrize("ctrl", [1 << 9, 1 << 11])
def test_busy_decoder_is_refused_before_any_write(ctrl: int) -> None:
    """COMMIT or ERR already set (no firmware runs to clear them): refuse, as Linux does."""
    dev = FakeMemDev(SZ_256M)
    hdm = HdmDecoders(dev.bar)
    hdm.regs.set(hdm.regs_of(1).CTRL, ctrl)
    hdm.regs.set(hdm.regs_of(0).CTRL, 1 << 10)  # decoder 0 reads as committed, so 1 is next
    before = bytes(dev.bar)
    with pytest.raises(DecoderError, match=rf"decoder 1 is busy \(CTRL {ctrl:#x}"):
        hdm.commit(1, DecoderSettings(base=BASE, size=SZ_256M))
    assert bytes(dev.bar) == before


def test_device_refusal_raises_and_leaves_the_decoder_idle(devices: list[FakeMemDev]) -> None:
    hdm = HdmDecoders(devices[0].bar)
    with pytest.raises(DecoderError, match="refused the programming"):
        hdm.commit(0, DecoderSettings(base=BASE, size=8 * SZ_256M))  # 2 GiB on a 1 GiB device
    assert devices[0].firmware.errors[0].startswith("needs DPA up to 0x80000000")
    assert hdm.read(0).ctrl & (1 << 9 | 1 << 10 | 1 << 11) == 0
    hdm.commit(0, DecoderSettings(base=BASE, size=4 * SZ_256M))
    assert len(hdm.committed()) == 1


def test_commit_without_firmware_times_out() -> None:
    dev = FakeMemDev(SZ_256M)  # nobody services it
    hdm = HdmDecoders(dev.bar, timeout_s=0.02)
    with pytest.raises(DecoderTimeout, match="no commit acknowledgement after 0.02 s"):
        hdm.commit(0, DecoderSettings(base=BASE, size=SZ_256M))


def test_reset_in_reverse_order_and_not_when_locked(devices: list[FakeMemDev]) -> None:
    hdm = HdmDecoders(devices[0].bar)
    hdm.commit(0, DecoderSettings(base=BASE, size=SZ_256M), lock=True)
    hdm.commit(1, DecoderSettings(base=BASE + SZ_256M, size=SZ_256M))
    with pytest.raises(DecoderError, match="reset the decoders above it first"):
        hdm.reset(0)
    hdm.reset(1)
    assert [s.index for s in hdm.committed()] == [0]
    assert hdm.read(1).base == 0 and hdm.read(1).size == 0
    with pytest.raises(DecoderError, match="locked on commit"):
        hdm.reset(0)


def test_two_way_region_places_chunks_alternately(devices: list[FakeMemDev]) -> None:
    a, b = devices[0], devices[1]
    region = program_region([a, b], base=BASE, size=2 * SZ_256M, granularity=256)
    data = bytes(range(256)) * 6 + b"tail"
    region.write(BASE + 100, data)
    assert region.read(BASE + 100, len(data)) == data
    # chunk 0 (HPA 0..255) -> a DPA 0; chunk 1 -> b DPA 0; chunk 2 -> a DPA 256; ...
    assert a.read(100, 156) == data[:156]
    assert b.read(0, 256) == data[156:412]
    assert a.read(256, 256) == data[412:668]
    assert region.translate(BASE + 3 * 256 + 5) == (1, 256 + 5)


POISON_HPA = BASE + (8 * 3 + 2) * 512 + 0x40  # DPA 0x1040 on position 2: DPA chunk 8 -> HPA chunk 8 * 3 + 2


@pytest.mark.parametrize("start, length", [(POISON_HPA - 64, 128), (BASE, 32 * 3 * 512)],
                         ids=["partial-round", "whole-rounds"])
def test_poisoned_line_is_reported_at_its_hpa(devices: list[FakeMemDev], start: int, length: int) -> None:
    region = program_region(devices, base=BASE, size=3 * SZ_256M, granularity=512)
    devices[2].poisoned.add(0x1040)
    with pytest.raises(RegionPoisonError) as caught:
        region.read(start, length)
    assert (caught.value.hpa, caught.value.dpa, caught.value.position) == (POISON_HPA, 0x1040, 2)
    assert str(caught.value) == f"poisoned line at HPA {POISON_HPA:#x} (target 2, DPA 0x1040): read returned no data"
    assert region.read(POISON_HPA + 64, 64) == bytes(64)


def test_region_dpa_follows_earlier_decoders(devices: list[FakeMemDev]) -> None:
    """A second region on the same devices starts at the DPA after the first one's."""
    a, b = devices[0], devices[1]
    program_region([a], base=BASE, size=SZ_256M)
    second = program_region([b, a], base=BASE + 2 * SZ_256M, size=2 * SZ_256M, granularity=4096)
    second.write(BASE + 2 * SZ_256M + 4096, b"on a, after region one")
    assert second.translate(BASE + 2 * SZ_256M + 4096) == (1, SZ_256M)
    assert a.read(SZ_256M, 22) == b"on a, after region one"


def test_failed_region_leaves_no_decoder_behind(devices: list[FakeMemDev]) -> None:
    a, b = devices[0], devices[1]
    program_region([b], base=BASE, size=4 * SZ_256M)  # b is full
    with pytest.raises(DecoderError, match="refused"):
        program_region([a, b], base=BASE + 4 * SZ_256M, size=2 * SZ_256M)
    assert HdmDecoders(a.bar).committed() == []


def test_destroy_region_frees_the_decoders(devices: list[FakeMemDev]) -> None:
    region = program_region(devices[:2], base=BASE, size=2 * SZ_256M)
    destroy_region(region)
    assert [HdmDecoders(d.bar).committed() for d in devices[:2]] == [[], []]


def test_destroy_refused_on_one_target_resets_none(devices: list[FakeMemDev]) -> None:
    """[a, b] with a second region on a only: b's decoder could go, a's cannot, so neither goes."""
    a, b = devices[0], devices[1]
    region = program_region([a, b], base=BASE, size=2 * SZ_256M)
    program_region([a], base=BASE + 2 * SZ_256M, size=SZ_256M)
    with pytest.raises(DecoderError, match="target 0: decoder 0: reset the decoders above it first"):
        destroy_region(region)
    assert [len(HdmDecoders(d.bar).committed()) for d in (a, b)] == [2, 1]


def test_region_arguments_are_checked(devices: list[FakeMemDev]) -> None:
    with pytest.raises(ConfigError, match="5 interleave ways is not supported"):
        Region([devices[0]] * 5, base=BASE, size=5 * SZ_256M, granularity=256)
    with pytest.raises(ConfigError, match="must be a positive multiple of 2 x 256 MiB"):
        program_region(devices[:2], base=BASE, size=SZ_256M)
    with pytest.raises(ConfigError, match="granularity 300 must be one of"):
        program_region(devices[:2], base=BASE, size=2 * SZ_256M, granularity=300)
    with pytest.raises(ConfigError, match="distinct memdevs"):
        program_region([devices[0], devices[0]], base=BASE, size=2 * SZ_256M)
    region = program_region(devices[:1], base=BASE, size=SZ_256M)
    with pytest.raises(ValueError, match="outside the region"):
        region.read(BASE + SZ_256M - 4, 8)
    with pytest.raises(DecoderError, match="no committed decoder"):
        Region(devices[1:2], base=BASE, size=SZ_256M, granularity=256)


# Granularity per ways: every IW with a mix of IG, so the whole-round path and the partial-round path
# both see several shapes.
GRANULARITY_FOR_WAYS = {1: 256, 2: 512, 3: 512, 4: 1024, 6: 256, 8: 4096, 12: 2048, 16: 16384}


@pytest.fixture(scope="module")
def regions() -> Iterator[dict[int, tuple[Region, list[FakeMemDev]]]]:
    """One region per interleave ways over fresh 256 MiB devices."""
    made = {}
    for ways, gran in GRANULARITY_FOR_WAYS.items():
        devs = [FakeMemDev(SZ_256M) for _ in range(ways)]
        with firmware_thread(devs):
            made[ways] = (program_region(devs, base=BASE, size=ways * SZ_256M, granularity=gran), devs)
    yield made


def check_against_dealt_chunks(devs: list[FakeMemDev], gran: int, offset: int, data: bytes) -> None:
    """Deal G-byte chunks round-robin from HPA offset 0 (no division, no modulo) and compare each
    chunk the write touched with the media of the device it was dealt to."""
    chunk, pos, next_dpa = 0, 0, [0] * len(devs)
    end = offset + len(data)
    while chunk < end:
        lo, hi = max(chunk, offset), min(chunk + gran, end)
        if lo < hi:
            dpa = next_dpa[pos] + lo - chunk
            assert devs[pos].read(dpa, hi - lo) == data[lo - offset:hi - offset], (pos, chunk)
        next_dpa[pos] += gran
        chunk += gran
        pos = pos + 1 if pos + 1 < len(devs) else 0


@pytest.mark.parametrize("ways", sorted(GRANULARITY_FOR_WAYS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_region_matches_round_robin_reference(regions: dict[int, tuple[Region, list[FakeMemDev]]], ways: int,
                                              data: st.DataObject) -> None:
    """Every byte of a write lands where dealing chunks round-robin puts it, and reads back."""
    region, devs = regions[ways]
    gran = region.granularity
    offset = data.draw(st.integers(0, 4 * ways * gran), label="offset")
    length = data.draw(st.integers(1, 3 * ways * gran + 100), label="length")
    payload = random.Random(data.draw(st.integers(0, 2**32), label="seed")).randbytes(length)
    region.write(BASE + offset, payload)
    assert region.read(BASE + offset, length) == payload
    check_against_dealt_chunks(devs, gran, offset, payload)
