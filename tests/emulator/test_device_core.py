"""The spine: register layout, mailbox protocol, dispatcher safety, device lifecycle."""
from __future__ import annotations

import struct
import threading

import pytest

from driver import DeviceGone, DeviceNotFound, MailboxTimeout, MemDev
from emulator import mailbox
from emulator.device import DeviceConfig, DeviceFiles, device_state, list_devices, serve
from emulator.firmware import Firmware
from emulator.spec import registers as R
from emulator.spec.errors import ConfigError
from emulator.spec.opcodes import Opcode
from emulator.spec.retcodes import RetCode


def test_capability_array_decoded_by_hand(memdev: MemDev) -> None:
    """§8.2.8.1/2: array register then 16-byte headers {id, version, offset, length}."""
    bar = memdev.bar
    array = struct.unpack_from("<Q", bar, 0)[0]
    assert array & 0xFFFF == 0 and (array >> 32) & 0xFFFF == 3
    headers = [struct.unpack_from("<HBxII", bar, 0x10 + 0x10 * i) for i in range(3)]
    assert [(h[0], h[2], h[3]) for h in headers] == [(0x0001, 0x80, 8), (0x0002, 0x88, 0x820), (0x4000, 0x8A8, 8)]
    assert struct.unpack_from("<I", bar, 0x88)[0] & 0x1F == 11  # 2 KiB payload
    memdev_status = struct.unpack_from("<Q", bar, 0x8A8)[0]
    assert (memdev_status >> 2) & 3 == 1 and (memdev_status >> 4) & 1 == 1  # media ready, mailbox ready


def test_identify_generic(memdev: MemDev) -> None:
    rc, out = memdev.send(Opcode.IDENTIFY)
    assert rc == RetCode.SUCCESS and len(out) == 0x12
    assert struct.unpack_from("<Q", out, 8)[0] == memdev.config.serial
    assert out[0x11] == 0x03  # component type: Type 3


def test_unknown_opcode_and_bad_length(memdev: MemDev) -> None:
    assert memdev.send(0xBEEF) == (RetCode.UNSUPPORTED, b"")
    assert memdev.send(Opcode.IDENTIFY, b"\0") == (RetCode.INVALID_PAYLOAD_LENGTH, b"")


def test_length_field_past_payload_area_is_refused(memdev: MemDev) -> None:
    """A host that writes a length larger than the payload area gets Invalid Payload Length."""
    regs = memdev.regs
    regs.set(R.MB_CMD, (R.MAILBOX_PAYLOAD_SIZE + 1) << 16 | Opcode.IDENTIFY)
    regs.set_field(R.MB_CTRL, "DOORBELL", 1)
    memdev._poll_doorbell_clear()
    assert regs.get_field(R.MB_STATUS, "RETCODE") == RetCode.INVALID_PAYLOAD_LENGTH


def test_handler_exception_is_internal_error_and_firmware_lives(memdev: MemDev, served) -> None:
    def broken(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
        raise ZeroDivisionError("firmware bug")

    mailbox.COMMANDS[0xC0FE] = mailbox.Command(0xC0FE, "broken", broken, 0)
    try:
        assert memdev.send(0xC0FE) == (RetCode.INTERNAL_ERROR, b"")
    finally:
        del mailbox.COMMANDS[0xC0FE]
    assert served.firmware.internal_errors == 1
    assert memdev.send(Opcode.IDENTIFY)[0] == RetCode.SUCCESS


def test_oversized_output_is_internal_error(memdev: MemDev) -> None:
    mailbox.COMMANDS[0xC0FF] = mailbox.Command(0xC0FF, "chatty", lambda fw, p: (RetCode.SUCCESS, bytes(4096)), 0)
    try:
        assert memdev.send(0xC0FF)[0] == RetCode.INTERNAL_ERROR
    finally:
        del mailbox.COMMANDS[0xC0FF]


def test_background_progress_abort_and_busy(memdev: MemDev, served) -> None:
    """A background job reports progress in the BG status register; abort below 85 % → Aborted."""
    gate = threading.Event()

    def job():
        for pct in range(0, 100, 10):
            while not gate.is_set():
                yield pct
            gate.clear()
        return RetCode.SUCCESS

    def start(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
        fw.start_background(0xC100, job())
        return RetCode.BACKGROUND_COMMAND_STARTED, b""

    mailbox.COMMANDS[0xC100] = mailbox.Command(0xC100, "slow", start, 0, effects=mailbox.Effect.BACKGROUND_OPERATION)
    try:
        assert memdev.send(0xC100) == (RetCode.BACKGROUND_COMMAND_STARTED, b"")
        assert memdev.send(0xC100) == (RetCode.BUSY, b"")  # one background operation at a time
        gate.set()
        while memdev.background_status().percent < 10:
            pass
        st = memdev.background_status()
        assert st.running and st.opcode == 0xC100
        memdev.abort_background()
        assert memdev.wait_background() == RetCode.ABORTED
        assert not memdev.background_status().running
    finally:
        del mailbox.COMMANDS[0xC100]


def test_threads_share_one_mailbox(memdev: MemDev) -> None:
    """Many host threads on one mailbox: each answer belongs to its own question."""
    errors: list[object] = []

    def worker(op: int, expect: RetCode) -> None:
        for _ in range(50):
            rc, _ = memdev.send(op)
            if rc != expect:
                errors.append((op, rc))

    threads = [threading.Thread(target=worker, args=(op, rc)) for op, rc in
               [(Opcode.IDENTIFY, RetCode.SUCCESS), (0xBEEF, RetCode.UNSUPPORTED)] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_device_lifecycle(device_name: str) -> None:
    with serve(DeviceConfig(name=device_name, capacity=256 << 20), keep=True):
        assert device_name in list_devices() and device_state(device_name) == "served"
    assert device_state(device_name) == "stopped"
    with pytest.raises(DeviceGone, match="no firmware serves it"):
        MemDev.open(device_name, ready_timeout_s=0.05)
    DeviceFiles.open(device_name).destroy()
    with pytest.raises(DeviceNotFound, match=device_name):
        MemDev.open(device_name)


def test_firmware_stopping_mid_use_is_reported(device_name: str) -> None:
    s = serve(DeviceConfig(name=device_name, capacity=256 << 20))
    served = s.__enter__()
    md = MemDev.open(device_name, timeout_s=0.2)
    served.runner.stop()
    served._thread.join()
    (served.files.path / "firmware.pid").unlink()
    with pytest.raises((DeviceGone, MailboxTimeout)):
        md.send(Opcode.IDENTIFY)
    md.close()
    s.__exit__(None, None, None)


@pytest.mark.parametrize("kw, message", [
    ({"name": "bad name"}, "device name"),
    ({"name": "x", "capacity": 100 << 20}, "multiple of 256 MiB"),
    ({"name": "x", "lsa_size": 3}, "lsa_size"),
    ({"name": "x", "fw_revision": "r" * 17}, "longer than 16"),
])
def test_bad_config_says_what_to_change(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeviceConfig(**kw)


def test_poisoned_bitmap_fails_untimed_read(memdev: MemDev) -> None:
    memdev.write_untimed(0x1000, b"\xAA" * 256)
    assert memdev.read_untimed(0x1000, 4) == b"\xAA" * 4
    memdev.files.poison[(0x1080 // 64) >> 3] |= 1 << ((0x1080 // 64) & 7)  # what Inject Poison does
    from driver import PoisonError

    with pytest.raises(PoisonError) as info:
        memdev.read_untimed(0x1000, 256)
    assert info.value.dpa == 0x1080
    assert memdev.read_untimed(0x1000, 0x80) == b"\xAA" * 0x80


def test_a_read_past_the_media_is_refused_before_its_buffer_is_made(memdev: MemDev) -> None:
    """A 1 TiB read of a small device: the range error, not a MemoryError from allocating."""
    cap = memdev.config.capacity
    for read in (memdev.read, memdev.read_untimed):
        with pytest.raises(ValueError, match=f"read of {1 << 40} B at DPA 0x40 runs past the end"):
            read(0x40, 1 << 40)
        with pytest.raises(ValueError, match="DPA must be an int >= 0"):
            read(-64, 8)
        with pytest.raises(ValueError, match="size must be an int >= 0"):
            read(0, -1)
        assert read(cap - 8, 8) == bytes(8)


def test_command_groups_state_is_named_fields_of_the_firmware(served) -> None:
    """Each command group's state is a field Firmware.__init__ builds (no attach hooks)."""
    from emulator.commands.event_policy import EventInterruptPolicy
    from emulator.commands.scan import ScanState
    from emulator.events import EventLogs
    from emulator.fwslots import FwSlots
    from emulator.health import HealthState
    from emulator.poison import PoisonList

    fw = served.firmware
    fields = {"fwslots": FwSlots, "health": HealthState, "event_policy": EventInterruptPolicy,
              "events": EventLogs, "poison": PoisonList, "scan_media": ScanState}
    assert {name: type(getattr(fw, name)) for name in fields} == fields
    assert fw.events.firmware_error in fw.error_hooks
