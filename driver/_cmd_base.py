"""Base of the typed-command mixins (driver/_cmd_*.py): what `MemDev` supplies to them.

`MemDev` lists `MailboxClient` before the mixins, so these declarations only tell the mixins (and
mypy) what they may call; the real `call`/`send` are MailboxClient's.
"""
from __future__ import annotations

from typing import Any

from driver.mailbox import Progress


class CommandMixin:
    config: Any

    def call(self, opcode: int, payload: bytes = b"", *, progress: Progress | None = None) -> bytes:
        raise NotImplementedError("provided by driver.mailbox.MailboxClient")

    def send(self, opcode: int, payload: bytes = b"", *, wait_background: bool = False,
             progress: Progress | None = None) -> tuple[int, bytes]:
        raise NotImplementedError("provided by driver.mailbox.MailboxClient")
