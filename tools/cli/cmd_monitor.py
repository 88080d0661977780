"""`cxlemu monitor` (live dashboard) and `cxlemu exporter` (Prometheus metrics)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from tools.cli._common import CliError, parse_port


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("monitor", help="live dashboard of devices (rich)",
                              description="Watch devices' telemetry pages: state, capacity, bandwidth, "
                                          "latency, KV hit rate, CHMU hotlist, events and poison.")
    p.add_argument("names", nargs="*", metavar="NAME", help="devices to watch (default: all)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    p.add_argument("--frames", type=int, metavar="N",
                   help="print N frames to stdout and exit (without a terminal: frames until Ctrl-C)")
    p.add_argument("--width", type=int, metavar="COLUMNS",
                   help="output width (default: the terminal's, 120 when not a terminal)")
    p.set_defaults(func=cmd_monitor)

    e = subparsers.add_parser("exporter", help="Prometheus metrics of devices over HTTP",
                              description="Serve GET /metrics (text format 0.0.4) from devices' telemetry pages.")
    e.add_argument("names", nargs="*", metavar="NAME", help="devices to export (default: all)")
    e.add_argument("--port", type=parse_port, required=True, help="TCP port to listen on, 1..65535")
    e.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    e.set_defaults(func=cmd_exporter)


def cmd_monitor(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tools.monitor import Monitor

    if not args.interval > 0:
        raise CliError(f"--interval must be > 0 seconds, got {args.interval}")
    if args.frames is not None and args.frames < 1:
        raise CliError(f"--frames must be >= 1, got {args.frames}")
    if args.width is not None and args.width < 60:
        raise CliError(f"--width must be >= 60 columns, got {args.width}")
    _check_names(args.names)
    width = args.width
    if width is None and not sys.stdout.isatty():
        width = int(os.environ.get("COLUMNS", "0")) or 120  # rich would say 80: too narrow
    monitor = Monitor(args.names or None, interval=args.interval, console=Console(width=width))
    if args.frames is not None or not sys.stdout.isatty():
        return monitor.run_frames(args.frames)  # a pipe or a log: frames one after another
    return monitor.run_live()


def _check_names(names: list[str]) -> None:
    """A named device must exist when the monitor starts: a typo would otherwise wait forever on a
    device that never appears (one that goes away later is shown as gone)."""
    from emulator.device import list_devices, runtime_dir
    from emulator.spec.errors import DeviceNotFound

    known = set(list_devices())
    for name in names:
        if name not in known:
            raise CliError(str(DeviceNotFound(name, str(runtime_dir()))))


def cmd_exporter(args: argparse.Namespace) -> int:
    from tools.exporter import start_exporter

    try:
        server = start_exporter(args.names or None, args.host, args.port)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", exit_code=1) from None
    which = ", ".join(args.names) if args.names else "all devices"
    print(f"cxlemu exporter: {which} at http://{args.host}:{server.port}/metrics (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()
