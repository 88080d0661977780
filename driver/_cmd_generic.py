"""Typed wrappers of the generic commands (§8.2.9.1)."""
from __future__ import annotations

from dataclasses import dataclass

from driver._cmd_base import CommandMixin
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads import BG_OP_STATUS, IDENTIFY


@dataclass(frozen=True)
class Identify:
    vendor_id: int
    device_id: int
    subsys_vendor_id: int
    subsys_id: int
    serial: int
    max_msg_size: int
    component_type: int


@dataclass(frozen=True)
class BackgroundStatus:
    running: bool
    percent: int
    opcode: int
    retcode: int


class GenericCommands(CommandMixin):
    """Mixin: needs `call(opcode, payload) -> bytes` (MailboxClient)."""


    def identify(self) -> Identify:
        return Identify(**IDENTIFY.unpack(self.call(Opcode.IDENTIFY)))

    def background_status(self) -> BackgroundStatus:
        d = BG_OP_STATUS.unpack(self.call(Opcode.BACKGROUND_OPERATION_STATUS))
        return BackgroundStatus(bool(d["status"] & 1), d["percent"] & 0x7F, d["opcode"], d["retcode"])

    def abort_background(self) -> None:
        self.call(Opcode.REQUEST_BACKGROUND_ABORT)
