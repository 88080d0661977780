"""`cxlemu presets`: the shipped timing presets, their numbers and where they come from."""
from __future__ import annotations

import argparse
from typing import Any

from tools.cli._common import CliError, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list timing presets with their numbers and sources")
    p.add_argument("names", nargs="*", help="only these presets")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.set_defaults(func=cmd_presets)


def record(preset: Any) -> dict[str, Any]:
    return {"name": preset.name, "description": preset.description, "source": preset.source,
            "note": preset.note, "derived_from": preset.derived_from, "timing": preset.timing.to_dict()}


def _bw(gbps: float | None) -> str:
    return f"{gbps:g}" if gbps else "unthrottled"


def render(records: list[dict[str, Any]]) -> Any:
    """Pure: records -> a rich renderable, the numbers in a table and each source below it
    (tests render it with Console(record=True))."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="cxlemu timing presets", caption="latency is added to local DRAM; bandwidth is per direction")
    for col, kw in (("preset", {"style": "bold", "no_wrap": True}), ("rd ns", {"justify": "right"}),
                    ("wr ns", {"justify": "right"}), ("rd GB/s", {"justify": "right"}),
                    ("wr GB/s", {"justify": "right"}), ("what", {"ratio": 1})):
        table.add_column(col, **kw)
    sources = []
    for i, r in enumerate(records, 1):
        t = r["timing"]
        table.add_row(r["name"], f"{t['read_latency_ns']:g}", f"{t['write_latency_ns']:g}",
                      _bw(t["read_bandwidth_gbps"]), _bw(t["write_bandwidth_gbps"]),
                      f"{r['description']} [{i}]")
        line = Text(f"[{i}] {r['name']}: {r['source']}")
        if r["derived_from"]:
            line.append(f"\n    {r['derived_from']}", style="dim")
        sources.append(line)
    return Group(table, Text("sources:", style="bold"), *sources)


def cmd_presets(args: argparse.Namespace) -> int:
    from emulator import presets

    names = args.names or presets.names()
    try:
        records = [record(presets.load(n)) for n in names]
    except presets.UnknownPreset as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print_json(records)
        return 0
    from rich.console import Console

    Console().print(render(records))
    return 0
