"""Label storage area: Get LSA and Set LSA (CXL r3.1 §8.2.9.9.2.3-4), over `fw.lsa` (the
device's `lsa` file, `config.lsa_size` bytes)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.mailbox import Effect, command
from emulator.spec import payloads_memdev as P
from emulator.spec import registers as R
from emulator.spec.opcodes import Opcode
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware


@command(Opcode.GET_LSA, "Get LSA", in_len=P.GET_LSA.size, needs_media=True)
def get_lsa(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    req = P.GET_LSA.unpack(payload)
    offset, length = req["offset"], req["length"]
    if length > R.MAILBOX_PAYLOAD_SIZE or offset + length > fw.config.lsa_size:
        return RetCode.INVALID_INPUT, b""
    return RetCode.SUCCESS, fw.lsa[offset:offset + length].tobytes()


@command(Opcode.SET_LSA, "Set LSA", in_len=None, min_len=P.SET_LSA.size, needs_media=True,
         effects=Effect.IMMEDIATE_CONFIG_CHANGE | Effect.IMMEDIATE_DATA_CHANGE)
def set_lsa(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    offset = P.SET_LSA.unpack(payload)["offset"]
    data = payload[P.SET_LSA.size:]
    if offset + len(data) > fw.config.lsa_size:
        return RetCode.INVALID_INPUT, b""
    fw.lsa[offset:offset + len(data)] = data
    return RetCode.SUCCESS, b""
