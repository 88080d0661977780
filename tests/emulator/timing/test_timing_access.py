"""The Dynamic Capacity access check: a host transfers a DC DPA only inside the extents it accepted
(its access bitmap), on both twins, for every transfer and DMA descriptor; a refusal moves nothing."""
from __future__ import annotations

import mmap
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from driver import NoExtent as DriverNoExtent
from emulator.dma import Descriptor, DescriptorArray, DmaEngine
from emulator.spec.errors import ConfigError, CxlemuError, DmaError, NoExtent, PoisonError
from emulator.timing import DataPath, ManualClock, TimingConfig, c_available
from emulator.timing.access import first_without_extent

if not c_available():
    from emulator.timing._build import build_in_place

    build_in_place()

IMPLS = ["c", "py"]
MEDIA = 1 << 16
BASE = 0x4000    # static capacity below, DC from here
BLOCK = 0x1000   # 12 DC blocks: a 2-byte bitmap
QEMU = TimingConfig(read_latency_ns=150, write_latency_ns=250,
                    read_bandwidth_gbps=16, write_bandwidth_gbps=16)


def make(impl: str, *, blocks: tuple[int, ...] = (), clock=None, config: TimingConfig = QEMU):
    """A DataPath over a seeded media whose DC blocks ``blocks`` are accessible."""
    media = bytearray(np.random.default_rng(11).integers(0, 256, MEDIA, dtype=np.uint8).tobytes())
    bits = bytearray(2)
    for b in blocks:
        bits[b >> 3] |= 1 << (b & 7)
    dp = DataPath(media, bytearray(MEDIA // 512), bytearray(4096), config, impl=impl,
                  clock=clock or ManualClock(0), access_bits=bits, access_base=BASE, access_block=BLOCK)
    return dp, media, bits


def block_dpa(i: int) -> int:
    return BASE + i * BLOCK


def test_no_extent_is_a_typed_error_the_driver_re_exports():
    err = NoExtent(0x5000)
    assert DriverNoExtent is NoExtent and isinstance(err, CxlemuError) and err.dpa == 0x5000
    assert str(err) == ("no extent at DPA 0x5000: a host reaches Dynamic Capacity only through extents "
                        "it accepted (Add DC Response); no data was moved")


@pytest.mark.parametrize("impl", IMPLS)
def test_static_capacity_is_never_checked(impl):
    dp, media, _ = make(impl)  # no DC block accessible
    out = bytearray(BASE)
    dp.read(0, out)
    assert out == media[:BASE]
    dp.write(0x100, b"\x5a" * 64)
    dp.read_untimed(BASE - 8, bytearray(8))
    dp.copy(0, 0x2000, 0x1000)
    assert media[0x100:0x140] == b"\x5a" * 64 and media[0x2100:0x2140] == b"\x5a" * 64
    assert dp.counters()["read_errors"] + dp.counters()["write_errors"] == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_a_transfer_inside_an_accessible_block_moves_its_bytes(impl):
    dp, media, _ = make(impl, blocks=(2, 3))
    out = bytearray(2 * BLOCK)
    assert dp.read(block_dpa(2), out) == 512 + 150  # 8 KiB at 16 GB/s + latency: timed as any read
    assert out == media[block_dpa(2):block_dpa(4)]
    dp.write(block_dpa(3) + 100, b"\x77" * 200)
    assert dp.read_bytes(block_dpa(3) + 100, 200) == b"\x77" * 200


def _attempt(dp: DataPath, op: str, dpa: int, n: int, out: bytearray):
    return {"read": lambda: dp.read(dpa, out),
            "read_bytes": lambda: dp.read_bytes(dpa, n),
            "write": lambda: dp.write(dpa, b"\xee" * n),
            "read_untimed": lambda: dp.read_untimed(dpa, out),
            "write_untimed": lambda: dp.write_untimed(dpa, b"\xee" * n),
            "copy_src": lambda: dp.copy(dpa, 0x1000, n),
            "copy_dst": lambda: dp.copy(0x1000, dpa, n)}[op]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clock", [None, ManualClock(0)], ids=["real", "sim"])
@pytest.mark.parametrize("op", ["read", "read_bytes", "write", "read_untimed", "write_untimed",
                                "copy_src", "copy_dst"])
def test_a_transfer_straddling_into_a_clear_block_fails_naming_it_and_moves_nothing(impl, clock, op):
    """Block 4 accessible, block 5 not: 8 KiB from the middle of block 4 fails at block 5's first
    DPA; neither media nor host buffer changes, and the link counts nothing but the error."""
    config = TimingConfig(read_latency_ns=150, read_bandwidth_gbps=16, media_read_bandwidth_gbps=32,
                          media_write_bandwidth_gbps=32)
    dp, media, _ = make(impl, blocks=(4,), clock=clock, config=config)
    dpa, n = block_dpa(4) + 0x800, 0x2000
    before, counters, media_counters = bytes(media), dp.counters(), dp.media_counters()
    out = bytearray(b"\xaa" * n)
    with pytest.raises(NoExtent) as exc:
        _attempt(dp, op, dpa, n, out)()
    assert exc.value.dpa == block_dpa(5)
    assert bytes(media) == before and out == b"\xaa" * n
    direction = "write" if op in ("write", "write_untimed", "copy_dst") else "read"
    counters[f"{direction}_errors"] += 1
    assert dp.counters() == counters and dp.media_counters() == media_counters


@pytest.mark.parametrize("impl", IMPLS)
def test_the_first_dpa_without_an_extent_is_named(impl):
    dp, *_ = make(impl, blocks=(0, 2))
    with pytest.raises(NoExtent) as exc:  # from static capacity into block 0 (set), 1 (clear), 2
        dp.read(BASE - 64, bytearray(3 * BLOCK))
    assert exc.value.dpa == block_dpa(1)
    with pytest.raises(NoExtent) as exc:  # starting inside a clear block: its own first byte
        dp.write(block_dpa(1) + 0x123, b"x")
    assert exc.value.dpa == block_dpa(1) + 0x123
    with pytest.raises(NoExtent) as exc:  # static capacity ok, DC block 0 now clear
        dp2, *_ = make(impl, blocks=(1,))
        dp2.read(BASE - 64, bytearray(128))
    assert exc.value.dpa == BASE


@pytest.mark.parametrize("impl", IMPLS)
def test_clearing_a_bit_fails_the_next_transfer(impl):
    """The firmware clears a released block's bit before it answers: the host's next transfer
    fails, with nothing cached from the previous one."""
    dp, media, bits = make(impl, blocks=(6,))
    out = bytearray(64)
    dp.read(block_dpa(6), out)
    bits[0] &= ~(1 << 6)
    with pytest.raises(NoExtent) as exc:
        dp.read(block_dpa(6), out)
    assert exc.value.dpa == block_dpa(6) and out == media[block_dpa(6):block_dpa(6) + 64]
    bits[0] |= 1 << 6  # accepted again
    dp.read(block_dpa(6), out)
    assert dp.counters()["read_transfers"] == 2 and dp.counters()["read_errors"] == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_past_the_media_the_range_error_comes_first(impl):
    dp, media, _ = make(impl, blocks=tuple(range(12)))
    before = bytes(media)
    with pytest.raises(ValueError, match=f"runs past the end of the media \\({MEDIA:#x} B\\)"):
        dp.write(MEDIA - 64, bytes(128))
    assert bytes(media) == before


@pytest.mark.parametrize("impl", IMPLS)
def test_blocks_past_the_bitmap_count_as_clear(impl):
    """Both scans, on a 1-byte bitmap (8 blocks) over a longer range: blocks 8 and on are
    outside the range the bitmap covers, so have no extent."""
    bits = np.array([0xFF], np.uint8)
    cases = [(block_dpa(7), BLOCK, None), (block_dpa(7), BLOCK + 1, block_dpa(8)),
             (block_dpa(9) + 5, 10, block_dpa(9) + 5), (0, BASE, None), (0, BASE + 1, None)]
    if impl == "py":
        got = [first_without_extent(bits, BASE, 12, dpa, n) for dpa, n, _ in cases]
    else:
        from emulator.timing.cimpl import ffi, lib

        dp = ffi.new("cxl_dp *")
        keep = ffi.from_buffer("uint8_t[]", bits)
        dp.access, dp.access_size, dp.access_base, dp.access_shift = keep, 1, BASE, 12
        got = [None if (r := lib.cxl_first_no_extent(dp, dpa, n)) == 2**64 - 1 else r for dpa, n, _ in cases]
    assert got == [want for *_, want in cases]


@pytest.mark.parametrize("impl", IMPLS)
def test_for_device_checks_a_bitmap_the_host_maps_read_only(impl, tmp_path):
    """As a device's access file is used: the firmware writes through its own mapping, the host's
    data path maps it read-only and sees each change at its next transfer."""
    from emulator.spec.registers import BAR_SIZE

    path = tmp_path / "access.h0"
    path.write_bytes(bytes(4096))
    with open(path, "r+b") as f:
        firmware, host = mmap.mmap(f.fileno(), 4096), mmap.mmap(f.fileno(), 4096, access=mmap.ACCESS_READ)
    files = SimpleNamespace(bar=bytearray(BAR_SIZE), media=bytearray(MEDIA), poison=bytearray(MEDIA // 512))
    with DataPath.for_device(files, config=QEMU, impl=impl, clock=ManualClock(0), access_bits=host,
                             access_base=BASE, access_block=BLOCK) as dp:
        dp.read(0, bytearray(64))
        with pytest.raises(NoExtent, match="no extent at DPA 0x4000"):
            dp.read(BASE, bytearray(64))
        firmware[0] = 1  # Add DC Response accepted: block 0
        dp.write(BASE, b"\x01" * 64)
        assert dp.read_bytes(BASE, 64) == b"\x01" * 64
        firmware[0] = 0  # released
        with pytest.raises(NoExtent):
            dp.write(BASE, b"\x02")
    host.close()
    firmware.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"access_block": 0x800}, r"access_block must be a power of two >= 4096 \(the DC block size in bytes\), got 2048"),
    ({"access_block": 0x3000}, "access_block must be a power of two >= 4096"),
    ({"access_block": 0}, "access_block must be a power of two >= 4096"),
    ({"access_block": True}, "access_block must be an int >= 0, got True"),
    ({"access_base": 0x4800}, r"access_base 0x4800 must be a multiple of access_block \(0x1000\)"),
    ({"access_base": -4096}, "access_base must be an int >= 0, got -4096"),
    ({"access_base": MEDIA + BLOCK}, r"access_base 0x11000 is past the end of the media \(0x10000 B\)"),
    ({"access_bits": bytearray(1)}, r"access_bits has 1 bytes; the 0xc000 B of media from access_base "
                                    r"0x4000 in 0x1000-B blocks need 2 \(1 bit per block\)"),
])
def test_bad_access_arguments_say_what_to_change(kwargs, message):
    args = {"access_bits": bytearray(2), "access_base": BASE, "access_block": BLOCK} | kwargs
    with pytest.raises(ConfigError, match=message):
        DataPath(bytearray(MEDIA), None, bytearray(4096), QEMU, **args)


def test_a_bitmap_covering_exactly_the_media_is_enough():
    """12 blocks from BASE need 2 bytes; a base at the media's end needs none."""
    DataPath(bytearray(MEDIA), None, bytearray(4096), QEMU, access_bits=bytearray(2), access_base=BASE,
             access_block=BLOCK).close()
    DataPath(bytearray(MEDIA), None, bytearray(4096), QEMU, access_bits=b"", access_base=MEDIA,
             access_block=BLOCK).close()


# -- the DMA engine ---------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("count", [2, 5], ids=["one-by-one", "batched"])
def test_a_dma_descriptor_without_an_extent_fails_alone_with_no_extent_as_cause(impl, count):
    dp, media, _ = make(impl, blocks=(0, 1))
    host = bytearray(b"\x33" * (count * 256))
    before = bytes(media)
    descs = [Descriptor("read", block_dpa(0) + i * 256, host, i * 256, 256) for i in range(count - 1)]
    descs.insert(1, Descriptor("write", block_dpa(1) + BLOCK - 128, host, 0, 256))  # into block 2
    with DmaEngine(dp, channels=1) as eng:
        results = eng.submit(descs).wait(10)
    bad = results[1]
    assert isinstance(bad, DmaError) and bad.index == 1 and isinstance(bad.__cause__, NoExtent)
    assert bad.__cause__.dpa == block_dpa(2) and f"{block_dpa(2):#x}" in str(bad)
    assert all(isinstance(r, int) for i, r in enumerate(results) if i != 1)
    assert bytes(media) == before  # the write moved nothing
    assert host[:(count - 1) * 256] == media[block_dpa(0):block_dpa(0) + (count - 1) * 256]


def test_a_descriptor_array_fails_the_descriptor_without_an_extent():
    dp, media, _ = make("c", blocks=(0,))
    out = np.zeros(3 * 4096, np.uint8)
    arr = DescriptorArray("read", [out], [0, 0, 0], [0x1000, block_dpa(0), block_dpa(3)], [0, 4096, 8192],
                          [4096, 4096, 4096])
    with DmaEngine(dp, channels=1) as eng:
        got = eng.submit(arr).wait(10)
    assert isinstance(got[0], int) and isinstance(got[1], int)
    assert isinstance(got[2], DmaError) and got[2].index == 2 and got[2].__cause__.dpa == block_dpa(3)
    assert (out[:4096] == np.frombuffer(media, np.uint8)[0x1000:0x2000]).all() and not out[8192:].any()


# -- differential: C vs Python ----------------------------------------------------------------
def _untimed(dp: DataPath, a: int, b: int, n: int) -> bytes:
    out = bytearray(n % 300)
    dp.read_untimed(a, out)
    dp.write_untimed(b, out)
    return bytes(out)


def _read(dp: DataPath, a: int, n: int) -> tuple[int, bytes]:
    out = bytearray(n)
    return dp.read(a, out), bytes(out)


def _flip(bits: bytearray, a: int) -> None:
    """The firmware sets or clears a block's bit between two transfers."""
    bits[(a >> 3) % len(bits)] ^= 1 << (a & 7)


#: each operation of the differential run: (data path, bitmap, a, b, n) -> what it returned
_OPS = {
    "read": lambda dp, bits, a, b, n: _read(dp, a, n),
    "write": lambda dp, bits, a, b, n: dp.write(a, bytes([n & 255]) * n),
    "copy": lambda dp, bits, a, b, n: dp.copy(a, b, n),
    "read_bytes": lambda dp, bits, a, b, n: dp.read_bytes(a, n % 300),
    "untimed": lambda dp, bits, a, b, n: _untimed(dp, a, b, n),
    "flip": lambda dp, bits, a, b, n: _flip(bits, a),
}


def _run(impl, shift, base_blocks, bitmap, ops, poisoned):
    block = 1 << shift
    media = bytearray(np.random.default_rng(5).integers(0, 256, MEDIA, dtype=np.uint8).tobytes())
    poison, bits = bytearray(MEDIA // 512), bytearray(bitmap)
    for dpa in poisoned:
        poison[dpa >> 9] |= 1 << ((dpa >> 6) & 7)
    dp = DataPath(media, poison, bytearray(4096), QEMU, impl=impl, clock=ManualClock(3),
                  access_bits=bits, access_base=base_blocks * block, access_block=block)
    results = []
    for op, a, b, n in ops:
        try:
            results.append(_OPS[op](dp, bits, a, b, n))
        except (NoExtent, PoisonError, ValueError) as exc:
            results.append((type(exc).__name__, str(exc)))
    return results, bytes(media), dp.counters()


_ops = st.lists(st.tuples(st.sampled_from(sorted(_OPS)),
                          st.integers(0, MEDIA), st.integers(0, MEDIA), st.integers(0, 3 * 8192)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(shift=st.sampled_from([12, 13, 14]), base_blocks=st.integers(0, 3), data=st.data(),
       ops=_ops, poisoned=st.lists(st.integers(0, MEDIA - 1), max_size=3))
def test_c_and_python_twins_agree_on_access(shift, base_blocks, data, ops, poisoned):
    """Random bitmaps (sized for the media, with a byte or two to spare), ranges and bit flips:
    same completions, bytes, errors and counters."""
    blocks = -(-(MEDIA - (base_blocks << shift)) >> shift)
    bitmap = data.draw(st.binary(min_size=-(-blocks // 8), max_size=-(-blocks // 8) + 2))
    assert _run("c", shift, base_blocks, bitmap, ops, poisoned) == _run("py", shift, base_blocks, bitmap, ops,
                                                                         poisoned)
