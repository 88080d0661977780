"""Health and alerts: Get Health Info, Get / Set Alert Configuration (CXL r3.1 §8.2.9.9.3), and
the firmware service that advances the health model (`emulator.health.HealthState`, `fw.health`)
from the link counters and logs each crossed threshold as a Memory Module event record.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from emulator.health import Alert
from emulator.mailbox import Effect, command
from emulator.spec import payloads_events as E
from emulator.spec import payloads_memdev as P
from emulator.spec import registers as R
from emulator.spec.opcodes import Opcode
from emulator.spec.retcodes import RetCode
from emulator.timing import linkstate as L

if TYPE_CHECKING:
    from emulator.firmware import Firmware

log = logging.getLogger(__name__)

HEALTH_PERIOD_NS = 100_000_000  # the firmware re-evaluates health ten times a second


# §8.2.9.9.3 Health information and alerts -----------------------------------------------------
@command(Opcode.GET_HEALTH_INFO, "Get Health Info", in_len=0)
def get_health_info(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    return RetCode.SUCCESS, fw.health.info(media_ready=_media_ready(fw))


@command(Opcode.GET_ALERT_CONFIG, "Get Alert Configuration", in_len=0)
def get_alert_config(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    return RetCode.SUCCESS, fw.health.alert_config()


_SET_FIELDS = (
    (P.ALERT_LIFE_USED, "life_used_warning"), (P.ALERT_OVER_TEMP, "over_temp_warning"),
    (P.ALERT_UNDER_TEMP, "under_temp_warning"), (P.ALERT_CORRECTED_VOLATILE, "corrected_volatile_warning"),
    (P.ALERT_CORRECTED_PERSISTENT, "corrected_persistent_warning"),
)


@command(Opcode.SET_ALERT_CONFIG, "Set Alert Configuration", in_len=P.SET_ALERT_CONFIG.size,
         effects=Effect.IMMEDIATE_POLICY_CHANGE)
def set_alert_config(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    """Each valid action enables (with its threshold) or disables one warning; all or nothing.
    Enable bits of actions not marked valid are ignored, as the fields they would apply to."""
    req = P.SET_ALERT_CONFIG.unpack(payload)
    valid, enable = req["valid_actions"], req["enable_actions"] & req["valid_actions"]
    if valid & ~P.ALERT_ALL:  # a warning this device does not have
        return RetCode.INVALID_INPUT, b""
    new = dataclasses.replace(fw.health.alerts)
    for bit, name in _SET_FIELDS:
        if valid & bit:
            new.enabled = (new.enabled | bit) if enable & bit else (new.enabled & ~bit)
            if enable & bit:
                setattr(new, name, req[name])
    why = new.validate()
    if why is not None:
        log.info("Set Alert Configuration refused: %s", why)
        return RetCode.INVALID_INPUT, b""
    fw.health.alerts = new
    report_alerts(fw, fw.health.check_alerts())  # a lowered threshold may already be crossed
    return RetCode.SUCCESS, b""


# the health service ---------------------------------------------------------------------------
def link_bytes(fw: Firmware) -> int:
    """Bytes moved over the link and inside the device so far (the timed data path's counters in
    the BAR's link-state page; 0 while no data path has stamped the page)."""
    base = R.LINK_STATE_OFFSET
    if fw.regs.read(base, 8) != L.MAGIC:
        return 0
    words = (L.dir_word(L.DIR_READ) + L.BYTES, L.dir_word(L.DIR_WRITE) + L.BYTES, L.COPY_WORD + L.BYTES)
    return sum(fw.regs.read(base + 8 * w, 8) for w in words)


class HealthService:
    """Firmware service: advances the health model from the link counters, reports crossings."""

    def __init__(self, fw: Firmware) -> None:
        self.fw = fw
        self._next_ns = 0

    def __call__(self, now_ns: int) -> None:
        if now_ns < self._next_ns:
            return
        self._next_ns = now_ns + HEALTH_PERIOD_NS
        report_alerts(self.fw, self.fw.health.advance(now_ns, link_bytes(self.fw)))


def report_alerts(fw: Firmware, alerts: list[Alert]) -> None:
    """Each crossing becomes a Memory Module event record (§8.2.9.2.1.3) in the event logs."""
    for alert in alerts:
        log.warning("%s: %s %s (value %d)", fw.config.name, alert.what,
                    "critical" if alert.level == P.LEVEL_CRITICAL else "warning", alert.value)
        emit_alert_event(fw, alert)


def emit_alert_event(fw: Firmware, alert: Alert) -> None:
    """Log a Memory Module event record (§8.2.9.2.1.3) with a health snapshot: a warning in the
    Warning log, a critical crossing in the Failure log (with the flags the host should act on)."""
    events = fw.events
    kind = {"life_used": E.DeviceEventType.LIFE_USED_CHANGE,
            "temperature": E.DeviceEventType.TEMPERATURE_CHANGE}.get(alert.what, E.DeviceEventType.HEALTH_STATUS_CHANGE)
    critical = alert.level == P.LEVEL_CRITICAL
    flags = 0
    if critical:
        flags = E.FLAG_PERFORMANCE_DEGRADED if alert.what == "temperature" else E.FLAG_MAINTENANCE_NEEDED
    events.memory_module(E.EventLog.FAILURE if critical else E.EventLog.WARNING, int(kind), flags=flags,
                         **fw.health.snapshot(media_ready=_media_ready(fw)))


def _media_ready(fw: Firmware) -> bool:
    return fw.regs.get_field(R.MEMDEV_STATUS, "MEDIA_STATUS") == R.MEDIA_READY
