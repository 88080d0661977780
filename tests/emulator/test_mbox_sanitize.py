"""Sanitize: media disabled while it runs (every media command refused), progress in slices, and
afterwards media, LSA, poison and events all gone, media enabled again. Secure Erase (4401h): the
same job shape, but user data only: media and poison go, the LSA and the event logs stay."""
from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import emulator.commands.sanitize as sanitize_mod
from emulator.firmware import Firmware
from emulator.mailbox import COMMANDS, dispatch
from emulator.spec import registers as R
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import EventLog
from emulator.spec.retcodes import RetCode

CAPACITY = 256 << 20




def well_formed(opcode: int) -> bytes:
    """A payload of the length the table asks for (the handler may still refuse its content)."""
    cmd = COMMANDS[opcode]
    return bytes(cmd.in_len if cmd.in_len is not None else cmd.min_len)


def dirty(fw: Firmware) -> None:
    fw.media[:4096] = 0xA5
    fw.media[CAPACITY - 64:] = 0x5A
    fw.media[100 << 20:(100 << 20) + 64] = 1
    fw.lsa[:] = 0xEE
    dispatch(fw, Opcode.INJECT_POISON, struct.pack("<Q", 0x2000))
    fw.poison.add_latent(CAPACITY - 128, 64)
    fw.events.general_media(EventLog.FAILURE, 0x2000)
    fw.events.memory_module(EventLog.INFO, 0)
    assert dispatch(fw, Opcode.SCAN_MEDIA, struct.pack("<QQB", 0x2000, 1, 1))[0] == RetCode.BACKGROUND_COMMAND_STARTED
    while fw.step_background():
        pass


def dirty_through_the_driver(md: Any, served: Any) -> None:
    """What a host leaves on a served device: data at both ends, an LSA, a poisoned line, a warning."""
    md.write(0, b"\x77" * 8192)
    md.write(CAPACITY - 4096, b"\x66" * 4096)
    assert md.send(Opcode.SET_LSA, struct.pack("<II", 0, 0) + b"\x99" * 512)[0] == RetCode.SUCCESS
    md.inject_poison(0x1000)
    served.firmware.events.general_media(EventLog.WARNING, 0x1000)


def test_progress_in_slices_and_everything_erased(fw: Firmware) -> None:
    dirty(fw)
    assert dispatch(fw, Opcode.SANITIZE, b"") == (RetCode.BACKGROUND_COMMAND_STARTED, b"")
    assert fw.media_disabled and fw.regs.get_field(R.MEMDEV_STATUS, "MEDIA_STATUS") == R.MEDIA_DISABLED
    percents = []
    while fw.step_background():
        percents.append(fw.background_status[1])
    # 256 MiB in 32 MiB slices; the register holds 99 until the job returns, then 100
    assert percents == [12, 25, 37, 50, 62, 75, 87, 99, 100]
    assert fw.background_status == (False, 100, Opcode.SANITIZE, RetCode.SUCCESS)
    assert not fw.media_disabled
    assert np.count_nonzero(fw.media) == 0 and np.count_nonzero(fw.lsa) == 0
    assert np.count_nonzero(fw.poison_bits) == 0 and fw.poison.records == []
    assert fw.events.counts() == (0, 0, 0, 0, 0)
    assert fw.regs.get_field(R.DEVICE_STATUS, "EVENT_STATUS") == 0
    assert dispatch(fw, Opcode.GET_SCAN_MEDIA_RESULTS, b"") == (RetCode.UNSUPPORTED, b"")  # results gone too


def test_every_media_command_is_refused_while_it_runs(fw: Firmware) -> None:
    assert dispatch(fw, Opcode.SANITIZE, b"")[0] == RetCode.BACKGROUND_COMMAND_STARTED
    fw.step_background()
    media = [op for op, cmd in COMMANDS.items() if cmd.needs_media]
    assert {Opcode.GET_EVENT_RECORDS, Opcode.GET_POISON_LIST, Opcode.INJECT_POISON, Opcode.CLEAR_POISON,
            Opcode.GET_SCAN_MEDIA_CAPABILITIES, Opcode.SCAN_MEDIA, Opcode.GET_SCAN_MEDIA_RESULTS,
            Opcode.SANITIZE} <= set(media)
    for op in media:
        # a background command meets the Busy rule first (§8.2.8.4; QEMU checks in that order)
        want = RetCode.BUSY if COMMANDS[op].background else RetCode.MEDIA_DISABLED
        assert dispatch(fw, op, well_formed(op)) == (want, b""), hex(op)
    assert dispatch(fw, Opcode.IDENTIFY, b"")[0] == RetCode.SUCCESS  # not a media command
    clear_none = struct.pack("<BBB3x", EventLog.INFO, 0, 0)
    assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, clear_none) == (RetCode.SUCCESS, b"")
    while fw.step_background():
        pass
    assert dispatch(fw, Opcode.GET_POISON_LIST, struct.pack("<QQ", 0, 1))[0] == RetCode.SUCCESS


def test_sanitize_cannot_be_aborted(fw: Firmware) -> None:
    assert dispatch(fw, Opcode.SANITIZE, b"")[0] == RetCode.BACKGROUND_COMMAND_STARTED
    fw.step_background()
    assert dispatch(fw, Opcode.REQUEST_BACKGROUND_ABORT, b"") == (RetCode.REQUEST_ABORT_NOT_SUPPORTED, b"")
    assert fw.background_running and fw.media_disabled
    while fw.step_background():
        pass
    assert fw.background_status[3] == RetCode.SUCCESS and not fw.media_disabled


def test_sanitize_end_to_end_through_the_driver(served: Any, memdev: Any) -> None:
    """A host that maps the media itself sees zeros afterwards; poisoned lines read again."""
    md = memdev
    dirty_through_the_driver(md, served)
    seen: list[int] = []
    md.sanitize(progress=seen.append)
    assert seen[-1] == 100 and seen == sorted(seen)
    assert np.count_nonzero(md.media) == 0
    assert md.read(0x1000, 64) == bytes(64)  # no longer poisoned
    rc, lsa = md.send(Opcode.GET_LSA, struct.pack("<II", 0, 512))
    assert rc == RetCode.SUCCESS and lsa == bytes(512)
    assert md.get_poison_list().records == [] and md.get_event_records("warning").records == []
    assert md.media_status == R.MEDIA_READY


# Secure Erase (§8.2.9.9.5.2) ------------------------------------------------------------------
def test_secure_erase_zeroes_media_and_poison_and_keeps_lsa_and_events(fw: Firmware) -> None:
    dirty(fw)
    events_before = fw.events.counts()
    assert sum(events_before) >= 2
    assert dispatch(fw, Opcode.SECURE_ERASE, b"") == (RetCode.BACKGROUND_COMMAND_STARTED, b"")
    assert fw.media_disabled
    percents = []
    while fw.step_background():
        percents.append(fw.background_status[1])
    assert percents == [12, 25, 37, 50, 62, 75, 87, 99, 100]  # 32 MiB slices, not paced
    assert fw.background_status == (False, 100, Opcode.SECURE_ERASE, RetCode.SUCCESS)
    assert not fw.media_disabled
    assert np.count_nonzero(fw.media) == 0
    assert np.count_nonzero(fw.poison_bits) == 0 and fw.poison.records == []
    assert fw.lsa.tobytes() == b"\xee" * 4096  # the LSA is not user data: kept
    assert fw.events.counts() == events_before  # event logs kept
    assert dispatch(fw, Opcode.GET_SCAN_MEDIA_RESULTS, b"") == (RetCode.UNSUPPORTED, b"")  # scan results gone


def test_secure_erase_is_refused_by_the_generic_rules_as_sanitize_is(fw: Firmware) -> None:
    assert dispatch(fw, Opcode.SECURE_ERASE, b"\0") == (RetCode.INVALID_PAYLOAD_LENGTH, b"")  # no input
    assert dispatch(fw, Opcode.SANITIZE, b"")[0] == RetCode.BACKGROUND_COMMAND_STARTED
    assert dispatch(fw, Opcode.SECURE_ERASE, b"") == (RetCode.BUSY, b"")  # another background op runs
    while fw.step_background():
        pass
    fw.media_disabled = True  # media disabled with no background operation running
    assert dispatch(fw, Opcode.SECURE_ERASE, b"") == (RetCode.MEDIA_DISABLED, b"")
    fw.media_disabled = False
    assert dispatch(fw, Opcode.SECURE_ERASE, b"")[0] == RetCode.BACKGROUND_COMMAND_STARTED
    fw.step_background()
    assert dispatch(fw, Opcode.GET_POISON_LIST, struct.pack("<QQ", 0, 1)) == (RetCode.MEDIA_DISABLED, b"")
    assert dispatch(fw, Opcode.GET_LSA, struct.pack("<II", 0, 64)) == (RetCode.MEDIA_DISABLED, b"")
    assert dispatch(fw, Opcode.SANITIZE, b"") == (RetCode.BUSY, b"")
    assert dispatch(fw, Opcode.REQUEST_BACKGROUND_ABORT, b"") == (RetCode.REQUEST_ABORT_NOT_SUPPORTED, b"")
    while fw.step_background():
        pass
    assert fw.background_status[2:] == (Opcode.SECURE_ERASE, RetCode.SUCCESS) and not fw.media_disabled


@pytest.fixture
def held_erase(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every Secure Erase job at 0 % until the event is set, so a test can look at the device
    while the erase runs (the job keeps yielding: the firmware still serves the mailbox)."""
    gate = threading.Event()
    zero_media = sanitize_mod._zero_media

    def held(fw: Firmware, cost_ns: Any) -> Any:
        while not gate.is_set():
            yield 0
        return (yield from zero_media(fw, cost_ns))

    monkeypatch.setattr(sanitize_mod, "_zero_media", held)
    yield gate
    gate.set()


def test_secure_erase_through_the_mailbox_of_a_served_device(served: Any, memdev: Any,
                                                            held_erase: threading.Event) -> None:
    md = memdev
    dirty_through_the_driver(md, served)
    warnings = md.get_event_records("warning").records
    assert len(warnings) >= 1

    assert md.send(Opcode.SECURE_ERASE) == (RetCode.BACKGROUND_COMMAND_STARTED, b"")
    assert md.media_status == R.MEDIA_DISABLED
    assert md.send(Opcode.GET_POISON_LIST, struct.pack("<QQ", 0, 1)) == (RetCode.MEDIA_DISABLED, b"")
    assert md.send(Opcode.GET_EVENT_RECORDS, bytes([EventLog.WARNING])) == (RetCode.MEDIA_DISABLED, b"")
    assert md.send(Opcode.SANITIZE) == (RetCode.BUSY, b"")
    held_erase.set()
    assert md.wait_background() == RetCode.SUCCESS

    assert md.media_status == R.MEDIA_READY
    assert np.count_nonzero(md.media) == 0
    assert md.read(0x1000, 64) == bytes(64)  # no longer poisoned
    assert md.get_poison_list().records == []
    rc, lsa = md.send(Opcode.GET_LSA, struct.pack("<II", 0, 512))
    assert rc == RetCode.SUCCESS and lsa == b"\x99" * 512  # kept
    assert md.get_event_records("warning").records == warnings  # kept


def test_secure_erase_driver_wrapper_and_command_effects_log(memdev: Any) -> None:
    md = memdev
    md.write(4096, b"\x55" * 4096)
    seen: list[int] = []
    md.secure_erase(progress=seen.append)
    assert seen[-1] == 100 and seen == sorted(seen)
    assert md.read(4096, 4096) == bytes(4096)
    cel = {e.opcode: e.effects for e in md.command_effects_log()}
    # Immediate Data Change (bit 2) | Security State Change (bit 5) | Background Operation (bit 6)
    assert cel[Opcode.SECURE_ERASE] == 0x64 == cel[Opcode.SANITIZE]


class _FakeTime:
    """A clock that moves only when the job naps: its slices are then exact."""

    def __init__(self) -> None:
        self.now = 0

    def monotonic_ns(self) -> int:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += round(s * 1e9)


def test_sanitize_is_paced_on_the_link_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000,000 B at 1 GB/s, 100 ns latency: slices of what the link has written by each nap
    (0.5 ms: 499,840 B, whole 64-B transactions) and the last byte exactly when a write of the
    whole on the idle link completes, 2,000,100 ns."""
    from emulator.commands import scan as scan_mod
    from firmware_model.link import WRITE, Link, LinkParams

    clock = _FakeTime()
    monkeypatch.setattr(scan_mod, "time", clock)
    link = LinkParams(lat_ns=(0, 100), fs_per_byte=(0, 1_000_000))
    cost = functools.partial(sanitize_mod.sanitize_ns, link)
    slices = list(scan_mod.paced_slices(2_000_000, cost, 1 << 30))
    ends = [499_840 * i for i in range(5)] + [2_000_000]
    assert slices == list(zip(ends, ends[1:]))
    assert clock.now == Link(link).transfer(WRITE, 0, 2_000_000) == 2_000_100
