"""Memory-device identity: Identify Memory Device, Get Partition Info, Get Security State (CXL
r3.1 §8.2.9.9.1, §8.2.9.9.2.1, §8.2.9.9.6.1).

cxlemu's device is volatile-only: all capacity is volatile, none is partitionable, and there is no
persistent-memory security (no passphrase can be set, so the security state is all zeros).
Get / Set LSA are in `commands.lsa`, health and alerts in `commands.health`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from emulator.mailbox import COMMANDS, command
from emulator.spec import payloads_events as E
from emulator.spec import payloads_memdev as P
from emulator.spec.payloads_memdev import CAPACITY_UNIT
from emulator.spec.layout import u24
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_poison import INJECT_POISON_LIMIT, POISON_LIST_LIMIT
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

# What Identify Memory Device reports about the logs and lists other groups own: the event logs'
# capacities (records, emulator.events) and the poison list's limits (emulator.poison).
EVENT_LOG_SIZES = dict(zip(("info", "warning", "failure", "fatal", "dynamic_capacity"), E.EVENT_LOG_SIZES))
POISON_LIST_MAX_RECORDS = POISON_LIST_LIMIT
assert len(EVENT_LOG_SIZES) == len(E.EventLog)


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


# §8.2.9.9.2.1 Get Partition Info -------------------------------------------------------------
@command(Opcode.GET_PARTITION_INFO, "Get Partition Info", in_len=0, needs_media=True)
def get_partition_info(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    # next_* both 0: no partition change is pending (§8.2.9.9.2.1)
    return RetCode.SUCCESS, P.PARTITION_INFO.pack(active_volatile=fw.config.capacity // CAPACITY_UNIT)


# §8.2.9.9.6.1 Get Security State -------------------------------------------------------------
@command(Opcode.GET_SECURITY_STATE, "Get Security State", in_len=0)
def get_security_state(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    # No persistent capacity, so no Set Passphrase: no passphrase set, never locked or frozen.
    return RetCode.SUCCESS, P.SECURITY_STATE.pack(state=0)
