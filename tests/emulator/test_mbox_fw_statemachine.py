"""Transfer / Activate FW as a hypothesis state machine: random sequences of Full, Init, Continue
(in order, resent, with a gap, overlapping), End (good or corrupt package, any slot), Abort and
Activate (online or on reset), each checked against a reference model of the slots (§8.2.9.3)."""
from __future__ import annotations

import struct

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mbox_support import firmware, run

from emulator.fwslots import build_image
from emulator.mailbox import dispatch
from emulator.spec.retcodes import RetCode

TRANSFER, ACTIVATE = 0x0201, 0x0202
FULL, INIT, CONTINUE, END, ABORT = 0, 1, 2, 3, 4
BOOT = "boot"
# 2304 B each (18 units of 128 B): with 512-B parts every offset is a whole number of units
PACKAGES = {rev: build_image(rev, bytes([i]) * 2240) for i, rev in enumerate(("r-a", "r-b", "r-c"))}
assert all(len(p) == 2304 for p in PACKAGES.values())
PART = 512


def xfer(action: int, slot: int, offset: int, data: bytes = b"") -> bytes:
    return struct.pack("<BBHI", action, slot, 0, offset // 128) + bytes(0x78) + data


class FwMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._ctx = firmware(fw_revision=BOOT)
        self.fw = self._ctx.__enter__()
        self.active, self.staged = 1, 0
        self.revisions: dict[int, str | None] = {1: BOOT, 2: None}
        self.open: tuple[str, int, int] | None = None  # (package, prev_offset, prev_len)

    def teardown(self) -> None:
        self._ctx.__exit__(None, None, None)

    def slot_refused(self, slot: int) -> bool:
        return slot == 0 or slot > 2 or slot == self.active

    def store(self, slot: int, rev: str) -> None:
        self.revisions[slot] = rev
        if self.staged == slot:
            self.staged = 0

    @rule(slot=st.integers(0, 3), rev=st.sampled_from(sorted(PACKAGES)), corrupt=st.booleans())
    def full(self, slot: int, rev: str, corrupt: bool) -> None:
        image = bytearray(build_image(rev, bytes(1000)))  # a Full transfer fits one payload
        if corrupt:
            image[-1] ^= 0xFF
        rc, _ = run(self.fw, TRANSFER, xfer(FULL, slot, 0, bytes(image)))
        if self.open is not None:
            assert rc == RetCode.FW_TRANSFER_IN_PROGRESS
        elif self.slot_refused(slot):
            assert rc == RetCode.FW_INVALID_SLOT
        elif corrupt:
            assert rc == RetCode.FW_AUTHENTICATION_FAILED
        else:
            assert rc == RetCode.SUCCESS
            self.store(slot, rev)

    @rule(rev=st.sampled_from(sorted(PACKAGES)))
    def init(self, rev: str) -> None:
        rc, _ = run(self.fw, TRANSFER, xfer(INIT, 0, 0, PACKAGES[rev][:PART]))
        if self.open is not None:
            assert rc == RetCode.FW_TRANSFER_IN_PROGRESS
        else:
            assert rc == RetCode.SUCCESS
            self.open = (rev, 0, PART)

    @rule(kind=st.sampled_from(["next", "resend", "gap", "overlap"]))
    def cont(self, kind: str) -> None:
        rev, prev, length = self.open if self.open is not None else ("r-a", 0, PART)
        end = prev + length
        offset = {"next": end, "resend": prev, "gap": end + 128, "overlap": max(0, end - 128)}[kind]
        data = PACKAGES[rev][offset:offset + PART]
        if not data or (kind == "resend" and len(data) != length):
            return  # the package has no such part
        rc, _ = run(self.fw, TRANSFER, xfer(CONTINUE, 0, offset, data))
        if self.open is None:
            assert rc == RetCode.INVALID_INPUT
        elif (offset, len(data)) == (prev, length) or offset == end:
            assert rc == RetCode.SUCCESS
            self.open = (rev, offset, len(data))
        else:
            assert rc == RetCode.FW_TRANSFER_OUT_OF_ORDER

    @precondition(lambda self: self.open is not None)
    @rule(slot=st.integers(0, 3), corrupt=st.booleans())
    def end(self, slot: int, corrupt: bool) -> None:
        assert self.open is not None
        rev, prev, length = self.open
        offset = prev + length
        data = bytearray(PACKAGES[rev][offset:])
        if corrupt and data:
            data[0] ^= 0xFF
        rc, _ = run(self.fw, TRANSFER, xfer(END, slot, offset, bytes(data)))
        if self.slot_refused(slot):
            assert rc == RetCode.FW_INVALID_SLOT  # the transfer stays open
            return
        self.open = None
        if corrupt and data:
            assert rc == RetCode.FW_AUTHENTICATION_FAILED
        else:
            assert rc == RetCode.SUCCESS
            self.store(slot, rev)

    @rule()
    def abort(self) -> None:
        assert run(self.fw, TRANSFER, xfer(ABORT, 0, 0)) == (RetCode.SUCCESS, b"")
        self.open = None

    @rule(slot=st.integers(0, 3), online=st.booleans())
    def activate(self, slot: int, online: bool) -> None:
        rc, _ = run(self.fw, ACTIVATE, bytes([0 if online else 1, slot]))
        if self.open is not None:
            assert rc == RetCode.FW_TRANSFER_IN_PROGRESS
        elif self.slot_refused(slot) or self.revisions.get(slot) is None:
            assert rc == RetCode.FW_INVALID_SLOT
        else:
            assert rc == RetCode.SUCCESS
            if online:
                self.active = slot
                self.staged = 0 if self.staged == slot else self.staged
            else:
                self.staged = slot

    @invariant()
    def device_reports_the_model(self) -> None:
        rc, out = dispatch(self.fw, 0x0200, b"")
        assert rc == RetCode.SUCCESS
        assert (out[1] & 7, out[1] >> 3 & 7) == (self.active, self.staged)
        for slot in (1, 2):
            assert out[0x10 * slot:0x10 * slot + 16] == (self.revisions[slot] or "").encode().ljust(16, b"\0")
        assert dispatch(self.fw, 0x4000, b"")[1][:16] == str(self.revisions[self.active]).encode().ljust(16, b"\0")


TestFwStateMachine = FwMachine.TestCase
TestFwStateMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow], database=None)
