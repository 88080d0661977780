"""Get Supported Logs and Get Log (CXL r3.1 §8.2.9.5), with the Command Effects Log.

The CEL is generated from the command table, one {opcode, effects} entry per command in opcode
order (§8.2.9.5.2.1), so a command appears in it the moment its module registers it; Linux reads
it at probe to learn which commands the device supports (cxl_walk_cel).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.mailbox import COMMANDS, command
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_memdev import (
    CEL_ENTRY,
    CEL_UUID,
    GET_LOG,
    SUPPORTED_LOG_ENTRY,
    SUPPORTED_LOGS,
)
from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware


def command_effects_log() -> bytes:
    """The CEL: 4-byte entries for every command in the table, by opcode."""
    return b"".join(CEL_ENTRY.pack(opcode=op, effects=int(COMMANDS[op].effects)) for op in sorted(COMMANDS))


@command(Opcode.GET_SUPPORTED_LOGS, "Get Supported Logs", in_len=0)
def get_supported_logs(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    entry = SUPPORTED_LOG_ENTRY.pack(uuid=CEL_UUID.bytes, size=len(command_effects_log()))
    return RetCode.SUCCESS, SUPPORTED_LOGS.pack(entries=1) + entry


@command(Opcode.GET_LOG, "Get Log", in_len=GET_LOG.size, needs_media=True)
def get_log(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    req = GET_LOG.unpack(payload)
    offset, length = req["offset"], req["length"]
    if length > MAILBOX_PAYLOAD_SIZE:
        return RetCode.INVALID_INPUT, b""
    if req["uuid"] != CEL_UUID.bytes:
        return RetCode.INVALID_LOG, b""
    cel = command_effects_log()
    if offset + length > len(cel):  # §8.2.9.5.2: "beyond the size of the log" is Invalid Input
        return RetCode.INVALID_INPUT, b""
    return RetCode.SUCCESS, cel[offset:offset + length]
