"""Calibration of the emulator's own per-access cost, deducted by the C core from real-time
waits so a configured latency is *added* latency; and the TSC spin's calibration.

Measured once per process (``calibrated_comp_ns``) by a C-level chase and combined with this
host's recent calibrations, kept in ``$XDG_CACHE_HOME/cxlemu/timing-calibration.json``
(``remembered_comp_ns``). Needs the C core (ImportError where it is not built).
"""
from __future__ import annotations

import functools
import json
import os
import re
import statistics
import time

from emulator.spec.errors import ConfigError
from emulator.timing import linkstate as ls
from emulator.timing.cimpl import _ABI_VERSION, CCore, lib
from emulator.timing.chase import build_chase_ring, trimmed_mean
from emulator.timing.config import LinkParams
from emulator.timing.localmem import cache_dir, host_fingerprint
from firmware_model.link import READ

# The calibration chases a 256 KiB ring (past L1, inside L2), at a short latency, in many short
# interleaved rounds (see _calibrate_native).  The ring's size moves the figure a little, as
# the bookkeeping costs more when the line came from further out (on the 2-vCPU host, 256 KiB:
# 14.8-15.1 ns; 1 MiB: 15.6-17.7; 16 MiB: 17.7-18.4; a 64 MiB chase needs ~16.5), but a ring
# that reaches L3 also reads other tenants' use of it (a 1 MiB one calibrated up to ~20 ns in
# 3 processes of 10).
_CALIBRATE_RING_BYTES = 256 << 10
_CALIBRATE_LAT_NS = 100
_CALIBRATE_FS = 15_625  # 64 GB/s: a 64-B hop holds the link 1 ns, so the reservation runs
_CALIBRATE_HOPS = 2000
_CALIBRATE_ROUNDS = 21
_CALIBRATE_PASSES = 3
_CALIBRATE_GAP_S = 0.04


@functools.cache
def tsc_ticks_per_ns() -> float:
    """Calibrate the C core's TSC spin against CLOCK_MONOTONIC over 20 ms (once per process;
    ``CXLEMU_TIMING_TSC=0`` keeps clock_gettime spins).  0.0 when there is no usable TSC."""
    if os.environ.get("CXLEMU_TIMING_TSC", "1") == "0":
        lib.cxl_tsc_calibrate(0)
        return 0.0
    lib.cxl_tsc_calibrate(20_000_000)
    return float(lib.cxl_ticks_per_ns())


def _calibrate_native(fs_per_byte: int) -> float:
    """(timed hop − untimed hop − configured added latency) of a C-level chase over
    _CALIBRATE_RING_BYTES: per round the difference of the two modes' trimmed means, the median
    over one pass's interleaved rounds, the least over _CALIBRATE_PASSES passes _CALIBRATE_GAP_S
    apart.

    Trimmed means, not interquartile ones: hops over L2-resident lines take nearly the same
    time each, and the clock reads in ~10-ns steps on some VMs, so a round's samples are two or
    three adjacent multiples of the step; an interquartile mean of those leans to the commonest
    one (by up to ±2 ns, depending on where the true time falls between steps), while a mean
    telescopes to the true total.  Only the slowest 1 % (interrupts, preemptions) is dropped.
    The least pass: a spell of contention on the core (a busy SMT sibling) makes the timed path
    cost more, never less, and the gaps let a short spell pass."""
    import mmap

    lines = _CALIBRATE_RING_BYTES // 64
    ring = mmap.mmap(-1, _CALIBRATE_RING_BYTES)  # page-aligned, returned to the OS after
    media = memoryview(ring)
    params = LinkParams(lat_ns=(_CALIBRATE_LAT_NS, 0), fs_per_byte=(fs_per_byte, 0), txn_bytes=64)
    expected = params.duration_ns(READ, 64)  # what each hop's 64-B line adds, by the link model
    # a state word that admits access, so the chase checks it as a device's data path does
    state_ok = 1 | lib.CXL_ST_UP | lib.CXL_ST_MEDIA
    state = memoryview(bytearray(8)).cast("Q")
    state[0] = state_ok
    core = CCore(media, None, memoryview(bytearray(ls.USED_BYTES)).cast("Q"), params, state=(state, state_ok))
    passes = []
    try:
        core.chase(build_chase_ring(media, 0, lines), 20_000, True)
        for i in range(_CALIBRATE_PASSES):
            if i:
                time.sleep(_CALIBRATE_GAP_S)
            estimates = []
            for _ in range(_CALIBRATE_ROUNDS):  # each round continues the chain where the last stopped
                _, timed = core.chase(core.last_end, _CALIBRATE_HOPS, True, _CALIBRATE_HOPS)
                _, local = core.chase(core.last_end, _CALIBRATE_HOPS, False, _CALIBRATE_HOPS)
                estimates.append(trimmed_mean(timed) - trimmed_mean(local) - expected)
            passes.append(statistics.median(estimates))
    finally:
        core.close()
        media.release()
        ring.close()
    return min(passes)


_COMP_NS_RE = re.compile(r"^\s*[0-9]+(\.[0-9]*)?\s*$|^\s*\.[0-9]+\s*$")


def _comp_ns_override(value: str) -> tuple[float, float]:
    """``CXLEMU_TIMING_COMP_NS``: one or two decimals of ns >= 0 (A or A,B); ConfigError otherwise
    (a negative figure would lengthen every wait, not compensate it)."""
    parts = value.split(",")
    if not 1 <= len(parts) <= 2 or not all(_COMP_NS_RE.match(x) for x in parts):
        raise ConfigError(f"CXLEMU_TIMING_COMP_NS must be one or two numbers of ns (A or A,B), decimals >= 0 "
                          f"such as 15.2 or 15.2,20 (0 disables compensation), got {value!r}")
    return float(parts[0]), float(parts[-1])


@functools.cache
def calibrated_comp_ns() -> tuple[float, float]:
    """The timed path's own cost per access over the same access with timing off (the TSC
    reading's fence, the spin's exit), in ns to a fraction of one, measured once per process
    (about 0.1 s, a third of it busy) by a C-level chase, where no interpreter noise blurs it,
    and combined with this host's recent calibrations (remembered_comp_ns()); deducted from
    every real-time wait so a configured latency is *added* latency.  Called from Python, the
    figure a program sees moves by ten or more ns either way with its access pattern (see
    BENCHMARKS).  [0] short transfers, [1] longer ones: one figure, since a longer transfer's
    link time dwarfs it.  ``CXLEMU_TIMING_COMP_NS=A[,B]`` overrides it (0 disables
    compensation)."""
    tsc_ticks_per_ns()
    override = os.environ.get("CXLEMU_TIMING_COMP_NS")
    if override is not None:
        return _comp_ns_override(override)
    comp = round(min(max(remembered_comp_ns(_calibrate_native(_CALIBRATE_FS)), -200.0), 500.0), 2)
    return comp, comp


#: calibrations kept per host, and how long one counts
_HISTORY_KEEP = 16
_HISTORY_MAX_AGE_S = 7 * 24 * 3600


def combine_calibrations(values: list[float]) -> float:
    """The host's compensation from its calibrations: the lower quartile (the least of fewer
    than four).  A spell of contention on the core (a busy SMT sibling, another tenant) can
    cover a whole calibration, 0.1 s, and inflate it by 4-7 ns; it never deflates one."""
    if len(values) < 4:
        return min(values)
    return statistics.quantiles(values, n=4)[0]


def remembered_comp_ns(measured: float, *, now: float | None = None) -> float:
    """Record this process's calibration with this host's recent ones
    (``$XDG_CACHE_HOME/cxlemu/timing-calibration.json``, keyed by the host and the method) and
    return combine_calibrations() of them all.  ``CXLEMU_TIMING_CALIBRATION_CACHE=0`` uses this
    process's alone; a cache that cannot be read or written is left alone."""
    if os.environ.get("CXLEMU_TIMING_CALIBRATION_CACHE", "1") == "0":
        return measured
    now = time.time() if now is None else now
    path = cache_dir() / "timing-calibration.json"
    key = host_fingerprint(f"calibration-v1|abi{_ABI_VERSION}|{_CALIBRATE_RING_BYTES}|"
                           f"{_CALIBRATE_LAT_NS}|{_CALIBRATE_HOPS}x{_CALIBRATE_ROUNDS}x{_CALIBRATE_PASSES}")
    history: list[list[float]] = []
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("key") == key:
            history = [[float(t), float(v)] for t, v in data["calibrations"]
                       if now - float(t) < _HISTORY_MAX_AGE_S]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    history = (history + [[now, measured]])[-_HISTORY_KEEP:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{os.getpid()}")
        staged.write_text(json.dumps({"key": key, "calibrations": history}))
        os.replace(staged, path)
    except OSError:
        pass
    return combine_calibrations([v for _, v in history])
