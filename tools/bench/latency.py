"""`cxlemu bench latency`: MLC-style idle latency through the timed data path.

A random cyclic chain of 64-B lines is laid in the device's media; each hop reads 8 bytes
(one transaction) at the DPA the previous hop returned, so no two accesses overlap, as in
Intel MLC's idle-latency test.  The chase runs from Python, one data-path call per hop, as
every user of the device calls it, in interleaved rounds: through the timed path (device) and
through the same path with timing off (local baseline: what an untimed device costs).  Added
latency is the difference of the two interquartile means (robust to preemption and to the
interpreter's own hiccups on a shared host); p50 / p99 come from the per-hop samples.  The
expected added latency per hop is the configured read latency plus one transaction's link
time, all times time_scale.

``native=True`` (``--native``) chases in C instead (``cxl_chase``), as MLC does: no
interpreter noise, so its mean and p99 show what the data path itself adds.
"""
from __future__ import annotations

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def configured_added_ns(dp: DataPath) -> float:
    """What the model adds to one dependent 8-byte read: latency + one transaction of link time."""
    params = dp.config.link_params()
    occ = (params.txn_bytes * params.fs_per_byte[0] + 500_000) // 1_000_000
    return float(params.lat_ns[0] + occ)


def _pct(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def measure(dp: DataPath, region: memoryview, base_dpa: int, *, hops: int = 100_000,
            rounds: int = 20, native: bool = False) -> LatencyResult:
    """Chase ``hops`` hops each way over ``region`` (at ``base_dpa``), in ``rounds`` rounds."""
    if dp.impl != "c":
        raise RuntimeError("the latency probe needs the C data path (the Python twin's own cost "
                           "is microseconds): pip install -e . or python -m emulator.timing._build")
    from emulator.timing import linkstate
    from emulator.timing._cimpl import (
        CCore,
        build_chase_ring,
        interquartile_mean,
        py_chase,
    )
    from emulator.timing.config import LinkParams

    lines = region.nbytes // 64
    start = base_dpa + build_chase_ring(region, 0, lines)
    words = np.frombuffer(region, dtype=np.uint64)
    words[::8] += np.uint64(base_dpa)  # the ring holds offsets within the region: make them DPAs
    del words
    if native:
        return _measure_native(dp, region.nbytes, start, hops, rounds)
    local = CCore(dp.media, dp.poison_bits, memoryview(bytearray(linkstate.USED_BYTES)).cast("Q"),
                  LinkParams(lat_ns=(0, 0), fs_per_byte=(0, 0), txn_bytes=64))
    per_round = max(1000, hops // rounds)
    _, dpa = py_chase(local.transfer, start, min(hops, 20_000))  # warm the TLB
    local_s: list[int] = []
    device_s: list[int] = []
    # each round continues the chain where the last stopped: restarting at one DPA would
    # chase the same few thousand lines, which then sit in cache, every round
    for _ in range(max(1, hops // per_round)):
        samples, dpa = py_chase(local.transfer, dpa, per_round)
        local_s += samples
        samples, dpa = py_chase(dp._core.transfer, dpa, per_round)
        device_s += samples
    local.close()
    return _result(region.nbytes, local_s, device_s, configured_added_ns(dp), interquartile_mean)


def _measure_native(dp: DataPath, working_set: int, start: int, hops: int,
                    rounds: int) -> LatencyResult:
    """The chase in C over the device's media and link page, compensated for C callers."""
    from emulator.timing._cimpl import CCore, calibrated_comp_ns, interquartile_mean

    core = CCore(dp.media, dp.poison_bits, dp._link, dp.config.link_params(), calibrated_comp_ns())
    per_round = max(1000, hops // rounds)
    core.chase(start, min(hops, 20_000), False)
    local: list[int] = []
    device: list[int] = []
    for _ in range(max(1, hops // per_round)):  # continuing the chain, as above
        local += core.chase(core.last_end, per_round, False, per_round)[1]
        device += core.chase(core.last_end, per_round, True, per_round)[1]
    core.close()
    return _result(working_set, local, device, configured_added_ns(dp), interquartile_mean)


def _result(working_set: int, local: list[int], device: list[int], configured: float,
            estimator: Any) -> LatencyResult:
    local_mean, device_mean = estimator(local), estimator(device)
    added = device_mean - local_mean
    p99_added = _pct(device, 0.99) - _pct(local, 0.99)
    return LatencyResult(
        working_set=working_set, hops=len(device), local_ns=local_mean, device_ns=device_mean,
        added_ns=added, configured_ns=configured,
        error_pct=100 * abs(added - configured) / configured if configured else 0.0,
        local_p50_ns=_pct(local, 0.5), local_p99_ns=_pct(local, 0.99),
        device_p50_ns=_pct(device, 0.5), device_p99_ns=_pct(device, 0.99),
        added_p50_ns=_pct(device, 0.5) - _pct(local, 0.5), added_p99_ns=p99_added,
        p99_jitter_pct=100 * abs(p99_added - configured) / configured if configured else 0.0)


def render(name: str, r: LatencyResult) -> Any:
    """Pure: a result -> rich Table."""
    from rich.table import Table

    t = Table(title=f"cxlemu bench latency {name}: {r.hops} dependent 8-B reads over "
                    f"{r.working_set >> 20} MiB")
    for col in ("", "IQ mean ns", "p50 ns", "p99 ns"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("local (timing off)", f"{r.local_ns:.1f}", f"{r.local_p50_ns:.0f}", f"{r.local_p99_ns:.0f}")
    t.add_row("device", f"{r.device_ns:.1f}", f"{r.device_p50_ns:.0f}", f"{r.device_p99_ns:.0f}")
    t.add_row("added", f"{r.added_ns:.1f}", f"{r.added_p50_ns:.0f}", f"{r.added_p99_ns:.0f}", style="bold")
    t.add_row("configured", f"{r.configured_ns:.1f}", "", "")
    t.caption = f"error {r.error_pct:.2f} % (interquartile mean), p99 jitter {r.p99_jitter_pct:.2f} %"
    return t


def register(bench: Any) -> None:
    from tools.bench.target import add_target_arguments

    p = bench.add_parser("latency", help="MLC-style idle latency: dependent pointer chase, added vs configured")
    add_target_arguments(p)
    p.add_argument("--working-set", default="64M", help="chase region (default 64M, larger than the LLC)")
    p.add_argument("--dpa", default="0", help="where the region starts (saved and restored)")
    p.add_argument("--hops", type=int, default=100_000, help="hops per mode")
    p.add_argument("--rounds", type=int, default=20, help="interleaved local/device rounds")
    p.add_argument("--native", action="store_true", help="chase in C, as MLC does (no interpreter noise)")
    p.set_defaults(func=cmd_latency)


def cmd_latency(args: Any) -> int:
    from tools.bench.target import open_target, scratch_region
    from tools.cli._common import CliError, parse_int, parse_size, print_json

    if args.hops < 1000 or args.rounds < 1:
        raise CliError("--hops must be >= 1000 and --rounds >= 1")
    size, dpa = parse_size(args.working_set), parse_int(args.dpa, "--dpa")
    if size < 4096:
        raise CliError(f"--working-set must be at least 4K (a ring of 64 lines of 64 B), got {size}")
    try:
        with open_target(args) as target, scratch_region(target.datapath, dpa, size) as region:
            result = measure(target.datapath, region, dpa, hops=args.hops, rounds=args.rounds,
                             native=args.native)
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print_json({"device": target.name, "private": target.private, "native": args.native,
                    "timing": target.timing.to_dict(), **result.to_dict()})
    else:
        from rich.console import Console

        Console().print(render(target.name, result))
    return 0
