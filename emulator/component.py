"""Component registers at reset, and the firmware's half of HDM decoder programming.

Nothing traps a host's store into the shared BAR, so the firmware plays the hardware's part of
CXL r3.1 §8.2.4.20.12 (Committing Decoder Programming) by polling: `HdmDecoderBlock.service()`
runs on every pass of the firmware runner and moves each decoder through

                 host sets COMMIT            checks pass
    [idle] ─────────────────────────▶ ? ───────────────────▶ [COMMITTED] ──┐ host clears COMMIT
      ▲  ▲                            │ checks fail                       │ (not locked)
      │  │ host clears COMMIT         ▼                                   │
      │  └──────────────────── [ERR_NOT_COMMITTED]                        │
      └───────────────────────────────────────────────────────────────────┘

The checks are those of §8.2.4.20.12 plus what a Type-3 device's DPA space needs: decoders 0..n-1
committed before n, base / size / DPA skip in 256 MiB units, valid IG / IW, size a whole number of
256 MiB units per way, HPA above the decoder below and below the decoder above, and the DPA of all
committed decoders within the device. The spec asks the device for the aliasing checks only with
Lock On Commit set; cxlemu makes them always, since a refused commit is easier to debug than
silent aliasing.

Commit order on a polled BAR. Hardware acts on each store as it arrives, so "decoders 0..n-1
committed before n" is judged when decoder n's COMMIT is written: a host that sets COMMIT on
decoder 1 and then on decoder 0 gets ERR_NOT_COMMITTED on 1. A pass of the service sees only the
registers' state, not the order of the stores that made it, and "1 then 0" leaves the same state
as "0 then 1". The rule cxlemu applies: **a commit request of decoder n is refused
(ERR_NOT_COMMITTED) when a decoder below n is committed in the same pass**. Both COMMIT bits were
then set before the device had reported COMMITTED for the lower one, so the host did not wait for
it, and which store came first cannot be known. For the bad order refusing is what hardware does;
for the good order it is what hardware may do when decoder n's COMMIT arrives before its commit of
decoder n-1 has completed. Only COMMIT bits already set when the pass took its snapshot of the registers
are acted on; one that appears while the pass runs (a host that saw this pass's COMMITTED and
went on to the next decoder, as it should) waits for the next pass, so a host that waits is never
refused. Linux never meets the rule: cxl_decoder_commit() commits in decoder order, one decoder at
a time, and cxld_await_commit() polls for COMMITTED (or ERR) before it returns, so the next
decoder's COMMIT is written only after the previous one reads COMMITTED; `driver.hdm` does the
same. Uncommits are not ordered: §8.2.4.20.7 clears COMMITTED on any 1 -> 0 of COMMIT.

A committed decoder is read-only while its COMMIT stays set, locked or not: its settings are
latched when it commits, `decoders()` decodes the latched copies, and any other change a host
makes to its registers (BASE, SIZE, DPA SKIP, CTRL fields) is undone by the next pass, which puts
the latched words back. So the registers always show what the device decodes, and a host
scribbling on a committed decoder never changes decode mid-access. To reprogram a decoder the
host clears COMMIT (COMMITTED drops), writes the new values and sets COMMIT again, as Linux does
(cxl_decoder_reset clears COMMIT, then zeroes the registers; cxl_decoder_commit programs them and
sets COMMIT); a write that lands in the same pass as the COMMIT clear is kept, since the decoder
is then uncommitted. With LOCK_ON_COMMIT even the COMMIT clear is undone: the registers are
read-only until reset. QEMU instead lets the write through and decodes what the registers
show (cxl_type3_dpa reads the decoder registers on every access); cxlemu refuses the write so
that registers and decode agree without re-running the commit checks on half-written values
(BASE_LO and BASE_HI are separate stores). COMMITTED and ERR_NOT_COMMITTED are read-only to the
host; the service restores them when a host writes them.

RAS: the status registers are RW1C, which a shared-memory BAR cannot emulate (a host writing back
the value it read, as Linux does to clear, is indistinguishable from no write). cxlemu reports media
errors through the poison list and event records instead, so RAS holds its reset values.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from emulator.hdm import IG_MAX, WAYS_BY_IW, DecoderSettings, hpa_to_dpa
from emulator.regfile import RegisterFile
from emulator.spec import component_regs as C
from emulator.spec.registers import Reg

_ALIGN = C.HDM_DECODER_ALIGN
_RO_CTRL_BITS = C.CTRL_COMMITTED | C.CTRL_ERR_NOT_COMMITTED


def _regfile(bar: Any) -> RegisterFile:
    return bar if isinstance(bar, RegisterFile) else RegisterFile(bar)


def init_component_registers(bar: Any, n_decoders: int = 4) -> None:
    """Reset the component block: capability array, RAS and an HDM capability of `n_decoders`.

    `bar` is the device's BAR (a RegisterFile or any writable buffer of BAR_SIZE bytes).
    """
    if n_decoders not in C.DECODER_COUNT_ENC:
        raise ValueError(f"n_decoders={n_decoders}: a device has one of {sorted(C.DECODER_COUNT_ENC)} decoders")
    regs = _regfile(bar)
    regs.region(C.COMPONENT_OFFSET, C.COMPONENT_SIZE)[:] = bytes(C.COMPONENT_SIZE)
    regs.set_fields(C.CM_CAP_HEADER, CAP_ID=C.CM_CAP_ID_ARRAY, CAP_VERSION=1, CACHE_MEM_VERSION=1,
                    ARRAY_SIZE=len(C.CM_CAPABILITIES))
    for index, (cap_id, version, offset) in enumerate(C.CM_CAPABILITIES, start=1):
        regs.set_fields(C.cm_cap_element(index), CAP_ID=cap_id, CAP_VERSION=version,
                        POINTER=offset - C.CM_OFFSET)
    for reg, value in C.RAS_RESET.items():
        regs.set(reg, value)
    # QEMU hdm_init_common for a Type-3 device: one target, 256 B and 4 KiB interleave address bits,
    # 3/6/12 and 16 ways.
    regs.set_fields(C.HDM_CAP, DECODER_COUNT=C.DECODER_COUNT_ENC[n_decoders], TARGET_COUNT=1,
                    INTERLEAVE_256B=1, INTERLEAVE_4K=1, IW_3_6_12=1, IW_16=1)


class DecoderRefused(Exception):
    """Why a commit request fails; becomes ERR_NOT_COMMITTED (the reason is kept for debugging)."""


@dataclass(frozen=True)
class _Latched:
    """A committed decoder: the register words at commit time and what they decode."""

    words: tuple[int, ...]  # BASE_LO, BASE_HI, SIZE_LO, SIZE_HI, CTRL, SKIP_LO, SKIP_HI
    settings: DecoderSettings

    @property
    def locked(self) -> bool:
        return bool(self.words[4] & C.CTRL_LOCK_ON_COMMIT)


class HdmDecoderBlock:
    """The device side of the HDM decoders of one device (firmware-owned, one thread)."""

    def __init__(self, bar: Any, capacity: int) -> None:
        self.regs = _regfile(bar)
        self.capacity = capacity
        count_enc = self.regs.get_field(C.HDM_CAP, "DECODER_COUNT")
        if count_enc not in C.DECODER_COUNT_DEC:
            raise ValueError("the HDM capability is not initialised: call init_component_registers first")
        self.n_decoders = C.DECODER_COUNT_DEC[count_enc]
        self._regs = [C.hdm_decoder(i) for i in range(self.n_decoders)]
        self._latched: list[_Latched | None] = [None] * self.n_decoders
        self.errors: dict[int, str] = {}  # decoder -> reason of its last refused commit
        self._window = (C.HDM_OFFSET, C.hdm_size(self.n_decoders))
        self._seen = b""  # the HDM registers as the last pass left them (see service)
        self._expect = bytearray()

    # ---- what the data path uses ----------------------------------------------------------------
    def decoders(self) -> list[DecoderSettings]:
        """The decoders that decode: the committed ones up to the first uncommitted one (QEMU's
        cxl_type3_dpa stops there too), or none while HDM Decoder Enable is clear (§8.2.4.20.2)."""
        if not self.regs.get_field(C.HDM_GLOBAL_CTRL, "HDM_DECODER_ENABLE"):
            return []
        prefix = []
        for latched in self._latched:
            if latched is None:
                break
            prefix.append(latched.settings)
        return prefix

    def hpa_to_dpa(self, hpa: int) -> int | None:
        """The DPA this device serves `hpa` at, or None when no enabled, committed decoder maps it."""
        return hpa_to_dpa(self.decoders(), hpa)

    @property
    def committed_count(self) -> int:
        return sum(latched is not None for latched in self._latched)

    # ---- the runner calls this every pass ------------------------------------------------------
    def service(self) -> None:
        """Act on the hosts' writes since the last pass.

        Uncommits run first, from the top decoder down, then commits from the bottom up. A
        commit request is acted on only if its COMMIT bit was set in the snapshot `now` this pass
        starts from, and is refused when a decoder below it is committed in this same pass (see
        the module docstring: their order cannot be known).

        A pass over unchanged registers costs one 0x90-byte compare against `_seen`: the registers
        as this pass found them plus this pass's own writes. A host write that lands during the
        pass, or that puts back a value the firmware just replaced, differs from it and is served
        on the next pass.
        """
        now = bytes(self.regs.region(*self._window))
        if now == self._seen:
            return
        self._expect = bytearray(now)
        for i in reversed(range(self.n_decoders)):
            if self._latched[i] is not None:
                self._service_committed(i)
        committed_now: set[int] = set()
        for i in range(self.n_decoders):
            if self._latched[i] is None and self._service_uncommitted(i, now, committed_now):
                committed_now.add(i)
        self._seen = bytes(self._expect)

    def _set(self, reg: Reg, value: int) -> None:
        self.regs.set(reg, value)
        at = reg.offset - self._window[0]
        self._expect[at:at + 4] = value.to_bytes(4, "little")

    def _words(self, i: int) -> tuple[int, ...]:
        return tuple(self.regs.get(reg) for reg in self._regs[i])

    def _write_words(self, i: int, words: tuple[int, ...]) -> None:
        for reg, value in zip(self._regs[i], words):
            self._set(reg, value)

    def _service_committed(self, i: int) -> None:
        latched = self._latched[i]
        assert latched is not None
        words = self._words(i)
        if words == latched.words:
            return
        ctrl = words[4]
        if latched.locked or ctrl & C.CTRL_COMMIT:
            # read-only while committed (until reset when locked): undo the host's write, so the
            # registers keep showing what decodes (module docstring)
            self._write_words(i, latched.words)
        else:
            self._uncommit(i, ctrl)

    def _uncommit(self, i: int, ctrl: int) -> None:
        """§8.2.4.20.7: a 1 -> 0 transition of Commit shall clear Committed, whatever the order.
        Software uncommits from the top down (Linux does); a host that uncommits below a committed
        decoder stops the decoders above from decoding until the hole is committed again."""
        self._latched[i] = None
        self._set(self._regs[i].CTRL, ctrl & ~_RO_CTRL_BITS)

    def _service_uncommitted(self, i: int, snapshot: bytes, committed_now: set[int]) -> bool:
        """Serve decoder i (not committed); True when this call committed it."""
        ctrl_reg = self._regs[i].CTRL
        ctrl = self.regs.get(ctrl_reg)
        if not ctrl & C.CTRL_COMMIT:
            if ctrl & _RO_CTRL_BITS:  # COMMIT cleared after an error (or a host wrote RO bits)
                self._set(ctrl_reg, ctrl & ~_RO_CTRL_BITS)
            return False
        if ctrl & C.CTRL_ERR_NOT_COMMITTED:
            return False  # waits for the host to clear COMMIT
        at = ctrl_reg.offset - self._window[0]
        if not int.from_bytes(snapshot[at:at + 4], "little") & C.CTRL_COMMIT:
            return False  # set after this pass's snapshot: the next pass serves it
        words = self._words(i)
        try:
            settings = self._check(i, words, committed_now)
        except DecoderRefused as exc:
            self.errors[i] = str(exc)
            self._set(ctrl_reg, (ctrl & ~C.CTRL_COMMITTED) | C.CTRL_ERR_NOT_COMMITTED)
            return False
        self.errors.pop(i, None)
        committed = words[:4] + ((ctrl & ~_RO_CTRL_BITS) | C.CTRL_COMMITTED,) + words[5:]
        self._latched[i] = _Latched(committed, settings)
        self._set(ctrl_reg, committed[4])
        return True

    # ---- the checks of a commit request --------------------------------------------------------
    def _check(self, i: int, words: tuple[int, ...], committed_now: Collection[int] = ()) -> DecoderSettings:
        """The settings a commit request programs, or DecoderRefused saying which rule it breaks.
        `committed_now`: the decoders this pass committed (their COMMITTED was not yet visible
        when decoder i's COMMIT was written)."""
        if any(latched is None for latched in self._latched[:i]):
            raise DecoderRefused(f"decoder {i} committed before decoders 0..{i - 1} (§8.2.4.20.12)")
        racing = sorted(j for j in committed_now if j < i)
        if racing:
            raise DecoderRefused(
                f"decoder {i}'s COMMIT was set before decoder {racing[-1]} reported COMMITTED (both seen in "
                f"one pass, so their order is unknown); decoders 0..{i - 1} must be committed first "
                f"(§8.2.4.20.12): wait for COMMITTED after each commit, as Linux does")
        base_lo, base_hi, size_lo, size_hi, ctrl, skip_lo, skip_hi = words
        base, size, skip = base_hi << 32 | base_lo, size_hi << 32 | size_lo, skip_hi << 32 | skip_lo
        for name, value in (("base", base), ("size", size), ("DPA skip", skip)):
            if value % _ALIGN:
                raise DecoderRefused(f"{name} {value:#x} is not a multiple of 256 MiB")
        ig, iw = C.CTRL_IG.get(ctrl), C.CTRL_IW.get(ctrl)
        if ig > IG_MAX or iw not in WAYS_BY_IW:
            raise DecoderRefused(f"IG={ig} / IW={iw} is a reserved encoding")
        ways = WAYS_BY_IW[iw]
        if size % (ways * _ALIGN):
            raise DecoderRefused(f"size {size:#x} does not give each of {ways} ways whole 256 MiB units")
        if base + size > 1 << 64:
            raise DecoderRefused(f"window [{base:#x}, +{size:#x}) wraps past 2^64")
        settings = DecoderSettings(base=base, size=size, ig=ig, iw=iw, dpa_skip=skip)
        self._check_neighbours(i, settings)
        return settings

    def _check_neighbours(self, i: int, settings: DecoderSettings) -> None:
        """HPA below the next committed decoder and above the previous one (§8.2.4.20.12), and
        the DPA of every committed decoder, accumulated in order, within the device."""
        others = {j: latched.settings for j, latched in enumerate(self._latched) if latched is not None and j != i}
        below = [others[j] for j in sorted(others) if j < i]
        above = [others[j] for j in sorted(others) if j > i]
        if below and settings.base < below[-1].base + below[-1].size:
            raise DecoderRefused(f"base {settings.base:#x} is below the end of decoder {i - 1} (§8.2.4.20.12)")
        if above and settings.base + settings.size > above[0].base:
            raise DecoderRefused(f"window [{settings.base:#x}, +{settings.size:#x}) reaches into the committed "
                                 f"decoder above it at {above[0].base:#x} (§8.2.4.20.12)")
        dpa_end = sum(d.dpa_skip + d.dpa_size for d in below + [settings] + above)
        if dpa_end > self.capacity:
            raise DecoderRefused(f"needs DPA up to {dpa_end:#x}, past the device's {self.capacity:#x}")


def attach(fw: Any) -> HdmDecoderBlock:
    """Give a firmware its component registers and HDM decoders, serviced on every runner pass.

    `fw` is an `emulator.firmware.Firmware` (regs, config.capacity, services list of
    callables taking the time in ns).
    """
    init_component_registers(fw.regs)
    hdm = HdmDecoderBlock(fw.regs, fw.config.capacity)
    fw.services.append(lambda _now_ns: hdm.service())
    return hdm


__all__ = ["DecoderRefused", "HdmDecoderBlock", "attach", "init_component_registers"]
