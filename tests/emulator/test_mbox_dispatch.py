"""The dispatcher's generic rules, checked for every opcode in the command table (all groups
imported): lengths, unsupported opcodes, Busy, Media Disabled, Internal Error; and the
acceptance line `cxlemu raw mem0 0x4000` on a 1 GiB device."""
from __future__ import annotations

import json
import struct
from collections.abc import Generator

import pytest
from mbox_support import firmware, ring, run

import emulator.commands  # noqa: F401  (fills COMMANDS with every group)
from emulator.mailbox import COMMANDS, Command, dispatch
from emulator.spec.opcodes import Opcode
from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE
from emulator.spec.retcodes import RetCode

OPCODES = sorted(COMMANDS)
FIXED = [op for op in OPCODES if COMMANDS[op].in_len is not None]
VARIABLE = [op for op in OPCODES if COMMANDS[op].in_len is None]
BACKGROUND = [op for op in OPCODES if COMMANDS[op].background]
MEDIA = [op for op in OPCODES if COMMANDS[op].needs_media]
# QEMU's cxl_process_cci_message refuses these while media is disabled (hw/cxl/cxl-mailbox-utils.c)
QEMU_MEDIA_COMMANDS = {Opcode.GET_EVENT_RECORDS, Opcode.GET_PARTITION_INFO, Opcode.SET_LSA, Opcode.GET_LSA,
                       Opcode.GET_LOG, Opcode.GET_POISON_LIST, Opcode.INJECT_POISON, Opcode.CLEAR_POISON,
                       Opcode.SANITIZE, Opcode.TRANSFER_FW, Opcode.ACTIVATE_FW}


def name(op: int) -> str:
    return f"{op:#06x}-{COMMANDS[op].name.replace(' ', '_')}"


def valid_length(op: int) -> int:
    cmd = COMMANDS[op]
    return cmd.in_len if cmd.in_len is not None else cmd.min_len


@pytest.fixture(scope="module")
def shared_fw():
    """One firmware for the module's read-only rule checks (each check is refused before any
    handler), so the hundreds of cases do not each build a device."""
    with firmware() as f:
        yield f


def forever() -> Generator[int, None, RetCode]:
    while True:
        yield 1


@pytest.mark.parametrize("op", FIXED, ids=name)
def test_fixed_length_commands_refuse_other_lengths(shared_fw, op):
    n = COMMANDS[op].in_len
    assert dispatch(shared_fw, op, bytes(n + 1)) == (RetCode.INVALID_PAYLOAD_LENGTH, b"")
    assert dispatch(shared_fw, op, bytes(n + 64)) == (RetCode.INVALID_PAYLOAD_LENGTH, b"")
    if n > 0:
        assert dispatch(shared_fw, op, bytes(n - 1)) == (RetCode.INVALID_PAYLOAD_LENGTH, b"")
        assert dispatch(shared_fw, op, b"") == (RetCode.INVALID_PAYLOAD_LENGTH, b"")


@pytest.mark.parametrize("op", VARIABLE, ids=name)
def test_variable_length_commands_refuse_less_than_their_minimum(shared_fw, op):
    n = COMMANDS[op].min_len
    assert n > 0, f"{COMMANDS[op].name}: a variable-length command needs a header"
    assert dispatch(shared_fw, op, bytes(n - 1)) == (RetCode.INVALID_PAYLOAD_LENGTH, b"")
    assert dispatch(shared_fw, op, b"") == (RetCode.INVALID_PAYLOAD_LENGTH, b"")


@pytest.mark.parametrize("op", OPCODES, ids=name)
def test_a_length_past_the_payload_area_is_refused(shared_fw, op):
    rc, out = ring(shared_fw, op, b"", length=MAILBOX_PAYLOAD_SIZE + 1)
    assert (rc, out) == (RetCode.INVALID_PAYLOAD_LENGTH, b"")


def test_every_other_opcode_is_unsupported(shared_fw):
    for op in range(0x10000):
        if op not in COMMANDS:
            assert dispatch(shared_fw, op, b"") == (RetCode.UNSUPPORTED, b"")
            assert dispatch(shared_fw, op, bytes(16)) == (RetCode.UNSUPPORTED, b"")
    assert ring(shared_fw, 0xFFFF, b"")[0] == RetCode.UNSUPPORTED


@pytest.mark.parametrize("op", BACKGROUND, ids=name)
def test_background_commands_are_busy_while_one_runs(op):
    with firmware() as fw:
        fw.start_background(Opcode.SANITIZE, forever(), abortable=True)
        assert dispatch(fw, op, bytes(valid_length(op))) == (RetCode.BUSY, b"")
        assert ring(fw, op, bytes(valid_length(op)))[0] == RetCode.BUSY
        assert fw.request_abort() == RetCode.SUCCESS  # the job ends: the command runs again
        assert dispatch(fw, op, bytes(valid_length(op)))[0] != RetCode.BUSY


def test_foreground_commands_run_during_a_background_operation():
    with firmware() as fw:
        fw.start_background(Opcode.SANITIZE, forever())
        for op in (0x0001, 0x0002, 0x4000, 0x4200, 0x0200, 0x0300, 0x0400):
            assert dispatch(fw, op, b"")[0] == RetCode.SUCCESS, hex(op)


@pytest.mark.parametrize("op", MEDIA, ids=name)
def test_media_commands_are_refused_while_media_is_disabled(op):
    with firmware() as fw:
        fw.media_disabled = True
        assert dispatch(fw, op, bytes(valid_length(op))) == (RetCode.MEDIA_DISABLED, b"")


def test_media_command_set_covers_qemus():
    assert {op for op in QEMU_MEDIA_COMMANDS if op in COMMANDS} <= set(MEDIA)


def test_other_commands_answer_while_media_is_disabled():
    with firmware() as fw:
        fw.media_disabled = True
        for op in sorted(set(OPCODES) - set(MEDIA)):
            rc, _ = run(fw, op, bytes(valid_length(op)))
            assert rc != RetCode.MEDIA_DISABLED, COMMANDS[op].name
            fw.media_disabled = True  # whatever the command did, keep the media disabled


@pytest.mark.skipif(Opcode.SANITIZE not in COMMANDS, reason="no Sanitize command in this build")
def test_media_disabled_during_a_sanitize_end_to_end():
    with firmware(capacity=256 << 20) as fw:
        assert ring(fw, Opcode.SANITIZE, b"")[0] == RetCode.BACKGROUND_COMMAND_STARTED
        refused = {op: ring(fw, op, bytes(valid_length(op)))[0] for op in MEDIA}
        # Busy comes first for background commands (rule order), Media Disabled for the rest
        assert refused == {op: RetCode.BUSY if op in BACKGROUND else RetCode.MEDIA_DISABLED for op in MEDIA}
        assert ring(fw, Opcode.GET_HEALTH_INFO, b"")[0] == RetCode.SUCCESS
        while fw.step_background():
            pass
        assert fw.background_status[3] == RetCode.SUCCESS
        assert ring(fw, Opcode.GET_LSA, struct.pack("<II", 0, 16)) == (RetCode.SUCCESS, bytes(16))


def test_a_handler_exception_is_an_internal_error_and_the_firmware_lives_on(monkeypatch):
    def broken(fw, payload):
        raise ZeroDivisionError("firmware bug")

    vendor_op = 0xC0FE
    monkeypatch.setitem(COMMANDS, vendor_op, Command(vendor_op, "Broken", broken, in_len=0))
    with firmware() as fw:
        failures = fw.events.count(2) if hasattr(fw, "events") else None
        assert ring(fw, vendor_op, b"") == (RetCode.INTERNAL_ERROR, b"")
        assert fw.internal_errors == 1
        rc, out = ring(fw, Opcode.IDENTIFY_MEMORY_DEVICE, b"")
        assert rc == RetCode.SUCCESS and struct.unpack_from("<Q", out, 0x10)[0] == 4
        if failures is not None:
            assert fw.events.count(2) == failures + 1  # logged for the host to see


def test_oversized_handler_output_is_an_internal_error(monkeypatch):
    vendor_op = 0xC0FF
    monkeypatch.setitem(COMMANDS, vendor_op, Command(
        vendor_op, "Chatty", lambda fw, p: (RetCode.SUCCESS, bytes(MAILBOX_PAYLOAD_SIZE + 1)), in_len=0))
    with firmware() as fw:
        assert dispatch(fw, vendor_op, b"") == (RetCode.INTERNAL_ERROR, b"")
        assert dispatch(fw, Opcode.IDENTIFY, b"")[0] == RetCode.SUCCESS


def test_acceptance_raw_identify_memory_device_reports_4_units_for_1_gib(device_name, capsys):
    from emulator.device import DeviceConfig, serve
    from tools.cli.main import main

    with serve(DeviceConfig(name=device_name, capacity=1 << 30)):
        assert main(["raw", device_name, "0x4000"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["retcode"] == 0
    payload = bytes.fromhex(answer["payload"])
    assert len(payload) == 0x45
    assert struct.unpack_from("<Q", payload, 0x10)[0] == 4
