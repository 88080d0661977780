"""Mailbox command handlers, one module per command group. Importing this package fills
`emulator.mailbox.COMMANDS` (`emulator.firmware` imports it once, at module level).

A group registers its handlers with `emulator.mailbox.command`; state it keeps is a named field
of `emulator.firmware.Firmware`, built in `Firmware.__init__`. Handlers never import the
firmware module (only for the type checker), so the command table sits below both sides.
"""
from __future__ import annotations

from emulator.commands import (
    dcd,
    event_policy,
    events,
    fw,
    generic,
    health,
    identify,
    logs,
    lsa,
    poison,
    sanitize,
    scan,
    timestamp,
)

GROUPS = (generic, fw, identify, lsa, health, timestamp, logs, event_policy, events, poison, scan, sanitize, dcd)

__all__ = ["GROUPS"]
