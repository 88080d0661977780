"""Typed wrappers of the firmware-update commands (CXL r3.1 §8.2.9.3).

`update_firmware` sends a package as Linux's fw_upload does (cxl_fw_write): one Full transfer when
it fits in a payload, else Init, Continue … End in 128-byte-aligned parts, each a background
command the host waits for; a failed part is followed by an Abort so the device is left clean.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from driver._cmd_base import CommandMixin
from emulator.spec import payloads_fw as F
from emulator.spec.errors import MailboxError
from emulator.spec.opcodes import Opcode
from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE
from emulator.spec.retcodes import RetCode

# Largest part: the payload minus the 80h header, rounded down to the 128-byte offset unit.
MAX_PART = (MAILBOX_PAYLOAD_SIZE - F.TRANSFER_FW.size) // F.FW_XFER_ALIGN * F.FW_XFER_ALIGN


@dataclass(frozen=True)
class FwInfo:
    slots_supported: int
    active_slot: int
    staged_slot: int  # 0: none
    online_activation: bool
    revisions: tuple[str | None, ...]  # per slot, None when empty


def transfer_payload(action: int, slot: int, offset: int, data: bytes = b"") -> bytes:
    """A Transfer FW input payload; `offset` in bytes (must be 128-byte aligned)."""
    if offset % F.FW_XFER_ALIGN:
        raise ValueError(f"transfer offset {offset} is not a multiple of {F.FW_XFER_ALIGN} bytes")
    return F.TRANSFER_FW.pack(action=action, slot=slot, offset=offset // F.FW_XFER_ALIGN) + bytes(data)


class FwCommands(CommandMixin):
    """Mixin: needs `send` and `call` (MailboxClient)."""

    def fw_info(self) -> FwInfo:
        out = self.call(Opcode.GET_FW_INFO)
        d = F.FW_INFO.unpack(out)
        n = d["slots_supported"]
        revs = tuple((d[f"revision{i}"].rstrip(b"\0").decode("ascii", errors="replace") or None)
                     for i in range(1, min(n, F.FW_MAX_SLOTS) + 1))
        return FwInfo(slots_supported=n, active_slot=d["slot_info"] & F.SLOT_ACTIVE_MASK,
                      staged_slot=(d["slot_info"] >> F.SLOT_STAGED_SHIFT) & F.SLOT_ACTIVE_MASK,
                      online_activation=bool(d["activation_caps"] & F.FW_CAP_ONLINE_ACTIVATION),
                      revisions=revs)

    def update_firmware(self, image: bytes, slot: int, *, part_size: int = MAX_PART,
                        progress: Callable[[int, int], None] | None = None) -> None:
        """Transfer a package into `slot`; `progress(sent, total)` after each part."""
        if not image:
            raise ValueError("firmware package is empty")
        if part_size <= 0 or part_size % F.FW_XFER_ALIGN or part_size > MAX_PART:
            raise ValueError(f"part_size must be a multiple of {F.FW_XFER_ALIGN} up to {MAX_PART}, got {part_size}")
        if len(image) <= part_size:
            self.call(Opcode.TRANSFER_FW, transfer_payload(F.XFER_FULL, slot, 0, image))
            if progress is not None:
                progress(len(image), len(image))
            return
        starts = range(0, len(image), part_size)
        try:
            for i, start in enumerate(starts):
                action = F.XFER_INIT if i == 0 else F.XFER_END if i == len(starts) - 1 else F.XFER_CONTINUE
                self.call(Opcode.TRANSFER_FW,
                          transfer_payload(action, slot, start, image[start:start + part_size]))
                if progress is not None:
                    progress(min(start + part_size, len(image)), len(image))
        except MailboxError as exc:
            if exc.retcode != RetCode.FW_TRANSFER_IN_PROGRESS:  # never abort someone else's transfer
                self.send(Opcode.TRANSFER_FW, transfer_payload(F.XFER_ABORT, 0, 0))  # best effort
            raise

    def abort_firmware_transfer(self) -> None:
        self.call(Opcode.TRANSFER_FW, transfer_payload(F.XFER_ABORT, 0, 0))

    def activate_firmware(self, slot: int, *, online: bool = True) -> None:
        """Run `slot`'s firmware now (online) or from the next reset."""
        action = F.ACTIVATE_ONLINE if online else F.ACTIVATE_ON_RESET
        self.call(Opcode.ACTIVATE_FW, F.ACTIVATE_FW.pack(action=action, slot=slot))
