"""`cxlemu bench bandwidth`: sustained throughput of the timed link, like MLC's bandwidth tests.

Transfers of one size stream through the DMA engine (several channels, several submissions in
flight, so the link never idles waiting for the host) for a fixed time; throughput is bytes
moved over the wall time from the first submission to the last completion.  ``read`` moves
media → host, ``write`` host → media, ``mixed`` alternates both (the two directions are
separate links, so mixed may reach read + write bandwidth).  With ``processes > 1`` that many
processes stream on the same device at once and throughput is their sum over the common
window: the link is shared through the device's link-state page.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from emulator.dma import Descriptor, DmaEngine
from emulator.timing import DataPath

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
MODES = ("read", "write", "mixed")
_BATCH_BYTES = 1 << 20


@dataclass(frozen=True)
class BandwidthResult:
    mode: str
    size: int
    processes: int
    bytes: int
    seconds: float
    gbps: float
    configured_gbps: float  # 0 = unthrottled
    error_pct: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def configured_gbps(dp: DataPath, mode: str) -> float:
    """Model throughput (GB/s) for the mode, time scale applied; 0 if a direction is unthrottled."""
    t = dp.config
    r = (t.read_bandwidth_gbps or 0.0) / t.time_scale
    w = (t.write_bandwidth_gbps or 0.0) / t.time_scale
    if mode == "read":
        return r
    if mode == "write":
        return w
    # mixed alternates equal-sized reads and writes: each direction carries half the bytes in
    # parallel, so the slower one sets the pace
    throttled = [x for x in (r, w) if x]
    return 2 * min(throttled) if throttled else 0.0


def _descriptors(mode: str, size: int, region_dpa: int, region_size: int, host: np.ndarray,
                 first: int) -> list[Descriptor]:
    """One submission's worth (about 1 MiB) of transfers; in mixed mode directions alternate
    starting with ``first``'s parity."""
    # mixed: at least one read and one write per submission, so a channel keeps both links busy
    count = max(2 if mode == "mixed" else 1, _BATCH_BYTES // size)
    slots = max(1, region_size // size)
    out = []
    for i in range(count):
        direction = mode if mode != "mixed" else ("read", "write")[(first + i) % 2]
        out.append(Descriptor(direction, region_dpa + ((first + i) % slots) * size, host, 0, size))
    return out


def stream(dp: DataPath, mode: str, size: int, region_dpa: int, region_size: int, *,
           seconds: float, channels: int = 2, depth: int = 4) -> tuple[int, int, int]:
    """Stream for about ``seconds``; returns (bytes, t_first_submit_ns, t_last_done_ns)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    hosts = [np.ones(size, dtype=np.uint8) for _ in range(channels)]
    # two lists per channel, alternated per submission: in mixed mode with one descriptor per
    # submission every channel then serves both directions, so neither link waits on one channel
    lists = [[_descriptors(mode, size, region_dpa, region_size, hosts[k], k + j) for j in (0, 1)]
             for k in range(channels)]
    per_list = len(lists[0][0]) * size
    moved = 0
    inflight: deque[Any] = deque()
    with DmaEngine(dp, channels=channels, queue_depth=depth) as eng:
        t0 = time.monotonic_ns()
        deadline = t0 + int(seconds * 1e9)
        k = 0
        while time.monotonic_ns() < deadline:
            if len(inflight) >= channels * depth:
                inflight.popleft().check()
                moved += per_list
            inflight.append(eng.submit(lists[k % channels][(k // channels) % 2], channel=k % channels))
            k += 1
        while inflight:
            inflight.popleft().check()
            moved += per_list
        t1 = time.monotonic_ns()
    return moved, t0, t1


def measure(dp: DataPath, mode: str, size: int, region_dpa: int, region_size: int, *,
            seconds: float = 0.3, channels: int = 2, depth: int = 4) -> BandwidthResult:
    moved, t0, t1 = stream(dp, mode, size, region_dpa, region_size, seconds=seconds,
                           channels=channels, depth=depth)
    return _result(dp, mode, size, 1, moved, (t1 - t0) / 1e9)


def _result(dp: DataPath, mode: str, size: int, processes: int, moved: int, secs: float) -> BandwidthResult:
    gbps = moved / secs / 1e9
    conf = configured_gbps(dp, mode)
    return BandwidthResult(mode=mode, size=size, processes=processes, bytes=moved, seconds=secs,
                           gbps=gbps, configured_gbps=conf,
                           error_pct=100 * abs(gbps - conf) / conf if conf else 0.0)


def _worker(name: str, mode: str, size: int, region: tuple[int, int], seconds: float,
            channels: int, impl: str, start: Any, out: Any) -> None:
    """One streaming process: opens the device by name, as an unrelated host would."""
    from emulator.device import DeviceFiles

    files = DeviceFiles.open(name)
    dp = DataPath.for_device(files, impl=impl)
    try:
        start.wait()
        out.put(stream(dp, mode, size, region[0], region[1], seconds=seconds, channels=channels))
    finally:
        dp.close()
        files.close()


def measure_shared(dp: DataPath, name: str, mode: str, size: int, region_dpa: int,
                   region_size: int, *, processes: int, seconds: float = 1.0,
                   channels: int = 1) -> BandwidthResult:
    """``processes`` processes stream at once on device ``name``; each gets its own slice of
    the region.  Throughput = their bytes / (last completion − first submission)."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    part = region_size // processes // size * size
    if part < size:
        raise ValueError(f"region of {region_size} B is too small for {processes} x {size} B")
    procs = [ctx.Process(target=_worker, args=(name, mode, size, (region_dpa + i * part, part),
                                                seconds, channels, dp.impl, start, out))
             for i in range(processes)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # let the interpreters import before the common start
    start.set()
    runs = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    moved = sum(r[0] for r in runs)
    secs = (max(r[2] for r in runs) - min(r[1] for r in runs)) / 1e9
    return _result(dp, mode, size, processes, moved, secs)
