"""What a device keeps across a power cycle, besides the files its hosts map.

A real Type-3 device keeps its media (here: the `media` file, whose pages live in shared
memory), its label storage area (`lsa`), its poison list and bitmap, its partition and its
firmware slots across a reset; registers, event logs, the timestamp and background operations
start over. The files persist by themselves; the firmware's own state is saved here:

    state.json       {"version": 1, "poison": PoisonList.to_state(), "fwslots": FwSlots.to_state()}
    fwslot<N>.img    the package in firmware slot N (only slots that hold one)

Written whole to a temporary file and renamed into place, so a firmware killed mid-write leaves
the previous state, never half of one. The firmware saves after every mailbox command that the
command table says changes something (its Command Effects), before it answers, so what a host
was told happened survives a SIGKILL; after every background operation; and on a timer for what
changes without a command (the data path's poison hits, Scan Media's findings).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from emulator.firmware import Firmware

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
VERSION = 1
SAVE_INTERVAL_NS = 200_000_000  # the timer's period for changes no command announced


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class PersistentState:
    """Loads a device's saved state into a new firmware, and saves it when it changes."""

    def __init__(self, fw: "Firmware") -> None:
        self.fw = fw
        self.dir = fw.files.path
        self._saved_text: str | None = None
        self._saved_images: dict[int, int] = {}  # slot -> crc of the package on disk
        self._next_ns = 0

    # ---- boot ------------------------------------------------------------------------------------
    def restore(self) -> bool:
        """Apply the saved state, if any; True when there was one. A damaged file is logged and
        ignored (the device boots as new, with its media and LSA files untouched)."""
        try:
            text = (self.dir / STATE_FILE).read_text()
            state: dict[str, Any] = json.loads(text)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            log.error("%s: %s cannot be read (%s): poison list and firmware slots start empty",
                      self.fw.config.name, STATE_FILE, exc)
            return False
        if state.get("version") != VERSION:
            log.error("%s: %s has version %r, not %d: ignored", self.fw.config.name, STATE_FILE,
                      state.get("version"), VERSION)
            return False
        self.fw.poison.restore(state.get("poison", {}))
        slots = state.get("fwslots", {})
        images = [self._read_image(i + 1) for i in range(len(slots.get("revisions", [])))]
        self.fw.fwslots.restore(slots, images)
        self.save()  # what the boot changed (a staged slot became active) is the new state
        return True

    def _read_image(self, slot: int) -> bytes | None:
        try:
            return (self.dir / f"fwslot{slot}.img").read_bytes()
        except OSError:
            return None

    # ---- saving ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {"version": VERSION, "poison": self.fw.poison.to_state(), "fwslots": self.fw.fwslots.to_state()}

    def save(self) -> bool:
        """Write the state if it changed since the last save; True if it wrote."""
        state = self.snapshot()
        text = json.dumps(state, sort_keys=True)
        if text == self._saved_text:
            return False
        for i, crc in enumerate(state["fwslots"]["crc32"]):
            image = self.fw.fwslots.images[i]
            if crc is not None and image is not None and self._saved_images.get(i + 1) != crc:
                _write_atomic(self.dir / f"fwslot{i + 1}.img", image)
                self._saved_images[i + 1] = crc
        _write_atomic(self.dir / STATE_FILE, text.encode())
        self._saved_text = text
        return True

    def service(self, now_ns: int) -> bool:
        """The runner's timer: save what changed without a command announcing it."""
        if now_ns < self._next_ns:
            return False
        self._next_ns = now_ns + SAVE_INTERVAL_NS
        self.save()
        return False  # saving is not work a host is waiting on: the runner may nap


__all__ = ["PersistentState", "STATE_FILE"]
