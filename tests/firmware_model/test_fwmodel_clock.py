"""Clocks: the simulated clock is simpy's time; the manual clock only moves forward."""
from __future__ import annotations

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
