"""The firmware: device state, background operations and the runner that services the doorbell.

    host                         BAR (shared)                     FirmwareRunner (thread/process)
    ────                         ────────────                     ───────────────────────────────
    write payload, command  ──▶  MB_CMD / payload
    set DOORBELL            ──▶  MB_CTRL.DOORBELL=1  ──poll──▶   dispatch(opcode, payload)
                                 MB_STATUS.RETCODE   ◀──────────  write output, length, retcode
    poll DOORBELL==0        ◀──  MB_CTRL.DOORBELL=0  ◀──────────  clear doorbell (last)
    (bg) poll BG_STATUS     ◀──  MB_BG_STATUS        ◀──────────  job slices between polls

Everything device-side runs in the runner's one thread, so handlers and background jobs never race
each other; hosts are serialised by the mailbox lock (driver) and the doorbell.

A device with ``config.hosts`` > 1 has one BAR per host port (``bar``, ``bar.h1``, ...), each its
own ``HostPort``: registers (mailbox, device status, memdev status), state word and event logs.
The runner services every port's doorbell each pass, one command per port, so no host starves;
while a command runs ``fw.port`` is its port, and ``fw.regs`` / ``fw.events`` resolve to it, so a
handler keeps its signature ``handler(fw, payload)`` and acts on the port that asked. Media,
poison, LSA, timestamp, health and firmware slots are the device's, shared by every port; the
HDM decoders and the CHMU are on port 0's BAR.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

import emulator.commands  # noqa: F401  (fills the command table, emulator.mailbox.COMMANDS)
from emulator import chmu, component, liveness
from emulator.chmu_feed import FeedDrain
from emulator.commands.event_policy import EventInterruptPolicy
from emulator.commands.health import HealthService
from emulator.commands.scan import ScanState
from emulator.dcd import DcState
from emulator.events import EventLogs, share_records
from emulator.fw_telemetry import FirmwarePublisher
from emulator.kv_pool import KvPoolService
from emulator.fwslots import FwSlots
from emulator.health import HealthState
from emulator.mailbox import COMMANDS, BackgroundJob, dispatch
from emulator.persist import UNSAVED, PersistentState
from emulator.poison import PoisonList
from emulator.regfile import RegisterFile, init_device_registers
from emulator.spec import registers as R
from emulator.spec.payloads_memdev import TIMESTAMP_MODULUS
from emulator.spec.retcodes import RetCode
from emulator.timing.clock import WallClock
from firmware_model.clock import Clock

if TYPE_CHECKING:
    from emulator.device_dir import DeviceFiles

log = logging.getLogger(__name__)

__all__ = ["ABORT_LIMIT_PERCENT", "BackgroundJob", "Firmware", "FirmwareRunner", "HostPort", "Service"]

Service = Callable[[int], object]  # returns truthy when it had work (the runner naps less)
# §8.2.9.1.5: an abort is honoured only while the operation is below this percent (QEMU).
ABORT_LIMIT_PERCENT = 85


class HostPort:
    """One host port: its BAR's registers and state word, and its event logs."""

    def __init__(self, host: int, bar: object, clock: Callable[[], int]) -> None:
        """``clock``: the device time event records are stamped with (``Firmware.timestamp_ns``)."""
        self.host = host
        self.bar = bar
        self.regs = RegisterFile(bar)
        self.state = liveness.state_view(bar)
        self.events = EventLogs(self.regs, clock)


class Firmware:
    """Device state the command handlers act on: the registers and media, and each command
    group's state as a named field (QEMU's CXLType3Dev keeps them the same way)."""

    def __init__(self, files: DeviceFiles, *, clock: Clock | None = None) -> None:
        """``clock``: the device's time (default the wall clock): boot time, the Set Timestamp
        clock, what the runner passes its services, the firmware transfer timeout."""
        self.files = files
        self.clock: Clock = clock if clock is not None else WallClock()
        self.config = files.config
        self.ports = [HostPort(h, bar, self.timestamp_ns) for h, bar in enumerate(files.host_bars())]
        self.port = self.ports[0]  # the port whose command runs (serving); port 0 otherwise
        # Boot (a power cycle): a new generation in the state word, down until ready, so hosts
        # still holding the last boot's handles fail (emulator/liveness.py); registers at reset.
        self.generation = liveness.next_generation(max(p.state[0] & liveness.GEN_MASK for p in self.ports))
        for p in self.ports:
            p.regs.region(0, R.BAR_SIZE)[:] = bytes(R.BAR_SIZE)
        self._set_state(self.generation)
        self.media = np.frombuffer(files.media, dtype=np.uint8)
        self.lsa = np.frombuffer(files.lsa, dtype=np.uint8) if self.config.lsa_size else np.zeros(0, np.uint8)
        self.poison_bits = np.frombuffer(files.poison, dtype=np.uint8)
        self.services: list[Service] = []
        self.error_hooks: list[Callable[[int, BaseException], None]] = []
        self.internal_errors = 0
        self.boot_ns = self.clock.now_ns()
        self._ts_base: int | None = None  # host time at _ts_mono, once Set Timestamp ran
        self._ts_mono = 0
        self._bg: BackgroundJob | None = None
        self._bg_opcode = 0
        self._bg_abortable = False
        self._bg_percent = 0
        self._bg_port = self.ports[0]  # the port whose command started the background operation
        for p in self.ports:
            init_device_registers(p.regs)
        self.hdm = component.attach(self)
        self.chmu = chmu.attach(self)
        # every port's accesses reach the one CHMU through that port's feed ring
        feeds = [FeedDrain(p.bar, self.chmu) for p in self.ports]
        self.access_feed = feeds[0]
        self.services.extend(feed.service for feed in feeds)
        # the command groups' state (emulator/commands/): firmware slots (fw), health and alerts
        # (health), interrupt policy (event_policy), event logs (events), poison list (poison),
        # the last media scan (scan)
        self.fwslots = FwSlots(self.config.fw_revision, clock=self.clock.now_ns)
        self.health = HealthState(start_ns=self.boot_ns)
        self.services.append(HealthService(self))
        self.event_policy = EventInterruptPolicy()
        share_records([p.events for p in self.ports])
        self.error_hooks.append(self.events.firmware_error)
        self.poison = PoisonList(self)
        self.scan_media = ScanState()
        self.dcd = DcState(self)  # Dynamic Capacity: each port's offer and extents, the access bitmaps
        self.kv_pool = KvPoolService(self)  # the shared KV index in the extent tagged kv-index
        self.persist = PersistentState(self)  # poison list and firmware slots of the last boot
        self.persist.restore()
        self.services.append(self.persist.service)
        self.services.append(self.kv_pool)
        self.telemetry = FirmwarePublisher(self)
        self.services.append(self.telemetry.service)
        for p in self.ports:
            p.regs.set_fields(R.MEMDEV_STATUS, MEDIA_STATUS=R.MEDIA_READY, MBOX_READY=1)
        self._set_state(liveness.serving_word(self.generation, media=True))

    # host ports --------------------------------------------------------------------------------
    @property
    def regs(self) -> RegisterFile:
        """The registers of the port whose command runs (port 0 outside a command)."""
        return self.port.regs

    @property
    def events(self) -> EventLogs:
        """The event logs of the port whose command runs (port 0 outside a command); a record
        added to them goes into every port's (``EventLogs.peers``)."""
        return self.port.events

    def _set_state(self, word: int) -> None:
        """The state word, the same in every port's BAR: each host's data path checks its own."""
        for p in self.ports:
            p.state[0] = word

    # time ------------------------------------------------------------------------------------
    def set_timestamp(self, host_ns: int) -> None:
        self._ts_base, self._ts_mono = host_ns, self.clock.now_ns()

    def timestamp_ns(self) -> int:
        """Device time: the host's last Set Timestamp plus elapsed time, modulo 2**64 (a u64
        everywhere it is reported: Get Timestamp, event records, the telemetry page); 0 until
        one was set (§8.2.9.4)."""
        if self._ts_base is None:
            return 0
        return (self._ts_base + (self.clock.now_ns() - self._ts_mono)) % TIMESTAMP_MODULUS

    @property
    def capacity_used_bytes(self) -> int:
        """DPA bytes backed by memory: the media file's allocated blocks (all of it once served: reserved)."""
        return os.stat(self.files.path / "media").st_blocks * 512

    # media state -----------------------------------------------------------------------------
    @property
    def media_disabled(self) -> bool:
        return self.regs.get_field(R.MEMDEV_STATUS, "MEDIA_STATUS") == R.MEDIA_DISABLED

    @media_disabled.setter
    def media_disabled(self, disabled: bool) -> None:
        """Memory Device Status and the state word together: hosts' data paths refuse the media
        (MediaDisabled) from the moment this returns until it is enabled again."""
        self._set_state(liveness.serving_word(self.generation, media=not disabled))
        for p in self.ports:
            p.regs.set_field(R.MEMDEV_STATUS, "MEDIA_STATUS", R.MEDIA_DISABLED if disabled else R.MEDIA_READY)

    # background operations (§8.2.8.4.7, §8.2.9.1.2) ----------------------------------------------
    @property
    def background_running(self) -> bool:
        return self._bg is not None

    @property
    def background_status(self) -> tuple[bool, int, int, int]:
        """(running, percent, opcode, retcode) as Background Operation Status reports them (the
        mailbox of the port that started the last one)."""
        v = self._bg_port.regs.get(R.MB_BG_STATUS)
        f = R.MB_BG_STATUS
        return (self._bg is not None, f.f("PERCENT").get(v), f.f("OPCODE").get(v), f.f("RETCODE").get(v))

    def start_background(self, opcode: int, job: BackgroundJob, *, abortable: bool = True) -> None:
        if self._bg is not None:
            raise RuntimeError("a background operation is already running")  # dispatcher returns Busy first
        self._bg, self._bg_opcode, self._bg_abortable, self._bg_percent = job, opcode, abortable, 0
        self._bg_port = self.port
        self.regs.set_fields(R.MB_BG_STATUS, OPCODE=opcode, PERCENT=0, RETCODE=0)
        self.regs.set_field(R.MB_STATUS, "BG_OP", 1)

    def step_background(self) -> bool:
        """Advance the background job one slice; True if one ran."""
        if self._bg is None:
            return False
        try:
            percent = next(self._bg)
        except StopIteration as stop:
            self._finish_background(RetCode(stop.value if stop.value is not None else RetCode.SUCCESS))
        except Exception as exc:
            log.exception("background operation %#06x failed", self._bg_opcode)
            self.note_internal_error(self._bg_opcode, exc)
            self._finish_background(RetCode.INTERNAL_ERROR)
        else:
            self._bg_percent = max(0, min(99, int(percent)))
            self._bg_port.regs.set_field(R.MB_BG_STATUS, "PERCENT", self._bg_percent)
        return True

    def request_abort(self) -> RetCode:
        """Request Background Operation Abort (§8.2.9.1.5): honoured below 85 %."""
        if self._bg is None:
            return RetCode.SUCCESS
        if not self._bg_abortable:
            return RetCode.REQUEST_ABORT_NOT_SUPPORTED
        if self._bg_percent < ABORT_LIMIT_PERCENT:
            self._bg.close()  # runs the job's finally: blocks (e.g. re-enable media)
            self._finish_background(RetCode.ABORTED, percent=self._bg_percent)
        return RetCode.SUCCESS

    def _finish_background(self, rc: RetCode, percent: int = 100) -> None:
        self._bg = None
        if not self._save_state() and rc == RetCode.SUCCESS and COMMANDS[self._bg_opcode].persistent:
            rc = UNSAVED  # what it changed is not saved: the host is not told it succeeded
        self._bg_port.regs.set_fields(R.MB_BG_STATUS, PERCENT=percent, RETCODE=int(rc))
        self._bg_port.regs.set_field(R.MB_STATUS, "BG_OP", 0)

    def _save_state(self) -> bool:
        """Persist what a command or background operation changed (emulator/persist.py); False
        when it could not be written (logged and flagged there, never fatal)."""
        return self.persist.save()

    # errors ----------------------------------------------------------------------------------
    def note_internal_error(self, opcode: int, exc: BaseException) -> None:
        self.internal_errors += 1
        for hook in self.error_hooks:
            try:
                hook(opcode, exc)
            except Exception:  # a failing hook must not take the firmware down either
                log.exception("internal-error hook failed")

    # mailbox ---------------------------------------------------------------------------------
    def service_mailbox(self) -> bool:
        """Run the command behind each port's rung doorbell, one per port; True if there was one."""
        served = False
        for port in self.ports:
            if port.regs.get(R.MB_CTRL) & 1:
                self.port = port
                try:
                    served = self._service_port(port) or served
                finally:
                    self.port = self.ports[0]
        return served

    def _service_port(self, port: HostPort) -> bool:
        """Run the command behind ``port``'s doorbell (``self.port`` is ``port``)."""
        regs = port.regs
        if not regs.get(R.MB_CTRL) & 1:
            return False
        cmd = regs.get(R.MB_CMD)
        opcode, length = R.MB_CMD.f("OPCODE").get(cmd), R.MB_CMD.f("LENGTH").get(cmd)
        if length > R.MAILBOX_PAYLOAD_SIZE:
            rc, out = RetCode.INVALID_PAYLOAD_LENGTH, b""
        else:
            payload = bytes(regs.region(R.MB_PAYLOAD_OFFSET, length))
            rc, out = dispatch(self, opcode, payload)
            cmd = COMMANDS.get(opcode)
            if cmd is not None and cmd.effects and rc == RetCode.SUCCESS:
                # before the answer: what the host was told survives a kill, or it is not told
                if not self._save_state() and cmd.persistent:
                    rc, out = UNSAVED, b""
        regs.region(R.MB_PAYLOAD_OFFSET, len(out))[:] = out
        regs.set_fields(R.MB_CMD, OPCODE=opcode, LENGTH=len(out))
        regs.set_fields(R.MB_STATUS, RETCODE=int(rc), BG_OP=int(self._bg is not None and self._bg_port is port))
        regs.set_field(R.MB_CTRL, "DOORBELL", 0)  # last: the host may read everything above now
        return True

    def close(self) -> None:
        self._save_state()
        self._set_state(self.generation)  # down: every host's data path and mailbox now fail
        for p in self.ports:
            p.state.release()
            p.regs.set_field(R.MEMDEV_STATUS, "MBOX_READY", 0)
        self.telemetry.close()
        self.kv_pool.detach()  # its views of the media and its CAS's export
        # drop the views so the mmaps can close
        self.media, self.lsa, self.poison_bits = (np.zeros(0, np.uint8) for _ in range(3))
        for p in self.ports:
            p.regs, p.bar = RegisterFile(bytearray(R.BAR_SIZE)), None


class FirmwareRunner:
    """Services the doorbell, steps background jobs and runs periodic services.

    Polls: a real device raises an interrupt on the doorbell; a file-backed BAR has none, so the
    runner spins briefly after activity (low mailbox latency for bursts) and naps when idle::

        mailbox command or background job ──► spin (spin_s), then nap idle_sleep_s
        idle ──► each nap twice the last, up to max_idle_sleep_s
        a service with work (the CHMU access feed had entries) ──► naps back to idle_sleep_s

    Polling every 0.5 ms kept an idle served device at 10 % of a core on this VM (a timed wake
    costs tens of microseconds here), and took that share from an in-process host's compute;
    backing off to 16 ms brings it to about 2 %. The first command after a quiet spell of t
    waits at most min(t, 16 ms) for its doorbell to be seen; a burst is served at once.
    """

    def __init__(self, fw: Firmware, *, idle_sleep_s: float = 0.0005, spin_s: float = 0.005,
                 max_idle_sleep_s: float = 0.016) -> None:
        self.fw = fw
        self.idle_sleep_s = idle_sleep_s
        self.max_idle_sleep_s = max(idle_sleep_s, max_idle_sleep_s)
        self.spin_s = spin_s
        self._stop = threading.Event()

    def step(self) -> tuple[bool, bool]:
        """One pass: the mailbox, a background job slice, the services. Returns (the mailbox or
        a background job had work, a service had work)."""
        busy = self.fw.service_mailbox()
        busy = self.fw.step_background() or busy
        now = self.fw.clock.now_ns()
        serviced = False
        for service in self.fw.services:
            try:
                serviced = bool(service(now)) or serviced
            except Exception as exc:
                log.exception("firmware service %r failed", service)
                self.fw.note_internal_error(0, exc)
        return busy, serviced

    def run(self) -> None:
        last_busy = time.monotonic()
        nap = self.idle_sleep_s
        while not self._stop.is_set():
            busy, serviced = self.step()
            if busy:
                last_busy = time.monotonic()
                nap = self.idle_sleep_s
            elif time.monotonic() - last_busy > self.spin_s:
                if serviced:
                    nap = self.idle_sleep_s
                self._stop.wait(nap)
                nap = min(2 * nap, self.max_idle_sleep_s)
            else:
                time.sleep(0)  # let an in-process host thread have the GIL

    def start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name=f"cxlemu-fw-{self.fw.config.name}", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()

