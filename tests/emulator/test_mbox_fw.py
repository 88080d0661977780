"""Firmware update: Get FW Info at the spec's offsets, Transfer FW (full, parts, order, abort,
slots, limits), Activate FW (online, on reset), and the driver's update path."""
from __future__ import annotations

import struct

import pytest
from mbox_support import run

from emulator import fwslots
from emulator.fwslots import build_image
from emulator.mailbox import dispatch
from emulator.spec.opcodes import Opcode
from emulator.spec.retcodes import RetCode

TRANSFER, ACTIVATE, FW_INFO = 0x0201, 0x0202, 0x0200
FULL, INIT, CONTINUE, END, ABORT = 0, 1, 2, 3, 4


def part(action: int, slot: int, offset_units: int, data: bytes = b"") -> bytes:
    """Transfer FW input built by hand: action @0, slot @1, offset (128-B units) @4, data @0x80."""
    return struct.pack("<BBHI", action, slot, 0, offset_units) + bytes(0x78) + data


def info(fw) -> tuple[int, int, int, list[bytes]]:
    rc, out = dispatch(fw, FW_INFO, b"")
    assert rc == RetCode.SUCCESS and len(out) == 0x50
    return out[0], out[1], out[2], [out[0x10 + 16 * i:0x20 + 16 * i] for i in range(4)]


pytestmark = pytest.mark.firmware(capacity=1 << 30, fw_revision="boot-1.0")


def rev(text: str) -> bytes:
    return text.encode().ljust(16, b"\0")


def test_fw_info_at_boot(fw):
    slots, slot_info, caps, revs = info(fw)
    assert (slots, slot_info & 7, slot_info >> 3 & 7, caps & 1) == (2, 1, 0, 1)
    assert revs == [rev("boot-1.0"), bytes(16), bytes(16), bytes(16)]


def test_full_transfer_then_online_activation(fw):
    image = build_image("new-2.0", b"\x5A" * 1000)
    assert run(fw, TRANSFER, part(FULL, 2, 0, image)) == (RetCode.SUCCESS, b"")
    assert info(fw)[3][:2] == [rev("boot-1.0"), rev("new-2.0")]
    assert info(fw)[1] == 1  # still running slot 1
    assert run(fw, ACTIVATE, bytes([0, 2]))[0] == RetCode.SUCCESS
    assert info(fw)[1] == 2
    assert dispatch(fw, 0x4000, b"")[1][:16] == rev("new-2.0")
    # now slot 1 is the one that may be written, slot 2 (active) may not
    assert run(fw, TRANSFER, part(FULL, 2, 0, image))[0] == RetCode.FW_INVALID_SLOT
    assert run(fw, TRANSFER, part(FULL, 1, 0, build_image("new-3.0")))[0] == RetCode.SUCCESS


def test_multi_part_transfer_in_order(fw):
    image = build_image("parts-1", bytes(range(256)) * 10)  # 64 + 2560 bytes
    pieces = [image[i:i + 1024] for i in range(0, len(image), 1024)]
    assert run(fw, TRANSFER, part(INIT, 0, 0, pieces[0]))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(CONTINUE, 0, 8, pieces[1]))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(CONTINUE, 0, 8, pieces[1]))[0] == RetCode.SUCCESS  # resent back to back
    assert run(fw, TRANSFER, part(END, 2, 16, pieces[2]))[0] == RetCode.SUCCESS
    assert info(fw)[3][1] == rev("parts-1")
    assert fw.fwslots.images[1] == image
    assert fw.fwslots.transfer is None


def test_out_of_order_parts_are_refused(fw):
    image = build_image("ooo", bytes(4000))
    assert run(fw, TRANSFER, part(INIT, 0, 0, image[:1024]))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(CONTINUE, 0, 16, image[2048:3072]))[0] == RetCode.FW_TRANSFER_OUT_OF_ORDER  # gap
    assert run(fw, TRANSFER, part(CONTINUE, 0, 4, image[512:1536]))[0] == RetCode.FW_TRANSFER_OUT_OF_ORDER  # overlap
    assert run(fw, TRANSFER, part(END, 2, 0, image))[0] == RetCode.FW_TRANSFER_OUT_OF_ORDER  # restart at 0
    # the refused parts changed nothing: the next part in order still completes the package
    assert run(fw, TRANSFER, part(CONTINUE, 0, 8, image[1024:3072]))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(END, 2, 24, image[3072:]))[0] == RetCode.SUCCESS
    assert fw.fwslots.images[1] == image


def test_open_transfer_blocks_new_transfers_and_activation(fw):
    assert run(fw, TRANSFER, part(FULL, 2, 0, build_image("staged")))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(INIT, 0, 0, bytes(256)))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(INIT, 0, 0, bytes(256)))[0] == RetCode.FW_TRANSFER_IN_PROGRESS
    assert run(fw, TRANSFER, part(FULL, 2, 0, build_image("x")))[0] == RetCode.FW_TRANSFER_IN_PROGRESS
    assert run(fw, ACTIVATE, bytes([0, 2]))[0] == RetCode.FW_TRANSFER_IN_PROGRESS


def test_abort_ends_the_transfer(fw):
    image = build_image("abort-me", bytes(3000))
    assert run(fw, TRANSFER, part(INIT, 0, 0, image[:1024]))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(ABORT, 0, 0)) == (RetCode.SUCCESS, b"")
    assert run(fw, TRANSFER, part(CONTINUE, 0, 8, image[1024:2048]))[0] == RetCode.INVALID_INPUT  # no Init
    assert run(fw, TRANSFER, part(END, 2, 8, image[1024:]))[0] == RetCode.INVALID_INPUT
    assert info(fw)[3][1] == bytes(16)
    assert run(fw, TRANSFER, part(ABORT, 0, 0))[0] == RetCode.SUCCESS  # nothing open: still fine
    assert run(fw, TRANSFER, part(INIT, 0, 0, image[:1024]))[0] == RetCode.SUCCESS  # a new one may start


def test_slot_validation(fw):
    image = build_image("slots")
    for slot in (0, 1, 3, 255):  # reserved, active, past the two slots
        assert run(fw, TRANSFER, part(FULL, slot, 0, image))[0] == RetCode.FW_INVALID_SLOT
    assert fw.fwslots.revisions == ["boot-1.0", None]


def test_end_into_active_slot_is_refused(fw):
    image = build_image("slot-end")
    assert run(fw, TRANSFER, part(INIT, 0, 0, image[:32]))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(END, 1, 0, image[:32]))[0] == RetCode.FW_INVALID_SLOT
    assert run(fw, TRANSFER, part(END, 3, 0, image[:32]))[0] == RetCode.FW_INVALID_SLOT
    assert fw.fwslots.transfer is not None  # a refused End leaves the transfer open


def test_activation_validation(fw):
    assert run(fw, ACTIVATE, bytes([0, 2]))[0] == RetCode.FW_INVALID_SLOT  # empty slot
    assert run(fw, ACTIVATE, bytes([0, 1]))[0] == RetCode.FW_INVALID_SLOT  # already active
    assert run(fw, ACTIVATE, bytes([0, 0]))[0] == RetCode.FW_INVALID_SLOT
    assert run(fw, ACTIVATE, bytes([0, 3]))[0] == RetCode.FW_INVALID_SLOT
    assert run(fw, TRANSFER, part(FULL, 2, 0, build_image("ok")))[0] == RetCode.SUCCESS
    assert run(fw, ACTIVATE, bytes([2, 2]))[0] == RetCode.INVALID_INPUT  # unknown action


def test_activation_on_next_reset_stages_the_slot(fw):
    assert run(fw, TRANSFER, part(FULL, 2, 0, build_image("later")))[0] == RetCode.SUCCESS
    assert dispatch(fw, ACTIVATE, bytes([1, 2])) == (RetCode.SUCCESS, b"")  # no background work
    _, slot_info, _, _ = info(fw)
    assert (slot_info & 7, slot_info >> 3 & 7) == (1, 2)
    assert dispatch(fw, 0x4000, b"")[1][:16] == rev("boot-1.0")
    fw.fwslots.cold_reset()
    assert info(fw)[1] == 2
    assert dispatch(fw, 0x4000, b"")[1][:16] == rev("later")


def test_bad_packages_fail_authentication(fw):
    good = build_image("auth", bytes(500))
    corrupt = good[:100] + b"\xFF" + good[101:]
    for bad in (corrupt, b"not a package at all", good[:-1], b"XXXXXXXX" + good[8:]):
        assert run(fw, TRANSFER, part(FULL, 2, 0, bad))[0] == RetCode.FW_AUTHENTICATION_FAILED
    assert info(fw)[3][1] == bytes(16)
    # a multi-part package that fails at End closes the transfer
    assert run(fw, TRANSFER, part(INIT, 0, 0, corrupt[:256]))[0] == RetCode.SUCCESS
    assert run(fw, TRANSFER, part(END, 2, 2, corrupt[256:]))[0] == RetCode.FW_AUTHENTICATION_FAILED
    assert fw.fwslots.transfer is None


def test_package_size_limit(fw):
    assert run(fw, TRANSFER, part(INIT, 0, 0, bytes(128)))[0] == RetCode.SUCCESS
    last_unit = (32 << 20) // 128 - 1  # a 129-byte part here would end past 32 MiB
    assert run(fw, TRANSFER, part(CONTINUE, 0, last_unit, bytes(129)))[0] == RetCode.INVALID_INPUT
    assert run(fw, TRANSFER, part(INIT, 1, 1, bytes(1)))[0] == RetCode.FW_TRANSFER_IN_PROGRESS


def test_init_must_start_at_offset_zero(fw):
    assert run(fw, TRANSFER, part(INIT, 0, 1, bytes(128)))[0] == RetCode.INVALID_INPUT
    assert run(fw, TRANSFER, part(7, 2, 0, bytes(128)))[0] == RetCode.INVALID_INPUT  # unknown action


def test_parts_more_than_30_s_apart_abandon_the_transfer(fw):
    now = [0]
    fw.fwslots.clock = lambda: now[0]
    assert run(fw, TRANSFER, part(INIT, 0, 0, bytes(128)))[0] == RetCode.SUCCESS
    now[0] = 29 * 10**9
    assert run(fw, TRANSFER, part(CONTINUE, 0, 1, bytes(128)))[0] == RetCode.SUCCESS
    now[0] = 29 * 10**9 + 30 * 10**9 + 1
    assert run(fw, TRANSFER, part(CONTINUE, 0, 2, bytes(128)))[0] == RetCode.INVALID_INPUT
    assert fw.fwslots.transfer is None
    assert run(fw, TRANSFER, part(INIT, 0, 0, bytes(128)))[0] == RetCode.SUCCESS  # a new one may start


def test_transfer_is_a_background_command_with_progress(fw, monkeypatch):
    monkeypatch.setattr(fwslots, "CRC_SLICE", 256)  # authenticate 4 KiB in 16 slices
    image = build_image("bg", bytes(range(256)) * 16)
    assert run(fw, TRANSFER, part(INIT, 0, 0, image[:1024]))[0] == RetCode.SUCCESS
    rc, _ = dispatch(fw, TRANSFER, part(END, 2, 8, image[1024:]))
    assert rc == RetCode.BACKGROUND_COMMAND_STARTED
    assert fw.background_status[:3] == (True, 0, TRANSFER)
    percents = []
    while fw.background_running:
        assert dispatch(fw, ACTIVATE, bytes([0, 2]))[0] == RetCode.BUSY  # one background op at a time
        assert dispatch(fw, FW_INFO, b"")[0] == RetCode.SUCCESS  # others still answer
        fw.step_background()
        percents.append(fw.background_status[1])
    assert percents == sorted(percents) and percents[-1] == 100 and len(percents) > 10
    assert fw.background_status == (False, 100, TRANSFER, RetCode.SUCCESS)


def test_request_abort_during_end_abandons_the_transfer(fw, monkeypatch):
    monkeypatch.setattr(fwslots, "CRC_SLICE", 256)
    image = build_image("aborted", bytes(4096))
    assert run(fw, TRANSFER, part(INIT, 0, 0, image[:1024]))[0] == RetCode.SUCCESS
    assert dispatch(fw, TRANSFER, part(END, 2, 8, image[1024:]))[0] == RetCode.BACKGROUND_COMMAND_STARTED
    for _ in range(3):
        fw.step_background()
    assert dispatch(fw, Opcode.REQUEST_BACKGROUND_ABORT, b"") == (RetCode.SUCCESS, b"")
    running, _, opcode, retcode = fw.background_status
    assert (running, opcode, retcode) == (False, TRANSFER, RetCode.ABORTED)
    assert fw.fwslots.transfer is None and info(fw)[3][1] == bytes(16)
    assert run(fw, TRANSFER, part(CONTINUE, 0, 8, image[1024:2048]))[0] == RetCode.INVALID_INPUT


def test_driver_update_and_activate(memdev):
    image = build_image("drv-9.9", bytes(range(256)) * 40)  # 10304 bytes: Init, 4 Continue, End
    sent = []
    memdev.update_firmware(image, 2, progress=lambda done, total: sent.append((done, total)))
    assert sent[-1] == (len(image), len(image)) and len(sent) == 6
    fi = memdev.fw_info()
    assert (fi.slots_supported, fi.active_slot, fi.staged_slot, fi.online_activation) == (2, 1, 0, True)
    assert fi.revisions == (memdev.config.fw_revision, "drv-9.9")
    memdev.activate_firmware(2)
    assert memdev.fw_info().active_slot == 2
    assert memdev.identify_memdev().fw_revision == "drv-9.9"
    small = build_image("drv-small")
    memdev.update_firmware(small, 1)  # fits one payload: a Full transfer
    memdev.activate_firmware(1, online=False)
    assert memdev.fw_info().staged_slot == 1


def test_driver_update_failure_aborts_and_raises(memdev):
    from driver import MailboxError

    image = build_image("bad-slot", bytes(5000))
    with pytest.raises(MailboxError) as err:
        memdev.update_firmware(image, 1)  # slot 1 is active: End is refused
    assert err.value.retcode == RetCode.FW_INVALID_SLOT
    memdev.update_firmware(image, 2)  # the failed transfer was aborted: a new one starts cleanly


def test_switching_back_to_the_boot_slot(fw):
    """Slot 1 holds the package the device booted, so a host can roll back to it."""
    assert run(fw, TRANSFER, part(FULL, 2, 0, build_image("new")))[0] == RetCode.SUCCESS
    assert run(fw, ACTIVATE, bytes([0, 2]))[0] == RetCode.SUCCESS
    assert run(fw, ACTIVATE, bytes([0, 1]))[0] == RetCode.SUCCESS
    assert info(fw)[1] == 1
    assert dispatch(fw, 0x4000, b"")[1][:16] == rev("boot-1.0")
