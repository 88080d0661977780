"""The timed data path's benches, their arguments and output: `cxlemu bench latency`, `bandwidth`,
`overhead` and `fidelity` (the measurements are ``tools.bench.latency``, ``bandwidth``,
``overhead``, ``fidelity``). The two probes of one device take it by NAME, or serve a private one
from a preset and timing flags (``tools.bench.target``)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tools.bench import bandwidth, fidelity, latency, overhead
from tools.bench.bandwidth import MODES, SIZES, BandwidthResult
from tools.bench.latency import ROUND_HOPS, LatencyResult
from tools.bench.overhead import OverheadResult
from tools.bench.target import TIMING_FLAGS, Target, open_target, private_timing, scratch_region
from tools.cli._common import CliError, parse_int, parse_size
from tools.cli.bench import show


def add_target_arguments(p: Any) -> None:
    """NAME of a served device, or --preset / explicit timing for a private device."""
    p.add_argument("name", nargs="?", help="a served device (see `cxlemu list`); omit to serve a private one")
    g = p.add_argument_group("private device (when NAME is omitted)")
    g.add_argument("--preset", help="timing preset (see `cxlemu presets`)")
    for flag, kind in TIMING_FLAGS:
        g.add_argument("--" + flag.replace("_", "-"), type=kind, default=None)
    g.add_argument("--capacity", default="256M", help="private device size (default 256M)")
    p.add_argument("--impl", choices=("auto", "c", "py"), default="auto", help="data path implementation")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")


@contextlib.contextmanager
def target_of(args: Any) -> Iterator[Target]:
    """The device ``args`` name, or a private one served from their timing flags."""
    given = {k: getattr(args, k) for k, _ in TIMING_FLAGS if getattr(args, k) is not None}
    if args.name and (args.preset or given):
        raise CliError("give either a device NAME or private-device timing flags (--preset, --read-latency-ns, ...), not both")
    if args.name:
        with open_target(args.name, impl=args.impl) as target:
            yield target
        return
    capacity = parse_size(args.capacity)
    with open_target(None, timing=private_timing(args.preset, given), capacity=capacity,
                     impl=args.impl) as target:
        yield target


def register_latency(bench: Any) -> None:
    p = bench.add_parser("latency", help="MLC-style idle latency: dependent pointer chase, added vs configured")
    add_target_arguments(p)
    p.add_argument("--working-set", default="64M", help="chase region (default 64M, larger than the LLC)")
    p.add_argument("--dpa", default="0", help="where the region starts (saved and restored)")
    p.add_argument("--hops", type=int, default=200_000, help="hops per mode")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"interleaved local/device rounds (default: rounds of {ROUND_HOPS} hops)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--native", dest="native", action="store_true", default=True,
                     help="chase in C, as MLC does (the default)")
    how.add_argument("--python", dest="native", action="store_false",
                     help="chase from a Python loop, one DataPath call per hop (adds the interpreter's own cost)")
    p.set_defaults(func=cmd_latency)


def cmd_latency(args: Any) -> int:
    if args.hops < 1000 or (args.rounds is not None and args.rounds < 1):
        raise CliError("--hops must be >= 1000 and --rounds >= 1")
    size, dpa = parse_size(args.working_set), parse_int(args.dpa, "--dpa")
    if size < 4096:
        raise CliError(f"--working-set must be at least 4K (a ring of 64 lines of 64 B), got {size}")
    try:
        with target_of(args) as target, scratch_region(target.datapath, dpa, size) as region:
            result = latency.measure(target.datapath, region, dpa, hops=args.hops, rounds=args.rounds,
                                     native=args.native)
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    show(args.json, {"device": target.name, "private": target.private, "timing": target.timing.to_dict(),
                     **result.to_dict()}, lambda: render_latency(target.name, result))
    return 0


def render_latency(name: str, r: LatencyResult) -> Any:
    """Pure: a result -> rich Table."""
    from rich.table import Table

    how = "a C chase, as MLC's" if r.native else "a Python loop, one DataPath call per hop"
    t = Table(title=f"cxlemu bench latency {name}: {r.hops} dependent 8-B reads over "
                    f"{r.working_set >> 20} MiB, {how}")
    for col in ("", "IQ mean ns", "p50 ns", "p99 ns"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("local (timing off)", f"{r.local_ns:.1f}", f"{r.local_p50_ns:.0f}", f"{r.local_p99_ns:.0f}")
    t.add_row("device", f"{r.device_ns:.1f}", f"{r.device_p50_ns:.0f}", f"{r.device_p99_ns:.0f}")
    t.add_row("added", f"{r.added_ns:.1f}", f"{r.added_p50_ns:.0f}", f"{r.added_p99_ns:.0f}", style="bold")
    t.add_row("configured", f"{r.configured_ns:.1f}", "", "")
    t.caption = f"error {r.error_pct:.2f} % (interquartile mean), p99 jitter {r.p99_jitter_pct:.2f} %"
    return t


def register_bandwidth(bench: Any) -> None:
    p = bench.add_parser("bandwidth", help="sustained read / write / mixed throughput, 4 KiB-8 MiB transfers")
    add_target_arguments(p)
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--size", action="append", help="transfer size (repeatable; default 4K..8M)")
    p.add_argument("--seconds", type=float, default=0.3, help="streaming time per point")
    p.add_argument("--channels", type=int, default=2, help="DMA channels per process")
    p.add_argument("--processes", type=int, default=1, help="processes streaming on the device at once")
    p.add_argument("--dpa", default="0", help="start of the region the probe uses (saved and restored)")
    p.add_argument("--region", default="64M", help="size of that region")
    p.set_defaults(func=cmd_bandwidth)


def cmd_bandwidth(args: Any) -> int:
    sizes = [parse_size(s) for s in args.size] if args.size else SIZES
    if min(sizes) < 1:
        raise CliError(f"--size must be at least 1 byte, got {min(sizes)}")
    modes = MODES if args.mode == "all" else (args.mode,)
    if args.processes < 1 or args.channels < 1 or args.seconds <= 0:
        raise CliError("--processes and --channels must be >= 1 and --seconds > 0")
    dpa, region_size = parse_int(args.dpa, "--dpa"), parse_size(args.region)
    too_big = [text for text, size in zip(args.size or [], sizes) if size > region_size]
    if too_big:  # checked before a device is served or a host buffer of that size allocated
        raise CliError(f"--size {too_big[0]} is larger than the region the probe streams through (--region "
                       f"{args.region}, {region_size:#x} B): give a --size of at most {args.region}, or a larger "
                       "--region (at most the device's capacity)")
    results = []
    try:
        with target_of(args) as target, scratch_region(target.datapath, dpa, region_size, "--region"):
            for mode in modes:
                for size in sizes:
                    if args.processes > 1:
                        results.append(bandwidth.measure_shared(
                            target.datapath, target.name, mode, size, dpa, region_size, processes=args.processes,
                            seconds=args.seconds, channels=args.channels))
                    else:
                        results.append(bandwidth.measure(target.datapath, mode, size, dpa, region_size,
                                                         seconds=args.seconds, channels=args.channels))
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    show(args.json, {"device": target.name, "private": target.private, "timing": target.timing.to_dict(),
                     "results": [r.to_dict() for r in results]}, lambda: render_bandwidth(target.name, results))
    return 0


def render_bandwidth(name: str, results: list[BandwidthResult]) -> Any:
    """Pure: results -> rich Table."""
    from rich.table import Table

    t = Table(title=f"cxlemu bench bandwidth {name}")
    for col in ("mode", "transfer", "procs", "GB/s", "configured", "error %"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        size = f"{r.size >> 20} MiB" if r.size >= 1 << 20 else f"{r.size >> 10} KiB"
        t.add_row(r.mode, size, str(r.processes), f"{r.gbps:.3f}",
                  f"{r.configured_gbps:g}" if r.configured_gbps else "unthrottled",
                  f"{r.error_pct:.2f}" if r.configured_gbps else "")
    return t


def register_overhead(bench: Any) -> None:
    p = bench.add_parser("overhead", help="the emulator's own cost: copy efficiency, per-transfer time")
    p.add_argument("--impl", choices=("auto", "c", "py"), default="auto")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_overhead)


def cmd_overhead(args: Any) -> int:
    result = overhead.measure(args.impl)
    show(args.json, result.to_dict(), lambda: render_overhead(result))
    return 0


def render_overhead(r: OverheadResult) -> Any:
    from rich.console import Group
    from rich.table import Table

    t = Table(title="copy efficiency: numpy.copyto time / DataPath.read time (1.0 = no overhead)")
    for col in ("size", "numpy µs", "untimed", "timed nil-link, plain numpy", "timed, registered"):
        t.add_column(col, justify="right")
    for row in r.copy:
        t.add_row(f"{row['size'] >> 10} KiB", f"{row['numpy_ns'] / 1e3:.1f}",
                  *(f"{row[k + '_ns'] / 1e3:.1f} µs ({row[k + '_ratio']:.3f})"
                    for k in ("untimed", "timed_nil_link", "timed_registered")))
    p = Table(title="one 64-B transfer from Python, submit to completion (median)")
    p.add_column("path")
    p.add_column("ns", justify="right")
    for k, v in r.per_transfer_ns.items():
        p.add_row(k, f"{v:.0f}")
    return Group(t, p)


def register_fidelity(bench: Any) -> None:
    p = bench.add_parser("fidelity", help="the timed data path's benchmark list, each against its target")
    p.add_argument("--quick", action="store_true", help="fewer hops and shorter streams (a smoke run)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fidelity)


def cmd_fidelity(args: Any) -> int:
    checks = fidelity.run(quick=args.quick)
    show(args.json, {"host": {"cpus": os.cpu_count(), "load": os.getloadavg()}, "checks": checks},
         lambda: render_fidelity(checks))
    return 1 if any(c["pass"] is False for c in checks) else 0


def render_fidelity(checks: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title="cxlemu bench fidelity")
    for col in ("check", "value", "target", ""):
        t.add_column(col, justify="right" if col == "value" else "left")
    for c in checks:
        verdict = {True: "[green]pass[/green]", False: "[red]FAIL[/red]", None: "[dim]info[/dim]"}
        t.add_row(c["check"], f"{c['value']:g}", c["target"], verdict[c["pass"]])
    return t
