"""The command table and the one dispatcher every mailbox command goes through.

How to add a command (as QEMU's cxl-mailbox-utils.c does):

1. Define its payload layouts in ``emulator/spec/`` (a `struct.Struct` with a size assertion).
2. Write the handler in a module under ``emulator/commands/``::

       @command(Opcode.GET_HEALTH_INFO, "Get Health Info", in_len=0)
       def get_health_info(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
           ...

   A background command calls ``fw.start_background(opcode, job)`` and returns
   ``(RetCode.BACKGROUND_COMMAND_STARTED, b"")``; ``job`` is a generator that does a slice of work
   per ``next()``, yields its percent complete, and returns the final RetCode.
3. Import the module from ``emulator/commands/__init__.py`` and add it to ``GROUPS``. The Command
   Effects Log and the generic checks follow from the table; the handler sees only well-formed,
   permitted input. State the group keeps is a named field of ``Firmware``, built in its
   ``__init__`` (``fw.events``, ``fw.poison``, ...).

This module is the one place both sides import: the handlers (``emulator/commands/``) register
into ``COMMANDS`` here and type the firmware only for the type checker; ``emulator/firmware.py``
imports the commands package once, at module level, which fills the table.

Generic rules, in order (CXL r3.1 §8.2.8.4; QEMU `cxl_process_cci_message`):
unsupported opcode → Unsupported; wrong length → Invalid Payload Length; a background command while
one runs → Busy; a media command while media is disabled (sanitize) → Media Disabled; a command
that changes the saved state while it cannot be saved → Internal Error (emulator/persist.py). A handler
that raises is a firmware bug: the host gets Internal Error, the firmware lives on.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntFlag
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

log = logging.getLogger(__name__)

Handler = Callable[["Firmware", memoryview], tuple[RetCode, bytes]]
# A background command's job: each next() does a slice of work and yields its percent complete;
# its return value is the final return code (Firmware.start_background).
BackgroundJob = Generator[int, None, RetCode]


class Effect(IntFlag):
    """Command Effects Log bits, CXL r3.1 §8.2.9.5.2.1 Table 8-75."""

    CONFIG_CHANGE_COLD_RESET = 1 << 0
    IMMEDIATE_CONFIG_CHANGE = 1 << 1
    IMMEDIATE_DATA_CHANGE = 1 << 2
    IMMEDIATE_POLICY_CHANGE = 1 << 3
    IMMEDIATE_LOG_CHANGE = 1 << 4
    SECURITY_STATE_CHANGE = 1 << 5
    BACKGROUND_OPERATION = 1 << 6
    SECONDARY_MAILBOX_SUPPORTED = 1 << 7
    REQUEST_ABORT_SUPPORTED = 1 << 8


@dataclass(frozen=True)
class Command:
    """One row of the command table."""

    opcode: int
    name: str
    handler: Handler
    in_len: int | None  # exact input length; None: variable, at least `min_len`
    min_len: int = 0
    effects: Effect = Effect(0)
    needs_media: bool = False  # refused with Media Disabled while media is disabled
    # changes what state.json keeps (emulator/persist.py): refused with Internal Error, changing
    # nothing, when the state cannot be written before it runs; not acknowledged if unsaved after
    persistent: bool = False

    @property
    def background(self) -> bool:
        return bool(self.effects & Effect.BACKGROUND_OPERATION)


COMMANDS: dict[int, Command] = {}


def command(opcode: int, name: str, *, in_len: int | None, min_len: int = 0,
            effects: Effect = Effect(0), needs_media: bool = False,
            persistent: bool = False) -> Callable[[Handler], Handler]:
    """Register a handler in the command table (one opcode, one handler)."""

    def register(handler: Handler) -> Handler:
        if opcode in COMMANDS:
            raise RuntimeError(f"opcode {opcode:#06x} registered twice ({COMMANDS[opcode].name}, {name})")
        if in_len is not None and in_len > MAILBOX_PAYLOAD_SIZE:
            raise RuntimeError(f"{name}: input length {in_len} exceeds the mailbox payload")
        COMMANDS[opcode] = Command(opcode, name, handler, in_len, min_len, effects, needs_media, persistent)
        return handler

    return register


def check(fw: "Firmware", cmd: Command | None, length: int) -> RetCode | None:
    """The generic rules; None when the command may run."""
    if cmd is None:
        return RetCode.UNSUPPORTED
    if cmd.in_len is not None and length != cmd.in_len:
        return RetCode.INVALID_PAYLOAD_LENGTH
    if cmd.in_len is None and length < cmd.min_len:
        return RetCode.INVALID_PAYLOAD_LENGTH
    if cmd.background and fw.background_running:
        return RetCode.BUSY
    if cmd.needs_media and fw.media_disabled:
        return RetCode.MEDIA_DISABLED
    return fw.persist.refusal(cmd.persistent)  # it would change saved state that cannot be saved


def dispatch(fw: "Firmware", opcode: int, payload: bytes | memoryview) -> tuple[RetCode, bytes]:
    """Run one command; always answers with a return code, never raises. The table is filled by
    importing ``emulator.commands`` (``emulator.firmware`` does)."""
    cmd = COMMANDS.get(opcode)
    refused = check(fw, cmd, len(payload))
    if refused is not None:
        return refused, b""
    assert cmd is not None
    try:
        rc, out = cmd.handler(fw, memoryview(bytes(payload)))
    except Exception as exc:  # a firmware bug must not kill the firmware
        log.exception("handler for %s (%#06x) failed", cmd.name, opcode)
        fw.note_internal_error(opcode, exc)
        return RetCode.INTERNAL_ERROR, b""
    if len(out) > MAILBOX_PAYLOAD_SIZE:
        fw.note_internal_error(opcode, RuntimeError(f"output of {len(out)} bytes exceeds the payload area"))
        return RetCode.INTERNAL_ERROR, b""
    return RetCode(rc), bytes(out)
