"""This host's local memory: idle latency and one thread's copy bandwidth, measured once.

Relative presets (``asic``, ``fpga``) scale these, as CXL-DMSim states its expanders against
local DRAM.  The measurement is an MLC-style dependent chase over a buffer larger than the
last-level cache (C core) and a numpy copy; it takes about 0.1 s and is cached in
``$XDG_CACHE_HOME/cxlemu/local-memory.json`` keyed by a fingerprint of the host (CPU model,
memory size, hostname).  ``CXLEMU_LOCAL_MEMORY="LAT_NS,GBPS"`` fixes the numbers instead
(tests, or a host whose numbers you know from Intel MLC).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from emulator.spec.errors import ConfigError

_CHASE_BYTES = 64 << 20
_CHASE_HOPS = 200_000
_COPY_BYTES = 64 << 20
_COPY_ROUNDS = 5
#: Used only when the C core is not built (a Python chase would measure the interpreter).
FALLBACK_LATENCY_NS = 100.0


@dataclass(frozen=True)
class LocalMemory:
    latency_ns: float
    bandwidth_gbps: float
    source: str  # "measured", "cached", "env" or "fallback"


def cache_dir() -> Path:
    """Where cxlemu keeps what it measured of this host: ``$XDG_CACHE_HOME/cxlemu``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cxlemu"


def host_fingerprint(method: str) -> str:
    """This host (CPU model, memory size, CPU count, hostname) and the measuring method's
    version: a better measurement, or another host, replaces an older one."""
    cpu = mem = ""
    try:
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
        mem = next((ln for ln in Path("/proc/meminfo").read_text().splitlines()
                    if ln.startswith("MemTotal")), "")
    except OSError:
        pass
    return hashlib.sha256(f"{method}|{platform.node()}|{cpu}|{mem}|{os.cpu_count()}".encode()).hexdigest()[:16]


def _from_env(text: str) -> LocalMemory:
    try:
        lat, bw = (float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"CXLEMU_LOCAL_MEMORY must be 'LATENCY_NS,BANDWIDTH_GBPS', got {text!r}") from None
    if not (lat > 0 and bw > 0):
        raise ConfigError(f"CXLEMU_LOCAL_MEMORY values must be > 0, got {text!r}")
    return LocalMemory(lat, bw, "env")


def measure_latency_ns() -> tuple[float, str]:
    """Idle load-to-use latency: a random dependent chase over 64 MiB (MLC idle latency)."""
    try:
        from emulator.timing.cimpl import CCore
    except ImportError:
        return FALLBACK_LATENCY_NS, "fallback"
    from emulator.timing import linkstate
    from emulator.timing.chase import build_chase_ring
    from emulator.timing.config import LinkParams

    media = memoryview(bytearray(_CHASE_BYTES))
    start = build_chase_ring(media, 0, _CHASE_BYTES // 64)
    core = CCore(media, None, memoryview(bytearray(linkstate.USED_BYTES)).cast("Q"),
                 LinkParams(lat_ns=(0, 0), fs_per_byte=(0, 0), txn_bytes=64))
    core.chase(start, 20_000, False)
    # no per-hop clock reads (one costs 20-40 ns on a VM): totals of short runs, the best of
    # them, so a run the scheduler interrupted does not count; each run continues the chain
    # (restarting would re-chase lines the previous run left in cache)
    runs, best = 20, float("inf")
    for _ in range(runs):
        best = min(best, core.chase(core.last_end, _CHASE_HOPS // runs, False)[0])
    core.close()
    return best / (_CHASE_HOPS // runs), "measured"


def measure_bandwidth_gbps() -> float:
    """One thread's copy bandwidth (GB/s of data moved), best of a few rounds."""
    src = np.ones(_COPY_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(_COPY_ROUNDS):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        best = min(best, time.perf_counter_ns() - t0)
    return _COPY_BYTES / best


def local_memory(*, refresh: bool = False) -> LocalMemory:
    """The env override, else the cached measurement for this host, else measure and cache."""
    env = os.environ.get("CXLEMU_LOCAL_MEMORY")
    if env:
        return _from_env(env)
    path, key = cache_dir() / "local-memory.json", host_fingerprint("v2")
    if not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("fingerprint") == key:
                return LocalMemory(float(data["latency_ns"]), float(data["bandwidth_gbps"]), "cached")
        except (OSError, ValueError, KeyError):
            pass
    lat, how = measure_latency_ns()
    result = LocalMemory(lat, measure_bandwidth_gbps(), how)
    if how == "fallback":
        print(f"cxlemu: note: timing C extension not built; assuming local latency "
              f"{FALLBACK_LATENCY_NS:g} ns", file=sys.stderr)
        return result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fingerprint": key, **asdict(result)}))
    except OSError:
        pass
    return result
