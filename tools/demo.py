"""`cxlemu demo`: a device served in-process, walked through as a new user would.

Identify, health, a poison inject / list / read / clear, a sanitize with a progress bar, and —
where torch and transformers are installed — a generation whose KV cache lives on the device.
Every step checks what it shows; the demo exits non-zero if one fails.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

from driver import MemDev, PoisonError
from emulator.device import DeviceConfig, serve
from tools.common import install_extra

DEMO_DPA = 0x10000
PATTERN = bytes(range(256)) * 2  # 512 B: eight 64-B lines


class DemoFailed(Exception):
    """A step showed something other than what the spec says it must."""


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise DemoFailed(what)


def _kv(console: Console, md_name: str) -> bool | None:
    """The KV generation step, or None when the KV extra is not installed."""
    try:
        from driver.kv.demo import run_kv_demo
    except ImportError as exc:
        console.print(escape(f"skipping the KV generation: {exc} ({install_extra('kv')})"), style="yellow")
        return None
    return run_kv_demo(console, device=md_name)


def step_identify(console: Console, md: MemDev) -> None:
    ident = md.identify_memdev()
    table = Table(title="Identify Memory Device (0x4000)", show_header=False)
    for key in ("fw_revision", "total_bytes", "volatile_bytes", "persistent_bytes", "lsa_size",
                "poison_list_max", "inject_poison_limit", "event_log_sizes"):
        table.add_row(key, str(getattr(ident, key)))
    console.print(table)
    _check(ident.total_bytes == md.config.capacity, "Identify reports the configured capacity")


def step_health(console: Console, md: MemDev) -> None:
    health = md.health()
    table = Table(title="Get Health Info (0x4200)", show_header=False)
    for key, value in vars(health).items():
        table.add_row(key, str(value))
    console.print(table)


def step_poison(console: Console, md: MemDev) -> None:
    bad = DEMO_DPA + 0x40
    md.write(DEMO_DPA, PATTERN)
    md.inject_poison(bad)
    listed = md.get_poison_list()
    console.print(f"injected poison at {bad:#x}; poison list: "
                  f"{[(hex(r.dpa), r.length, r.source) for r in listed.records]}")
    _check([r.dpa for r in listed.records] == [bad], "the poison list shows the injected line")
    try:
        md.read(DEMO_DPA, len(PATTERN))
    except PoisonError as exc:
        console.print(f"a read across it fails and returns no data: [red]{exc}[/]")
    else:
        raise DemoFailed("a read across a poisoned line returned data")
    md.clear_poison(bad, PATTERN[0x40:0x80])
    _check(md.get_poison_list().records == [], "clear poison empties the list")
    _check(md.read(DEMO_DPA, len(PATTERN)) == PATTERN, "clear poison wrote the 64 bytes given")
    console.print("cleared (writing the 64 bytes given): the list is empty and the read returns the data")


def step_sanitize(console: Console, md: MemDev) -> None:
    with Progress(TextColumn("sanitize (0x4400)"), BarColumn(), TaskProgressColumn(), console=console) as bar:
        task = bar.add_task("sanitize", total=100)
        md.sanitize(progress=lambda pct: bar.update(task, completed=pct))
        bar.update(task, completed=100)
    _check(md.read(DEMO_DPA, len(PATTERN)) == bytes(len(PATTERN)), "sanitize zeroes the media")
    console.print("media zeroed, media enabled again")


STEPS: list[tuple[str, Callable[[Console, MemDev], None]]] = [
    ("identify", step_identify), ("health", step_health), ("poison", step_poison), ("sanitize", step_sanitize),
]


def run_demo(console: Console | None = None, *, kv: bool = True) -> int:
    console = console or Console()
    name = f"demo{os.getpid()}"
    results: list[tuple[str, str]] = []
    with serve(DeviceConfig(name=name, capacity=256 << 20)):
        console.rule(f"[bold]cxlemu demo[/]: device {name} (256 MiB), firmware in a thread of this process")
        with MemDev.open(name) as md:
            for label, step in STEPS:
                console.rule(label)
                try:
                    step(console, md)
                    results.append((label, "ok"))
                except DemoFailed as exc:
                    results.append((label, f"FAILED: {exc}"))
        if kv:
            console.rule("KV cache on the device")
            outcome = _kv(console, name)
            results.append(("kv generation", {None: "skipped", True: "ok", False: "FAILED"}[outcome]))
    summary = Table(title="demo summary")
    summary.add_column("step")
    summary.add_column("result")
    for label, result in results:
        summary.add_row(label, result if result != "ok" else "[green]ok[/]")
    console.print(summary)
    return 0 if all(r in ("ok", "skipped") for _, r in results) else 1
