"""`cxlemu events NAME [--log LOG] [--clear] [--human]`: read (and clear) the device's event logs.

Without --clear it shows what Get Event Records returns (the oldest records, as many as fit,
and whether there are more); with --clear it drains each log as Linux does (get, clear those
handles, repeat), so every record is shown once and then gone.
"""
from __future__ import annotations

import argparse
from typing import Any

from tools.cli._common import print_json
from tools.cli.cmd_poison import device

LOGS = ("info", "warning", "failure", "fatal", "dcd")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="show (and with --clear, drain) the event logs as JSON")
    p.add_argument("name")
    p.add_argument("--log", choices=LOGS, default=None, help="one log (default: all five)")
    p.add_argument("--clear", action="store_true", help="clear the records shown (drains the log)")
    p.add_argument("--human", action="store_true", help="rich tables instead of JSON")
    p.set_defaults(func=cmd_events)


def _log_json(records: list[Any], batches: list[Any]) -> dict[str, Any]:
    """One log: its records plus the overflow state the first answer reported."""
    first = batches[0]
    return {"overflow": first.overflow, "overflow_count": first.overflow_count,
            "first_overflow_ts": first.first_overflow_ts, "last_overflow_ts": first.last_overflow_ts,
            "more": batches[-1].more, "records": [r.to_json() for r in records]}


def _detail(rec: Any) -> str:
    f = rec.fields
    if rec.kind in ("general_media", "dram"):
        return f"dpa {f['physical_address'] & ~0x3F:#x} type {f['event_type']} transaction {f['transaction_type']}"
    if rec.kind == "memory_module":
        return f"event {f['device_event_type']} health {f['health_status']:#x} temp {f['temperature']} C"
    if rec.kind == "firmware_error":
        return f"opcode {f['opcode']:#06x}: {f['text']}"
    return rec.uuid


def cmd_events(args: argparse.Namespace) -> int:
    logs = [args.log] if args.log else list(LOGS)
    shown: dict[str, tuple[list[Any], list[Any]]] = {}
    with device(args.name) as md:
        for log in logs:
            if args.clear:
                shown[log] = md.drain_events(log)
            else:
                batch = md.get_event_records(log)
                shown[log] = (batch.records, [batch])
    if args.human:
        _print_human(args.name, shown)
    else:
        print_json({"memdev": args.name, "logs": {log: _log_json(*got) for log, got in shown.items()}})
    return 0


def _print_human(name: str, shown: dict[str, tuple[list[Any], list[Any]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for log, (records, batches) in shown.items():
        lost = batches[0].overflow_count
        table = Table(title=f"{name} {log} log" + (f" (overflowed, {lost} lost)" if batches[0].overflow else ""))
        for col in ("handle", "kind", "severity", "timestamp", "detail"):
            table.add_column(col)
        for rec in records:
            table.add_row(str(rec.handle), rec.kind, str(rec.severity), str(rec.timestamp), _detail(rec))
        console.print(table)
