"""Background Operation Status (opcode 0002h, CXL r3.1 §8.2.9.1.2): the raw output payload and the
driver's decoding of it. Byte 0 is percent complete in bits 7:1 and "in progress" in bit 0, byte 1
reserved (QEMU cmd_infostat_bg_op_sts: `status = complete_pct << 1 | running`)."""
from __future__ import annotations

import pytest

from driver._cmd_generic import BackgroundStatus, GenericCommands
from emulator.firmware import Firmware
from emulator.mailbox import dispatch
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads import bg_op_status_byte, bg_op_status_fields
from emulator.spec.retcodes import RetCode


class InProcessHost(GenericCommands):
    """The driver's typed wrappers over a firmware's dispatcher (no runner, no BAR round trip)."""

    def __init__(self, fw: Firmware) -> None:
        self.fw = fw

    def call(self, opcode: int, payload: bytes = b"", *, progress: object = None) -> bytes:
        rc, out = dispatch(self.fw, opcode, payload)
        assert rc == RetCode.SUCCESS, rc
        return out


def bg_status_payload(fw: Firmware) -> bytes:
    rc, out = dispatch(fw, Opcode.BACKGROUND_OPERATION_STATUS, b"")
    assert rc == RetCode.SUCCESS
    return out


def test_raw_bytes_while_running_and_after(fw: Firmware) -> None:
    """A 256 MiB sanitize goes in 32 MiB slices: 37 % after 3, 87 % after 7 (bit 7 set)."""
    assert dispatch(fw, Opcode.SANITIZE, b"")[0] == RetCode.BACKGROUND_COMMAND_STARTED
    for _ in range(3):
        fw.step_background()
    # 37 << 1 | 1 = 0x4B; reserved 00; opcode 4400h LE; return code 0; vendor status 0
    assert bg_status_payload(fw) == bytes.fromhex("4b 00 00 44 00 00 00 00")
    for _ in range(4):
        fw.step_background()
    assert bg_status_payload(fw) == bytes.fromhex("af 00 00 44 00 00 00 00")  # 87 << 1 | 1
    while fw.step_background():
        pass
    assert bg_status_payload(fw) == bytes.fromhex("c8 00 00 44 00 00 00 00")  # 100 << 1, done, Success


def test_driver_decodes_percent_from_bits_7_to_1(fw: Firmware) -> None:
    host = InProcessHost(fw)
    assert host.background_status() == BackgroundStatus(False, 0, 0, 0)
    assert dispatch(fw, Opcode.SANITIZE, b"")[0] == RetCode.BACKGROUND_COMMAND_STARTED
    for _ in range(7):
        fw.step_background()
    assert host.background_status() == BackgroundStatus(True, 87, Opcode.SANITIZE, 0)
    while fw.step_background():
        pass
    assert host.background_status() == BackgroundStatus(False, 100, Opcode.SANITIZE, RetCode.SUCCESS)


@pytest.mark.parametrize("running, percent, byte", [(False, 0, 0x00), (True, 0, 0x01), (True, 63, 0x7F),
                                                    (True, 64, 0x81), (False, 100, 0xC8)])
def test_status_byte_both_ways(running: bool, percent: int, byte: int) -> None:
    assert bg_op_status_byte(running, percent) == byte
    assert bg_op_status_fields(byte) == (running, percent)


def test_status_byte_refuses_a_percent_past_100() -> None:
    with pytest.raises(ValueError, match="outside 0..100"):
        bg_op_status_byte(True, 101)
