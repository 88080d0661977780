"""Poison commands: Get Poison List, Inject Poison, Clear Poison (CXL r3.1 §8.2.9.9.4.1-3).

The list and the bitmap hosts check live in `emulator.poison.PoisonList` (`fw.poison`); these
handlers decode payloads and encode Media Error Records. Scan Media is in `commands.scan`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.mailbox import Effect, command
from emulator.poison import PoisonRecord
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_poison import (
    CLEAR_POISON,
    DPA_RANGE,
    INJECT_POISON,
    MAX_POISON_RECORDS_PER_GET,
    MEDIA_ERROR_RECORD,
    POISON_FLAG_MORE,
    POISON_FLAG_OVERFLOW,
    POISON_FLAG_SCAN_RUNNING,
    POISON_LINE,
    POISON_LIST_OUT,
)
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware


def encode_records(records: list[PoisonRecord]) -> bytes:
    """Media Error Records: DPA with the source in bits [2:0], length in 64-B units."""
    return b"".join(MEDIA_ERROR_RECORD.pack(address=r.dpa | int(r.source), length=r.length // POISON_LINE)
                    for r in records)


def check_range(fw: Firmware, address: int, lines: int) -> RetCode | None:
    """A DPA range input (Get Poison List, Scan Media): aligned start, inside the DPA space."""
    if address % POISON_LINE:
        return RetCode.INVALID_INPUT  # QEMU: "64 byte alignment required"
    if address + lines * POISON_LINE > fw.config.capacity:
        return RetCode.INVALID_PHYSICAL_ADDRESS
    return None


@command(Opcode.GET_POISON_LIST, "Get Poison List", in_len=DPA_RANGE.size, needs_media=True)
def get_poison_list(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    q = DPA_RANGE.unpack(payload)
    refused = check_range(fw, q["address"], q["length"])
    if refused is not None:
        return refused, b""
    records, more = fw.poison.get(q["address"], q["length"] * POISON_LINE, MAX_POISON_RECORDS_PER_GET)
    flags = (POISON_FLAG_MORE if more else 0) | (POISON_FLAG_OVERFLOW if fw.poison.overflowed else 0)
    if fw.background_running and fw.background_status[2] == Opcode.SCAN_MEDIA:
        flags |= POISON_FLAG_SCAN_RUNNING
    head = POISON_LIST_OUT.pack(flags=flags, overflow_ts=fw.poison.overflow_ns if fw.poison.overflowed else 0,
                                count=len(records))
    return RetCode.SUCCESS, head + encode_records(records)


@command(Opcode.INJECT_POISON, "Inject Poison", in_len=INJECT_POISON.size, needs_media=True,
         effects=Effect.IMMEDIATE_DATA_CHANGE, persistent=True)
def inject_poison(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    return fw.poison.inject(INJECT_POISON.unpack(payload)["address"]), b""


@command(Opcode.CLEAR_POISON, "Clear Poison", in_len=CLEAR_POISON.size, needs_media=True,
         effects=Effect.IMMEDIATE_DATA_CHANGE, persistent=True)
def clear_poison(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    p = CLEAR_POISON.unpack(payload)
    return fw.poison.clear(p["address"], p["data"]), b""
