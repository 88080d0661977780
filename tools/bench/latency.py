"""`cxlemu bench latency`: MLC-style idle latency through the timed data path.

A random cyclic chain of 64-B lines is laid in the device's media; each hop reads 8 bytes
(one transaction) at the DPA the previous hop returned, so no two accesses overlap, as in
Intel MLC's idle-latency test.  The chase runs in interleaved rounds of ROUND_HOPS hops:
through the timed path (device) and through the same path with timing off (local baseline:
what an untimed device costs).  Added latency is, per round, the difference of the two modes'
interquartile means (robust to preemption), median over rounds (robust to spells of host
contention); p50 / p99 come from the per-hop samples (the added p99 per round, likewise).  The
expected added latency per hop is the configured read latency plus one transaction's link
time, all times time_scale.

By default the chase runs in C (``cxl_chase``, one ``cxl_read`` per hop), as MLC's does: no
interpreter between hops, so its mean and p99 show what the data path itself adds; the timed
path's own cost is deducted with the compensation a C caller's data path gets.
``native=False`` (``--python``) chases from Python instead, one ``DataPath`` call per hop, as
a Python program reads: each hop then also carries the interpreter (~0.5 µs a hop here), and
the added latency reads some tens of ns over the configured one (BENCHMARKS.md, "Latency from a
Python loop": the likeliest cause, the bookkeeping missing in caches the interpreter uses between
calls, is not settled).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from emulator.timing import DataPath

DEFAULT_WORKING_SET = 64 << 20


@dataclass(frozen=True)
class LatencyResult:
    working_set: int
    hops: int
    local_ns: float
    device_ns: float
    added_ns: float
    configured_ns: float
    error_pct: float
    local_p50_ns: float
    local_p99_ns: float
    device_p50_ns: float
    device_p99_ns: float
    added_p50_ns: float
    added_p99_ns: float
    p99_jitter_pct: float
    native: bool = True  # chased in C (MLC's method); False: from a Python loop

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def configured_added_ns(dp: DataPath) -> float:
    """What the model adds to one dependent 8-byte read: latency + one transaction of link time."""
    params = dp.config.link_params()  # the one link model (firmware_model.link)
    return float(params.duration_ns(0, params.txn_bytes))


def _pct(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _band_pct(samples: list[int], q: float, half_width: float = 0.005) -> float:
    """The q-quantile as the mean of the samples within ±half_width of it (q ± 0.5 points).
    Per-hop samples are multiples of the clock's step (the TSC advances in ~10-ns steps on some
    VMs), so a plain quantile is too, and a difference of two of them jumps by whole steps:
    the band's mean resolves finer wherever the band spans more than one step."""
    ordered = sorted(samples)
    n = len(ordered)
    lo = min(n - 1, int((q - half_width) * n))
    band = ordered[lo:max(lo + 1, int((q + half_width) * n) + 1)]
    return sum(band) / len(band)


#: hops per interleaved round: short rounds put the two modes side by side in time, so a swing
#: of the shared host (another tenant, the SMT sibling's load) lands on both alike
ROUND_HOPS = 1000


def measure(dp: DataPath, region: memoryview, base_dpa: int, *, hops: int = 200_000,
            rounds: int | None = None, native: bool = True) -> LatencyResult:
    """Chase ``hops`` hops each way over ``region`` (at ``base_dpa``), in ``rounds`` rounds
    (default: rounds of ROUND_HOPS)."""
    if dp.impl != "c":
        raise RuntimeError("the latency probe needs the C data path (the Python twin's own cost "
                           "is microseconds): pip install -e . or python -m emulator.timing._build")
    from emulator.timing import linkstate
    from emulator.timing.cimpl import CCore
    from emulator.timing.chase import build_chase_ring, py_chase
    from emulator.timing.config import LinkParams

    rounds = rounds or max(1, hops // ROUND_HOPS)
    lines = region.nbytes // 64
    start = base_dpa + build_chase_ring(region, 0, lines)
    words = np.frombuffer(region, dtype=np.uint64)
    words[::8] += np.uint64(base_dpa)  # the ring holds offsets within the region: make them DPAs
    del words
    if native:
        return _measure_native(dp, region.nbytes, start, hops, rounds)
    local = CCore(dp.media, dp.poison_bits, memoryview(bytearray(linkstate.USED_BYTES)).cast("Q"),
                  LinkParams(lat_ns=(0, 0), fs_per_byte=(0, 0), txn_bytes=64))
    per_round = max(ROUND_HOPS, hops // rounds)
    _, dpa = py_chase(local.transfer, start, min(hops, 20_000))  # warm the TLB
    local_r: list[list[int]] = []
    device_r: list[list[int]] = []
    # each round continues the chain where the last stopped: restarting at one DPA would
    # chase the same few thousand lines, which then sit in cache, every round
    for _ in range(max(1, hops // per_round)):
        samples, dpa = py_chase(local.transfer, dpa, per_round)
        local_r.append(samples)
        samples, dpa = py_chase(dp._core.transfer, dpa, per_round)
        device_r.append(samples)
    local.close()
    return _result(region.nbytes, local_r, device_r, configured_added_ns(dp), native=False)


def _measure_native(dp: DataPath, working_set: int, start: int, hops: int,
                    rounds: int) -> LatencyResult:
    """The chase in C over the device's media and link page, compensated for C callers."""
    from emulator.timing.cimpl import CCore
    from emulator.timing.calibration import calibrated_comp_ns

    core = CCore(dp.media, dp.poison_bits, dp._link, dp.config.link_params(), calibrated_comp_ns())
    per_round = max(ROUND_HOPS, hops // rounds)
    core.chase(start, min(hops, 20_000), False)
    local: list[list[int]] = []
    device: list[list[int]] = []
    for _ in range(max(1, hops // per_round)):  # continuing the chain, as above
        local.append(core.chase(core.last_end, per_round, False, per_round)[1])
        device.append(core.chase(core.last_end, per_round, True, per_round)[1])
    core.close()
    return _result(working_set, local, device, configured_added_ns(dp))


def _result(working_set: int, local_rounds: list[list[int]], device_rounds: list[list[int]],
            configured: float, native: bool = True) -> LatencyResult:
    """Means and quantiles over all hops for each mode; the added latency and its p99 per round
    (the two modes of one round ran side by side in time), median over rounds: a spell of host
    contention (another tenant, a busy SMT sibling: +5-10 ns on the timed path for 0.05-0.3 s)
    that covers a minority of the rounds moves the pooled means, not the median."""
    from emulator.timing.chase import interquartile_mean

    local = [x for r in local_rounds for x in r]
    device = [x for r in device_rounds for x in r]
    local_mean, device_mean = interquartile_mean(local), interquartile_mean(device)
    added = statistics.median(interquartile_mean(d) - interquartile_mean(lo)
                              for lo, d in zip(local_rounds, device_rounds))
    p99_added = statistics.median(_band_pct(d, 0.99) - _band_pct(lo, 0.99)
                                  for lo, d in zip(local_rounds, device_rounds))
    return LatencyResult(
        working_set=working_set, hops=len(device), local_ns=local_mean, device_ns=device_mean,
        added_ns=added, configured_ns=configured,
        error_pct=100 * abs(added - configured) / configured if configured else 0.0,
        local_p50_ns=_pct(local, 0.5), local_p99_ns=_pct(local, 0.99),
        device_p50_ns=_pct(device, 0.5), device_p99_ns=_pct(device, 0.99),
        added_p50_ns=_pct(device, 0.5) - _pct(local, 0.5), added_p99_ns=p99_added,
        p99_jitter_pct=100 * abs(p99_added - configured) / configured if configured else 0.0,
        native=native)
