"""Helpers for the mailbox tests: an in-process firmware without a runner thread, driven by hand.

Calling `dispatch` / `Firmware.step_background` directly makes every test deterministic: a
background job advances exactly when the test steps it.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager

from emulator.device import DeviceConfig, DeviceFiles
from emulator.firmware import Firmware
from emulator.mailbox import dispatch
from emulator.spec import registers as R
from emulator.spec.retcodes import RetCode

_names = itertools.count()


@contextmanager
def firmware(capacity: int = 1 << 30, lsa_size: int = 4096, fw_revision: str = "cxlemu-test", *,
             name: str | None = None, hosts: int = 1, dc_regions: tuple[int, ...] = ()) -> Iterator[Firmware]:
    """A device's files and its `Firmware` (no runner), destroyed afterwards."""
    name = name or f"fw{os.getpid()}-{next(_names)}"
    files = DeviceFiles.create(DeviceConfig(name=name, capacity=capacity, lsa_size=lsa_size, fw_revision=fw_revision,
                                            hosts=hosts, dc_regions=dc_regions))
    fw = Firmware(files)
    try:
        yield fw
    finally:
        fw.close()
        files.destroy()


def run(fw: Firmware, opcode: int, payload: bytes = b"", *, max_steps: int = 100_000) -> tuple[RetCode, bytes]:
    """Dispatch one command; a background one is stepped to completion and its own code returned."""
    rc, out = dispatch(fw, opcode, payload)
    if rc != RetCode.BACKGROUND_COMMAND_STARTED:
        return rc, out
    for _ in range(max_steps):
        if not fw.step_background():
            break
    running, percent, bg_opcode, bg_rc = fw.background_status
    assert not running and percent == 100 and bg_opcode == opcode
    return RetCode(bg_rc), b""


def ring(fw: Firmware, opcode: int, payload: bytes, *, length: int | None = None) -> tuple[int, bytes]:
    """One exchange through the registers, as a host does it (`length` may lie about the payload)."""
    regs = fw.regs
    regs.region(R.MB_PAYLOAD_OFFSET, len(payload))[:] = payload
    cmd = R.MB_CMD.f("OPCODE").put(0, opcode)
    regs.set(R.MB_CMD, R.MB_CMD.f("LENGTH").put(cmd, len(payload) if length is None else length))
    regs.set_field(R.MB_CTRL, "DOORBELL", 1)
    assert fw.service_mailbox()
    assert regs.get_field(R.MB_CTRL, "DOORBELL") == 0
    out_len = regs.get_field(R.MB_CMD, "LENGTH")
    return regs.get_field(R.MB_STATUS, "RETCODE"), bytes(regs.region(R.MB_PAYLOAD_OFFSET, out_len))
