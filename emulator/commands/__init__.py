"""Mailbox command handlers, one module per command group. Importing this package fills
`emulator.mailbox.COMMANDS`; `attach_all(fw)` gives each group its state on a new firmware."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from emulator.firmware import Firmware

# Order matters only for attach(): groups that others use attach first.
GROUPS = [
    "emulator.commands.generic",
    "emulator.commands.fw",
    "emulator.commands.identify",
    "emulator.commands.timestamp",
    "emulator.commands.logs",
    "emulator.commands.event_policy",
    "emulator.commands.events",
    "emulator.commands.poison",
    "emulator.commands.scan",
    "emulator.commands.sanitize",
]
_modules = [importlib.import_module(name) for name in GROUPS]


def attach_all(fw: "Firmware") -> None:
    for module in _modules:
        attach = getattr(module, "attach", None)
        if attach is not None:
            attach(fw)
