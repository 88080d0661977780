"""Poison list against a reference model: random inject / clear / internal errors / latent errors
through the real handlers, with a small list limit so overflow and split-on-clear happen often."""
from __future__ import annotations

import itertools
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulator.firmware import Firmware
from emulator.mailbox import dispatch
from emulator.poison import PoisonList
from emulator.spec.opcodes import Opcode
from emulator.spec.retcodes import RetCode

LINES = 32   # operations stay in the first 32 lines (2 KiB): collisions are common
LIMIT = 3    # small, so overflow and split-on-clear with a full list happen often




ops = st.lists(st.one_of(
    st.tuples(st.just("inject"), st.integers(0, LINES - 1)),
    st.tuples(st.just("clear"), st.integers(0, LINES - 1)),
    st.tuples(st.just("add"), st.integers(0, LINES - 1), st.integers(1, 8)),
    st.tuples(st.just("latent"), st.integers(0, LINES - 1), st.integers(1, 8)),
), max_size=40)


def listed_lines(pl: PoisonList) -> set[int]:
    return {line for r in pl.records for line in range(r.dpa // 64, r.end // 64)}


def gaps(lines: range, listed: set[int]) -> list[list[int]]:
    """Maximal runs of unlisted lines in `lines`: the records an internal error adds, in order."""
    runs: list[list[int]] = []
    for line in lines:
        if line in listed:
            continue
        if runs and runs[-1][-1] == line - 1:
            runs[-1].append(line)
        else:
            runs.append([line])
    return runs


def expect_clear(fw: Firmware, line: int, listed: set[int]) -> tuple[set[int], bool]:
    """Listed lines after clearing `line`, and whether the list must overflow (a tail with no room)."""
    records = fw.poison.records
    hit = [r for r in records if r.dpa <= line * 64 < r.end]
    if not hit:
        return listed, False
    r = hit[0]
    head = set(range(r.dpa // 64, line))
    tail = set(range(line + 1, r.end // 64))
    fits = len(records) - 1 + bool(head) < LIMIT
    after = (listed - set(range(r.dpa // 64, r.end // 64))) | head | (tail if fits else set())
    return after, bool(tail) and not fits


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_list_and_bitmap_follow_the_model(fw: Firmware, script: list[tuple]) -> None:
    fw.poison = PoisonList(fw, limit=LIMIT)  # a fresh list per example (the fixture is per test)
    fw.poison_bits[:] = 0
    bad: set[int] = set()       # lines that fail reads
    listed: set[int] = set()    # lines the list reports
    overflowed = False
    for op in script:
        kind, line = op[0], op[1]
        if kind == "inject":
            room = len(fw.poison) < LIMIT
            rc = dispatch(fw, Opcode.INJECT_POISON, struct.pack("<Q", line * 64))[0]
            if line in listed or room:
                assert rc == RetCode.SUCCESS
                bad.add(line)
                listed.add(line)
            else:
                assert rc == RetCode.INJECT_POISON_LIMIT_REACHED
        elif kind == "clear":
            listed, overflows = expect_clear(fw, line, listed)
            overflowed |= overflows
            assert dispatch(fw, Opcode.CLEAR_POISON, struct.pack("<Q", line * 64) + bytes(64))[0] == RetCode.SUCCESS
            bad.discard(line)
        else:
            span = range(line, min(line + op[2], LINES))
            if kind == "add":
                pieces = gaps(span, listed)
                room = LIMIT - len(fw.poison)
                for piece in pieces[:room]:
                    listed |= set(piece)
                overflowed |= len(pieces) > room
                assert fw.poison.add(line * 64, len(span) * 64, transaction=None) == (len(pieces) <= room)
            else:
                fw.poison.add_latent(line * 64, len(span) * 64)
            bad |= set(span)
        records = fw.poison.records
        assert all(a.end <= b.dpa for a, b in itertools.pairwise(records))  # sorted, disjoint
        assert len(records) <= LIMIT
        assert listed_lines(fw.poison) == listed and listed <= bad
        assert fw.poison.overflowed == overflowed
        bits = np.unpackbits(fw.poison_bits[:LINES // 8], bitorder="little")
        assert set(np.flatnonzero(bits).tolist()) == bad  # the bitmap holds exactly the bad lines
        assert not fw.poison_bits[LINES // 8:].any()
