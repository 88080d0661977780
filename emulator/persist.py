"""What a device keeps across a power cycle, besides the files its hosts map.

A real Type-3 device keeps its media (here: the `media` file, whose pages live in shared
memory), its label storage area (`lsa`), its poison list and bitmap, its partition and its
firmware slots across a reset; registers, event logs, the timestamp and background operations
start over. The files persist by themselves; the firmware's own state is saved here:

    state.json       {"version": 1, "poison": PoisonList.to_state(), "fwslots": FwSlots.to_state(),
                      "dcd": DcState.to_state() (each port's accepted extents and offer; older: none)}
    fwslot<N>.img    the package in firmware slot N (only slots that hold one)

Written whole to a temporary file and renamed into place, so a firmware killed mid-write leaves
the previous state, never half of one. The firmware saves after every mailbox command that the
command table says changes something (its Command Effects), before it answers, so what a host
was told happened survives a SIGKILL; after every background operation; and on a timer for what
changes without a command (the data path's poison hits, Scan Media's findings).

Damaged state loses nothing. A `state.json` that cannot be read, is not JSON, or holds other
than what `snapshot` writes is moved aside to `state.json.bad-<UTC time>` before anything saves;
the poison list is rebuilt from the bitmap (every bad line listed again, source Unknown), so the
list and the bitmap agree; the firmware slots start as configured (the moved file keeps what
they held). A damaged file that cannot be moved aside stops the boot (`StateError`, naming it
and `--fresh`). Without a `state.json` the list is rebuilt from the bitmap the same way.

State that cannot be saved is not acknowledged as saved. A failed save (the file made a
directory, the folder read-only, the disk full) is logged once, retried with back-off and
flagged (`error`, `failures`: Maintenance Needed in Get Health Info, `state_save_failures` on the
telemetry page and in the monitor). Before a command that changes the saved state runs, the
dispatcher asks `refusal`, which writes the state as it is: where that fails, the command is
refused with UNSAVED and changes nothing, so a host told it failed never finds it applied. One
whose own save fails after it ran (the disk filled in between) is answered UNSAVED, not Success.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from emulator.dcd import check_dcd_state
from emulator.spec.errors import ConfigError
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_poison import PoisonSource
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
VERSION = 1
SAVE_INTERVAL_NS = 200_000_000  # the timer's period for changes no command announced
RETRY_MAX_NS = 10_000_000_000   # a failing save is retried after 0.4 s, 0.8 s, ... then every 10 s
# Internal Error (§8.2.8.4.5.1: "not completed because of an internal device error"): the
# device's own non-volatile store failed. Not Retry Required (a retry fails the same until an
# operator fixes the folder), not Media Disabled or Permanent Media Failure (the media is fine).
UNSAVED = RetCode.INTERNAL_ERROR


class StateError(ConfigError):
    """A damaged state file that cannot be moved aside: the device does not boot over it."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # a failed write or rename leaves no temporary file behind
            tmp.unlink()


def _ints(value: Any, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))


def check_state(state: Any) -> None:
    """Raise ValueError naming the first part of a loaded state that `snapshot` would not write."""
    if not isinstance(state, dict):
        raise ValueError("not a JSON object")
    if state.get("version") != VERSION:
        raise ValueError(f"version {state.get('version')!r}, not {VERSION}")
    poison, slots = state.get("poison"), state.get("fwslots")
    if not isinstance(poison, dict) or not isinstance(poison.get("records"), list):
        raise ValueError("poison.records is not a list")
    sources = {int(s) for s in PoisonSource}
    if not all(_ints(r, 3) and r[2] in sources for r in poison["records"]):
        raise ValueError("poison.records holds other than [dpa, length, source] integers")
    if not isinstance(poison.get("overflowed"), bool) or not _ints([poison.get("overflow_ns")], 1):
        raise ValueError("poison.overflowed / overflow_ns are not a boolean and an integer")
    if not isinstance(slots, dict) or not _ints([slots.get(k) for k in ("slots", "active", "staged")], 3):
        raise ValueError("fwslots is not an object with integer slots, active and staged")
    revisions, crcs = slots.get("revisions"), slots.get("crc32")
    if not isinstance(revisions, list) or not all(r is None or isinstance(r, str) for r in revisions):
        raise ValueError("fwslots.revisions is not a list of strings or nulls")
    if not isinstance(crcs, list) or not all(c is None or _ints([c], 1) for c in crcs):
        raise ValueError("fwslots.crc32 is not a list of integers or nulls")
    if "dcd" in state:  # a state saved before Dynamic Capacity has none
        check_dcd_state(state["dcd"])


class PersistentState:
    """Loads a device's saved state into a new firmware, and saves it when it changes."""

    def __init__(self, fw: "Firmware") -> None:
        self.fw = fw
        self.dir = fw.files.path
        self._saved_text: str | None = None
        self._saved_images: dict[int, int] = {}  # slot -> crc of the package on disk
        self._next_ns = 0
        self.error: str | None = None  # why the last save failed; None while the file is current
        self.failures = 0              # failed saves since the last one that succeeded

    # ---- boot ------------------------------------------------------------------------------------
    def restore(self) -> bool:
        """Apply the saved state, if any; True when there was one. A damaged file is moved aside
        and the poison list rebuilt from the bitmap (the module doc)."""
        path = self.dir / STATE_FILE
        try:
            state: dict[str, Any] = json.loads(path.read_bytes())
            check_state(state)
        except FileNotFoundError:
            self._relist(None)
            return False
        except (OSError, ValueError) as exc:  # JSON and UTF-8 decode errors are ValueErrors
            self._relist(f"{STATE_FILE} was damaged ({exc}) and is kept as {self._set_aside(path, exc)}")
            return False
        self.fw.poison.restore(state["poison"])
        slots = state["fwslots"]
        images = [self._read_image(i + 1) for i in range(len(slots["revisions"]))]
        self.fw.fwslots.restore(slots, images)
        self.fw.dcd.restore(state.get("dcd"))
        self.save()  # what the boot changed (a staged slot became active) is the new state
        return True

    def _set_aside(self, path: Path, exc: BaseException) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        bad = path.with_name(f"{STATE_FILE}.bad-{stamp}")
        n = 1
        while bad.exists() or bad.is_symlink():
            bad, n = path.with_name(f"{STATE_FILE}.bad-{stamp}.{n}"), n + 1
        try:
            os.replace(path, bad)
        except OSError as err:
            raise StateError(f"{path} is damaged ({exc}) and cannot be moved aside ({err.strerror or err}): "
                             f"move it away, or serve {self.fw.config.name!r} with --fresh to start it "
                             f"empty") from None
        return bad.name

    def _relist(self, damage: str | None) -> None:
        """The saved list is gone (`damage` says how; None: there was no file): list every bad
        line of the bitmap again, so the two agree, and save that at once."""
        listed = self.fw.poison.relist_from_bitmap()
        if damage is not None or listed:  # no file and a clean bitmap: a new device, nothing to say
            log.error("%s: %s: poison list rebuilt from the bitmap (%d records), firmware slots as "
                      "configured", self.fw.config.name, damage or f"no {STATE_FILE}", listed)
        self.save()

    def _read_image(self, slot: int) -> bytes | None:
        try:
            return (self.dir / f"fwslot{slot}.img").read_bytes()
        except OSError:
            return None

    # ---- saving ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {"version": VERSION, "poison": self.fw.poison.to_state(), "fwslots": self.fw.fwslots.to_state(),
                "dcd": self.fw.dcd.to_state()}

    def save(self, *, force: bool = False) -> bool:
        """Write the state if it changed since the last save (``force``: even if not, to find out
        whether it can be written). True when the file holds the current state (written now or
        before); False when it could not be written (logged once per failing spell, flagged,
        retried by `service` with back-off)."""
        state = self.snapshot()
        text = json.dumps(state, sort_keys=True)
        if text == self._saved_text and not force and self.error is None:
            return True  # a failing store is written again even when nothing changed: to notice it mended
        try:
            for i, crc in enumerate(state["fwslots"]["crc32"]):
                image = self.fw.fwslots.images[i]
                if crc is not None and image is not None and self._saved_images.get(i + 1) != crc:
                    _write_atomic(self.dir / f"fwslot{i + 1}.img", image)
                    self._saved_images[i + 1] = crc
            _write_atomic(self.dir / STATE_FILE, text.encode())
        except OSError as exc:
            self._failed(exc)
            return False
        self._saved_text = text
        if self.error is not None:
            log.warning("%s: device state saved again after %d failed tries", self.fw.config.name, self.failures)
            self.error, self.failures = None, 0
            self.fw.health.state_unsaved = False
        return True

    def _failed(self, exc: OSError) -> None:
        self.failures += 1
        if self.error is None:  # once per spell: the timer retries without a word
            log.error("%s: cannot save the device state in %s (%s): poison and firmware-slot commands are "
                      "refused with Internal Error until it can; retrying", self.fw.config.name, self.dir,
                      exc.strerror or exc)
        self.error = f"{exc.strerror or exc}: {exc.filename or self.dir}"
        self.fw.health.state_unsaved = True

    def refusal(self, persistent: bool) -> RetCode | None:
        """The dispatcher's check before a command runs: UNSAVED for one that would change the
        saved state when the state cannot be written now (a forced save: a store that broke since
        the last save is found before the command changes anything, a fixed one at once)."""
        if persistent and not self.save(force=True):
            return UNSAVED
        return None

    def service(self, now_ns: int) -> bool:
        """The runner's timer: save what changed without a command announcing it; while saving
        fails, retry after twice the last wait, up to RETRY_MAX_NS."""
        if now_ns < self._next_ns:
            return False
        self.save()
        wait = SAVE_INTERVAL_NS if self.error is None else min(RETRY_MAX_NS, SAVE_INTERVAL_NS << min(self.failures, 6))
        self._next_ns = now_ns + wait
        return False  # saving is not work a host is waiting on: the runner may nap


__all__ = ["PersistentState", "STATE_FILE", "StateError", "UNSAVED", "check_state"]
