"""Memory-device commands: payloads decoded by hand at the spec's offsets, and their behaviour."""
from __future__ import annotations

import struct
import uuid

import pytest
from mbox_support import run

from emulator.commands import identify
from emulator.firmware import FirmwareRunner
from emulator.mailbox import COMMANDS, Effect, dispatch
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import EventLog
from emulator.spec.retcodes import RetCode
from emulator.telemetry import TelemetryReader

GIB = 1 << 30
CEL_UUID_BYTES = bytes.fromhex("0da9c0b5bf414b788f7996b1623b3f17")


pytestmark = pytest.mark.firmware(capacity=GIB, lsa_size=4096, fw_revision="rev-A")


def test_identify_memory_device_fields_at_spec_offsets(fw):
    rc, out = dispatch(fw, 0x4000, b"")
    assert rc == RetCode.SUCCESS and len(out) == 0x45
    assert out[0x00:0x10] == b"rev-A".ljust(16, b"\0")
    total, vol, pers, align = struct.unpack_from("<4Q", out, 0x10)
    assert (total, vol, pers, align) == (4, 4, 0, 0)  # 1 GiB in 256 MiB units, all volatile
    sizes = identify.EVENT_LOG_SIZES
    assert struct.unpack_from("<4H", out, 0x30) == (sizes["info"], sizes["warning"], sizes["failure"], sizes["fatal"])
    assert struct.unpack_from("<I", out, 0x38)[0] == 4096
    assert int.from_bytes(out[0x3C:0x3F], "little") == 256
    assert struct.unpack_from("<H", out, 0x3F)[0] == identify.INJECT_POISON_LIMIT
    assert out[0x41] == (0x2 if Opcode.SCAN_MEDIA in COMMANDS else 0)  # bit 1: scans media
    assert out[0x42] == 0
    assert struct.unpack_from("<H", out, 0x43)[0] == sizes["dynamic_capacity"]


def test_partition_info_reports_all_capacity_volatile(fw):
    rc, out = dispatch(fw, 0x4100, b"")
    assert rc == RetCode.SUCCESS
    assert struct.unpack("<4Q", out) == (4, 0, 0, 0)


def test_lsa_round_trip_and_bounds(fw):
    data = bytes(range(200)) * 2
    assert dispatch(fw, 0x4103, struct.pack("<II", 100, 0) + data) == (RetCode.SUCCESS, b"")
    assert bytes(fw.lsa[100:500]) == data
    assert dispatch(fw, 0x4102, struct.pack("<II", 100, 400)) == (RetCode.SUCCESS, data)
    assert dispatch(fw, 0x4102, struct.pack("<II", 4096 - 8, 8))[0] == RetCode.SUCCESS  # ends at the end
    assert dispatch(fw, 0x4102, struct.pack("<II", 4096 - 8, 9)) == (RetCode.INVALID_INPUT, b"")
    assert dispatch(fw, 0x4102, struct.pack("<II", 0, 2049)) == (RetCode.INVALID_INPUT, b"")
    assert dispatch(fw, 0x4102, struct.pack("<II", 0xFFFFFFFF, 1)) == (RetCode.INVALID_INPUT, b"")
    before = bytes(fw.lsa)
    assert dispatch(fw, 0x4103, struct.pack("<II", 4090, 0) + b"x" * 7) == (RetCode.INVALID_INPUT, b"")
    assert bytes(fw.lsa) == before  # a refused write changes nothing


def test_health_info_fields_at_spec_offsets(fw):
    rc, out = dispatch(fw, 0x4200, b"")
    assert rc == RetCode.SUCCESS and len(out) == 0x12
    health, media, additional, life = out[0], out[1], out[2], out[3]
    (temp,) = struct.unpack_from("<h", out, 0x04)
    dirty, vol_errs, pers_errs = struct.unpack_from("<3I", out, 0x06)
    assert (health, media, additional, life) == (0, 0, 0, 0)
    assert temp == 35  # idle: the model's ambient temperature
    assert (dirty, vol_errs, pers_errs) == (0, 0, 0)
    fw.health.note_corrected_error()
    fw.health.note_corrected_error(persistent=True)
    fw.health.note_corrected_error(persistent=True)
    out = dispatch(fw, 0x4200, b"")[1]
    assert struct.unpack_from("<3I", out, 0x06) == (0, 1, 2)
    fw.media_disabled = True
    assert dispatch(fw, 0x4200, b"")[1][1] == 1  # media status: not ready


def test_alert_configuration_get_set(fw):
    rc, out = dispatch(fw, 0x4201, b"")
    assert rc == RetCode.SUCCESS and len(out) == 0x10
    assert out[0] == 0 and out[1] == 0x1F  # nothing enabled; all five programmable
    assert out[2] == 90  # life used critical
    assert struct.unpack_from("<2h", out, 0x04) == (85, 0)  # over / under temperature critical
    # enable the over-temperature (bit 1) and corrected volatile (bit 3) warnings
    req = struct.pack("<BBBBhhHH", 0x0A, 0x0A, 0, 0, 70, 0, 5, 0)
    assert dispatch(fw, 0x4202, req) == (RetCode.SUCCESS, b"")
    out = dispatch(fw, 0x4201, b"")[1]
    assert out[0] == 0x0A
    assert struct.unpack_from("<h", out, 0x08)[0] == 70
    assert struct.unpack_from("<H", out, 0x0C)[0] == 5
    # a warning at or above the critical threshold is refused and changes nothing
    assert dispatch(fw, 0x4202, struct.pack("<BBBBhhHH", 0x02, 0x02, 0, 0, 85, 0, 0, 0))[0] == RetCode.INVALID_INPUT
    assert dispatch(fw, 0x4202, struct.pack("<BBBBhhHH", 0x01, 0x01, 95, 0, 0, 0, 0, 0))[0] == RetCode.INVALID_INPUT
    assert dispatch(fw, 0x4202, struct.pack("<BBBBhhHH", 0x04, 0x04, 0, 0, 0, -5, 0, 0))[0] == RetCode.INVALID_INPUT
    # an alert this device does not have is refused; enable bits of actions not valid are ignored
    assert dispatch(fw, 0x4202, struct.pack("<BBBBhhHH", 0x20, 0x20, 0, 0, 0, 0, 0, 0))[0] == RetCode.INVALID_INPUT
    assert dispatch(fw, 0x4201, b"")[1][0] == 0x0A
    assert dispatch(fw, 0x4202, struct.pack("<BBBBhhHH", 0x01, 0x03, 10, 0, 99, 0, 0, 0))[0] == RetCode.SUCCESS
    out = dispatch(fw, 0x4201, b"")[1]
    assert (out[0], out[3], struct.unpack_from("<h", out, 0x08)[0]) == (0x0B, 10, 70)  # over-temp untouched
    assert dispatch(fw, 0x4202, struct.pack("<BBBBhhHH", 0x01, 0x00, 0, 0, 0, 0, 0, 0))[0] == RetCode.SUCCESS
    # disable the over-temperature warning only
    assert dispatch(fw, 0x4202, struct.pack("<BBBBhhHH", 0x02, 0x00, 0, 0, 0, 0, 0, 0))[0] == RetCode.SUCCESS
    assert dispatch(fw, 0x4201, b"")[1][0] == 0x08


def test_lowering_a_threshold_below_the_value_logs_a_warning_event(fw):
    events = getattr(fw, "events", None)
    if events is None:
        pytest.skip("this firmware has no event logs")
    before = events.count(1)
    req = struct.pack("<BBBBhhHH", 0x02, 0x02, 0, 0, 30, 0, 0, 0)  # over-temp warning 30 C < 35 C now
    assert dispatch(fw, 0x4202, req)[0] == RetCode.SUCCESS
    assert events.count(1) == before + 1
    rc, out = dispatch(fw, 0x0100, bytes([1]))  # Get Event Records, warning log
    assert rc == RetCode.SUCCESS
    (count,) = struct.unpack_from("<H", out, 0x14)
    rec = out[0x20 + (count - 1) * 0x80:0x20 + count * 0x80]
    assert uuid.UUID(bytes=rec[:16]) == uuid.UUID("fe927475-dd59-4339-a586-79bab113b774")
    assert rec[0x30] == 3  # device event type: temperature change
    assert struct.unpack_from("<h", rec, 0x35)[0] == 35
    assert rec[0x33] >> 2 & 3 == 1  # additional status: temperature warning
    # staying above the threshold logs nothing more
    assert fw.health.check_alerts() == []


def test_timestamp_get_set(fw):
    assert dispatch(fw, 0x0300, b"") == (RetCode.SUCCESS, bytes(8))  # unset: 0
    t0 = 1_700_000_000_123_456_789
    assert dispatch(fw, 0x0301, struct.pack("<Q", t0)) == (RetCode.SUCCESS, b"")
    (now,) = struct.unpack("<Q", dispatch(fw, 0x0300, b"")[1])
    assert t0 <= now < t0 + 60 * 10**9  # counts on from the host's value


def test_a_timestamp_just_below_2_64_wraps_and_the_device_lives_on(fw):
    """Issue 24.5: Set Timestamp 2**64-1 answered Success, then the telemetry service raised twice
    per publish (the page's u64) and every event record failed (Internal Error)."""
    assert dispatch(fw, Opcode.SET_TIMESTAMP, b"\xff" * 8) == (RetCode.SUCCESS, b"")
    (now,) = struct.unpack("<Q", dispatch(fw, Opcode.GET_TIMESTAMP, b"")[1])
    assert now < 60 * 10**9  # one ns after 2**64-1 is 0: the clock wrapped
    fw.poison.report_hit(0x40)  # a data-path hit logs a General Media record stamped with it
    rc, out = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.FAILURE]))
    assert rc == RetCode.SUCCESS and struct.unpack_from("<H", out, 0x14)[0] == 1
    assert struct.unpack_from("<Q", out, 0x20 + 0x18)[0] < 60 * 10**9
    FirmwareRunner(fw).step()  # the services: the first step publishes the telemetry page
    page = TelemetryReader(fw.files.bar).snapshot().firmware
    assert page is not None and page.timestamp_ns < 60 * 10**9
    assert fw.internal_errors == 0


def test_timestamp_counts_on_by_the_device_clock(device_name):
    """On a ManualClock the device time is exact: the host's value plus the ns the clock moved;
    boot time and the health model start on the same clock."""
    from emulator.device import DeviceConfig, DeviceFiles
    from emulator.firmware import Firmware
    from firmware_model.clock import ManualClock

    clock = ManualClock(5_000)
    files = DeviceFiles.create(DeviceConfig(name=device_name, capacity=256 << 20))
    fw = Firmware(files, clock=clock)
    try:
        assert fw.boot_ns == fw.health.start_ns == 5_000
        assert dispatch(fw, 0x0301, struct.pack("<Q", 1_700_000_000_123_456_789))[0] == RetCode.SUCCESS
        clock.advance(2_500)
        assert dispatch(fw, 0x0300, b"") == (RetCode.SUCCESS, struct.pack("<Q", 1_700_000_000_123_459_289))
    finally:
        fw.close()
        files.destroy()


def test_supported_logs_lists_the_cel_with_its_size(fw):
    rc, out = dispatch(fw, 0x0400, b"")
    assert rc == RetCode.SUCCESS and len(out) == 8 + 20
    assert struct.unpack_from("<H", out, 0)[0] == 1
    assert out[8:24] == CEL_UUID_BYTES
    assert struct.unpack_from("<I", out, 24)[0] == 4 * len(COMMANDS)


def test_cel_holds_every_command_with_its_effects(fw):
    size = 4 * len(COMMANDS)
    rc, cel = dispatch(fw, 0x0401, CEL_UUID_BYTES + struct.pack("<II", 0, size))
    assert rc == RetCode.SUCCESS and len(cel) == size
    entries = [struct.unpack_from("<HH", cel, off) for off in range(0, size, 4)]
    assert [op for op, _ in entries] == sorted(COMMANDS)
    assert {op: eff for op, eff in entries} == {op: int(c.effects) for op, c in COMMANDS.items()}
    listed = {op for op, _ in entries}
    for opcode in (0x4000, 0x4100, 0x4102, 0x4103, 0x4200, 0x4201, 0x4202, 0x0300, 0x0301, 0x0400,
                   0x0401, 0x0102, 0x0103, 0x0200, 0x0201, 0x0202, 0x4500):
        assert opcode in listed
    effects = dict(entries)
    assert effects[0x0201] & Effect.BACKGROUND_OPERATION and effects[0x0202] & Effect.BACKGROUND_OPERATION
    assert effects[0x4103] == Effect.IMMEDIATE_CONFIG_CHANGE | Effect.IMMEDIATE_DATA_CHANGE
    # a piece from the middle
    assert dispatch(fw, 0x0401, CEL_UUID_BYTES + struct.pack("<II", 4, 8)) == (RetCode.SUCCESS, cel[4:12])


def test_get_log_refuses_unknown_logs_and_reads_past_the_end(fw):
    size = 4 * len(COMMANDS)
    other = uuid.uuid4().bytes
    assert dispatch(fw, 0x0401, other + struct.pack("<II", 0, 4)) == (RetCode.INVALID_LOG, b"")
    assert dispatch(fw, 0x0401, CEL_UUID_BYTES + struct.pack("<II", 0, size + 4))[0] == RetCode.INVALID_INPUT
    assert dispatch(fw, 0x0401, CEL_UUID_BYTES + struct.pack("<II", size, 4))[0] == RetCode.INVALID_INPUT
    assert dispatch(fw, 0x0401, CEL_UUID_BYTES + struct.pack("<II", 0, 4096))[0] == RetCode.INVALID_INPUT
    assert dispatch(fw, 0x0401, CEL_UUID_BYTES + struct.pack("<II", size, 0)) == (RetCode.SUCCESS, b"")


def test_security_state_is_unlocked_with_no_passphrase(fw):
    assert dispatch(fw, 0x4500, b"") == (RetCode.SUCCESS, bytes(4))


def test_event_interrupt_policy(fw):
    assert dispatch(fw, 0x0102, b"") == (RetCode.SUCCESS, bytes(5))
    assert dispatch(fw, 0x0103, bytes([1, 1, 0, 1])) == (RetCode.SUCCESS, b"")
    assert dispatch(fw, 0x0102, b"")[1] == bytes([1, 1, 0, 1, 0])
    assert dispatch(fw, 0x0103, bytes([0, 0, 0, 0, 1])) == (RetCode.SUCCESS, b"")
    assert dispatch(fw, 0x0102, b"")[1] == bytes([0, 0, 0, 0, 1])
    assert dispatch(fw, 0x0103, bytes([3, 0, 0, 0]))[0] == RetCode.INVALID_INPUT  # reserved mode
    assert dispatch(fw, 0x0103, bytes([0, 2, 0, 0]))[0] == RetCode.INVALID_INPUT  # no FW-first path
    assert dispatch(fw, 0x0103, bytes(6))[0] == RetCode.INVALID_PAYLOAD_LENGTH
    assert dispatch(fw, 0x0103, bytes(3))[0] == RetCode.INVALID_PAYLOAD_LENGTH
    assert dispatch(fw, 0x0102, b"")[1] == bytes([0, 0, 0, 0, 1])  # refused Sets changed nothing


def test_activated_revision_shows_in_identify(fw):
    from emulator.fwslots import build_image

    image = build_image("rev-B", b"\xAA" * 300)
    payload = struct.pack("<BBHI", 0, 2, 0, 0) + bytes(0x78) + image
    assert run(fw, Opcode.TRANSFER_FW, payload)[0] == RetCode.SUCCESS
    assert dispatch(fw, 0x4000, b"")[1][:16] == b"rev-A".ljust(16, b"\0")  # stored, not yet active
    assert run(fw, Opcode.ACTIVATE_FW, bytes([0, 2]))[0] == RetCode.SUCCESS
    assert dispatch(fw, 0x4000, b"")[1][:16] == b"rev-B".ljust(16, b"\0")


# end to end through the driver ------------------------------------------------------------------
def test_driver_wrappers(memdev):
    ident = memdev.identify_memdev()
    assert ident.total_bytes == ident.volatile_bytes == 256 << 20 and ident.persistent_bytes == 0
    assert ident.fw_revision == memdev.config.fw_revision
    assert ident.lsa_size == memdev.config.lsa_size
    assert memdev.partition_info().active_volatile_bytes == 256 << 20
    blob = bytes(range(256)) * 20  # 5120 bytes: three Set LSA and three Get LSA commands
    memdev.set_lsa(1000, blob)
    assert memdev.get_lsa(1000, len(blob)) == blob
    assert memdev.health().temperature == 35
    memdev.set_alert_config(over_temp_warning=60, corrected_volatile_warning=10)
    cfg = memdev.alert_config()
    assert (cfg.valid_alerts, cfg.over_temp_warning, cfg.corrected_volatile_warning) == (0x0A, 60, 10)
    memdev.set_alert_config(disable=["corrected_volatile_warning"])
    assert memdev.alert_config().valid_alerts == 0x02
    t = memdev.set_timestamp(1_800_000_000_000_000_000)
    assert memdev.timestamp() >= t
    assert sorted(e.opcode for e in memdev.command_effects_log()) == sorted(COMMANDS)
    assert not memdev.security_state().locked
    memdev.set_event_interrupt_policy(info=1, fatal=1)
    assert memdev.event_interrupt_policy() == {"info": 1, "warning": 0, "failure": 0, "fatal": 1,
                                               "dynamic_capacity": 0}


def _offsets(layout) -> dict[str, int]:
    return {k: v for k, v in layout.offsets.items() if not k.startswith("rsvd")}


def test_layout_offsets_are_the_specs():
    """Every field at the offset the spec's table gives (typed in from the tables, not derived)."""
    from emulator.spec import payloads_fw as F
    from emulator.spec import payloads_memdev as M

    assert (M.IDENTIFY_MEMDEV.size, _offsets(M.IDENTIFY_MEMDEV)) == (0x45, {
        "fw_revision": 0x00, "total_capacity": 0x10, "volatile_capacity": 0x18, "persistent_capacity": 0x20,
        "partition_align": 0x28, "info_event_log_size": 0x30, "warning_event_log_size": 0x32,
        "failure_event_log_size": 0x34, "fatal_event_log_size": 0x36, "lsa_size": 0x38,
        "poison_list_max_mer": 0x3C, "inject_poison_limit": 0x3F, "poison_caps": 0x41,
        "qos_telemetry_caps": 0x42, "dc_event_log_size": 0x43})
    assert (M.HEALTH_INFO.size, _offsets(M.HEALTH_INFO)) == (0x12, {
        "health_status": 0x0, "media_status": 0x1, "additional_status": 0x2, "life_used": 0x3,
        "temperature": 0x4, "dirty_shutdowns": 0x6, "corrected_volatile_errors": 0xA,
        "corrected_persistent_errors": 0xE})
    assert (M.ALERT_CONFIG.size, _offsets(M.ALERT_CONFIG)) == (0x10, {
        "valid_alerts": 0x0, "programmable_alerts": 0x1, "life_used_critical": 0x2, "life_used_warning": 0x3,
        "over_temp_critical": 0x4, "under_temp_critical": 0x6, "over_temp_warning": 0x8,
        "under_temp_warning": 0xA, "corrected_volatile_warning": 0xC, "corrected_persistent_warning": 0xE})
    assert (M.SET_ALERT_CONFIG.size, _offsets(M.SET_ALERT_CONFIG)) == (0xC, {
        "valid_actions": 0x0, "enable_actions": 0x1, "life_used_warning": 0x2, "over_temp_warning": 0x4,
        "under_temp_warning": 0x6, "corrected_volatile_warning": 0x8, "corrected_persistent_warning": 0xA})
    assert (M.PARTITION_INFO.size, _offsets(M.PARTITION_INFO)) == (0x20, {
        "active_volatile": 0x0, "active_persistent": 0x8, "next_volatile": 0x10, "next_persistent": 0x18})
    assert _offsets(M.GET_LSA) == {"offset": 0, "length": 4} and M.SET_LSA.size == 8
    assert (M.GET_LOG.size, _offsets(M.GET_LOG)) == (0x18, {"uuid": 0x0, "offset": 0x10, "length": 0x14})
    assert (M.SUPPORTED_LOG_ENTRY.size, M.SUPPORTED_LOGS.size, M.CEL_ENTRY.size) == (0x14, 0x8, 0x4)
    assert (M.SECURITY_STATE.size, M.TIMESTAMP.size, M.EVENT_INT_POLICY.size) == (4, 8, 5)
    assert (F.FW_INFO.size, _offsets(F.FW_INFO)) == (0x50, {
        "slots_supported": 0x0, "slot_info": 0x1, "activation_caps": 0x2, "revision1": 0x10,
        "revision2": 0x20, "revision3": 0x30, "revision4": 0x40})
    assert (F.TRANSFER_FW.size, _offsets(F.TRANSFER_FW)) == (0x80, {"action": 0x0, "slot": 0x1, "offset": 0x4})
    assert (F.ACTIVATE_FW.size, _offsets(F.ACTIVATE_FW)) == (0x2, {"action": 0x0, "slot": 0x1})
