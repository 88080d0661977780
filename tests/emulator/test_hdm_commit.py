"""Component register layout and the firmware's HDM commit protocol (emulator.component).

The host side here is raw 32-bit stores at offsets computed by hand from CXL r3.1 §8.2.4.20, so a
wrong table in emulator.spec.component_regs fails these tests rather than agreeing with itself.
"""
from __future__ import annotations

import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from emulator.component import HdmDecoderBlock, init_component_registers
from emulator.hdm import DecoderSettings
from emulator.spec.registers import BAR_SIZE

SZ_256M = 256 << 20
CM = 0x10000 + 0x1000      # component block + CXL.cache/mem
HDM = CM + 0x200
LOCK, COMMIT, COMMITTED, ERR = 1 << 8, 1 << 9, 1 << 10, 1 << 11


class Host:
    """What a host does to the BAR: aligned 32-bit loads and stores."""

    def __init__(self, bar: bytearray) -> None:
        self.bar = bar

    def rd(self, off: int) -> int:
        return struct.unpack_from("<I", self.bar, off)[0]

    def wr(self, off: int, value: int) -> None:
        struct.pack_into("<I", self.bar, off, value)

    def ctrl(self, n: int) -> int:
        return self.rd(HDM + 0x20 + 0x20 * n)

    def set_ctrl(self, n: int, value: int) -> None:
        self.wr(HDM + 0x20 + 0x20 * n, value)

    def program(self, n: int, base: int, size: int, *, ig: int = 0, iw: int = 0, skip: int = 0,
                lock: bool = False) -> None:
        """Linux's order: base, size, skip, then CTRL with COMMIT last."""
        dec = HDM + 0x10 + 0x20 * n
        self.wr(dec + 0x04, base >> 32)
        self.wr(dec + 0x00, base & 0xFFFFFFFF)
        self.wr(dec + 0x0C, size >> 32)
        self.wr(dec + 0x08, size & 0xFFFFFFFF)
        self.wr(dec + 0x18, skip >> 32)
        self.wr(dec + 0x14, skip & 0xFFFFFFFF)
        self.wr(dec + 0x10, ig | iw << 4 | (LOCK if lock else 0) | COMMIT | 1 << 12)

    def enable(self) -> None:
        self.wr(HDM + 0x04, 1 << 1)


@pytest.fixture
def dev() -> tuple[Host, HdmDecoderBlock]:
    bar = bytearray(BAR_SIZE)
    init_component_registers(bar)
    return Host(bar), HdmDecoderBlock(bar, capacity=4 * SZ_256M)


def test_layout_decoded_by_hand() -> None:
    """Capability array, RAS reset values and the HDM capability at the offsets of §8.2.4."""
    host = Host(bytearray(BAR_SIZE))
    init_component_registers(host.bar, n_decoders=4)
    assert host.rd(CM) == 1 | 1 << 16 | 1 << 20 | 2 << 24     # ID 1, v1, cache/mem v1, 2 elements
    assert host.rd(CM + 4) == 2 | 2 << 16 | 0x100 << 20        # RAS, v2, at +0x100
    assert host.rd(CM + 8) == 5 | 1 << 16 | 0x200 << 20        # HDM, v1, at +0x200
    ras = CM + 0x100
    # masks and severity all set; capability/control: multiple headers (bit 9), poison enabled (bit 13)
    assert [host.rd(ras + off) for off in range(0, 0x18, 4)] == [0, 0x1CFFF, 0x1CFFF, 0, 0x7F, 0x2200]
    # count enc 2 (4 decoders), 1 target, 256 B + 4 KiB interleave bits, 3/6/12 and 16 ways
    assert host.rd(HDM) == 0x2 | 1 << 4 | 1 << 8 | 1 << 9 | 1 << 11 | 1 << 12
    assert host.rd(HDM + 4) == 0


def test_decoder_count_follows_the_spec_encoding() -> None:
    bar = bytearray(BAR_SIZE)
    init_component_registers(bar, n_decoders=10)
    assert Host(bar).rd(HDM) & 0xF == 5
    assert HdmDecoderBlock(bar, SZ_256M).n_decoders == 10
    with pytest.raises(ValueError, match="one of"):
        init_component_registers(bar, n_decoders=3)


def test_commit_sets_committed_and_decodes_once_enabled(dev: tuple[Host, HdmDecoderBlock]) -> None:
    host, hdm = dev
    host.program(0, base=16 * SZ_256M, size=2 * SZ_256M, iw=1, ig=2)
    hdm.service()
    assert host.ctrl(0) == 2 | 1 << 4 | COMMIT | COMMITTED | 1 << 12
    assert hdm.decoders() == []  # HDM Decoder Enable still clear
    assert hdm.hpa_to_dpa(16 * SZ_256M) is None
    host.enable()
    assert hdm.decoders() == [DecoderSettings(base=16 * SZ_256M, size=2 * SZ_256M, ig=2, iw=1)]
    assert hdm.hpa_to_dpa(16 * SZ_256M + 3 * 1024 + 7) == 1024 + 7  # chunk 3 of 1 KiB: 2nd on position 1


def test_commit_out_of_order_sets_error_until_commit_is_cleared(dev: tuple[Host, HdmDecoderBlock]) -> None:
    host, hdm = dev
    host.program(1, base=0, size=SZ_256M)
    hdm.service()
    assert host.ctrl(1) & (COMMIT | COMMITTED | ERR) == COMMIT | ERR
    assert "before decoders 0..0" in hdm.errors[1]
    hdm.service()
    assert host.ctrl(1) & ERR  # stays until the host acts
    host.set_ctrl(1, host.ctrl(1) & ~COMMIT)  # Linux cxld_await_commit on error
    hdm.service()
    assert host.ctrl(1) & (COMMIT | COMMITTED | ERR) == 0


@pytest.mark.parametrize("kwargs, reason", [
    ({"base": SZ_256M + 4096, "size": SZ_256M}, "base 0x10001000 is not a multiple of 256 MiB"),
    ({"base": 0, "size": SZ_256M + 256}, "size 0x10000100 is not a multiple"),
    ({"base": 0, "size": SZ_256M, "skip": 1 << 20}, "DPA skip 0x100000 is not a multiple"),
    ({"base": 0, "size": SZ_256M, "iw": 5}, "IG=0 / IW=5 is a reserved encoding"),
    ({"base": 0, "size": SZ_256M, "ig": 7}, "IG=7 / IW=0 is a reserved encoding"),
    ({"base": 0, "size": 2 * SZ_256M, "iw": 8}, "does not give each of 3 ways whole 256 MiB units"),
    ({"base": 0, "size": 5 * SZ_256M}, "needs DPA up to 0x50000000, past the device's 0x40000000"),
    ({"base": 0, "size": 4 * SZ_256M, "skip": SZ_256M}, "needs DPA up to 0x50000000"),
    ({"base": 0xFFFFFFFF_F0000000, "size": 2 * SZ_256M}, "wraps past 2^64"),
])
def test_bad_programming_is_refused_with_error_bit(dev: tuple[Host, HdmDecoderBlock], kwargs: dict[str, int],
                                                   reason: str) -> None:
    host, hdm = dev
    host.program(0, **kwargs)
    hdm.service()
    assert host.ctrl(0) & (COMMITTED | ERR) == ERR
    assert reason in hdm.errors[0]
    assert hdm.committed_count == 0


def test_dpa_accumulates_across_decoders(dev: tuple[Host, HdmDecoderBlock]) -> None:
    """1 GiB device: decoder 0 takes 512 MiB of DPA (2-way 1 GiB window); decoder 1 skips 256 MiB."""
    host, hdm = dev
    host.enable()
    host.program(0, base=0x40 * SZ_256M, size=4 * SZ_256M, iw=1)
    hdm.service()  # a host waits for COMMITTED before the next decoder (Linux cxld_await_commit)
    host.program(1, base=0x80 * SZ_256M, size=2 * SZ_256M, skip=SZ_256M)
    hdm.service()
    assert "needs DPA up to 0x50000000" in hdm.errors[1]  # 512 + 256 + 512 MiB > 1 GiB
    host.set_ctrl(1, host.ctrl(1) & ~COMMIT)
    hdm.service()
    host.program(1, base=0x80 * SZ_256M, size=SZ_256M, skip=SZ_256M)
    hdm.service()
    assert [d.base for d in hdm.decoders()] == [0x40 * SZ_256M, 0x80 * SZ_256M]


def test_base_below_previous_window_is_refused(dev: tuple[Host, HdmDecoderBlock]) -> None:
    host, hdm = dev
    host.program(0, base=8 * SZ_256M, size=2 * SZ_256M)
    hdm.service()
    host.program(1, base=9 * SZ_256M, size=SZ_256M)
    hdm.service()
    assert host.ctrl(0) & COMMITTED
    assert "below the end of decoder 0" in hdm.errors[1]


def test_locked_decoder_registers_are_restored(dev: tuple[Host, HdmDecoderBlock]) -> None:
    host, hdm = dev
    host.enable()
    host.program(0, base=4 * SZ_256M, size=SZ_256M, lock=True)
    hdm.service()
    before = bytes(host.bar[HDM + 0x10: HDM + 0x30])
    host.wr(HDM + 0x10, 0x70000000)                # BASE_LO
    host.set_ctrl(0, host.ctrl(0) & ~COMMIT)        # try to uncommit
    hdm.service()
    assert bytes(host.bar[HDM + 0x10: HDM + 0x30]) == before
    assert hdm.decoders() == [DecoderSettings(base=4 * SZ_256M, size=SZ_256M)]
    assert hdm.errors == {}


def test_uncommit_below_a_committed_decoder_stops_decode_above_it(dev: tuple[Host, HdmDecoderBlock]) -> None:
    """§8.2.4.20.7: clearing Commit clears Committed in any order; decode stops at the hole (QEMU)."""
    host, hdm = dev
    host.enable()
    host.program(0, base=0, size=SZ_256M)
    hdm.service()
    host.program(1, base=SZ_256M, size=SZ_256M)
    hdm.service()
    host.set_ctrl(0, host.ctrl(0) & ~COMMIT)
    hdm.service()
    assert host.ctrl(0) & (COMMIT | COMMITTED) == 0 and host.ctrl(1) & COMMITTED
    assert hdm.decoders() == [] and hdm.hpa_to_dpa(SZ_256M) is None
    host.program(0, base=0, size=2 * SZ_256M)  # would reach into decoder 1
    hdm.service()
    assert "reaches into the committed decoder above it at 0x10000000" in hdm.errors[0]
    host.set_ctrl(0, host.ctrl(0) & ~COMMIT)
    hdm.service()
    host.program(0, base=0, size=SZ_256M)
    hdm.service()
    assert [d.base for d in hdm.decoders()] == [0, SZ_256M]


def test_recommitting_a_hole_counts_the_dpa_of_decoders_above(dev: tuple[Host, HdmDecoderBlock]) -> None:
    host, hdm = dev  # 1 GiB of DPA
    host.program(0, base=0, size=SZ_256M)
    hdm.service()
    host.program(1, base=4 * SZ_256M, size=2 * SZ_256M)
    hdm.service()
    host.set_ctrl(0, host.ctrl(0) & ~COMMIT)
    hdm.service()
    host.program(0, base=0, size=3 * SZ_256M)  # 768 MiB + decoder 1's 512 MiB > 1 GiB
    hdm.service()
    assert hdm.errors[0] == "needs DPA up to 0x50000000, past the device's 0x40000000"


def test_uncommit_top_down_in_one_pass(dev: tuple[Host, HdmDecoderBlock]) -> None:
    host, hdm = dev
    host.program(0, base=0, size=SZ_256M)
    hdm.service()
    host.program(1, base=SZ_256M, size=SZ_256M)
    hdm.service()
    host.set_ctrl(1, host.ctrl(1) & ~COMMIT)
    host.set_ctrl(0, host.ctrl(0) & ~COMMIT)
    hdm.service()
    assert (host.ctrl(0) | host.ctrl(1)) & (COMMIT | COMMITTED | ERR) == 0
    assert hdm.committed_count == 0


def test_a_refused_write_repeated_is_refused_again(dev: tuple[Host, HdmDecoderBlock]) -> None:
    """The host writing back the value the firmware just replaced is a new write, not a no-op."""
    host, hdm = dev
    host.program(0, base=0, size=SZ_256M, lock=True)
    hdm.service()
    for _ in range(3):
        host.set_ctrl(0, host.ctrl(0) & ~COMMIT)
        hdm.service()
        assert host.ctrl(0) & (COMMIT | COMMITTED) == COMMIT | COMMITTED


def test_commit_1_then_0_between_two_passes_refuses_1(dev: tuple[Host, HdmDecoderBlock]) -> None:
    """Hardware judges decoder 1's COMMIT when it is written: decoder 0 was not committed then."""
    host, hdm = dev
    host.enable()
    host.program(1, base=SZ_256M, size=SZ_256M)  # COMMIT on decoder 1 first ...
    host.program(0, base=0, size=SZ_256M)        # ... then on decoder 0, no firmware pass between
    hdm.service()
    assert host.ctrl(0) == COMMIT | COMMITTED | 1 << 12
    assert host.ctrl(1) == COMMIT | ERR | 1 << 12
    assert hdm.errors == {1: "decoder 1's COMMIT was set before decoder 0 reported COMMITTED (both seen in "
                             "one pass, so their order is unknown); decoders 0..0 must be committed first "
                             "(§8.2.4.20.12): wait for COMMITTED after each commit, as Linux does"}
    assert hdm.decoders() == [DecoderSettings(base=0, size=SZ_256M)]
    assert hdm.hpa_to_dpa(SZ_256M) is None
    host.set_ctrl(1, host.ctrl(1) & ~COMMIT)  # Linux cxld_await_commit on error, then a retry
    hdm.service()
    host.set_ctrl(1, host.ctrl(1) | COMMIT)
    hdm.service()
    assert host.ctrl(1) == COMMIT | COMMITTED | 1 << 12
    assert hdm.hpa_to_dpa(SZ_256M + 64) == SZ_256M + 64


def test_commit_0_then_1_between_two_passes_is_refused_alike(dev: tuple[Host, HdmDecoderBlock]) -> None:
    """The same registers as 1-then-0: the store order is unknown, so decoder 1 is refused too."""
    host, hdm = dev
    host.program(0, base=0, size=SZ_256M)
    host.program(1, base=SZ_256M, size=SZ_256M)
    hdm.service()
    assert host.ctrl(0) & (COMMITTED | ERR) == COMMITTED
    assert host.ctrl(1) & (COMMITTED | ERR) == ERR
    assert hdm.committed_count == 1


def test_commit_raised_during_a_pass_waits_for_the_next_pass(dev: tuple[Host, HdmDecoderBlock],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that sees decoder 0's COMMITTED while the pass is still running and at once commits
    decoder 1 (what Linux does, only fast) is served by the next pass, never refused."""
    host, hdm = dev
    ctrl0 = HDM + 0x20
    set_register = hdm._set

    def set_then_host_reacts(reg: object, value: int) -> None:
        set_register(reg, value)  # type: ignore[arg-type]
        if reg.offset == ctrl0 and value & COMMITTED:  # type: ignore[attr-defined]
            host.program(1, base=SZ_256M, size=SZ_256M)

    monkeypatch.setattr(hdm, "_set", set_then_host_reacts)
    host.program(0, base=0, size=SZ_256M)
    hdm.service()
    assert host.ctrl(0) & (COMMITTED | ERR) == COMMITTED
    assert host.ctrl(1) == COMMIT | 1 << 12  # not looked at yet
    monkeypatch.setattr(hdm, "_set", set_register)
    hdm.service()
    assert host.ctrl(1) == COMMIT | COMMITTED | 1 << 12
    assert hdm.errors == {}


def test_committed_decoder_reprogrammed_keeps_registers_and_decode_agreed(
        dev: tuple[Host, HdmDecoderBlock]) -> None:
    """An unlocked, committed decoder is read-only while COMMIT stays set: a new base (or IG) put
    into its registers is undone, so the registers show the window the device decodes."""
    host, hdm = dev
    host.enable()
    host.program(0, base=4 * SZ_256M, size=SZ_256M)
    hdm.service()
    before = bytes(host.bar[HDM + 0x10: HDM + 0x30])
    host.wr(HDM + 0x14, 0)                      # BASE_HI
    host.wr(HDM + 0x10, 0x70000000)             # BASE_LO: base 0x70000000, COMMIT still set
    host.set_ctrl(0, host.ctrl(0) | 3)          # and IG 3
    hdm.service()
    assert bytes(host.bar[HDM + 0x10: HDM + 0x30]) == before
    assert host.rd(HDM + 0x10) == 0x40000000 and host.ctrl(0) == COMMIT | COMMITTED | 1 << 12
    assert hdm.decoders() == [DecoderSettings(base=4 * SZ_256M, size=SZ_256M)]
    assert hdm.hpa_to_dpa(0x70000000) is None
    assert hdm.hpa_to_dpa(4 * SZ_256M + 0x1040) == 0x1040
    assert hdm.errors == {}


def test_reprogramming_after_clearing_commit_takes_the_new_base(dev: tuple[Host, HdmDecoderBlock]) -> None:
    """The way to move a committed decoder: clear COMMIT (a base written in the same gap is kept,
    the decoder being uncommitted), then commit again (Linux cxl_decoder_reset, cxl_decoder_commit)."""
    host, hdm = dev
    host.enable()
    host.program(0, base=4 * SZ_256M, size=SZ_256M)
    hdm.service()
    host.set_ctrl(0, host.ctrl(0) & ~COMMIT)
    host.wr(HDM + 0x10, 0x70000000)
    hdm.service()
    assert host.rd(HDM + 0x10) == 0x70000000 and host.ctrl(0) & (COMMIT | COMMITTED) == 0
    assert hdm.decoders() == []
    host.set_ctrl(0, host.ctrl(0) | COMMIT)
    hdm.service()
    assert hdm.decoders() == [DecoderSettings(base=0x70000000, size=SZ_256M)]
    assert hdm.hpa_to_dpa(0x70000000 + 64) == 64 and hdm.hpa_to_dpa(4 * SZ_256M) is None


def test_read_only_status_bits_are_restored(dev: tuple[Host, HdmDecoderBlock]) -> None:
    host, hdm = dev
    host.set_ctrl(2, COMMITTED | ERR)  # a host cannot set these
    host.program(0, base=0, size=SZ_256M)
    hdm.service()
    host.set_ctrl(0, host.ctrl(0) & ~COMMITTED)  # nor clear this one
    hdm.service()
    assert host.ctrl(2) == 0
    assert host.ctrl(0) & (COMMIT | COMMITTED) == COMMIT | COMMITTED


SLOT = 4 * SZ_256M  # decoder n's window starts at n * SLOT, so HPA order always holds


class CommitProtocol(RuleBasedStateMachine):
    """Random host commits and uncommits against a model of §8.2.4.20.7/12 and QEMU's decode."""

    def __init__(self) -> None:
        super().__init__()
        bar = bytearray(BAR_SIZE)
        init_component_registers(bar)
        self.host, self.hdm = Host(bar), HdmDecoderBlock(bar, capacity=8 * SZ_256M)
        self.host.enable()
        self.model: dict[int, tuple[int, bool]] = {}  # committed decoder -> (size, locked)

    @rule(n=st.integers(0, 3), units=st.integers(0, 3), lock=st.booleans())
    def commit(self, n: int, units: int, lock: bool) -> None:
        if self.host.ctrl(n) & (COMMIT | COMMITTED | ERR):
            return  # the driver refuses these; covered elsewhere
        self.host.program(n, base=n * SLOT, size=units * SZ_256M, lock=lock)
        self.hdm.service()
        used = sum(size for size, _ in self.model.values())
        ok = all(m in self.model for m in range(n)) and used + units * SZ_256M <= 8 * SZ_256M
        assert bool(self.host.ctrl(n) & COMMITTED) == ok
        assert bool(self.host.ctrl(n) & ERR) == (not ok)
        if ok:
            self.model[n] = (units * SZ_256M, lock)
        else:
            self.host.set_ctrl(n, self.host.ctrl(n) & ~COMMIT)
            self.hdm.service()

    @rule(n=st.integers(0, 3))
    def uncommit(self, n: int) -> None:
        self.host.set_ctrl(n, self.host.ctrl(n) & ~COMMIT)
        self.hdm.service()
        if n in self.model and not self.model[n][1]:
            del self.model[n]

    @rule(n=st.integers(0, 3), base_lo=st.integers(0, 15).map(lambda u: u << 28))
    def scribble_base(self, n: int, base_lo: int) -> None:
        """A host writing BASE_LO with COMMIT left as it is (undone on a committed decoder)."""
        self.host.wr(HDM + 0x10 + 0x20 * n, base_lo)
        self.hdm.service()

    @invariant()
    def registers_and_decode_match_model(self) -> None:
        prefix = []
        for n in range(4):
            assert bool(self.host.ctrl(n) & COMMITTED) == (n in self.model)
            if n in self.model:  # what a committed decoder's registers show is what it was given
                dec = HDM + 0x10 + 0x20 * n
                assert self.host.rd(dec + 4) << 32 | self.host.rd(dec) == n * SLOT
                assert self.host.rd(dec + 0xC) << 32 | self.host.rd(dec + 8) == self.model[n][0]
            if n in self.model and len(prefix) == n:
                prefix.append((n * SLOT, self.model[n][0]))
        assert [(d.base, d.size) for d in self.hdm.decoders()] == prefix


TestCommitProtocol = CommitProtocol.TestCase
TestCommitProtocol.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
