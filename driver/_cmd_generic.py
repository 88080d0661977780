"""Typed wrappers of the generic commands (§8.2.9.1)."""
from __future__ import annotations

from dataclasses import dataclass

from driver._cmd_base import CommandMixin
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads import BG_OP_STATUS, IDENTIFY, bg_op_status_fields


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
        """Background Operation Status (§8.2.9.1.2): percent from bits 7:1 of byte 0."""
        d = BG_OP_STATUS.unpack(self.call(Opcode.BACKGROUND_OPERATION_STATUS))
        running, percent = bg_op_status_fields(d["status"])
        return BackgroundStatus(running, percent, d["opcode"], d["retcode"])

    def abort_background(self) -> None:
        self.call(Opcode.REQUEST_BACKGROUND_ABORT)
