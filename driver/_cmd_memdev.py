"""Typed wrappers of the memory-device commands: identify, partition, LSA, health, alerts,
timestamp, logs (CEL), security state, Secure Erase, event interrupt policy (CXL r3.1 §8.2.9.2.4-5,
§8.2.9.4-5, §8.2.9.9.1-3, §8.2.9.9.5.2, §8.2.9.9.6). Each returns a dataclass (or None) and raises
`MailboxError` on a return code. Sanitize's wrapper is in `driver/_cmd_poison.py`."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from driver._cmd_base import CommandMixin
from driver.mailbox import Progress
from emulator.spec import payloads_memdev as P
from emulator.spec.payloads_memdev import CAPACITY_UNIT
from emulator.spec.layout import Layout
from emulator.spec.opcodes import Opcode
from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE


@dataclass(frozen=True)
class MemdevIdentity:
    """Identify Memory Device, capacities in bytes."""

    fw_revision: str
    total_bytes: int
    volatile_bytes: int
    persistent_bytes: int
    partition_align_bytes: int
    event_log_sizes: dict[str, int]
    lsa_size: int
    poison_list_max: int
    inject_poison_limit: int
    poison_caps: int
    qos_telemetry_caps: int


@dataclass(frozen=True)
class PartitionInfo:
    active_volatile_bytes: int
    active_persistent_bytes: int
    next_volatile_bytes: int
    next_persistent_bytes: int


@dataclass(frozen=True)
class HealthInfo:
    health_status: int
    media_status: int
    additional_status: int
    life_used: int
    temperature: int
    dirty_shutdowns: int
    corrected_volatile_errors: int
    corrected_persistent_errors: int

    @property
    def life_used_level(self) -> int:
        """0 normal, 1 warning, 2 critical (Additional Status [1:0])."""
        return self.additional_status & 0x3

    @property
    def temperature_level(self) -> int:
        """0 normal, 1 warning, 2 critical (Additional Status [3:2])."""
        return (self.additional_status >> 2) & 0x3


@dataclass(frozen=True)
class AlertConfiguration:
    valid_alerts: int
    programmable_alerts: int
    life_used_critical: int
    life_used_warning: int
    over_temp_critical: int
    under_temp_critical: int
    over_temp_warning: int
    under_temp_warning: int
    corrected_volatile_warning: int
    corrected_persistent_warning: int


@dataclass(frozen=True)
class SecurityState:
    state: int

    @property
    def locked(self) -> bool:
        return bool(self.state & P.SECURITY_LOCKED)

    @property
    def frozen(self) -> bool:
        return bool(self.state & P.SECURITY_FROZEN)


@dataclass(frozen=True)
class CelEntry:
    opcode: int
    effects: int


_ALERT_BITS = {"life_used_warning": P.ALERT_LIFE_USED, "over_temp_warning": P.ALERT_OVER_TEMP,
               "under_temp_warning": P.ALERT_UNDER_TEMP,
               "corrected_volatile_warning": P.ALERT_CORRECTED_VOLATILE,
               "corrected_persistent_warning": P.ALERT_CORRECTED_PERSISTENT}
_ALERT_RANGES = {"life_used_warning": (0, 100), "over_temp_warning": (-0x8000, 0x7FFF),
                 "under_temp_warning": (-0x8000, 0x7FFF), "corrected_volatile_warning": (0, 0xFFFF),
                 "corrected_persistent_warning": (0, 0xFFFF)}
_EVENT_LOGS = ("info", "warning", "failure", "fatal", "dynamic_capacity")


def _decode(layout: Layout, out: bytes) -> dict[str, Any]:
    if len(out) < layout.size:
        raise ValueError(f"{layout.name}: device returned {len(out)} bytes, expected {layout.size}")
    return layout.unpack(out)


class MemdevCommands(CommandMixin):
    """Mixin: needs `call(opcode, payload) -> bytes` (MailboxClient)."""


    def identify_memdev(self) -> MemdevIdentity:
        d = _decode(P.IDENTIFY_MEMDEV, self.call(Opcode.IDENTIFY_MEMORY_DEVICE))
        return MemdevIdentity(
            fw_revision=d["fw_revision"].rstrip(b"\0").decode("ascii", errors="replace"),
            total_bytes=d["total_capacity"] * CAPACITY_UNIT, volatile_bytes=d["volatile_capacity"] * CAPACITY_UNIT,
            persistent_bytes=d["persistent_capacity"] * CAPACITY_UNIT,
            partition_align_bytes=d["partition_align"] * CAPACITY_UNIT,
            event_log_sizes={"info": d["info_event_log_size"], "warning": d["warning_event_log_size"],
                             "failure": d["failure_event_log_size"], "fatal": d["fatal_event_log_size"],
                             "dynamic_capacity": d["dc_event_log_size"]},
            lsa_size=d["lsa_size"], poison_list_max=int.from_bytes(d["poison_list_max_mer"], "little"),
            inject_poison_limit=d["inject_poison_limit"], poison_caps=d["poison_caps"],
            qos_telemetry_caps=d["qos_telemetry_caps"])

    def partition_info(self) -> PartitionInfo:
        d = _decode(P.PARTITION_INFO, self.call(Opcode.GET_PARTITION_INFO))
        return PartitionInfo(*(d[k] * CAPACITY_UNIT for k in
                               ("active_volatile", "active_persistent", "next_volatile", "next_persistent")))

    # label storage area: read and written in payload-sized pieces, as Linux's cxl_mem_get_lsa
    def get_lsa(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
        chunks = []
        for start in range(offset, offset + length, MAILBOX_PAYLOAD_SIZE):
            n = min(MAILBOX_PAYLOAD_SIZE, offset + length - start)
            chunks.append(self.call(Opcode.GET_LSA, P.GET_LSA.pack(offset=start, length=n)))
        return b"".join(chunks)

    def set_lsa(self, offset: int, data: bytes) -> None:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        step = MAILBOX_PAYLOAD_SIZE - P.SET_LSA.size
        for pos in range(0, len(data), step):
            self.call(Opcode.SET_LSA, P.SET_LSA.pack(offset=offset + pos) + bytes(data[pos:pos + step]))

    # health and alerts
    def health(self) -> HealthInfo:
        return HealthInfo(**_decode(P.HEALTH_INFO, self.call(Opcode.GET_HEALTH_INFO)))

    def alert_config(self) -> AlertConfiguration:
        return AlertConfiguration(**_decode(P.ALERT_CONFIG, self.call(Opcode.GET_ALERT_CONFIG)))

    def set_alert_config(self, *, disable: Iterable[str] = (), **thresholds: int) -> None:
        """Enable warnings with their thresholds (``over_temp_warning=70``), disable others by name."""
        names = set(thresholds) | set(disable)
        unknown = names - set(_ALERT_BITS)
        if unknown:
            raise ValueError(f"unknown alert(s) {sorted(unknown)}; use {sorted(_ALERT_BITS)}")
        for n, value in thresholds.items():
            lo, hi = _ALERT_RANGES[n]
            if not lo <= value <= hi:
                raise ValueError(f"{n} {value} is outside {lo}..{hi}")
        valid = sum(_ALERT_BITS[n] for n in names)
        enable = sum(_ALERT_BITS[n] for n in thresholds)
        self.call(Opcode.SET_ALERT_CONFIG, P.SET_ALERT_CONFIG.pack(
            valid_actions=valid, enable_actions=enable, **thresholds))

    # timestamp
    def timestamp(self) -> int:
        """Device time in ns since the Unix epoch (0 until a host set it)."""
        return P.TIMESTAMP.unpack(self.call(Opcode.GET_TIMESTAMP))["timestamp"]

    def set_timestamp(self, ns: int | None = None) -> int:
        """Set the device clock (default: this host's time, as Linux does at probe); returns it."""
        ns = time.time_ns() if ns is None else ns
        if not 0 <= ns < 2**64:
            raise ValueError(f"timestamp {ns} is outside a u64 of ns")
        self.call(Opcode.SET_TIMESTAMP, P.TIMESTAMP.pack(timestamp=ns))
        return ns

    # logs
    def supported_logs(self) -> dict[uuid.UUID, int]:
        out = self.call(Opcode.GET_SUPPORTED_LOGS)
        n = _decode(P.SUPPORTED_LOGS, out)["entries"]
        entries = (P.SUPPORTED_LOG_ENTRY.unpack(out, P.SUPPORTED_LOGS.size + i * P.SUPPORTED_LOG_ENTRY.size)
                   for i in range(n))
        return {uuid.UUID(bytes=e["uuid"]): e["size"] for e in entries}

    def get_log(self, log: uuid.UUID, offset: int, length: int) -> bytes:
        return self.call(Opcode.GET_LOG, P.GET_LOG.pack(uuid=log.bytes, offset=offset, length=length))

    def command_effects_log(self) -> list[CelEntry]:
        """The whole CEL, read in payload-sized pieces (Linux cxl_xfer_log)."""
        size = self.supported_logs()[P.CEL_UUID]
        raw = b"".join(self.get_log(P.CEL_UUID, off, min(MAILBOX_PAYLOAD_SIZE, size - off))
                       for off in range(0, size, MAILBOX_PAYLOAD_SIZE))
        return [CelEntry(**P.CEL_ENTRY.unpack(raw, off)) for off in range(0, len(raw), P.CEL_ENTRY.size)]

    # security and event interrupts
    def security_state(self) -> SecurityState:
        return SecurityState(_decode(P.SECURITY_STATE, self.call(Opcode.GET_SECURITY_STATE))["state"])

    def secure_erase(self, progress: Progress | None = None) -> None:
        """Secure Erase (4401h, background; Linux `cxl sanitize-memdev --erase`): zeroes the media
        and clears poison, keeps the LSA and the event logs; media disabled while it runs.
        `progress` gets each new percent complete. Sanitize (which also erases the LSA and the
        events) is `sanitize()`."""
        self.call(Opcode.SECURE_ERASE, progress=progress)

    def event_interrupt_policy(self) -> dict[str, int]:
        """Per event log: its setting byte (mode in [1:0], MSI message number in [7:4])."""
        out = self.call(Opcode.GET_EVENT_INTERRUPT_POLICY)
        return dict(zip(_EVENT_LOGS, out))

    def set_event_interrupt_policy(self, *, info: int = 0, warning: int = 0, failure: int = 0,
                                   fatal: int = 0, dynamic_capacity: int | None = None) -> None:
        """Interrupt mode per log (0 none, 1 MSI/MSI-X); the DC byte is sent only when given."""
        body = bytes([info, warning, failure, fatal])
        if dynamic_capacity is not None:
            body += bytes([dynamic_capacity])
        self.call(Opcode.SET_EVENT_INTERRUPT_POLICY, body)
