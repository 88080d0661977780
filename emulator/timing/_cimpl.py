"""The C core (cffi extension ``_cdatapath``) behind the same interface as ``PyCore``.

Also home of the per-process calibration of the emulator's own per-access cost, which the
C core deducts from real-time waits so a configured latency is *added* latency.
"""
from __future__ import annotations

import functools
import json
import os
import re
import statistics
import time
from typing import Any

import numpy as np

from emulator.timing import _cdatapath
from emulator.timing import linkstate as ls
from emulator.timing._buffers import host_view
from emulator.timing._cdatapath import ffi, lib  # ImportError when not built
from emulator.timing.config import LinkParams

_ABI_VERSION = 4  # CXL_ABI_VERSION in _datapath.h
if getattr(lib, "CXL_ABI_VERSION", 1) != _ABI_VERSION:
    raise ImportError("emulator.timing._cdatapath is a stale build of the C core: rebuild it "
                      "(`pip install -e .` or `python -m emulator.timing._build`)")


def _load_fastcall() -> Any:
    """``emulator.timing._fastcall`` from the extension's own file (``_fastcall.c``), or None
    where it is not compiled in (Python < 3.11): then plain buffers go through from_buffer."""
    import importlib.machinery
    import importlib.util

    name = "emulator.timing._fastcall"
    loader = importlib.machinery.ExtensionFileLoader(name, _cdatapath.__file__)
    spec = importlib.util.spec_from_file_location(name, _cdatapath.__file__, loader=loader)
    try:
        return importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    except ImportError:
        return None


_from_buffer, _read, _write, _U8 = ffi.from_buffer, lib.cxl_read, lib.cxl_write, ffi.typeof("uint8_t[]")
_FASTCALL = _load_fastcall()
#: ``transfer(dp, err, dir, dpa, buffer, now, wait)``: a host buffer to the C core in one call,
#: borrowed through the buffer protocol; ``issue(dp, desc, now, err)``: one DMA descriptor.
#: Addresses as ints (``address()``).  None without the module (see _load_fastcall).
fast_transfer: Any = getattr(_FASTCALL, "transfer", None)
fast_issue: Any = getattr(_FASTCALL, "issue", None)
#: ``read_bytes(dp, err, dpa, n, now)``: a timed read into a new bytes object (or a CXL_E_* code).
fast_read_bytes: Any = getattr(_FASTCALL, "read_bytes", None)
#: The C base of ``emulator.dma.DmaHandle`` (its fields) and the DMA engine's inline path for
#: one descriptor (issue, and a done handle if complete), or None (see _load_fastcall).
handle_base: Any = getattr(_FASTCALL, "HandleBase", None)
fast_inline1: Any = getattr(_FASTCALL, "inline1", None)
#: A DMA channel's claim word (atomic; inline1 claims an idle channel with one CAS).
channel_state: Any = getattr(_FASTCALL, "ChannelState", None)


def address(cdata: Any) -> int:
    """The address a cdata pointer holds, for _fastcall (valid while ``cdata`` lives)."""
    return int(ffi.cast("uintptr_t", cdata))


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


class CCore:
    """Owns the ``cxl_dp`` struct and keeps the buffers it points into alive."""

    def __init__(self, media: memoryview, poison: memoryview | None, link: memoryview,
                 params: LinkParams, comp_ns: tuple[float, float] = (0.0, 0.0),
                 state: tuple[memoryview, int] | None = None) -> None:
        self._keep: list[Any] = []
        dp = ffi.new("cxl_dp *")
        dp.media = self._ptr(media)
        dp.media_size = media.nbytes
        if poison is not None:
            dp.poison = self._ptr(poison)
            dp.poison_size = poison.nbytes
        dp.link = ffi.cast("uint64_t *", self._ptr(link))
        dp.lat_ns = list(params.lat_ns)
        dp.fs_per_byte = list(params.fs_per_byte)
        dp.txn_bytes = params.txn_bytes
        dp.comp_ps = [round(1000 * c) for c in comp_ns]
        dp.untimed = int(params.untimed)
        if state is not None:  # (a writable view of the device state word, the value it must hold)
            dp.state = ffi.cast("uint64_t *", self._ptr(state[0]))
            dp.state_ok = state[1]
        self.dp = dp
        self.params = params
        self.err = ffi.new("uint64_t *")
        # the addresses _fastcall takes (valid while self.dp / self.err live)
        self.dp_addr, self.err_addr = address(dp), address(self.err)

    def _ptr(self, buf: memoryview) -> Any:
        cdata = ffi.from_buffer("uint8_t[]", buf, require_writable=not buf.readonly)
        self._keep.append(cdata)
        return cdata

    def close(self) -> None:
        for cdata in self._keep:
            ffi.release(cdata)
        self._keep.clear()

    @property
    def err_dpa(self) -> int:
        return int(self.err[0])

    def transfer(self, d: int, dpa: int, host: Any, now: int, wait: bool) -> int:
        """Any C-contiguous buffer goes to C as is; anything else through ``host_view``
        (torch tensors, or a clear error for a buffer that cannot be used)."""
        if isinstance(host, ffi.CData):  # a registered HostBuffer's pinned view
            buf = host
        else:
            if fast_transfer is not None:
                try:
                    return fast_transfer(self.dp_addr, self.err_addr, d, dpa, host, now, wait)
                except (TypeError, ValueError, BufferError):
                    pass  # not a plain buffer: host_view() below converts it or says why
            try:
                buf = _from_buffer(_U8, host, require_writable=d == 0)
            except (TypeError, ValueError, BufferError):
                buf = _from_buffer(_U8, host_view(host, writable=d == 0), require_writable=d == 0)
        if d == 0:
            return _read(self.dp, dpa, buf, len(buf), now, wait, self.err)
        return _write(self.dp, dpa, buf, len(buf), now, wait, self.err)

    def copy(self, src: int, dst: int, n: int, now: int, wait: bool) -> int:
        return lib.cxl_copy(self.dp, src, dst, n, now, wait, self.err)

    def untimed(self, d: int, dpa: int, host: memoryview) -> int:
        if d == ls.DIR_READ:
            buf = ffi.from_buffer("uint8_t[]", host, require_writable=True)
            return lib.cxl_read_untimed(self.dp, dpa, buf, host.nbytes, self.err)
        return lib.cxl_write_untimed(self.dp, dpa, ffi.from_buffer("uint8_t[]", host),
                                     host.nbytes, self.err)

    def chase(self, dpa: int, hops: int, timed: bool, nsamples: int = 0) -> tuple[int, list[int]]:
        """Dependent pointer chase (see ``cxl_chase``): total ns and per-hop samples."""
        samples = ffi.new("int64_t[]", max(nsamples, 1))
        end = ffi.new("uint64_t *")
        total = lib.cxl_chase(self.dp, dpa, hops, int(timed), samples, nsamples, end)
        if total < 0:
            raise ValueError(f"pointer chase left the media at hop from DPA {dpa:#x} (code {total})")
        self.last_end = int(end[0])  # where a following round continues the chain
        return int(total), list(samples[0:nsamples])


def now_ns() -> int:
    return int(lib.cxl_now())


def wait_until(deadline: int) -> None:
    lib.cxl_wait_until(deadline)


def build_chase_ring(media: memoryview, base: int, lines: int, seed: int = 1) -> int:
    """Write a random cyclic permutation of ``lines`` 64-B lines starting at ``base`` (64-B
    aligned): each line's first u64 holds the DPA of the next.  Random order defeats the
    prefetcher, as in MLC.  Returns the DPA to start the chase at."""
    if base % 64:
        raise ValueError(f"chase ring base must be 64-B aligned, got {base:#x}")
    order = np.random.default_rng(seed).permutation(lines).astype(np.uint64)
    words = np.frombuffer(media, dtype=np.uint64, count=lines * 8, offset=base)
    words[order * 8] = base + np.roll(order, -1) * 64
    return base + int(order[0]) * 64


def interquartile_mean(samples: list[int]) -> float:
    """Mean of the middle half: as robust as the median to preemptions and interpreter
    hiccups, finer than a clock that ticks in 10-ns steps on some VMs."""
    ordered = sorted(samples)
    q = len(ordered) // 4
    middle = ordered[q:len(ordered) - q] or ordered
    return sum(middle) / len(middle)


def trimmed_mean(samples: list[int], keep: float = 0.99) -> float:
    """Mean of the fastest ``keep`` fraction: drops hops hit by an interrupt or preemption
    (the host is shared; a 4 ms tick or a migration is not the device's latency)."""
    ordered = sorted(samples)
    kept = ordered[:max(1, int(len(ordered) * keep))]
    return sum(kept) / len(kept)


@functools.cache
def tsc_ticks_per_ns() -> float:
    """Calibrate the C core's TSC spin against CLOCK_MONOTONIC over 20 ms (once per process;
    ``CXLEMU_TIMING_TSC=0`` keeps clock_gettime spins).  0.0 when there is no usable TSC."""
    if os.environ.get("CXLEMU_TIMING_TSC", "1") == "0":
        lib.cxl_tsc_calibrate(0)
        return 0.0
    lib.cxl_tsc_calibrate(20_000_000)
    return float(lib.cxl_ticks_per_ns())


def py_chase(transfer: Any, dpa: int, hops: int) -> tuple[list[int], int]:
    """Dependent pointer chase from Python: each hop is one ``transfer(0, dpa, buf, -1, True)``
    call (the call a DataPath.read makes) of 8 bytes, then a jump to the DPA read.  Returns
    per-hop times in ns (perf_counter, one reading per hop in every mode) and the DPA where a
    following round continues the chain."""
    buf = bytearray(8)
    samples = [0] * hops
    clock = time.perf_counter_ns
    from_bytes = int.from_bytes
    prev = clock()
    for i in range(hops):
        transfer(0, dpa, buf, -1, True)
        dpa = from_bytes(buf, "little")
        t = clock()
        samples[i] = t - prev
        prev = t
    return samples, dpa


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
    expected = _CALIBRATE_LAT_NS + (64 * fs_per_byte + 500_000) // 1_000_000
    # a state word that admits access, so the chase checks it as a device's data path does
    state_ok = 1 | lib.CXL_ST_UP | lib.CXL_ST_MEDIA
    state = memoryview(bytearray(8)).cast("Q")
    state[0] = state_ok
    core = CCore(media, None, memoryview(bytearray(ls.USED_BYTES)).cast("Q"),
                 LinkParams(lat_ns=(_CALIBRATE_LAT_NS, 0), fs_per_byte=(fs_per_byte, 0), txn_bytes=64),
                 state=(state, state_ok))
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
    from emulator.spec.errors import ConfigError

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
    from emulator.timing.localmem import cache_dir, host_fingerprint

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
