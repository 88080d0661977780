"""Mailbox fuzz: random commands (table opcodes and random ones, random lengths and bytes, random
background progress between them) against a fresh firmware per example. Every answer must be a
spec return code with an output that fits the payload area, no handler may raise (Internal
Error), and the device must still answer Identify afterwards.

CI runs 100 examples x 25 commands in-process (dispatch through the registers, background jobs
stepped by the test) plus a short end-to-end run through a served device and `MemDev.send`.
More: CXLEMU_FUZZ_EXAMPLES=5000 python -m pytest tests/emulator/test_mbox_fuzz.py
"""
from __future__ import annotations

import os
import struct
import time

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mbox_support import firmware, ring

import emulator.commands  # noqa: F401  (fills COMMANDS with every group)
from emulator.fw_telemetry import PUBLISH_PERIOD_NS
from emulator.fwslots import build_image
from emulator.mailbox import COMMANDS
from emulator.spec.opcodes import Opcode
from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE
from emulator.spec.retcodes import RetCode

EXAMPLES = int(os.environ.get("CXLEMU_FUZZ_EXAMPLES", "100"))
COMMANDS_PER_EXAMPLE = 25
OPCODES = sorted(COMMANDS)
SPEC_CODES = range(0x21)  # 0x00-0x20, CXL r3.1 §8.2.8.4.5.1
CEL_UUID = bytes.fromhex("0da9c0b5bf414b788f7996b1623b3f17")
# Bytes a field of a well-formed request tends to hold: zeros, small counts, 64-B-aligned offsets.
SMALL = st.sampled_from([0, 0, 0, 0, 1, 2, 3, 4, 0x10, 0x40, 0x80, 0xFF])
IMAGE = build_image("fuzz", bytes(range(256)))
# Examples are large on purpose (25 commands, some filling the payload area), near Hypothesis's
# entropy limit: its data_too_large check would fail a run by chance, so it is suppressed.


@st.composite
def templated(draw: st.DrawFn, op: int, base: int) -> bytes:
    """Payloads shaped like real requests, so handlers get past their input checks."""
    if op == Opcode.GET_LOG:
        offset, length = 4 * draw(st.integers(0, 40)), 4 * draw(st.integers(0, 40))
        return CEL_UUID + struct.pack("<II", offset, length)
    if op == Opcode.TRANSFER_FW:
        action, slot, units = draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(0, 4))
        data = draw(st.sampled_from([IMAGE, IMAGE[:128], IMAGE[128:256], IMAGE[256:], b""]))
        return struct.pack("<BBHI", action, slot, 0, units) + bytes(0x78) + data
    if op == Opcode.SET_TIMESTAMP:  # any u64, often within 100 µs of the wrap, so it wraps mid-example
        return struct.pack("<Q", draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(2**64 - 10**5, 2**64 - 1))))
    extra = 0 if COMMANDS[op].in_len is not None else 16
    return bytes(draw(st.lists(SMALL, min_size=base, max_size=base + extra)))


@st.composite
def mailbox_command(draw: st.DrawFn) -> tuple[int, bytes, int]:
    """(opcode, payload, background slices to run afterwards)."""
    op = draw(st.one_of(st.sampled_from(OPCODES), st.sampled_from(OPCODES), st.integers(0, 0xFFFF)))
    cmd = COMMANDS.get(op)
    base = 0 if cmd is None else (cmd.in_len if cmd.in_len is not None else cmd.min_len)
    shape = draw(st.sampled_from(("template", "template", "exact", "header+data", "random", "large")))
    if shape == "template" and cmd is not None:
        payload = draw(templated(op, base))
    elif shape in ("exact", "template"):  # the right length: reaches the handler's own checks
        payload = draw(st.binary(min_size=base, max_size=base))
    elif shape == "header+data":
        payload = draw(st.binary(min_size=base, max_size=base + 300))
    elif shape == "random":
        payload = draw(st.binary(max_size=96))
    else:
        payload = draw(st.binary(min_size=MAILBOX_PAYLOAD_SIZE - 64, max_size=MAILBOX_PAYLOAD_SIZE))
    return op, payload, draw(st.integers(0, 3))


def check_answer(fw, op: int, rc: int, out: bytes) -> None:
    assert rc in SPEC_CODES, f"opcode {op:#06x} answered {rc:#x}"
    assert len(out) <= MAILBOX_PAYLOAD_SIZE
    assert fw.internal_errors == 0, f"opcode {op:#06x}: a handler raised (see the log)"


def settle(fw, max_steps: int = 64) -> None:
    """Let a background job run a while; one that paces itself by wall clock may stay running."""
    for _ in range(max_steps):
        if not fw.step_background():
            return


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(mailbox_command(), min_size=COMMANDS_PER_EXAMPLE, max_size=COMMANDS_PER_EXAMPLE))
def test_random_commands_in_process(commands):
    with firmware(capacity=256 << 20, lsa_size=4096) as fw:
        for op, payload, steps in commands:
            rc, out = ring(fw, op, payload)
            check_answer(fw, op, rc, out)
            for _ in range(steps):
                fw.step_background()
            assert fw.background_status[3] in SPEC_CODES
            fw.telemetry.publish(time.monotonic_ns())  # stamps the page with the device's clock
            assert fw.internal_errors == 0
        settle(fw)
        assert fw.background_status[3] in SPEC_CODES
        assert fw.internal_errors == 0
        assert ring(fw, Opcode.IDENTIFY, b"")[0] == RetCode.SUCCESS
        assert ring(fw, Opcode.IDENTIFY_MEMORY_DEVICE, b"")[0] == RetCode.SUCCESS


@settings(max_examples=max(5, EXAMPLES // 10), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large], database=None)
@given(commands=st.lists(mailbox_command(), min_size=20, max_size=20))
def test_random_commands_end_to_end(served, commands):
    """Through the doorbell of a device served by its runner thread (background jobs run there)."""
    from driver import MemDev

    with MemDev.open(served.name) as md:
        for op, payload, _ in commands:
            rc, out = md.send(op, payload)
            assert rc in SPEC_CODES and len(out) <= MAILBOX_PAYLOAD_SIZE
        time.sleep(2 * PUBLISH_PERIOD_NS / 1e9)  # the runner publishes the page with the clock set
        assert md.send(Opcode.IDENTIFY)[0] == RetCode.SUCCESS
        assert served.firmware.internal_errors == 0
