"""Cost of the telemetry page's two sides, so the firmware runner's budget is known.

    python -m tools.monitor.bench [--rounds N]

Prints microseconds per call: a full firmware publish (256 hotlist entries, 16 events, 16 poison
records), a small host publish, and a reader snapshot of both sections. Figures are wall-clock
means over N rounds on this machine: compare them with each other, not across machines.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from emulator.spec.registers import BAR_SIZE
from emulator.telemetry import EventEntry, PoisonEntry, TelemetryReader, TelemetryWriter


def _mean_us(fn: Callable[[], object], rounds: int) -> float:
    fn()  # warm caches (dtype lookups, first-touch of the page)
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds * 1e6


def run(rounds: int) -> dict[str, float]:
    bar = bytearray(BAR_SIZE)
    fw = TelemetryWriter(bar, "firmware")
    host = TelemetryWriter(bar, "host")
    reader = TelemetryReader(bar)
    hotlist = [(u * 7, 1000 - u) for u in range(256)]
    events = [EventEntry(i, i % 5, f"event {i}: general media error") for i in range(16)]
    poison = [PoisonEntry(i * 4096, 64, 3) for i in range(16)]
    return {
        "firmware publish, full (256 hot, 16 events, 16 poison)": _mean_us(
            lambda: fw.publish(uptime_ns=1, capacity_bytes=1 << 30, hotlist=hotlist, recent_events=events,
                               recent_poison=poison), rounds),
        "firmware publish, 4 scalars": _mean_us(
            lambda: fw.publish(uptime_ns=2, timestamp_ns=3, temperature_c=40, media_status=1), rounds),
        "host publish, 6 counters": _mean_us(
            lambda: host.publish(hits=1, misses=2, loads=3, offloads=4, stall_ns=5, tokens_generated=6), rounds),
        "reader snapshot, both sections": _mean_us(reader.snapshot, rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    for name, us in run(args.rounds).items():
        print(f"{us:9.1f} us  {name}")


if __name__ == "__main__":
    main()
