"""``cxlemu chmu NAME``: show and program a device's Hotness Monitoring Unit through its registers.

    cxlemu chmu mem0                          # capabilities, configuration, status, hotlist (peek)
    cxlemu chmu mem0 --consume --json         # read the hotlist and advance head past it
    cxlemu chmu mem0 --consume --limit 8      # show and consume the 8 oldest entries only
    cxlemu chmu mem0 --threshold 4 --unit-size 4K --mode epoch --epoch-ms 100   # (re)configure + enable
    cxlemu chmu mem0 --disable | --reset | --clear-overflow
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from tools.cli._common import CliError, parse_size, print_json

_TEXT_LIMIT = 32  # hotlist entries shown as text without --limit
_CONFIG_FLAGS = ("threshold", "unit_size", "mode", "epoch_ms", "downsample", "random", "track",
                 "fill_threshold", "irq_fill")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("chmu", help="show or configure a device's CHMU (hotness monitoring unit)")
    p.add_argument("name", metavar="NAME", help="device name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--consume", action="store_true",
                   help="advance the hotlist head past what is shown (exactly those entries)")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                   help="hotlist entries to show, oldest first (default: 32 as text, all with --json)")
    g = p.add_argument_group("configure (any of these reprograms, resets and enables the unit)")
    g.add_argument("--threshold", type=int, help="hotness threshold (accesses per unit)")
    g.add_argument("--unit-size", help="unit size, a power of two from 256 to 2M (default 4K)")
    g.add_argument("--mode", choices=("epoch", "always-on"), help="reporting mode (default epoch)")
    g.add_argument("--epoch-ms", type=float, help="epoch length in ms, a multiple of 0.1 (default 100)")
    g.add_argument("--downsample", type=int, help="count one access in N (power of two, default 1)")
    g.add_argument("--random", action="store_true", default=None, help="randomised downsampling")
    g.add_argument("--track", choices=("r", "w", "rw"), help="requests to count (default rw)")
    g.add_argument("--fill-threshold", type=int, help="raise the level interrupt at this many entries")
    g.add_argument("--irq-fill", action="store_true", default=None, help="interrupt on the fill threshold")
    g.add_argument("--no-wait", action="store_true", help="do not wait for the firmware to apply it")
    a = p.add_argument_group("actions")
    a.add_argument("--disable", action="store_true", help="stop counting")
    a.add_argument("--reset", action="store_true", help="clear counters, hotlist and status")
    a.add_argument("--clear-overflow", action="store_true", help="clear the overflow / fill status bits")
    p.set_defaults(func=_cmd_chmu)


def _positive_int(text: str) -> int:
    """--limit: a whole number >= 1 (an argparse ``type=``: a bad one is a one-line error, exit 2)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"malformed number {text!r}: use a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _open(name: str):
    from driver.chmu import ChmuRegs
    from emulator.device import open_bar
    from emulator.spec.errors import DeviceNotFound

    try:
        bar = open_bar(name, writable=True)
    except DeviceNotFound as exc:
        raise CliError(str(exc)) from None
    return bar, ChmuRegs.of_bar(bar)


def _configure(regs: Any, args: argparse.Namespace) -> None:
    from emulator.spec.errors import ConfigError

    epoch_ns = round((args.epoch_ms if args.epoch_ms is not None else 100.0) * 1e6)
    try:
        regs.configure(unit_size=parse_size(args.unit_size) if args.unit_size else 4096,
                       threshold=args.threshold if args.threshold is not None else 1,
                       mode="always_on" if args.mode == "always-on" else "epoch", epoch_ns=epoch_ns,
                       downsampling=args.downsample or 1, randomized=bool(args.random),
                       track=args.track or "rw", fill_threshold=args.fill_threshold or 0,
                       irq_on_fill=bool(args.irq_fill))
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _wait_applied(regs: Any, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while regs.busy:
        if time.monotonic() > deadline:
            raise CliError("the device did not apply the CHMU configuration within 2 s: "
                           "is its firmware running (`cxlemu serve`)? (--no-wait to skip)")
        time.sleep(0.001)


def _cmd_chmu(args: argparse.Namespace) -> int:
    bar, regs = _open(args.name)
    doc = _apply_and_read(regs, args)  # on an error the mapping is left to the garbage collector
    del regs
    bar.close()
    if args.json:
        print_json(doc)
    else:
        _print_text(doc)
    return 0


def _apply_and_read(regs: Any, args: argparse.Namespace) -> dict[str, Any]:
    if any(getattr(args, f) is not None for f in _CONFIG_FLAGS):
        _configure(regs, args)
        if not args.no_wait:
            _wait_applied(regs)
    if args.disable:
        regs.disable()
    if args.reset:
        regs.reset()
    if args.clear_overflow:
        regs.clear_status(overflow=True, fill=True)
    limit = args.limit if args.limit is not None else None if args.json else _TEXT_LIMIT
    shown = regs.read_hotlist(consume=False)[:limit]
    status = regs.status()  # after the read: its entries count at least those read
    consumed = regs.consume(len(shown)) if args.consume else 0  # what is shown, never more
    return {"name": args.name, "capabilities": regs.capabilities(), "config": regs.config(),
            "status": vars(status) | {"entries": status.entries},
            "hotlist": [{"dpa": dpa, "count": n} for dpa, n in shown], "consumed": consumed}


def _print_text(doc: dict[str, Any]) -> None:
    c, s = doc["config"], doc["status"]
    state = "enabled" if s["enabled"] else "disabled"
    epoch = f"epoch {c['epoch_ns'] / 1e6:g} ms" if c["mode"] == "epoch" else "always-on"
    print(f"{doc['name']}: CHMU {state}, {epoch}, unit {c['unit_size']} B, threshold {c['threshold']}, "
          f"track {c['track']}, downsampling 1/{c['downsampling']}{' random' if c['randomized'] else ''}")
    flags = [n for n in ("overflow", "fill_threshold_reached") if s[n]]
    print(f"hotlist: {s['entries']}/{s['hotlist_size'] - 1} entries (head {s['head']}, tail {s['tail']})"
          + (f", status: {', '.join(flags)}" if flags else ""))
    for e in doc["hotlist"]:
        print(f"  DPA {e['dpa']:#014x}  count {e['count']}")
    more = s["entries"] - len(doc["hotlist"])
    if more > 0:
        print(f"  ... {more} more, not shown{' nor consumed' if doc['consumed'] else ''} (--limit N or --json)")
    if doc["consumed"]:
        print(f"consumed {doc['consumed']} entries")
