"""`cxlemu bench latency`: MLC-style idle latency through the timed data path.

A random cyclic chain of 64-B lines is laid in the device's media; each hop reads 8 bytes
(one transaction) at the DPA the previous hop returned, so no two accesses overlap, as in
Intel MLC's idle-latency test.  The chase runs in C (``cxl_chase``) twice per round,
interleaved: once through the timed path (device) and once through the same path with timing
off (local baseline: what an untimed device costs).  Added latency is the difference of the
two trimmed means (slowest 1 % dropped: interrupts and preemptions are the host's, not the
device's); p50/p99 come from per-hop samples.  Expected added latency per hop is the
configured read latency plus one transaction's link time, all times time_scale.
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
            rounds: int = 5) -> LatencyResult:
    """Chase ``rounds`` x ``hops`` hops each way over ``region`` (at ``base_dpa``)."""
    if dp.impl != "c":
        raise RuntimeError("the latency probe chases pointers in C: build the extension "
                           "(pip install -e . or python -m emulator.timing._build)")
    from emulator.timing._cimpl import build_chase_ring, trimmed_mean

    lines = region.nbytes // 64
    offset_ring = build_chase_ring(region, 0, lines)
    start = base_dpa + offset_ring
    # the ring holds offsets within the region; shift them to DPAs
    words = np.frombuffer(region, dtype=np.uint64)
    words[::8] += np.uint64(base_dpa)
    core = dp._core
    core.chase(start, min(hops, 20_000), False)  # warm the TLB and caches
    local: list[int] = []
    device: list[int] = []
    for _ in range(rounds):
        local += core.chase(start, hops, False, hops)[1]
        device += core.chase(start, hops, True, hops)[1]
    del words
    local_mean, device_mean = trimmed_mean(local), trimmed_mean(device)
    configured = configured_added_ns(dp)
    added = device_mean - local_mean
    p99_added = _pct(device, 0.99) - _pct(local, 0.99)
    return LatencyResult(
        working_set=region.nbytes, hops=hops * rounds, local_ns=local_mean, device_ns=device_mean,
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
    for col in ("", "mean ns", "p50 ns", "p99 ns"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("local (timing off)", f"{r.local_ns:.1f}", f"{r.local_p50_ns:.0f}", f"{r.local_p99_ns:.0f}")
    t.add_row("device", f"{r.device_ns:.1f}", f"{r.device_p50_ns:.0f}", f"{r.device_p99_ns:.0f}")
    t.add_row("added", f"{r.added_ns:.1f}", f"{r.added_p50_ns:.0f}", f"{r.added_p99_ns:.0f}", style="bold")
    t.add_row("configured", f"{r.configured_ns:.1f}", "", "")
    t.caption = f"error {r.error_pct:.2f} % (mean), p99 jitter {r.p99_jitter_pct:.2f} %"
    return t


def register(bench: Any) -> None:
    from tools.bench.target import add_target_arguments

    p = bench.add_parser("latency", help="MLC-style idle latency: dependent pointer chase, added vs configured")
    add_target_arguments(p)
    p.add_argument("--working-set", default="64M", help="chase region (default 64M, larger than the LLC)")
    p.add_argument("--dpa", default="0", help="where the region starts (saved and restored)")
    p.add_argument("--hops", type=int, default=100_000, help="hops per round and mode")
    p.add_argument("--rounds", type=int, default=5, help="interleaved local/device rounds")
    p.set_defaults(func=cmd_latency)


def cmd_latency(args: Any) -> int:
    from tools.bench.target import open_target, scratch_region
    from tools.cli._common import CliError, parse_int, parse_size, print_json

    if args.hops < 1000 or args.rounds < 1:
        raise CliError("--hops must be >= 1000 and --rounds >= 1")
    size, dpa = parse_size(args.working_set), parse_int(args.dpa, "--dpa")
    try:
        with open_target(args) as target:
            with scratch_region(target.datapath, dpa, size) as region:
                result = measure(target.datapath, region, dpa, hops=args.hops, rounds=args.rounds)
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print_json({"device": target.name, "private": target.private,
                    "timing": target.timing.to_dict(), **result.to_dict()})
    else:
        from rich.console import Console

        Console().print(render(target.name, result))
    return 0
