"""Generic component commands: Identify, Background Operation Status, Request Abort (§8.2.9.1)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.mailbox import command
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads import (BG_OP_STATUS, COMPONENT_TYPE_TYPE3, CXLEMU_DEVICE_ID,
                                    CXLEMU_VENDOR_ID, IDENTIFY, bg_op_status_byte)
from emulator.spec.registers import MAILBOX_PAYLOAD_LOG2
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware


@command(Opcode.IDENTIFY, "Identify", in_len=0)
def identify(fw: "Firmware", payload: memoryview) -> tuple[RetCode, bytes]:
    return RetCode.SUCCESS, IDENTIFY.pack(
        vendor_id=CXLEMU_VENDOR_ID, device_id=CXLEMU_DEVICE_ID, subsys_vendor_id=CXLEMU_VENDOR_ID,
        subsys_id=CXLEMU_DEVICE_ID, serial=fw.config.serial, max_msg_size=MAILBOX_PAYLOAD_LOG2,
        component_type=COMPONENT_TYPE_TYPE3)


@command(Opcode.BACKGROUND_OPERATION_STATUS, "Background Operation Status", in_len=0)
def background_operation_status(fw: "Firmware", payload: memoryview) -> tuple[RetCode, bytes]:
    """§8.2.9.1.2: byte 0 = percent complete [7:1] | in progress [0] (QEMU cmd_infostat_bg_op_sts)."""
    running, percent, opcode, retcode = fw.background_status
    return RetCode.SUCCESS, BG_OP_STATUS.pack(status=bg_op_status_byte(running, percent), opcode=opcode,
                                              retcode=retcode)


@command(Opcode.REQUEST_BACKGROUND_ABORT, "Request Background Operation Abort", in_len=0)
def request_background_abort(fw: "Firmware", payload: memoryview) -> tuple[RetCode, bytes]:
    return fw.request_abort(), b""
