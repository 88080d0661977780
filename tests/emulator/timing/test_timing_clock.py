"""The wall clock: the one Clock (firmware_model.clock's protocol) that reads real time, and what
an unsimulated data path tells; a simulated one tells its ManualClock's time."""
from __future__ import annotations

import time

from emulator.timing import Clock, DataPath, ManualClock, TimingConfig, WallClock


def _datapath(clock: Clock | None) -> DataPath:
    return DataPath(bytearray(4096), bytearray(8), bytearray(4096), TimingConfig(), impl="py", clock=clock)


def test_wall_clock_is_the_monotonic_clock_in_integer_ns() -> None:
    wall = WallClock()
    before = time.monotonic_ns()
    a, b = wall.now_ns(), wall.now_ns()
    assert isinstance(wall, Clock) and type(a) is int and before <= a <= b <= time.monotonic_ns()


def test_data_path_tells_its_clocks_time() -> None:
    before = time.monotonic_ns()
    assert before <= _datapath(None).now_ns() <= time.monotonic_ns()
    clock = ManualClock(123)
    dp = _datapath(clock)
    clock.advance(7)
    assert dp.now_ns() == 130 and dp.clock is clock
