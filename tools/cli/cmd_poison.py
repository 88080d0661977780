"""Media commands: `cxlemu poison list|inject|clear`, `cxlemu scan-media`, `cxlemu sanitize`.

    cxlemu poison list mem0 [--dpa 0x1000 --length 1M] [--human]
    cxlemu poison inject mem0 0x1000
    cxlemu poison clear mem0 0x1000 [--data HEX64]
    cxlemu scan-media mem0 [--dpa X --length SIZE] [--no-event-log]
    cxlemu sanitize mem0 [--erase]

JSON on stdout (as `cxl list --media-errors` prints media errors); progress bars on stderr.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tools.cli._common import (
    CliError,
    parse_hex,
    parse_int,
    parse_size,
    print_json,
)
from tools.cli._common import (
    memdev_session as device,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("poison", help="list, inject or clear poisoned 64-B lines")
    psub = p.add_subparsers(dest="poison_command", metavar="ACTION", parser_class=type(p))
    psub.required = True
    q = psub.add_parser("list", help="the device's poison list (Get Poison List) as JSON")
    q.add_argument("name")
    q.add_argument("--dpa", default="0", help="start of the range (default 0)")
    q.add_argument("--length", default=None, help="size of the range, e.g. 1M (default: to the end)")
    q.add_argument("--human", action="store_true", help="a rich table instead of JSON")
    q.set_defaults(func=cmd_poison_list)
    q = psub.add_parser("inject", help="poison the 64-B line at DPA (Inject Poison)")
    q.add_argument("name")
    q.add_argument("dpa", help="64-B aligned device physical address, e.g. 0x1000")
    q.set_defaults(func=cmd_poison_inject)
    q = psub.add_parser("clear", help="write a 64-B line and unpoison it (Clear Poison)")
    q.add_argument("name")
    q.add_argument("dpa", help="64-B aligned device physical address")
    q.add_argument("--data", default=None, help="the 64 bytes to write, as hex (default zeros)")
    q.set_defaults(func=cmd_poison_clear)

    p = sub.add_parser("scan-media", help="scan the media for errors (background) and print what it found")
    p.add_argument("name")
    p.add_argument("--dpa", default="0", help="start of the range (default 0)")
    p.add_argument("--length", default=None, help="size of the range (default: to the end)")
    p.add_argument("--no-event-log", action="store_true", help="do not log the errors found as events")
    p.set_defaults(func=cmd_scan_media)

    p = sub.add_parser("sanitize", help="erase media, LSA, poison and events (background, with progress)")
    p.add_argument("name")
    p.add_argument("--erase", action="store_true",
                   help="Secure Erase (4401h) instead, as `cxl sanitize-memdev --erase`: media and poison "
                        "only, LSA and events kept")
    p.set_defaults(func=cmd_sanitize)




@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields the callback that takes percent complete."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=100)
        yield lambda percent: bar.update(task, completed=percent)


def _range(args: argparse.Namespace) -> tuple[int, int | None]:
    dpa = parse_int(args.dpa, "DPA")
    return dpa, None if args.length is None else parse_size(args.length)


def _scan_range(args: argparse.Namespace, capacity: int) -> tuple[int, int]:
    """--dpa / --length as a non-empty range inside the device, else a one-line error naming the
    valid range (an empty scan would print nothing and exit 0; one past the end, an inverted range)."""
    dpa, length = _range(args)
    shown = f"[{dpa:#x}, {'end of device' if length is None else hex(dpa + length)})"
    device = f"the device is [0x0, {capacity:#x})"
    if not 0 <= dpa < capacity:
        raise CliError(f"range {shown} is outside the device: {device}, use a --dpa below {capacity:#x}")
    if length == 0:
        raise CliError(f"range {shown} is empty: {device}, use a --length of 64 to {capacity - dpa:#x} "
                       f"from --dpa {dpa:#x}")
    if length is not None and dpa + length > capacity:
        raise CliError(f"range {shown} ends past the device: {device}, use a --length of at most "
                       f"{capacity - dpa:#x} from --dpa {dpa:#x}")
    return dpa, capacity - dpa if length is None else length


def _json_errors(records: list[Any]) -> list[dict[str, Any]]:
    return [r.to_json() for r in records]


def cmd_poison_list(args: argparse.Namespace) -> int:
    with device(args.name) as md:
        plist = md.get_poison_list(*_range(args))
    if args.human:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{args.name} poison list" + (" (overflowed)" if plist.overflow else ""))
        for col in ("dpa", "length", "source"):
            table.add_column(col)
        for r in plist.records:
            table.add_row(f"{r.dpa:#x}", str(r.length), r.source)
        Console().print(table)
        return 0
    print_json({"memdev": args.name, "overflow": plist.overflow, "overflow_timestamp": plist.overflow_timestamp,
                "scan_running": plist.scan_running, "media_errors": _json_errors(plist.records)})
    return 0


def cmd_poison_inject(args: argparse.Namespace) -> int:
    dpa = parse_int(args.dpa, "DPA")
    with device(args.name) as md:
        md.inject_poison(dpa)
    print_json({"memdev": args.name, "dpa": dpa, "poisoned": True})
    return 0


def cmd_poison_clear(args: argparse.Namespace) -> int:
    dpa = parse_int(args.dpa, "DPA")
    data = bytes(64) if args.data is None else parse_hex(args.data, "--data")
    if len(data) != 64:
        raise CliError(f"--data must be exactly 64 bytes (128 hex digits), got {len(data)}")
    with device(args.name) as md:
        md.clear_poison(dpa, data)
    print_json({"memdev": args.name, "dpa": dpa, "poisoned": False})
    return 0


def cmd_scan_media(args: argparse.Namespace) -> int:
    with device(args.name) as md:
        dpa, length = _scan_range(args, md.config.capacity)
        md._dpa_range(dpa, length)  # a misaligned range fails here, before the progress bar is drawn
        with progress_bar(f"scan {args.name}") as update:
            res = md.scan_media(dpa, length, log_events=not args.no_event_log, progress=update)
    print_json({"memdev": args.name, "stopped_prematurely": res.stopped_prematurely,
                "restart_dpa": res.restart_dpa, "restart_length": res.restart_length,
                "media_errors": _json_errors(res.records)})
    return 0


def cmd_sanitize(args: argparse.Namespace) -> int:
    what = "secure erase" if args.erase else "sanitize"
    with device(args.name) as md, progress_bar(f"{what} {args.name}") as update:
        (md.secure_erase if args.erase else md.sanitize)(progress=update)
    print_json({"memdev": args.name, "secure_erased" if args.erase else "sanitized": True})
    return 0
