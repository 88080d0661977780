"""Pure render functions of the monitor, rendered to text with Console(record=True)."""
from __future__ import annotations

import io

from rich.console import Console, RenderableType

from emulator.telemetry import (
    EventEntry,
    FirmwareTelemetry,
    HostTelemetry,
    PoisonEntry,
    PoolHost,
    PoolTelemetry,
    TelemetrySnapshot,
)
from emulator.timing import linkstate
from tools.monitor import panels as P
from tools.monitor.app import dashboard, dashboard_grid, header
from tools.monitor.history import LinkHistory, sparkline
from tools.monitor.source import DeviceView

GiB, MiB = 1 << 30, 1 << 20


def render(renderable: RenderableType, width: int = 100) -> str:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def squeeze(text: str) -> str:
    """Runs of spaces to one, so column padding does not make assertions brittle."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def link(**values: int) -> dict[str, int]:
    counters = linkstate.snapshot(bytes(linkstate.USED_BYTES))
    counters.update(values)
    return counters


def firmware(**values: object) -> FirmwareTelemetry:
    base: dict[str, object] = {"uptime_ns": 90 * 10**9, "capacity_bytes": GiB, "capacity_used_bytes": 512 * MiB,
                               "media_status": 1, "temperature_c": 41, "seq": 2, "writer_pid": 100}
    base.update(values)
    return FirmwareTelemetry(**base)  # type: ignore[arg-type]


def view(name: str = "mon0", state: str = "served", fw: FirmwareTelemetry | None = None,
         host: HostTelemetry | None = None, **kw: object) -> DeviceView:
    return DeviceView(name, state, kw.pop("detail", "firmware pid 100"),  # type: ignore[arg-type]
                      TelemetrySnapshot((1, 0), fw or firmware(), host), **kw)  # type: ignore[arg-type]


def test_device_table_rows() -> None:
    """State, media status, health bits, temperature and uptime per device; marker on the selected."""
    views = [view(), view("mon1", "gone", firmware(health_status=0b10, media_status=3, temperature_c=-3),
                          detail="firmware pid 7 exited")]
    text = squeeze(render(P.device_table(views, selected=1), width=120))
    assert "mon0 served ready ok 41 °C 1.50 min" not in text  # uptime is shown in seconds
    assert "mon0 served ready ok 41 °C 90.00 s firmware pid 100" in text
    assert "▶ mon1 gone disabled performance degraded -3 °C 90.00 s firmware pid 7 exited" in text


def test_device_table_flags_a_state_that_cannot_be_saved() -> None:
    """Issue 24.3: layout 1.2's state_save_failures shows in the health column, in red; a page of
    1.1 lacks the field and shows the health bits alone."""
    fw = firmware(health_status=0b1, state_save_failures=5)
    saved = TelemetrySnapshot((1, 2), firmware(), None)
    unsaved = TelemetrySnapshot((1, 2), fw, None)
    older = TelemetrySnapshot((1, 1), fw, None)
    rows = [DeviceView("mon0", "served", "firmware pid 100", snap) for snap in (saved, unsaved, older)]
    text = squeeze(render(P.device_table(rows, selected=0), width=160))
    assert "mon0 served ready ok 41 °C 90.00 s firmware pid 100" in text
    assert "mon0 served ready maintenance needed; state NOT SAVED (5 tries) 41 °C 90.00 s" in text
    assert "mon0 served ready maintenance needed 41 °C 90.00 s firmware pid 100" in text
    cell = P.health_cell(unsaved)
    assert [(cell.plain[s.start:s.end], str(s.style)) for s in cell.spans] == [
        ("; state NOT SAVED (5 tries)", "bold red")]


def test_capacity_bar() -> None:
    text = render(P.capacity_panel(view()))
    assert "█" * 15 + "░" * 15 + "  512.0 MiB of 1.0 GiB used (50.0%)" in text
    assert "capacity" in text and "last seen" not in text


def test_panels_of_a_gone_device_say_last_seen() -> None:
    text = render(P.capacity_panel(view(state="gone")))
    assert "capacity (last seen)" in text


def test_bandwidth_without_data_path_says_so() -> None:
    text = squeeze(render(P.bandwidth_panel(view(), now=0.0)))
    assert "no data path yet: no timed transfer has stamped the link-state page" in text


def test_bandwidth_rates_sparkline_and_totals() -> None:
    """Two samples 1 s apart: 2 GB read, 0.5 GB written -> rates, totals, full sparkline cell."""
    history = LinkHistory()
    history.add(100.0, link())
    now_counters = link(read_bytes=2 * 10**9, read_transfers=1000, write_bytes=5 * 10**8, write_transfers=250)
    history.add(101.0, now_counters)
    v = view(link=now_counters, history=history)
    lines = squeeze(render(P.bandwidth_panel(v, now=101.0, width=10))).splitlines()
    assert lines[1:6] == ["│ read 2.00 GB/s total 1.9 GiB, 1,000 transfers │",
                          "│ █ │",
                          "│ write 500.00 MB/s total 476.8 MiB, 250 transfers │",
                          "│ ▂ │",
                          "│ last 60 s, peak 2.00 GB/s │"]
    raw = render(P.bandwidth_panel(v, now=101.0, width=10)).splitlines()
    assert raw[2].startswith("│       " + " " * 9 + "█ ")  # newest cell is the last of 10


def test_bandwidth_first_frame_is_measuring() -> None:
    history = LinkHistory()
    history.add(5.0, link(read_bytes=64))
    text = squeeze(render(P.bandwidth_panel(view(link=link(read_bytes=64), history=history), now=5.0, width=4)))
    assert "read measuring total 64 B, 0 transfers" in text


def test_sparkline_scale_and_gaps() -> None:
    assert sparkline([0, 1, 2, 4, 8, None], top=8) == "▁▁▂▄█ "
    assert sparkline([None, None]) == "  "
    assert sparkline([3.0, 6.0, 0.01]) == "▄█▁"


def test_history_bins_reset_and_window() -> None:
    """Rates land in time bins of the last minute; a counter going back restarts the history."""
    h = LinkHistory(window_s=60.0)
    h.add(0.0, link())
    h.add(30.0, link(read_bytes=300))   # 10 B/s over (0, 30]
    h.add(60.0, link(read_bytes=1500))  # 40 B/s over (30, 60]
    assert h.series(0, 2, now=60.0) == [10.0, 40.0]
    assert h.series(0, 4, now=60.0) == [None, 10.0, None, 40.0]
    assert h.series(0, 1, now=60.0) == [25.0]
    assert len(h.samples) == 3
    h.add(61.0, link(read_bytes=1600))
    assert [t for t, _ in h.samples] == [30.0, 60.0, 61.0]  # older than 60 s dropped
    h.add(62.0, link(read_bytes=10))  # device recreated
    assert h.latest() is None and len(h.samples) == 1


def test_latency_histogram_rows() -> None:
    counters = link(read_transfers=15, read_latency_ns=15 * 200, read_hist_07=10, read_hist_08=5)
    history = LinkHistory()
    history.add(1.0, counters)
    text = squeeze(render(P.latency_panel(view(link=counters, history=history), width=10)))
    assert "read: 15 transfers, mean 200 ns, since start" in text
    assert "128 ns–255 ns ██████████ 10" in text
    assert "256 ns–511 ns █████ 5" in text
    assert "write: 0 transfers, mean -, since start" in text and "no transfers" in text


def test_latency_and_bandwidth_count_transfers_from_one_field() -> None:
    """An untimed link's 152 reads (counted, no latency recorded): both panels say 152, and the
    latency panel says why it has no histogram instead of "no transfers"."""
    counters = link(read_bytes=152 * 4096, read_transfers=152)
    history = LinkHistory()
    history.add(1.0, counters)
    v = view(link=counters, history=history)
    bandwidth = squeeze(render(P.bandwidth_panel(v, now=1.0, width=4))).splitlines()
    latency = squeeze(render(P.latency_panel(v, width=10))).splitlines()
    assert bandwidth[1] == "│ read measuring total 608.0 KiB, 152 transfers │"
    assert latency[1:5] == ["│ read: 152 transfers, mean -, since start │",
                            "│ none timed: an untimed link records no latency │",
                            "│ write: 0 transfers, mean -, since start │",
                            "│ no transfers │"]


def test_latency_over_a_window_without_timed_transfers_says_so() -> None:
    history = LinkHistory()
    old = link(read_transfers=15, read_latency_ns=15 * 200, read_hist_07=15)
    history.add(1.0, old)
    history.add(3.0, old)
    text = squeeze(render(P.latency_panel(view(link=old, history=history), width=10)))
    assert "read: 15 transfers, mean 200 ns, last 2 s" in text and "none timed in the last 2 s" in text


def test_kv_panel_rates() -> None:
    host = HostTelemetry(hits=900, misses=100, prefetch_issued=200, prefetch_useful=150, prefetch_late=30,
                         prefetch_wasted=20, loads=70, offloads=40, evictions=12, stall_ns=12_345_678,
                         tokens_generated=512, blocks_resident=16, blocks_total=64, hbm_bytes=60 * MiB,
                         hbm_budget_bytes=128 * MiB, writer_pid=4242)
    text = squeeze(render(P.kv_panel(view(host=host))))
    assert "KV cache (writer pid 4242)" in text
    assert "hit rate 90.0% (900 hits, 100 misses)" in text
    assert "prefetch 200 issued: 75.0% useful, 15.0% late, 10.0% wasted" in text
    assert "transfers 70 loads, 40 offloads, 12 evictions" in text
    assert "stall 12.35 ms over 512 tokens" in text
    assert "blocks █████░░░░░░░░░░░░░░░ 16/64 resident" in text
    assert "HBM 60.0 MiB of 128.0 MiB" in text


def test_kv_panel_prefix_sharing() -> None:
    """Layout 1.1: chunks shared now of those used, the device bytes that saves, and the totals of
    writes and reads avoided and copies on write."""
    host = HostTelemetry(device_chunks_shared=32, device_chunks_used=152, device_saved_bytes=16 * 1024,
                         chunk_bytes=256, dedup_write_bytes=8192, dedup_load_bytes=59392, cow_copies=1234,
                         dedup_chunks=32, writer_pid=7)
    v = DeviceView("mon0", "served", "firmware pid 100", TelemetrySnapshot((1, 1), firmware(), host))
    text = squeeze(render(P.kv_panel(v)))
    assert "│ sharing 32/152 device chunks shared, 16.0 KiB saved │" in text
    assert "│ dedup 8.0 KiB unwritten, 58.0 KiB unread, 1,234 CoW │" in text


def test_kv_panel_of_a_layout_1_0_page_says_sharing_is_not_published() -> None:
    """A 1.0 page has no sharing fields: the panel says so instead of showing zeros."""
    text = squeeze(render(P.kv_panel(view(host=HostTelemetry(device_chunks_shared=5)))))
    assert "│ sharing not published (telemetry layout 1.0) │" in text
    assert "dedup" not in text and "device chunks" not in text


def test_kv_panel_without_shim() -> None:
    assert "no KV shim attached (host section empty)" in squeeze(render(P.kv_panel(view())))


def test_queue_panel() -> None:
    host = HostTelemetry(dma_sq_depth=3, dma_cq_depth=1, prefetch_queue_depth=7)
    text = squeeze(render(P.queue_panel(view(fw=firmware(bg_running=1, bg_opcode=0x4400, bg_percent=40),
                                             host=host))))
    assert "│ DMA submission 3 │" in text
    assert "│ DMA completion 1 │" in text
    assert "│ prefetch queue 7 │" in text
    assert "│ background op 0x4400 40% │" in text


def test_heatmap_cells_and_legend() -> None:
    """1 GiB in 8x2 cells of 64 MiB: unit 0 (count 100) is hottest, DPA 512 MiB (count 10) warm."""
    fw = firmware(chmu_enabled=1, chmu_unit_size=4096, chmu_epoch_count=3,
                  hotlist=[(0, 100), (512 * MiB // 4096, 10)])
    assert P.heat_cells(fw, GiB, 16) == [100, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0]
    lines = render(P.heatmap_panel(view(fw=fw), width=8, rows=2)).splitlines()
    assert lines[1].rstrip("│ ") == "│ █"
    assert lines[2].rstrip("│ ") == "│ ▒"
    assert "epoch 3, 2 hot units of 4.0 KiB; cell = 64.0 MiB; hottest DPA 0x0 (100)" in lines[3]


def test_heat_levels_log_scale() -> None:
    assert [P.heat_level(c, 1000) for c in (0, 1, 10, 100, 999, 1000)] == [0, 1, 2, 3, 3, 4]
    assert P.heat_level(1, 1) == 4


def test_heatmap_disabled() -> None:
    assert "CHMU disabled" in render(P.heatmap_panel(view()))


def test_events_and_poison() -> None:
    fw = firmware(events_info=2, events_fail=1, poison_count=1,
                  recent_events=[EventEntry(1_700_000_000_123_000_000, 2, "general media: uncorrectable")],
                  recent_poison=[PoisonEntry(0x4000, 128, 3)])
    text = squeeze(render(P.events_panel(view(fw=fw))))
    assert "events: info 2 warn 0 fail 1 fatal 0 dcd 0 poison records 1" in text
    assert "22:13:20.123 fail general media: uncorrectable" in text
    assert "poison DPA 0x4000 +128 B injected" in text


def test_formatters() -> None:
    assert [P.fmt_bytes(n) for n in (0, 1023, 1536, 3 * GiB)] == ["0 B", "1023 B", "1.5 KiB", "3.0 GiB"]
    assert [P.fmt_rate(r) for r in (12, 1.5e3, 2.5e9)] == ["12 B/s", "1.50 kB/s", "2.50 GB/s"]
    assert [P.fmt_ns(n) for n in (850, 12_300, 4_560_000, 7.89e9)] == ["850 ns", "12.3 µs", "4.56 ms", "7.89 s"]
    assert P.health_text(0b101) == "maintenance needed, replace hardware"


def test_header_and_dashboards() -> None:
    views = [view(), view("mon1", "stopped", detail="not served (no firmware.pid)")]
    assert render(header(views, 1, "12:00:00", paused=True, interactive=True), width=200).strip() == (
        "cxlemu monitor  mon1: stopped (not served (no firmware.pid))  12:00:00  PAUSED  "
        "[←/→ device · space pause · q quit]")
    grid = squeeze(render(dashboard_grid(views, 0, 0.0, "12:00:00"), width=140))
    for title in ("devices", "capacity", "bandwidth", "latency", "KV cache", "queues", "events & poison",
                  "CHMU hotlist"):
        assert f" {title} " in grid
    screen = render(dashboard(views, 0, 0.0, "12:00:00"), width=140)
    assert "cxlemu monitor  mon0: served" in screen and "capacity" in screen


def test_dashboard_for_a_device_never_seen() -> None:
    absent = DeviceView("ghost", "not found", "no device in /x")
    text = squeeze(render(dashboard_grid([absent], 0, 0.0, "t"), width=100))
    assert "ghost is not found: no device in /x; waiting for it to appear" in text
    assert "capacity" not in text


def test_stale_telemetry_is_flagged() -> None:
    """A served device whose firmware stopped publishing (hung runner) says how old the page is."""
    stale = squeeze(render(P.device_table([view(telemetry_age_s=12.4)], 0), width=140))
    assert "firmware pid 100; telemetry 12 s old" in stale
    fresh = squeeze(render(P.device_table([view(telemetry_age_s=0.2)], 0), width=140))
    assert "telemetry" not in fresh
    gone = view(state="gone", telemetry_age_s=60.0, detail="device files removed")
    assert not gone.stale


def test_reader_notes_are_shown() -> None:
    v = view()
    assert v.snapshot is not None
    v.snapshot.notes = ["no KV shim has published telemetry", "host section unreadable: writer 7 stopped mid-update"]
    assert render(P.notes_line(v)).strip() == (
        "no KV shim has published telemetry; host section unreadable: writer 7 stopped mid-update")
    assert "writer 7 stopped mid-update" in squeeze(render(dashboard_grid([v], 0, 0.0, "t"), width=200))


def pool_view(pool: PoolTelemetry | None, state: str = "served") -> DeviceView:
    return DeviceView("pool0", state, "firmware pid 100", TelemetrySnapshot((1, 3), firmware(), None, pool=pool))


def two_hosts_and_a_pool() -> PoolTelemetry:
    """Host 0 (pid 4242) a member holding two extents and pool entries; host 1 joining, offered one."""
    rows = [PoolHost(pid=4242, pool_phase=2, pool_pid=4242, extents=2, extent_bytes=4 * MiB,
                     shared_extent_bytes=2 * MiB, sealed=5, shared=2, unshared_bytes=12288, quota_bytes=MiB,
                     pins=3, allocations=1, pool_hits=1234, cross_hits=456),
            PoolHost(pool_phase=1, pool_pid=77, pending_extents=1, quota_bytes=MiB)]
    return PoolTelemetry(hosts=2, pool_hosts=2, pool_slots=480, pool_slot_bytes=64 * 1024, pool_used=6,
                         pool_sealed=5, pool_shared=2, pool_evictions=3, pool_quota_evictions=1,
                         pool_reaped_allocations=1, pool_cleared_pins=8, host_rows=rows)


def test_hosts_panel_rows_and_pool_totals() -> None:
    """Issue 25.7: per host its pid and state, extents, shared bytes, sealed and shared blocks, hits
    and cross-host hits, pins, allocations in flight and quota; then the pool's totals."""
    lines = squeeze(render(P.hosts_panel(pool_view(two_hosts_and_a_pool())), width=150)).splitlines()
    assert "hosts & pool (2 ports)" in lines[0] and len(lines) == 7
    assert lines[1:2] + lines[3:6] == [
        "│ host pid state extents shared ext sealed shared hits cross-host pins in flight unshared / quota │",
        "│ 0 4242 member 2 (4.0 MiB) 2.0 MiB 5 2 1,234 456 3 1 12.0 KiB / 1.0 MiB │",
        "│ 1 77 joining 0 +1 offered 0 B 0 0 0 0 0 0 0 B / 1.0 MiB │",
        "│ pool: 6/480 slots of 64.0 KiB used (1.2%), 5 sealed, 2 read across hosts; 3 evicted (1 over quota), "
        "1 allocations reaped, 8 pins cleared │"]


def test_hosts_panel_without_a_pool_shows_ports_and_extents() -> None:
    """Several ports, no pool: who claimed each port and its extents; the pool columns are absent."""
    rows = [PoolHost(pid=31, extents=1, extent_bytes=256 * MiB), PoolHost()]
    pool = PoolTelemetry(hosts=2, host_rows=rows)
    text = squeeze(render(P.hosts_panel(pool_view(pool, state="gone")), width=100))
    assert "hosts & pool (2 ports) (last seen)" in text
    assert "│ host pid state extents shared ext │" in text
    assert "│ 0 31 claimed 1 (256.0 MiB) 0 B │" in text and "│ 1 - free 0 0 B │" in text
    assert "no KV pool on this device (`cxlemu pool create NAME --size SIZE` makes one)" in text
    assert "sealed" not in text


def test_hosts_panel_only_where_there_is_more_than_one_host_or_a_pool() -> None:
    """One host and no pool, or a page before layout 1.3: no hosts panel on the dashboard; two
    hosts, or one host with a pool: the panel, in both dashboards."""
    single = PoolTelemetry(hosts=1, host_rows=[PoolHost(pid=5)])
    one_with_pool = PoolTelemetry(hosts=1, pool_hosts=1, pool_slots=64, host_rows=[PoolHost(pool_phase=2)])
    assert [P.pool_of(pool_view(p)) is not None for p in (None, single, one_with_pool, two_hosts_and_a_pool())] == [
        False, False, True, True]
    assert "hosts & pool" not in render(dashboard_grid([pool_view(single)], 0, 0.0, "t"), width=140)
    assert "hosts & pool" not in render(dashboard_grid([view()], 0, 0.0, "t"), width=140)
    assert "no hosts/pool section (telemetry layout before 1.3)" in squeeze(render(P.hosts_panel(view())))
    grid = squeeze(render(dashboard_grid([pool_view(two_hosts_and_a_pool())], 0, 0.0, "t"), width=140))
    assert "│ 0 4242 member 2 (4.0 MiB) 2.0 MiB 5 2 1,234 456 3 1 12.0 KiB / 1.0 MiB │" in grid
    screen = squeeze(render(dashboard([pool_view(two_hosts_and_a_pool())], 0, 0.0, "t", width=150), width=150))
    assert "│ 1 77 joining 0 +1 offered 0 B 0 0 0 0 0 0 0 B / 1.0 MiB │" in screen
    assert "8 pins cleared" in screen
