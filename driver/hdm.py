"""Host-side HDM decoder programming, as Linux's drivers/cxl/core/hdm.c does it.

    commit(n):  refuse if n is not the next decoder, or if COMMITTED / COMMIT / ERR is set
                write BASE_HI, BASE_LO, SIZE_HI, SIZE_LO, DPA SKIP_HI, SKIP_LO
                write CTRL = IG | IW | TYPE | COMMIT (one store, last)
                poll CTRL until COMMITTED (done) or ERR_NOT_COMMITTED (clear COMMIT, wait for the
                device to drop ERR, fail)
    reset(n):   only the top committed decoder; clear COMMIT, wait for COMMITTED to drop, zero the
                window (cxl_decoder_reset)

The poll allows `COMMIT_TIMEOUT_S` = 2 s where Linux allows 20 ms (CXL r3.1 §8.2.4.20.12 gives
hardware 10 ms): here the "hardware" is a firmware loop polling the BAR from another thread or
process, which may be napping between passes, descheduled on a loaded machine, or waiting for the
GIL behind the host itself; 2 s is also the mailbox timeout, so a device that answers commands
answers commits.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from emulator.hdm import DecoderSettings, ways_from_iw
from emulator.regfile import RegisterFile
from emulator.spec import component_regs as C
from emulator.spec.errors import CxlemuError

COMMIT_TIMEOUT_S = 2.0
POLL_INTERVAL_S = 0.001  # Linux fsleep(1000) between reads


class DecoderError(CxlemuError):
    """A decoder could not be programmed or reset; the message says which and why."""


class DecoderTimeout(DecoderError, TimeoutError):
    """The device did not acknowledge a commit or uncommit in time: its firmware is not running."""


@dataclass(frozen=True)
class DecoderState:
    """One decoder's registers as a host reads them."""

    index: int
    base: int
    size: int
    dpa_skip: int
    ctrl: int

    @property
    def committed(self) -> bool:
        return bool(self.ctrl & C.CTRL_COMMITTED)

    @property
    def locked(self) -> bool:
        return bool(self.ctrl & C.CTRL_LOCK_ON_COMMIT)

    @property
    def settings(self) -> DecoderSettings:
        return DecoderSettings(base=self.base, size=self.size, ig=C.CTRL_IG.get(self.ctrl),
                               iw=C.CTRL_IW.get(self.ctrl), dpa_skip=self.dpa_skip)


def probe_hdm(regs: RegisterFile) -> int:
    """Absolute BAR offset of the HDM decoder capability (Linux cxl_probe_component_regs)."""
    header = regs.get(C.CM_CAP_HEADER)
    if C.CM_CAP_HEADER.f("CAP_ID").get(header) != C.CM_CAP_ID_ARRAY:
        raise DecoderError("no CXL.cache/mem capability array in the component registers")
    for index in range(1, C.CM_CAP_HEADER.f("ARRAY_SIZE").get(header) + 1):
        element = C.cm_cap_element(index)
        value = regs.get(element)
        if element.f("CAP_ID").get(value) == C.CM_CAP_ID_HDM:
            return C.CM_OFFSET + element.f("POINTER").get(value)
    raise DecoderError("the device has no HDM decoder capability")


class HdmDecoders:
    """A host's view of one device's HDM decoder capability."""

    def __init__(self, bar: Any, *, timeout_s: float = COMMIT_TIMEOUT_S) -> None:
        self.regs = bar if isinstance(bar, RegisterFile) else RegisterFile(bar)
        offset = probe_hdm(self.regs)
        if offset != C.HDM_OFFSET:  # cxlemu fixes the BAR map (emulator.spec), like a uapi header
            raise DecoderError(f"HDM capability at {offset:#x}, expected {C.HDM_OFFSET:#x}")
        self.n_decoders = C.DECODER_COUNT_DEC[self.regs.get_field(C.HDM_CAP, "DECODER_COUNT")]
        self.timeout_s = timeout_s

    def read(self, n: int) -> DecoderState:
        r = self.regs_of(n)
        get = self.regs.get
        return DecoderState(n, get(r.BASE_HI) << 32 | get(r.BASE_LO), get(r.SIZE_HI) << 32 | get(r.SIZE_LO),
                            get(r.SKIP_HI) << 32 | get(r.SKIP_LO), get(r.CTRL))

    def committed(self) -> list[DecoderState]:
        """The committed decoders, which form a prefix 0..k-1 (decoders commit in order)."""
        states = []
        for n in range(self.n_decoders):
            state = self.read(n)
            if not state.committed:
                break
            states.append(state)
        return states

    @property
    def enabled(self) -> bool:
        return bool(self.regs.get_field(C.HDM_GLOBAL_CTRL, "HDM_DECODER_ENABLE"))

    def enable(self) -> None:
        """Set HDM Decoder Enable (§8.2.4.20.2), as Linux's devm_cxl_enable_hdm does at probe."""
        self.regs.set_field(C.HDM_GLOBAL_CTRL, "HDM_DECODER_ENABLE", 1)

    def commit(self, n: int, settings: DecoderSettings, *, lock: bool = False) -> None:
        """Program and commit decoder `n` (Linux cxl_decoder_commit); raises DecoderError."""
        self._check_programmable(n, settings)
        r = self.regs_of(n)
        ctrl = self.regs.get(r.CTRL) & ~C.CTRL_HOST_WRITABLE
        ctrl = C.CTRL_IW.put(C.CTRL_IG.put(ctrl, settings.ig), settings.iw)
        ctrl |= C.CTRL_TYPE_HOST_ONLY | C.CTRL_COMMIT | (C.CTRL_LOCK_ON_COMMIT if lock else 0)
        for hi, lo, value in ((r.BASE_HI, r.BASE_LO, settings.base), (r.SIZE_HI, r.SIZE_LO, settings.size),
                              (r.SKIP_HI, r.SKIP_LO, settings.dpa_skip)):
            self.regs.set(hi, value >> 32)
            self.regs.set(lo, value & 0xFFFF_FFFF)
        self.regs.set(r.CTRL, ctrl)
        self._await_commit(n)

    def reset(self, n: int) -> None:
        """Uncommit decoder `n`, the top committed one (Linux cxl_decoder_reset); raises DecoderError."""
        state = self.read(n)
        if not state.committed:
            return
        if n != len(self.committed()) - 1:
            raise DecoderError(f"decoder {n}: reset the decoders above it first (they uncommit in reverse order)")
        if state.locked:
            raise DecoderError(f"decoder {n} is locked on commit: it stays until the device is reset")
        r = self.regs_of(n)
        self.regs.set(r.CTRL, state.ctrl & ~C.CTRL_COMMIT)
        self._await(n, lambda ctrl: not ctrl & C.CTRL_COMMITTED, "uncommit")
        for reg in (r.SIZE_HI, r.SIZE_LO, r.BASE_HI, r.BASE_LO):
            self.regs.set(reg, 0)

    # ---- helpers -------------------------------------------------------------------------------
    def regs_of(self, n: int) -> C.DecoderRegs:
        """The register table of decoder `n`; DecoderError if the device has no such decoder."""
        if not 0 <= n < self.n_decoders:
            raise DecoderError(f"decoder {n} does not exist: the device has {self.n_decoders}")
        return C.hdm_decoder(n)

    def _check_programmable(self, n: int, settings: DecoderSettings) -> None:
        expected = len(self.committed())
        if n != expected:
            raise DecoderError(f"decoder {n}: out of order commit, expected decoder {expected}")
        ctrl = self.read(n).ctrl
        busy = ctrl & (C.CTRL_COMMITTED | C.CTRL_COMMIT | C.CTRL_ERR_NOT_COMMITTED)
        if busy:
            raise DecoderError(f"decoder {n} is busy (CTRL {ctrl:#x}: COMMIT/COMMITTED/ERR set): reset it first")
        for name, value in (("base", settings.base), ("size", settings.size), ("dpa_skip", settings.dpa_skip)):
            if value % C.HDM_DECODER_ALIGN:
                raise DecoderError(f"decoder {n}: {name} {value:#x} must be a multiple of 256 MiB")
        ways_from_iw(settings.iw)

    def _await_commit(self, n: int) -> None:
        """Linux cxld_await_commit: on ERR clear COMMIT and fail, on COMMITTED succeed."""
        ctrl = self._await(n, lambda c: bool(c & (C.CTRL_COMMITTED | C.CTRL_ERR_NOT_COMMITTED)), "commit")
        if ctrl & C.CTRL_ERR_NOT_COMMITTED:
            self.regs.set(self.regs_of(n).CTRL, ctrl & ~C.CTRL_COMMIT)
            # Unlike Linux, also wait for the device to drop ERR, so a retry finds the decoder idle
            # rather than racing the firmware's next pass.
            self._await(n, lambda c: not c & C.CTRL_ERR_NOT_COMMITTED, "error clear")
            raise DecoderError(f"decoder {n}: the device refused the programming (ERR_NOT_COMMITTED); "
                               "check order, 256 MiB alignment, ways x 256 MiB size and free DPA")

    def _await(self, n: int, done: Callable[[int], bool], what: str) -> int:
        reg = self.regs_of(n).CTRL
        deadline = time.monotonic() + self.timeout_s
        while True:
            ctrl = self.regs.get(reg)
            if done(ctrl):
                return ctrl
            if time.monotonic() > deadline:
                raise DecoderTimeout(f"decoder {n}: no {what} acknowledgement after {self.timeout_s} s "
                                     "(is the device's firmware running?)")
            time.sleep(POLL_INTERVAL_S)


__all__ = ["COMMIT_TIMEOUT_S", "DecoderError", "DecoderState", "DecoderTimeout", "HdmDecoders", "probe_hdm"]
