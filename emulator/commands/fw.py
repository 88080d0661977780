"""Firmware update: Get FW Info, Transfer FW, Activate FW (CXL r3.1 §8.2.9.3).

Transfer FW and Activate FW are background commands (QEMU marks both BACKGROUND_OPERATION and
abortable). Each handler only validates; its job changes `fw.fwslots`, so a part whose job is
aborted before it ran leaves the slots exactly as they were, and one aborted mid-way abandons
the transfer (the host must start again with Init).
"""
from __future__ import annotations

import logging
from collections.abc import Generator
from typing import TYPE_CHECKING

from emulator.fwslots import FwSlots, ImageError, authenticate
from emulator.mailbox import Effect, command
from emulator.spec import payloads_fw as F
from emulator.spec.opcodes import Opcode
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

log = logging.getLogger(__name__)

_BACKGROUND = Effect.BACKGROUND_OPERATION | Effect.REQUEST_ABORT_SUPPORTED


@command(Opcode.GET_FW_INFO, "Get FW Info", in_len=0)
def get_fw_info(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    slots: FwSlots = fw.fwslots
    revs = {f"revision{i}": (slots.revision(i) or "").encode() if i <= slots.slots else b""
            for i in range(1, F.FW_MAX_SLOTS + 1)}
    return RetCode.SUCCESS, F.FW_INFO.pack(
        slots_supported=slots.slots, slot_info=slots.active | slots.staged << F.SLOT_STAGED_SHIFT,
        activation_caps=F.FW_CAP_ONLINE_ACTIVATION, **revs)


@command(Opcode.TRANSFER_FW, "Transfer FW", in_len=None, min_len=F.TRANSFER_FW.size,
         effects=_BACKGROUND, needs_media=True, persistent=True)
def transfer_fw(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    slots: FwSlots = fw.fwslots
    hdr = F.TRANSFER_FW.unpack(payload)
    action, slot = hdr["action"], hdr["slot"]
    if action == F.XFER_ABORT:
        slots.abort()  # nothing runs in the background now (the dispatcher answered Busy otherwise)
        return RetCode.SUCCESS, b""
    offset, data = hdr["offset"] * F.FW_XFER_ALIGN, bytes(payload[F.TRANSFER_FW.size:])
    refused = slots.check_part(action, slot, offset, len(data))
    if refused is not None:
        return refused, b""
    fw.start_background(Opcode.TRANSFER_FW, _transfer_job(slots, action, slot, offset, data))
    return RetCode.BACKGROUND_COMMAND_STARTED, b""


def _transfer_job(slots: FwSlots, action: int, slot: int, offset: int,
                  data: bytes) -> Generator[int, None, RetCode]:
    if action == F.XFER_FULL:
        image = data
    else:
        slots.write_part(action, offset, data)
        if action != F.XFER_END:
            return RetCode.SUCCESS
        assert slots.transfer is not None
        image = bytes(slots.transfer.buf)
    try:
        yield 1
        revision = yield from authenticate(image)
    except ImageError as exc:
        log.info("firmware package for slot %d refused: %s", slot, exc)
        slots.abort()
        return RetCode.FW_AUTHENTICATION_FAILED
    except BaseException:  # Request Background Operation Abort (GeneratorExit) or a bug
        slots.abort()  # the package never became whole: the host starts again with Init
        raise
    slots.store(slot, image, revision)
    slots.abort()  # the transfer is complete
    return RetCode.SUCCESS


@command(Opcode.ACTIVATE_FW, "Activate FW", in_len=F.ACTIVATE_FW.size, effects=_BACKGROUND,
         needs_media=True, persistent=True)
def activate_fw(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    slots: FwSlots = fw.fwslots
    req = F.ACTIVATE_FW.unpack(payload)
    action, slot = req["action"], req["slot"]
    if action not in (F.ACTIVATE_ONLINE, F.ACTIVATE_ON_RESET):
        return RetCode.INVALID_INPUT, b""
    refused = slots.activation_error(slot)
    if refused is not None:
        return refused, b""
    if action == F.ACTIVATE_ON_RESET:
        slots.stage(slot)  # nothing to do until the reset
        return RetCode.SUCCESS, b""
    fw.start_background(Opcode.ACTIVATE_FW, _activate_job(slots, slot))
    return RetCode.BACKGROUND_COMMAND_STARTED, b""


def _activate_job(slots: FwSlots, slot: int) -> Generator[int, None, RetCode]:
    """Online activation: re-verify the slot's package (a device never jumps into a corrupt
    image), then switch the running firmware over."""
    image = slots.images[slot - 1]
    assert image is not None, "activation_error admits only slots holding a package"
    try:
        revision = yield from authenticate(image)
    except ImageError:  # the slot's copy went bad since it was stored: refuse to run it
        return RetCode.FW_AUTHENTICATION_FAILED
    slots.activate(slot)
    log.info("firmware %r (slot %d) is now active", revision, slot)
    return RetCode.SUCCESS
