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

_TIMING_FLAGS = (("read_latency_ns", float), ("write_latency_ns", float),
                 ("bandwidth_gbps", float), ("transaction_bytes", int), ("time_scale", float))


def add_target_arguments(p: Any) -> None:
    """NAME of a served device, or --preset / explicit timing for a private device."""
    p.add_argument("name", nargs="?", help="a served device (see `cxlemu list`); omit to serve a private one")
    g = p.add_argument_group("private device (when NAME is omitted)")
    g.add_argument("--preset", help="timing preset (see `cxlemu presets`)")
    for flag, kind in _TIMING_FLAGS:
        g.add_argument("--" + flag.replace("_", "-"), type=kind, default=None)
    g.add_argument("--capacity", default="256M", help="private device size (default 256M)")
    p.add_argument("--impl", choices=("auto", "c", "py"), default="auto", help="data path implementation")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")


def timing_from_args(args: Any) -> TimingConfig:
    """Preset first, explicit flags override (as `cxlemu serve` does)."""
    base = TimingConfig()
    if args.preset:
        from emulator import presets

        base = presets.load(args.preset).timing
    given = {k: getattr(args, k) for k, _ in _TIMING_FLAGS if getattr(args, k) is not None}
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
def open_target(args: Any) -> Iterator[Target]:
    """Open the device named by ``args`` (or serve a private one) and its data path."""
    from emulator.device import DeviceConfig, DeviceFiles, serve
    from tools.common import CliError, parse_size

    explicit = args.preset or any(getattr(args, k) is not None for k, _ in _TIMING_FLAGS)
    if args.name and explicit:
        raise CliError("give either a device NAME or private-device timing flags (--preset, --read-latency-ns, ...), not both")
    if args.name:
        files = DeviceFiles.open(args.name)
        dp = DataPath.for_device(files, impl=args.impl)
        try:
            yield Target(args.name, False, dp, files)
        finally:
            dp.close()
            files.close()
        return
    config = DeviceConfig(name=f"bench-{os.getpid()}", capacity=parse_size(args.capacity),
                          timing=timing_from_args(args))
    with serve(config) as served:
        dp = DataPath.for_device(served.files, impl=args.impl)
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
