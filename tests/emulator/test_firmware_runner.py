"""The firmware runner's polling: spin after mailbox activity, then naps that double while the
device is idle (up to a cap), back to the shortest while a service such as the CHMU access feed
has work."""
from __future__ import annotations

from emulator.firmware import FirmwareRunner
from firmware_model.clock import ManualClock


class _Firmware:
    """What the runner calls: a mailbox and a background job that are idle unless scripted,
    and services whose return values are scripted per pass."""

    def __init__(self, busy: list[bool], feed: list[bool]) -> None:
        self.busy, self.feed = busy, feed
        self.services = [self._feed]
        self.passes = 0
        self.clock = ManualClock(5_000)
        self.told: list[int] = []

    def service_mailbox(self) -> bool:
        self.passes += 1
        return self.busy.pop(0) if self.busy else False

    def step_background(self) -> bool:
        return False

    def _feed(self, now_ns: int) -> bool:
        self.told.append(now_ns)
        return self.feed.pop(0) if self.feed else False

    def note_internal_error(self, code: int, exc: BaseException) -> None:
        raise AssertionError(exc)


class _Naps:
    """Stands in for the runner's stop event: records each nap, stops after ``count``."""

    def __init__(self, count: int) -> None:
        self.naps: list[float] = []
        self.count = count

    def is_set(self) -> bool:
        return len(self.naps) >= self.count

    def wait(self, timeout: float) -> bool:
        self.naps.append(timeout)
        return False


def naps(busy: list[bool], feed: list[bool], count: int) -> list[float]:
    runner = FirmwareRunner(_Firmware(busy, feed), idle_sleep_s=0.0005, spin_s=0.0,  # type: ignore[arg-type]
                            max_idle_sleep_s=0.016)
    runner._stop = _Naps(count)  # type: ignore[assignment]
    runner.run()
    return [round(n * 1e4) / 10 for n in runner._stop.naps]  # type: ignore[attr-defined]


def test_idle_naps_double_up_to_the_cap() -> None:
    assert naps([], [], 8) == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]


def test_a_mailbox_command_brings_the_shortest_nap_back() -> None:
    # passes 1-4 idle (naps 0.5 .. 4), pass 5 a command (no nap: the runner spins), then idle
    assert naps([False] * 4 + [True], [], 8) == [0.5, 1.0, 2.0, 4.0, 0.5, 1.0, 2.0, 4.0]


def test_a_service_with_work_keeps_the_shortest_nap() -> None:
    # the feed has entries on passes 4-6: those naps are the shortest, then they grow again
    assert naps([], [False] * 3 + [True] * 3, 9) == [0.5, 1.0, 2.0, 0.5, 0.5, 0.5, 1.0, 2.0, 4.0]


def test_served_device_defaults() -> None:
    runner = FirmwareRunner(_Firmware([], []))  # type: ignore[arg-type]
    assert (runner.idle_sleep_s, runner.max_idle_sleep_s, runner.spin_s) == (0.0005, 0.016, 0.005)


def test_services_are_told_the_firmware_clocks_time() -> None:
    fw = _Firmware([], [])
    runner = FirmwareRunner(fw)  # type: ignore[arg-type]
    runner.step()
    fw.clock.advance(7)
    runner.step()
    assert fw.told == [5_000, 5_007]
