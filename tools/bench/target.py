"""What a probe measures: a device served elsewhere (by name) or a private one served here.

Either way the probe gets a ``DataPath`` over the device's own media, poison bitmap and
link-state page, exactly what ``MemDev`` uses, so it pays the same link as every other host.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from emulator.timing import DataPath, TimingConfig

#: the timing a private device takes from its own flags (name, type); the CLI makes each a flag
TIMING_FLAGS = (("read_latency_ns", float), ("write_latency_ns", float),
                ("bandwidth_gbps", float), ("transaction_bytes", int), ("time_scale", float))


def private_timing(preset: str | None, given: dict[str, Any]) -> TimingConfig:
    """Preset first, the values given (TIMING_FLAGS' names; ``bandwidth_gbps`` both ways)
    override, as `cxlemu serve` does."""
    base = TimingConfig()
    if preset:
        from emulator import presets

        base = presets.load(preset).timing
    given = dict(given)
    if "bandwidth_gbps" in given:
        bw = given.pop("bandwidth_gbps")
        given.update(read_bandwidth_gbps=bw, write_bandwidth_gbps=bw)
    return TimingConfig(**{**base.to_dict(), **given})


@dataclass
class Target:
    name: str
    private: bool
    datapath: DataPath
    files: Any

    @property
    def timing(self) -> TimingConfig:
        return self.datapath.config


@contextlib.contextmanager
def open_target(name: str | None, *, timing: TimingConfig | None = None, capacity: int = 256 << 20,
                impl: str = "auto") -> Iterator[Target]:
    """Open the served device ``name`` and its data path, or (``name`` None) serve a private one
    of ``capacity`` bytes with ``timing``."""
    from emulator.device import DeviceConfig, DeviceFiles, serve

    if name:
        files = DeviceFiles.open(name)
        dp = DataPath.for_device(files, impl=impl)
        try:
            yield Target(name, False, dp, files)
        finally:
            dp.close()
            files.close()
        return
    config = DeviceConfig(name=f"bench-{os.getpid()}", capacity=capacity, timing=timing or TimingConfig())
    with serve(config) as served:
        dp = DataPath.for_device(served.files, impl=impl)
        try:
            yield Target(config.name, True, dp, served.files)
        finally:
            dp.close()


@contextlib.contextmanager
def scratch_region(dp: DataPath, dpa: int, size: int, size_flag: str = "--working-set") -> Iterator[memoryview]:
    """A region of media a probe may overwrite; its contents are saved and restored, so a
    probe leaves a served device's data as it found it. ``size_flag`` is the option that sized
    it, named in the error."""
    if dpa % 64 or dpa + size > dp.size:
        raise ValueError(f"probe region [{dpa:#x}, {dpa + size:#x}) must be 64-B aligned and inside "
                         f"the media ({dp.size:#x} B): pass a smaller {size_flag} or another --dpa")
    saved = bytearray(size)
    dp.read_untimed(dpa, saved)  # also refuses a region holding poison
    try:
        yield dp.media[dpa:dpa + size]
    finally:
        dp.write_untimed(dpa, saved)
