"""Clocks: one protocol, integer ns; the simpy clock is simpy's time in whole ns; the manual
clock only moves forward, by integers; and no other clock exists in the tree."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import simpy

from firmware_model.clock import Clock, ManualClock, SimpyClock
from firmware_model.hotness import HotnessConfig, HotnessUnit


def test_sim_clock_reads_simpy_time() -> None:
    clock = SimpyClock()
    assert isinstance(clock, Clock) and clock.now_ns() == 0

    def proc():
        yield clock.env.timeout(250)

    clock.env.process(proc())
    clock.run()
    assert clock.env.now == 250 and clock.now_ns() == 250
    clock.run(until=1000)
    assert clock.now_ns() == 1000


def test_sim_clock_reads_whole_ns_of_a_fractional_simpy_time() -> None:
    """A deadline of t ns has passed when t <= now_ns(), exactly as when t <= env.now."""
    clock = SimpyClock()
    clock.run(until=250.75)
    assert clock.now_ns() == 250 and type(clock.now_ns()) is int


def test_manual_clock_counts_integer_ns() -> None:
    clock = ManualClock()
    assert clock.now_ns() == 0 and clock.advance(np.int64(7)) == 7 and type(clock.now_ns()) is int
    with pytest.raises(TypeError, match="integer number of ns"):
        clock.advance(0.5)
    with pytest.raises(TypeError, match="integer number of ns"):
        ManualClock(1.0)
    with pytest.raises(ValueError, match="start_ns must be >= 0"):
        ManualClock(-1)
    assert clock.now_ns() == 7


def test_manual_clock_moves_forward_only() -> None:
    clock = ManualClock(10)
    assert clock.advance(5) == 15 and clock.now_ns() == 15
    clock.set(20)
    with pytest.raises(ValueError, match="only moves forward"):
        clock.set(19)
    with pytest.raises(ValueError, match="only moves forward"):
        clock.advance(-1)


def test_hotness_unit_reads_its_clock_when_no_time_is_given() -> None:
    """Epochs end by the clock: a batch recorded after the epoch end closes it first."""
    env = simpy.Environment()
    unit = HotnessUnit(1 << 20, HotnessConfig(threshold=1, epoch_ns=100), clock=SimpyClock(env))
    unit.record(np.array([4096], dtype=np.uint64))

    def later():
        yield env.timeout(150)
        unit.record(np.array([8192], dtype=np.uint64))

    env.process(later())
    env.run()
    assert env.now == 150 and unit.status.epochs == 1 and unit.epoch_start == 100
    assert unit.hotlist.peek() == [(1, 1)] and unit.counters[2] == 1


ROOT = Path(__file__).resolve().parents[2]


def test_the_tree_has_one_clock_protocol_and_one_clock_of_each_kind() -> None:
    """Issue 24: firmware_model.clock holds the protocol, the manual clock and simpy's; the wall
    clock is the emulator's. A second clock class anywhere in the four packages fails here."""
    found = set()
    for package in ("firmware_model", "emulator", "driver", "tools"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Clock"):
                    found.add((path.relative_to(ROOT).as_posix(), node.name))
    assert found == {("firmware_model/clock.py", "Clock"), ("firmware_model/clock.py", "ManualClock"),
                     ("firmware_model/clock.py", "SimpyClock"), ("emulator/timing/clock.py", "WallClock")}
