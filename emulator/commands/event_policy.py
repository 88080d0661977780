"""Get / Set Event Interrupt Policy (CXL r3.1 §8.2.9.2.4-5).

One setting byte per event log (informational, warning, failure, fatal, dynamic capacity): bits
[1:0] are the interrupt mode (0 none, 1 MSI/MSI-X, 2 firmware interrupt, 3 reserved) and, in the
Get output, bits [7:4] the MSI message number. cxlemu signals events through the Device Status
register and has a single message number (0), and no firmware-first path: a Set asking for a
firmware interrupt or the reserved mode is Invalid Input. The DC byte is optional in a Set
(Linux sends 4 bytes, QEMU accepts 4 or 5).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.mailbox import Effect, command
from emulator.spec import payloads_memdev as P
from emulator.spec.opcodes import Opcode
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

LOGS = ("info", "warning", "failure", "fatal", "dynamic_capacity")
MSI_MESSAGE_NUMBER = 0  # the device's one vector (Mailbox Capabilities MSI number is 0 too)


class EventInterruptPolicy:
    """The interrupt mode per event log; all off after reset (§8.2.9.2.4)."""

    def __init__(self) -> None:
        self.modes = dict.fromkeys(LOGS, P.INT_MODE_NONE)

    def encode(self) -> bytes:
        return P.EVENT_INT_POLICY.pack(**{
            log: mode | (MSI_MESSAGE_NUMBER << P.INT_MSGNUM_SHIFT if mode == P.INT_MODE_MSI else 0)
            for log, mode in self.modes.items()})


@command(Opcode.GET_EVENT_INTERRUPT_POLICY, "Get Event Interrupt Policy", in_len=0)
def get_event_interrupt_policy(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    return RetCode.SUCCESS, fw.event_policy.encode()


@command(Opcode.SET_EVENT_INTERRUPT_POLICY, "Set Event Interrupt Policy", in_len=None,
         min_len=P.EVENT_INT_POLICY_BASE_SIZE, effects=Effect.IMMEDIATE_CONFIG_CHANGE)
def set_event_interrupt_policy(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    if len(payload) > P.EVENT_INT_POLICY.size:
        return RetCode.INVALID_PAYLOAD_LENGTH, b""
    modes = {log: setting & P.INT_MODE_MASK for log, setting in zip(LOGS, bytes(payload))}
    if any(mode not in (P.INT_MODE_NONE, P.INT_MODE_MSI) for mode in modes.values()):
        return RetCode.INVALID_INPUT, b""
    fw.event_policy.modes.update(modes)  # a 4-byte Set leaves the DC log's setting as it was
    return RetCode.SUCCESS, b""
