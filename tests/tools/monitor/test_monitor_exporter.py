"""The Prometheus exporter: exposition text from the page, scraped over loopback."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from cli_support import cxlemu, default_sigint

from driver import MemDev
from emulator.device import DeviceConfig, Served, serve
from emulator.spec import registers as R
from emulator.telemetry import (
    EventEntry,
    FirmwareTelemetry,
    HostTelemetry,
    PoolHost,
    PoolTelemetry,
    TelemetryReader,
    TelemetrySnapshot,
    TelemetryWriter,
)
from emulator.timing import DataPath, TimingConfig, linkstate
from tools.exporter import CONTENT_TYPE, render_metrics, start_exporter
from tools.monitor.source import DeviceView

MiB = 1 << 20


def scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def samples(text: str) -> dict[str, float]:
    """'name{labels}' -> value, for every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_render_metrics_exact_text() -> None:
    """Families with HELP/TYPE once, samples labelled by device, base units (prometheus_client's
    text format: values as Go floats)."""
    fw = FirmwareTelemetry(uptime_ns=2_500_000_000, capacity_bytes=MiB, temperature_c=-4, events_warn=2,
                           hotlist=[(1, 2)], seq=2)
    host = HostTelemetry(hits=7, stall_ns=1_500_000_000, dma_sq_depth=3, seq=2)
    views = [DeviceView("a", "served", snapshot=TelemetrySnapshot((1, 0), fw, host)),
             DeviceView("b\"x", "gone", snapshot=TelemetrySnapshot((1, 0), fw, host))]
    text = render_metrics(views)
    assert text.startswith("# HELP cxlemu:device_up 1 while a live firmware serves the device.\n"
                           "# TYPE cxlemu:device_up gauge\n"
                           'cxlemu:device_up{device="a"} 1.0\n'
                           'cxlemu:device_up{device="b\\"x"} 0.0\n')
    got = samples(text)
    assert got['cxlemu:device_state{device="a",state="served"}'] == 1
    assert got['cxlemu:device_state{device="a",state="gone"}'] == 0
    assert got['cxlemu:uptime_seconds{device="a"}'] == 2.5
    assert got['cxlemu:temperature_celsius{device="a"}'] == -4
    assert got['cxlemu:event_records{device="a",log="warn"}'] == 2
    assert got['cxlemu:chmu_hotlist_entries{device="a"}'] == 1
    assert got['cxlemu:kv_hits_total{device="a"}'] == 7
    assert got['cxlemu:kv_stall_seconds_total{device="a"}'] == 1.5
    assert got['cxlemu:queue_depth{device="a",queue="dma_sq"}'] == 3
    assert not any('device="b\\"x"' in k for k in got if "device_up" not in k and "device_state" not in k)
    assert "# TYPE cxlemu:kv_hits_total counter" in text
    assert text.count("# TYPE cxlemu:uptime_seconds gauge") == 1


SHARING = {"kv_dedup_chunks_total": 32, "kv_dedup_write_bytes_total": 8192, "kv_dedup_load_bytes_total": 59392,
           "kv_cow_copies_total": 3, "kv_chunk_bytes": 256, "kv_device_chunks_used": 152,
           "kv_device_chunks_shared": 32, "kv_device_saved_bytes": 16384}


def _sharing_host() -> HostTelemetry:
    return HostTelemetry(dedup_chunks=32, dedup_write_bytes=8192, dedup_load_bytes=59392, cow_copies=3,
                         chunk_bytes=256, device_chunks_used=152, device_chunks_shared=32,
                         device_saved_bytes=16384, seq=2)


def test_prefix_sharing_metrics() -> None:
    """Layout 1.1 pages export the sharing fields: totals as counters, the state now as gauges."""
    text = render_metrics([DeviceView("a", "served", snapshot=TelemetrySnapshot((1, 1), None, _sharing_host()))])
    got = samples(text)
    assert {name: got[f'cxlemu:{name}{{device="a"}}'] for name in SHARING} == SHARING
    assert "# TYPE cxlemu:kv_dedup_write_bytes_total counter" in text
    assert "# TYPE cxlemu:kv_device_saved_bytes gauge" in text
    assert "# HELP cxlemu:kv_device_saved_bytes Device bytes prefix sharing saves now: (references - chunks " \
           "used) x chunk size." in text


def test_prefix_sharing_metrics_absent_from_a_layout_1_0_page() -> None:
    """A 1.0 page lacks the fields: no series rather than a false zero."""
    got = samples(render_metrics([DeviceView("a", "served", snapshot=TelemetrySnapshot((1, 0), None,
                                                                                       _sharing_host()))]))
    assert got['cxlemu:kv_hits_total{device="a"}'] == 0
    assert not [k for k in got if any(k.startswith(f"cxlemu:{name}{{") for name in SHARING)]


def test_state_save_failures_exported_from_a_layout_1_2_page_only() -> None:
    """Issue 24.3: a device that cannot save its state says so to a scraper too."""
    fw = FirmwareTelemetry(state_save_failures=4, health_status=1, seq=2)
    got = samples(render_metrics([DeviceView("a", "served", snapshot=TelemetrySnapshot((1, 2), fw, None))]))
    assert (got['cxlemu:state_save_failures{device="a"}'], got['cxlemu:health_status{device="a"}']) == (4, 1)
    older = samples(render_metrics([DeviceView("a", "served", snapshot=TelemetrySnapshot((1, 1), fw, None))]))
    assert 'cxlemu:health_status{device="a"}' in older and not [k for k in older if "state_save" in k]


def test_hosts_and_pool_metrics_carry_a_host_label() -> None:
    """Issue 25.7: per host port its claim and extents; with a pool, each host's state, entries,
    hits and cross-host hits, pins, allocations and quota, and the pool's totals."""
    rows = [PoolHost(pid=4242, pool_phase=2, extents=2, extent_bytes=4 * MiB, shared_extent_bytes=2 * MiB,
                     sealed=5, shared=2, unshared_bytes=12288, quota_bytes=MiB, pins=3, allocations=1,
                     pool_hits=1234, cross_hits=456, evicted=9),
            PoolHost(pool_phase=1, pending_extents=1, quota_bytes=MiB)]
    pool = PoolTelemetry(hosts=2, pool_hosts=2, pool_slots=480, pool_slot_bytes=65536, pool_used=6,
                         pool_sealed=5, pool_shared=2, pool_evictions=3, pool_quota_evictions=1,
                         pool_reaped_allocations=1, pool_cleared_pins=8, host_rows=rows, seq=2)
    text = render_metrics([DeviceView("p", "served", snapshot=TelemetrySnapshot((1, 3), None, None, pool=pool))])
    got = {k: v for k, v in samples(text).items() if "device_" not in k}
    h0, h1 = 'device="p",host="0"', 'device="p",host="1"'
    assert got == {
        'cxlemu:host_ports{device="p"}': 2, 'cxlemu:pool_slots{device="p"}': 480,
        'cxlemu:pool_slot_bytes{device="p"}': 65536, 'cxlemu:pool_used_slots{device="p"}': 6,
        'cxlemu:pool_evictions_total{device="p"}': 3, 'cxlemu:pool_quota_evictions_total{device="p"}': 1,
        'cxlemu:pool_reaped_allocations_total{device="p"}': 1, 'cxlemu:pool_cleared_pins_total{device="p"}': 8,
        f'cxlemu:host_claimed{{{h0}}}': 1, f'cxlemu:dc_extents{{{h0}}}': 2, f'cxlemu:dc_extents_pending{{{h0}}}': 0,
        f'cxlemu:dc_extent_bytes{{{h0}}}': 4 * MiB, f'cxlemu:dc_shared_extent_bytes{{{h0}}}': 2 * MiB,
        f'cxlemu:pool_host_state{{{h0},state="out"}}': 0, f'cxlemu:pool_host_state{{{h0},state="joining"}}': 0,
        f'cxlemu:pool_host_state{{{h0},state="member"}}': 1,
        f'cxlemu:pool_sealed_entries{{{h0}}}': 5, f'cxlemu:pool_shared_entries{{{h0}}}': 2,
        f'cxlemu:pool_hits_total{{{h0}}}': 1234, f'cxlemu:pool_cross_host_hits_total{{{h0}}}': 456,
        f'cxlemu:pool_pins{{{h0}}}': 3, f'cxlemu:pool_allocations_in_flight{{{h0}}}': 1,
        f'cxlemu:pool_unshared_bytes{{{h0}}}': 12288, f'cxlemu:pool_quota_bytes{{{h0}}}': MiB,
        f'cxlemu:pool_host_evictions_total{{{h0}}}': 9,
        f'cxlemu:host_claimed{{{h1}}}': 0, f'cxlemu:dc_extents{{{h1}}}': 0, f'cxlemu:dc_extents_pending{{{h1}}}': 1,
        f'cxlemu:dc_extent_bytes{{{h1}}}': 0, f'cxlemu:dc_shared_extent_bytes{{{h1}}}': 0,
        f'cxlemu:pool_host_state{{{h1},state="out"}}': 0, f'cxlemu:pool_host_state{{{h1},state="joining"}}': 1,
        f'cxlemu:pool_host_state{{{h1},state="member"}}': 0,
        f'cxlemu:pool_sealed_entries{{{h1}}}': 0, f'cxlemu:pool_shared_entries{{{h1}}}': 0,
        f'cxlemu:pool_hits_total{{{h1}}}': 0, f'cxlemu:pool_cross_host_hits_total{{{h1}}}': 0,
        f'cxlemu:pool_pins{{{h1}}}': 0, f'cxlemu:pool_allocations_in_flight{{{h1}}}': 0,
        f'cxlemu:pool_unshared_bytes{{{h1}}}': 0, f'cxlemu:pool_quota_bytes{{{h1}}}': MiB,
        f'cxlemu:pool_host_evictions_total{{{h1}}}': 0}
    assert "# TYPE cxlemu:pool_cross_host_hits_total counter" in text
    assert ("# HELP cxlemu:pool_cross_host_hits_total KV pool loads by the host of a block another host "
            "published.") in text


def test_pool_metrics_absent_without_a_pool_or_before_layout_1_3() -> None:
    """No pool: the ports' claims and extents only; a page before 1.3: no host series at all."""
    pool = PoolTelemetry(hosts=1, host_rows=[PoolHost(extents=1, extent_bytes=MiB)], seq=2)
    snap = TelemetrySnapshot((1, 3), None, None, pool=pool)
    got = samples(render_metrics([DeviceView("p", "served", snapshot=snap)]))
    assert got['cxlemu:dc_extent_bytes{device="p",host="0"}'] == MiB
    assert not [k for k in got if k.startswith("cxlemu:pool_")]
    older = samples(render_metrics([DeviceView("p", "served", snapshot=TelemetrySnapshot((1, 2), None, None))]))
    assert not [k for k in older if "host=" in k or "pool" in k]


def test_latency_histogram_is_cumulative() -> None:
    link = linkstate.snapshot(bytes(linkstate.USED_BYTES))
    link.update(read_transfers=15, read_latency_ns=3000, read_hist_07=10, read_hist_08=5, read_bytes=960)
    view = DeviceView("a", "served", snapshot=TelemetrySnapshot((1, 0)), link=link)
    got = samples(render_metrics([view]))
    le = lambda k: repr((1 << (k + 1)) * 1e-9)
    assert got[f'cxlemu:link_latency_seconds_bucket{{device="a",direction="read",le="{le(6)}"}}'] == 0
    assert got[f'cxlemu:link_latency_seconds_bucket{{device="a",direction="read",le="{le(7)}"}}'] == 10
    assert got[f'cxlemu:link_latency_seconds_bucket{{device="a",direction="read",le="{le(8)}"}}'] == 15
    assert got['cxlemu:link_latency_seconds_bucket{device="a",direction="read",le="+Inf"}'] == 15
    assert got['cxlemu:link_latency_seconds_sum{device="a",direction="read"}'] == 3e-6
    assert got['cxlemu:link_latency_seconds_count{device="a",direction="read"}'] == 15
    assert got['cxlemu:link_bytes_total{device="a",direction="read"}'] == 960



def test_latency_histogram_counts_only_transfers_that_recorded_a_latency() -> None:
    """An untimed transfer counts in link_transfers_total but records no latency: counting it in
    the histogram's +Inf bucket and _count put it past every finite bucket (a latency of infinity)
    and dragged the mean from _sum/_count down."""
    link = linkstate.snapshot(bytes(linkstate.USED_BYTES))
    link.update(read_transfers=25, read_latency_ns=3000, read_hist_07=10, read_hist_08=5, read_bytes=1600)
    got = samples(render_metrics([DeviceView("a", "served", snapshot=TelemetrySnapshot((1, 0)), link=link)]))
    assert got['cxlemu:link_latency_seconds_bucket{device="a",direction="read",le="+Inf"}'] == 15
    assert got['cxlemu:link_latency_seconds_count{device="a",direction="read"}'] == 15
    assert got['cxlemu:link_transfers_total{device="a",direction="read"}'] == 25

@pytest.fixture
def loaded(device_name: str) -> Iterator[Served]:
    """A served timed device after some traffic, with both sections published, then quiet."""
    timing = TimingConfig(read_latency_ns=200, write_latency_ns=200, read_bandwidth_gbps=4.0, write_bandwidth_gbps=4.0)
    with serve(DeviceConfig(name=device_name, capacity=256 * MiB, timing=timing)) as served:
        files = served.files
        # quiesce the firmware's own publisher: this test writes section (a) with known values.
        # Two mailbox round trips later every runner pass that could still publish has ended.
        served.firmware.services.remove(served.firmware.telemetry.service)
        with MemDev.open(served.name) as md:
            md.identify()
            md.identify()
        dp = DataPath(files.media, files.poison,
                      memoryview(files.bar)[R.LINK_STATE_OFFSET:R.LINK_STATE_OFFSET + R.LINK_STATE_SIZE], timing)
        buf = np.zeros(64 << 10, np.uint8)
        for i in range(20):
            dp.write(i * len(buf), buf)
        for i in range(5):
            dp.read(i * len(buf), buf)
        fw = TelemetryWriter(files.bar, "firmware")
        fw.publish(uptime_ns=3 * 10**9, capacity_bytes=256 * MiB, capacity_used_bytes=20 * 64 << 10,
                   media_status=1, temperature_c=38, events_info=1,
                   recent_events=[EventEntry(1, 0, "hello")])
        with TelemetryWriter(files.bar, "host") as host:
            host.publish(hits=41, misses=9, prefetch_late=2, tokens_generated=300, blocks_total=16)
            yield served
        fw.close()


def test_scrape_matches_the_page(loaded: Served) -> None:
    """Numbers scraped over loopback equal those read from the page directly."""
    server = start_exporter([loaded.name], "127.0.0.1", 0)
    try:
        status, ctype, text = scrape(server.port)
    finally:
        server.shutdown()
    assert (status, ctype) == (200, CONTENT_TYPE)
    snap = TelemetryReader(loaded.files.bar).snapshot()
    link = linkstate.snapshot(memoryview(loaded.files.bar)[R.LINK_STATE_OFFSET:])
    assert snap.firmware is not None and snap.host is not None
    d = f'device="{loaded.name}"'
    got = samples(text)
    assert got[f"cxlemu:device_up{{{d}}}"] == 1
    assert got[f"cxlemu:telemetry_updated_timestamp_seconds{{{d}}}"] == snap.firmware.updated_ns * 1e-9
    assert got[f"cxlemu:capacity_used_bytes{{{d}}}"] == snap.firmware.capacity_used_bytes == 20 * 64 << 10
    assert got[f"cxlemu:temperature_celsius{{{d}}}"] == snap.firmware.temperature_c == 38
    assert got[f'cxlemu:event_records{{{d},log="info"}}'] == 1
    assert got[f"cxlemu:kv_hits_total{{{d}}}"] == snap.host.hits == 41
    assert got[f"cxlemu:generation_tokens_total{{{d}}}"] == 300
    assert got[f'cxlemu:link_bytes_total{{{d},direction="write"}}'] == link["write_bytes"] == 20 * 64 << 10
    assert got[f'cxlemu:link_transfers_total{{{d},direction="read"}}'] == link["read_transfers"] == 5
    assert got[f'cxlemu:link_latency_seconds_count{{{d},direction="write"}}'] == 20
    assert got[f'cxlemu:link_latency_seconds_bucket{{{d},direction="write",le="+Inf"}}'] == 20


def test_openmetrics_when_asked(loaded: Served) -> None:
    """A scraper that accepts OpenMetrics gets it (prometheus_client's negotiation): the same
    sample names (colons kept), counter families named without _total, the # EOF terminator."""
    server = start_exporter([loaded.name], "127.0.0.1", 0)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics",
                                     headers={"Accept": "application/openmetrics-text;version=1.0.0,"
                                                        "text/plain;version=0.0.4;q=0.5"})  # Prometheus 2
        with urllib.request.urlopen(req, timeout=10) as resp:
            ctype, text = resp.headers["Content-Type"], resp.read().decode()
    finally:
        server.shutdown()
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert text.endswith("# EOF\n")
    assert "# TYPE cxlemu:kv_hits counter" in text
    d = f'device="{loaded.name}"'
    got = samples("\n".join(line for line in text.splitlines() if line != "# EOF"))
    assert got[f"cxlemu:kv_hits_total{{{d}}}"] == 41
    assert got[f'cxlemu:link_latency_seconds_count{{{d},direction="write"}}'] == 20


def test_exporter_paths_and_missing_devices(device_name: str) -> None:
    """Unknown paths 404; a device that does not exist is exported as down, nothing else."""
    server = start_exporter(lambda: [device_name], "127.0.0.1", 0)
    try:
        assert scrape(server.port, "/nope")[0] == 404
        assert scrape(server.port, "/")[2] == "cxlemu exporter: metrics at /metrics\n"
        got = samples(scrape(server.port)[2])
    finally:
        server.shutdown()
    assert got == {**{f'cxlemu:device_state{{device="{device_name}",state="{s}"}}': float(s == "not found")
                      for s in ("served", "stopped", "gone", "not found")},
                   f'cxlemu:device_up{{device="{device_name}"}}': 0.0}
    with pytest.raises(OSError):  # the socket is closed after shutdown
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_exporter_cli_serves_until_interrupted(loaded: Served) -> None:
    """`cxlemu exporter NAME --port P` in another process answers scrapes and exits 0 on SIGINT."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli.main", "exporter", loaded.name, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"cxlemu exporter: {loaded.name} at http://127.0.0.1:{port}/metrics (Ctrl-C stops)\n"
        got = samples(scrape(port)[2])
        assert got[f'cxlemu:kv_misses_total{{device="{loaded.name}"}}'] == 9
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_exporter_cli_bad_port_and_busy_port() -> None:
    bad = cxlemu("exporter", "--port", "70000")
    assert (bad.returncode, bad.stderr) == (2, "cxlemu: error: argument --port: port must be 1..65535, got 70000\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        busy = cxlemu("exporter", "--port", str(port))
    assert busy.returncode == 1
    assert re.fullmatch(rf"cxlemu: error: cannot listen on 127\.0\.0\.1:{port}: .+\n", busy.stderr)
