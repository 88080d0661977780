"""Get / Set Timestamp (CXL r3.1 §8.2.9.4).

The host sets the device's clock in ns since the Unix epoch; the device then counts on from it
(`Firmware.set_timestamp` / `timestamp_ns`). Until a host sets it, Get Timestamp returns 0, as
QEMU does, and event records are stamped 0. The clock wraps modulo 2**64: a host may set it to
any u64, even one just below the wrap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.mailbox import Effect, command
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_memdev import TIMESTAMP
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware


@command(Opcode.GET_TIMESTAMP, "Get Timestamp", in_len=0)
def get_timestamp(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    return RetCode.SUCCESS, TIMESTAMP.pack(timestamp=fw.timestamp_ns())


@command(Opcode.SET_TIMESTAMP, "Set Timestamp", in_len=TIMESTAMP.size, effects=Effect.IMMEDIATE_POLICY_CHANGE)
def set_timestamp(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    fw.set_timestamp(TIMESTAMP.unpack(payload)["timestamp"])
    return RetCode.SUCCESS, b""
