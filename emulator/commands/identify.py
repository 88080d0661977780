"""Memory-device commands: Identify Memory Device, Get Partition Info, Get / Set LSA, Get Health
Info, Get / Set Alert Configuration, Get Security State (CXL r3.1 §8.2.9.9.1-3, §8.2.9.9.6).

cxlemu's device is volatile-only: all capacity is volatile, none is partitionable, and there is no
persistent-memory security (no passphrase can be set, so the security state is all zeros).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from emulator.firmware import attach_state
from emulator.health import Alert, HealthState
from emulator.mailbox import COMMANDS, Effect, command
from emulator.spec import payloads_events as E
from emulator.spec import payloads_memdev as P
from emulator.spec import registers as R
from emulator.spec.layout import u24
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_poison import INJECT_POISON_LIMIT, POISON_LIST_LIMIT
from emulator.spec.retcodes import RetCode
from emulator.timing import linkstate as L

if TYPE_CHECKING:
    from emulator.firmware import Firmware

log = logging.getLogger(__name__)

CAPACITY_UNIT = 256 << 20  # §8.2.9.9.1.1: capacities are multiples of 256 MiB
HEALTH_PERIOD_NS = 100_000_000  # the firmware re-evaluates health ten times a second

# What Identify Memory Device reports about the logs and lists other groups own: the event logs'
# capacities (records, emulator.events) and the poison list's limits (emulator.poison).
EVENT_LOG_SIZES = dict(zip(("info", "warning", "failure", "fatal", "dynamic_capacity"), E.EVENT_LOG_SIZES))
POISON_LIST_MAX_RECORDS = POISON_LIST_LIMIT
assert len(EVENT_LOG_SIZES) == len(E.EventLog)


def attach(fw: Firmware) -> None:
    attach_state(fw, "health", HealthState(start_ns=time.monotonic_ns()))
    fw.services.append(HealthService(fw))


# §8.2.9.9.1.1 Identify Memory Device ------------------------------------------------------------
@command(Opcode.IDENTIFY_MEMORY_DEVICE, "Identify Memory Device", in_len=0)
def identify_memory_device(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    units = fw.config.capacity // CAPACITY_UNIT
    caps = P.POISON_CAP_SCANS_MEDIA if Opcode.SCAN_MEDIA in COMMANDS else 0
    sizes = EVENT_LOG_SIZES
    return RetCode.SUCCESS, P.IDENTIFY_MEMDEV.pack(
        fw_revision=fw.fwslots.active_revision.encode(), total_capacity=units, volatile_capacity=units,
        persistent_capacity=0, partition_align=0,
        info_event_log_size=sizes["info"], warning_event_log_size=sizes["warning"],
        failure_event_log_size=sizes["failure"], fatal_event_log_size=sizes["fatal"],
        lsa_size=fw.config.lsa_size, poison_list_max_mer=u24(POISON_LIST_MAX_RECORDS),
        inject_poison_limit=INJECT_POISON_LIMIT, poison_caps=caps, qos_telemetry_caps=0,
        dc_event_log_size=sizes["dynamic_capacity"])


# §8.2.9.9.2 Capacity configuration and label storage -----------------------------------------
@command(Opcode.GET_PARTITION_INFO, "Get Partition Info", in_len=0, needs_media=True)
def get_partition_info(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    # next_* both 0: no partition change is pending (§8.2.9.9.2.1)
    return RetCode.SUCCESS, P.PARTITION_INFO.pack(active_volatile=fw.config.capacity // CAPACITY_UNIT)


@command(Opcode.GET_LSA, "Get LSA", in_len=P.GET_LSA.size, needs_media=True)
def get_lsa(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    req = P.GET_LSA.unpack(payload)
    offset, length = req["offset"], req["length"]
    if length > R.MAILBOX_PAYLOAD_SIZE or offset + length > fw.config.lsa_size:
        return RetCode.INVALID_INPUT, b""
    return RetCode.SUCCESS, fw.lsa[offset:offset + length].tobytes()


@command(Opcode.SET_LSA, "Set LSA", in_len=None, min_len=P.SET_LSA.size, needs_media=True,
         effects=Effect.IMMEDIATE_CONFIG_CHANGE | Effect.IMMEDIATE_DATA_CHANGE)
def set_lsa(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    offset = P.SET_LSA.unpack(payload)["offset"]
    data = payload[P.SET_LSA.size:]
    if offset + len(data) > fw.config.lsa_size:
        return RetCode.INVALID_INPUT, b""
    fw.lsa[offset:offset + len(data)] = data
    return RetCode.SUCCESS, b""


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


# §8.2.9.9.6.1 Get Security State -------------------------------------------------------------
@command(Opcode.GET_SECURITY_STATE, "Get Security State", in_len=0)
def get_security_state(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    # No persistent capacity, so no Set Passphrase: no passphrase set, never locked or frozen.
    return RetCode.SUCCESS, P.SECURITY_STATE.pack(state=0)


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
    events = getattr(fw, "events", None)
    if events is None:  # a firmware built without the event logs
        return
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
