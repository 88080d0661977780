"""Pure render functions: a `DeviceView` (or several) in, a rich renderable out.

Nothing here reads a clock, a file or the terminal; the caller passes `now` where a function
needs it. Tests render each panel with ``Console(record=True, width=...)`` and assert on the text.
"""
from __future__ import annotations

import math
from datetime import datetime, timezone

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from emulator.telemetry import (
    LOG_NAMES,
    POOL_PHASES,
    FirmwareTelemetry,
    HostTelemetry,
    PoolHost,
    PoolTelemetry,
    TelemetrySnapshot,
)
from emulator.timing import linkstate
from tools.monitor.history import DIRECTIONS, sparkline
from tools.monitor.source import DeviceView, timed_transfers

MEDIA_STATUS = {0: "not ready", 1: "ready", 2: "error", 3: "disabled"}  # CXL r3.1 §8.2.8.5.1.1
# Get Health Info health status bits, CXL r3.1 §8.2.9.9.3.1 (Table 8-133).
HEALTH_BITS = ("maintenance needed", "performance degraded", "replace hardware")
POISON_SOURCES = {0: "unknown", 1: "external", 2: "internal", 3: "injected", 7: "vendor"}
STATE_STYLE = {"served": "green", "stopped": "yellow", "gone": "bold red", "not found": "red"}
LOG_STYLE = {"info": "cyan", "warn": "yellow", "fail": "red", "fatal": "bold red", "dcd": "magenta"}
HEAT_CHARS = " ░▒▓█"
PHASE_STYLE = {"out": "dim", "joining": "yellow", "member": "green"}


def fmt_bytes(n: float) -> str:
    """Binary units, one decimal: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_rate(bytes_per_s: float) -> str:
    """Decimal units, as link bandwidth is quoted: 2.5e9 -> '2.50 GB/s'."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def fmt_ns(ns: float) -> str:
    """A duration: '850 ns', '12.3 µs', '4.56 ms', '7.89 s'."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.{1 if unit == 'µs' else 2}f} {unit}"
    return f"{ns:.0f} ns"


def fmt_timestamp(ns: int) -> str:
    """A device timestamp (ns since the Unix epoch, §8.2.9.4.1) as UTC time of day."""
    return datetime.fromtimestamp(ns // 1_000_000_000, timezone.utc).strftime("%H:%M:%S") + \
        f".{ns // 1_000_000 % 1000:03d}"


def fmt_pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def bar(fraction: float, width: int) -> str:
    """A text bar of `width` cells, `fraction` of them full (clamped to 0..1)."""
    full = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * full + "░" * (width - full)


def health_text(status: int) -> str:
    names = [name for bit, name in enumerate(HEALTH_BITS) if status >> bit & 1]
    return ", ".join(names) if names else "ok"


def health_cell(snap: TelemetrySnapshot | None) -> Text:
    """The device table's health column: the health status bits, and in red when the device's
    own state cannot be saved (layout 1.2 on: poison and firmware-slot commands are refused)."""
    fw = snap.firmware if snap else None
    if fw is None:
        return Text("-")
    cell = Text(health_text(fw.health_status))
    if snap is not None and snap.has("firmware", "state_save_failures") and fw.state_save_failures:
        cell.append(f"; state NOT SAVED ({fw.state_save_failures} tries)", style="bold red")
    return cell


def _title(view: DeviceView, what: str) -> str:
    return what if view.up else f"{what} (last seen)"


def _detail(view: DeviceView) -> Text:
    if view.stale:
        assert view.telemetry_age_s is not None
        return Text(f"{view.detail}; telemetry {view.telemetry_age_s:.0f} s old", style="yellow")
    return Text(view.detail)


def notes_line(view: DeviceView) -> Text:
    """What the telemetry reader could not read, as one dim line (empty when all is well)."""
    notes = view.snapshot.notes if view.snapshot else []
    return Text("; ".join(notes), style="dim") if notes else Text()


def device_table(views: list[DeviceView], selected: int) -> Table:
    """One row per device: state, media status, health, temperature, uptime."""
    table = Table(show_edge=False, pad_edge=False, box=box.SIMPLE_HEAD)
    for col in ("", "device", "state", "media", "health", "temp", "uptime", "detail"):
        table.add_column(col, no_wrap=True)
    for i, view in enumerate(views):
        fw = view.snapshot.firmware if view.snapshot else None
        table.add_row(
            "▶" if i == selected else "", view.name, Text(view.state, style=STATE_STYLE[view.state]),
            MEDIA_STATUS.get(fw.media_status, "?") if fw else "-",
            health_cell(view.snapshot),
            f"{fw.temperature_c} °C" if fw else "-",
            fmt_ns(fw.uptime_ns) if fw else "-", _detail(view))
    return table


def capacity_panel(view: DeviceView, width: int = 30) -> Panel:
    """Used DPA bytes against capacity, as a bar."""
    fw = view.snapshot.firmware if view.snapshot else None
    total = fw.capacity_bytes if fw and fw.capacity_bytes else view.capacity_bytes
    if fw is None:
        return Panel(Text(f"capacity {fmt_bytes(total)}; firmware has not published usage"),
                     title=_title(view, "capacity"))
    used = fw.capacity_used_bytes
    line = Text(bar(used / total if total else 0.0, width), style="blue")
    line.append(f"  {fmt_bytes(used)} of {fmt_bytes(total)} used ({fmt_pct(used, total)})")
    return Panel(line, title=_title(view, "capacity"))


def bandwidth_panel(view: DeviceView, now: float, width: int = 40) -> Panel:
    """Per direction: the latest rate and totals since start, then a sparkline of the last minute
    in `width` cells (one cell = window / width seconds)."""
    link = view.link
    if link is None:
        return Panel(Text("no data path yet: no timed transfer has stamped the link-state page",
                          style="dim"), title=_title(view, "bandwidth"))
    latest = view.history.latest()
    series = [view.history.series(d, width, now) for d in range(len(DIRECTIONS))]
    top = max((v for s in series for v in s if v is not None), default=0.0)
    lines = Text(no_wrap=True, overflow="crop")
    for d, name in enumerate(DIRECTIONS):
        rate = fmt_rate(latest.bytes_per_s[d]) if latest else "measuring"
        lines.append(f"{name:<6}", style="bold")
        lines.append(f"{rate:>11}  total {fmt_bytes(link[f'{name}_bytes'])}, "
                     f"{link[f'{name}_transfers']:,} transfers\n      ")
        lines.append(sparkline(series[d], top), style="green")
        lines.append("\n")
    lines.append(f"last {view.history.window_s:.0f} s, peak {fmt_rate(top)}", style="dim")
    return Panel(lines, title=_title(view, "bandwidth"))


def _bucket_label(k: int) -> str:
    lo = 0 if k == 0 else 1 << k
    return f"{fmt_ns(lo)}–{fmt_ns((1 << (k + 1)) - 1)}" if k < linkstate.HIST_BUCKETS - 1 else f"≥{fmt_ns(lo)}"


def latency_panel(view: DeviceView, width: int = 30) -> Panel:
    """Per direction: the transfers since start (the bandwidth panel's count, the same field), the
    mean latency of the timed ones, and their log2 histogram over the window."""
    link = view.link
    if link is None:
        return Panel(Text("no data path yet", style="dim"), title=_title(view, "latency"))
    parts: list[RenderableType] = []
    for d, name in enumerate(DIRECTIONS):
        counts, span = view.history.latency_counts(d)
        n, timed = link[f"{name}_transfers"], timed_transfers(link, name)
        mean = f"mean {fmt_ns(link[f'{name}_latency_ns'] / timed)}" if timed else "mean -"
        parts.append(Text(f"{name}: {n:,} transfers, {mean}, {span}", style="bold"))
        used = [k for k, c in enumerate(counts) if c]
        if not used:
            note = ("no transfers" if not n else "none timed: an untimed link records no latency" if not timed
                    else f"none timed in the {span}")
            parts.append(Text(f"  {note}", style="dim"))
            continue
        top = max(counts)
        grid = Table.grid(padding=(0, 1))
        for _ in range(3):
            grid.add_column(no_wrap=True)
        for k in range(used[0], used[-1] + 1):
            grid.add_row(f"  {_bucket_label(k):>17}", Text(bar(counts[k] / top, width).rstrip("░"),
                                                             style="magenta"), f"{counts[k]:,}")
        parts.append(grid)
    return Panel(Group(*parts), title=_title(view, "latency"))


def queue_panel(view: DeviceView) -> Panel:
    """Queue depths (KV shim) and the firmware's background operation."""
    snap = view.snapshot
    host, fw = (snap.host, snap.firmware) if snap else (None, None)
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    if host is not None:
        table.add_row("DMA submission", str(host.dma_sq_depth))
        table.add_row("DMA completion", str(host.dma_cq_depth))
        table.add_row("prefetch queue", str(host.prefetch_queue_depth))
    else:
        table.add_row(Text("no KV shim attached", style="dim"), "")
    if fw is not None:
        bg = f"{fw.bg_opcode:#06x} {fw.bg_percent}%" if fw.bg_running else "idle"
        table.add_row("background op", bg)
    return Panel(table, title=_title(view, "queues"))


def kv_panel(view: DeviceView) -> Panel:
    """Hit rate, prefetch timeliness, stall time, accelerator residency and the prefix-sharing
    saving of the KV shim."""
    host = view.snapshot.host if view.snapshot else None
    if host is None:
        return Panel(Text("no KV shim attached (host section empty)", style="dim"),
                     title=_title(view, "KV cache"))
    lookups = host.hits + host.misses
    issued = host.prefetch_issued
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_row("hit rate", f"{fmt_pct(host.hits, lookups)}  ({host.hits:,} hits, {host.misses:,} misses)")
    table.add_row("prefetch", f"{issued:,} issued: {fmt_pct(host.prefetch_useful, issued)} useful, "
                              f"{fmt_pct(host.prefetch_late, issued)} late, "
                              f"{fmt_pct(host.prefetch_wasted, issued)} wasted")
    table.add_row("transfers", f"{host.loads:,} loads, {host.offloads:,} offloads, {host.evictions:,} evictions")
    table.add_row("stall", f"{fmt_ns(host.stall_ns)} over {host.tokens_generated:,} tokens")
    table.add_row("blocks", f"{bar(host.blocks_resident / host.blocks_total if host.blocks_total else 0, 20)} "
                            f"{host.blocks_resident:,}/{host.blocks_total:,} resident")
    table.add_row("HBM", f"{fmt_bytes(host.hbm_bytes)} of {fmt_bytes(host.hbm_budget_bytes)}")
    for label, text in sharing_rows(view.snapshot, host):
        table.add_row(label, text)
    return Panel(table, title=_title(view, f"KV cache (writer pid {host.writer_pid})"))


def sharing_rows(snap: TelemetrySnapshot | None, host: HostTelemetry) -> list[tuple[str, str | Text]]:
    """Prefix sharing: device chunks shared now and the bytes that saves, then the totals of
    writes and reads avoided and copies on write. A page of layout 1.0 has no such fields."""
    if snap is None or not snap.has("host", "device_saved_bytes"):
        version = ".".join(map(str, snap.version)) if snap and snap.version else "?"
        return [("sharing", Text(f"not published (telemetry layout {version})", style="dim"))]
    shared = (f"{host.device_chunks_shared:,}/{host.device_chunks_used:,} device chunks shared, "
              f"{fmt_bytes(host.device_saved_bytes)} saved")
    avoided = (f"{fmt_bytes(host.dedup_write_bytes)} unwritten, {fmt_bytes(host.dedup_load_bytes)} unread, "
               f"{host.cow_copies:,} CoW")
    return [("sharing", shared), ("dedup", avoided)]


def heat_cells(fw: FirmwareTelemetry, capacity: int, cells: int) -> list[int]:
    """Hotlist counts summed into `cells` equal slices of the DPA space."""
    out = [0] * cells
    if capacity <= 0:
        return out
    for unit, count in fw.hotlist:
        dpa = unit * fw.chmu_unit_size
        if dpa < capacity:
            out[dpa * cells // capacity] += count
    return out


def heat_level(count: int, top: int) -> int:
    """0 for an empty cell, else 1..4 on a log scale up to the hottest cell (counts span decades)."""
    steps = len(HEAT_CHARS) - 1
    if count <= 0:
        return 0
    if top <= 1:
        return steps
    return 1 + min(steps - 1, int(math.log(count) / math.log(top) * (steps - 1)))


def heatmap_panel(view: DeviceView, width: int = 64, rows: int = 4) -> Panel:
    """The CHMU hotlist as a heat map: the DPA space in width x rows cells, row-major from DPA 0."""
    fw = view.snapshot.firmware if view.snapshot else None
    capacity = fw.capacity_bytes if fw and fw.capacity_bytes else view.capacity_bytes
    if fw is None or not fw.chmu_enabled:
        return Panel(Text("CHMU disabled" if fw else "firmware has not published", style="dim"),
                     title=_title(view, "CHMU hotlist"))
    cells = heat_cells(fw, capacity, width * rows)
    top = max(cells)
    text = Text()
    for r in range(rows):
        for c in cells[r * width:(r + 1) * width]:
            level = heat_level(c, top)
            text.append(HEAT_CHARS[level], style="red" if level >= 3 else "yellow")
        text.append("\n")
    hottest = max(fw.hotlist, key=lambda p: p[1], default=None)
    legend = (f"epoch {fw.chmu_epoch_count:,}, {len(fw.hotlist)} hot units of {fmt_bytes(fw.chmu_unit_size)}; "
              f"cell = {fmt_bytes(capacity / (width * rows))}")
    if hottest:
        legend += f"; hottest DPA {hottest[0] * fw.chmu_unit_size:#x} ({hottest[1]:,})"
    text.append(legend, style="dim")
    return Panel(text, title=_title(view, "CHMU hotlist"))


def events_panel(view: DeviceView, limit: int = 6) -> Panel:
    """Event log counts, the newest events, the poison list."""
    fw = view.snapshot.firmware if view.snapshot else None
    if fw is None:
        return Panel(Text("firmware has not published", style="dim"), title=_title(view, "events & poison"))
    counts = Text("events: ")
    for name in LOG_NAMES:
        counts.append(f"{name} {getattr(fw, f'events_{name}')}  ", style=LOG_STYLE[name])
    counts.append(f"poison records {fw.poison_count}", style="red" if fw.poison_count else "")
    rows = [counts]  # one line per entry; long summaries are cut at the panel's edge
    for ev in fw.recent_events[:limit]:
        log = LOG_NAMES[ev.log] if ev.log < len(LOG_NAMES) else str(ev.log)
        rows.append(Text.assemble(f"{fmt_timestamp(ev.timestamp_ns)} ", (f"{log:<6}", LOG_STYLE.get(log, "")),
                                  f" {ev.text}", no_wrap=True, overflow="ellipsis"))
    for p in fw.recent_poison[:limit]:
        rows.append(Text.assemble(("poison", "red"), f"       DPA {p.dpa:#x} +{fmt_bytes(p.length)} "
                                  f"{POISON_SOURCES.get(p.source, str(p.source))}", no_wrap=True))
    return Panel(Group(*rows), title=_title(view, "events & poison"))


def pool_of(view: DeviceView) -> PoolTelemetry | None:
    """The pool section when there is something to show: several host ports, or a KV pool."""
    pool = view.snapshot.pool if view.snapshot else None
    return pool if pool is not None and (pool.hosts > 1 or pool.pool_hosts > 0) else None


def _extents_cell(row: PoolHost) -> str:
    cell = f"{row.extents} ({fmt_bytes(row.extent_bytes)})" if row.extents else "0"
    return cell + (f" +{row.pending_extents} offered" if row.pending_extents else "")


def _host_state(row: PoolHost, in_pool: bool) -> Text:
    if in_pool:
        phase = POOL_PHASES[row.pool_phase] if row.pool_phase < len(POOL_PHASES) else str(row.pool_phase)
        return Text(phase, style=PHASE_STYLE.get(phase, ""))
    return Text("claimed" if row.pid else "free", style="" if row.pid else "dim")


def _pool_line(pool: PoolTelemetry) -> Text:
    if not pool.pool_hosts:
        return Text("no KV pool on this device (`cxlemu pool create NAME --size SIZE` makes one)", style="dim")
    return Text(f"pool: {pool.pool_used:,}/{pool.pool_slots:,} slots of {fmt_bytes(pool.pool_slot_bytes)} used "
                f"({fmt_pct(pool.pool_used, pool.pool_slots)}), {pool.pool_sealed:,} sealed, "
                f"{pool.pool_shared:,} read across hosts; {pool.pool_evictions:,} evicted "
                f"({pool.pool_quota_evictions:,} over quota), {pool.pool_reaped_allocations:,} allocations "
                f"reaped, {pool.pool_cleared_pins:,} pins cleared")


def hosts_panel(view: DeviceView) -> Panel:
    """One row per host port: its process, its state (in the pool, or claimed), its Dynamic
    Capacity extents and the shared (tagged) bytes among them; with a pool, what it holds there:
    sealed blocks (and how many of them another host read: shared), its hits (and those served by another host's
    blocks), pins, allocations in flight, unshared bytes against its quota. Then the pool's totals."""
    pool = view.snapshot.pool if view.snapshot else None
    if pool is None:
        return Panel(Text("no hosts/pool section (telemetry layout before 1.3)", style="dim"),
                     title=_title(view, "hosts & pool"))
    in_pool = pool.pool_hosts > 0
    table = Table(show_edge=False, pad_edge=False, box=box.SIMPLE_HEAD)
    cols = ["host", "pid", "state", "extents", "shared ext"]
    if in_pool:
        cols += ["sealed", "shared", "hits", "cross-host", "pins", "in flight", "unshared / quota"]
    for col in cols:
        table.add_column(col, no_wrap=True, justify="left" if col in ("host", "state", "extents") else "right")
    for h, row in enumerate(pool.host_rows):
        pid = row.pid or row.pool_pid
        cells: list[str | Text] = [str(h), str(pid) if pid else "-", _host_state(row, in_pool and h < pool.pool_hosts),
                                   _extents_cell(row), fmt_bytes(row.shared_extent_bytes)]
        if in_pool:
            cells += [f"{row.sealed:,}", f"{row.shared:,}", f"{row.pool_hits:,}", f"{row.cross_hits:,}",
                      f"{row.pins:,}", f"{row.allocations:,}",
                      f"{fmt_bytes(row.unshared_bytes)} / {fmt_bytes(row.quota_bytes)}"]
        table.add_row(*cells)
    return Panel(Group(table, _pool_line(pool)), title=_title(view, f"hosts & pool ({pool.hosts} ports)"))
