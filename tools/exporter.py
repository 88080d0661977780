"""Prometheus exporter: the telemetry page as metrics, scraped over HTTP.

``cxlemu exporter [NAME ...] --port PORT`` (or ``start_exporter`` from ``cxlemu serve
--metrics-port``) answers ``GET /metrics``. ``prometheus_client`` writes the exposition (the text
format 0.0.4, or OpenMetrics when the scraper asks for it in its Accept header) and serves HTTP;
this module is a custom collector (``DeviceCollector``) that turns the devices' telemetry pages
into metric families. Every scrape reads the pages afresh (the same read-only path as the
monitor), so numbers are as current as the writers' last publish. Names follow vLLM's and
LMCache's style (``vllm:num_requests_running``, ``lmcache:num_hit_tokens``): a ``cxlemu:``
prefix, base units (bytes, seconds), ``_total`` on counters, and a ``device`` label on every
sample.

    scrape ──▶ WSGI app (/metrics) ──▶ prometheus_client encoder (Accept: text or OpenMetrics)
                                          └──▶ DeviceCollector.collect(): DeviceSet.poll()
                                                 └──▶ families(views): one Metric per family
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from emulator.telemetry import LOG_NAMES, POOL_PHASES, PoolTelemetry
from emulator.timing import linkstate
from tools.monitor.source import STATES, DeviceSet, DeviceView, timed_transfers

#: What a scrape without an Accept header gets (OpenMetrics when asked for).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
Sample = tuple[str, dict[str, str], float]  # (name suffix, labels, value)

# name: (type, help, field of the firmware section)
_FIRMWARE_GAUGES = {
    "uptime_seconds": ("gauge", "Time since the firmware started.", "uptime_ns"),
    "capacity_bytes": ("gauge", "Size of the DPA space.", "capacity_bytes"),
    "capacity_used_bytes": ("gauge", "DPA bytes holding data.", "capacity_used_bytes"),
    "media_status": ("gauge", "Memory Device Status MEDIA_STATUS: 0 not ready, 1 ready, 2 error, 3 disabled.",
                     "media_status"),
    "health_status": ("gauge", "Get Health Info health status bits (0 = healthy).", "health_status"),
    "temperature_celsius": ("gauge", "Device temperature.", "temperature_c"),
    "life_used_percent": ("gauge", "Device life used, percent.", "life_used_pct"),
    "poison_records": ("gauge", "Records in the poison list.", "poison_count"),
    "background_op_running": ("gauge", "1 while a background command runs.", "bg_running"),
    "background_op_percent": ("gauge", "Percent complete of the background command.", "bg_percent"),
    "chmu_enabled": ("gauge", "1 when the hotness monitoring unit counts accesses.", "chmu_enabled"),
    "chmu_epochs_total": ("counter", "Hotness monitoring epochs completed.", "chmu_epoch_count"),
}
# name: (type, help, field of the host/KV section)
_HOST_METRICS = {
    "kv_hits_total": ("counter", "KV block lookups resident in the accelerator.", "hits"),
    "kv_misses_total": ("counter", "KV block lookups not resident.", "misses"),
    "kv_loads_total": ("counter", "KV blocks copied device to accelerator.", "loads"),
    "kv_offloads_total": ("counter", "KV blocks copied accelerator to device.", "offloads"),
    "kv_prefetch_issued_total": ("counter", "KV prefetches started.", "prefetch_issued"),
    "kv_prefetch_useful_total": ("counter", "Prefetched KV blocks used after arriving.", "prefetch_useful"),
    "kv_prefetch_late_total": ("counter", "Prefetched KV blocks needed before arriving.", "prefetch_late"),
    "kv_prefetch_wasted_total": ("counter", "Prefetched KV blocks evicted unused.", "prefetch_wasted"),
    "kv_evictions_total": ("counter", "KV blocks evicted from the accelerator.", "evictions"),
    "generation_tokens_total": ("counter", "Tokens generated.", "tokens_generated"),
    "kv_blocks_resident": ("gauge", "KV blocks resident in the accelerator.", "blocks_resident"),
    "kv_blocks_total": ("gauge", "KV block slots in the accelerator arena.", "blocks_total"),
    "hbm_kv_bytes": ("gauge", "Accelerator bytes holding KV.", "hbm_bytes"),
    "hbm_kv_budget_bytes": ("gauge", "Accelerator bytes allowed for KV.", "hbm_budget_bytes"),
}
# Prefix sharing (host section since layout 1.1): left out for an older page, where they would
# read as a false zero.
_SHARING_METRICS = {
    "kv_dedup_chunks_total": ("counter", ("KV blocks stored by pointing at a device chunk already holding "
                                          "their bytes (prefix sharing)."), "dedup_chunks"),
    "kv_dedup_write_bytes_total": ("counter", "Bytes prefix sharing kept from being written to the device.",
                                   "dedup_write_bytes"),
    "kv_dedup_load_bytes_total": ("counter", ("Bytes prefix sharing kept from being read from the device "
                                              "(one read served every sequence sharing a chunk)."),
                                  "dedup_load_bytes"),
    "kv_cow_copies_total": ("counter", "Shared KV chunks copied on write when a sequence diverged.",
                            "cow_copies"),
    "kv_chunk_bytes": ("gauge", "Bytes per device KV chunk.", "chunk_bytes"),
    "kv_device_chunks_used": ("gauge", "Device KV chunks referenced now.", "device_chunks_used"),
    "kv_device_chunks_shared": ("gauge", "Device KV chunks referenced by more than one block now.",
                                "device_chunks_shared"),
    "kv_device_saved_bytes": ("gauge", ("Device bytes prefix sharing saves now: (references - chunks "
                                        "used) x chunk size."), "device_saved_bytes"),
}
# Several hosts and the shared KV pool (the pool section, layout 1.3 on). Per host port, labelled
# `host`: name: (type, help, field of PoolHost); the pool's rows only where the device has a pool.
_HOST_PORT_METRICS = {
    "host_claimed": ("gauge", "1 while a live process holds the host port (host.<h>.pid).", "pid"),
    "dc_extents": ("gauge", "Dynamic Capacity extents the host port accepted.", "extents"),
    "dc_extents_pending": ("gauge", "Dynamic Capacity extents offered to the host port, not yet accepted.",
                           "pending_extents"),
    "dc_extent_bytes": ("gauge", "Bytes of the Dynamic Capacity extents the host port accepted.", "extent_bytes"),
    "dc_shared_extent_bytes": ("gauge", "Bytes of those extents that are tagged (shared capacity).",
                               "shared_extent_bytes"),
}
_POOL_HOST_METRICS = {
    "pool_sealed_entries": ("gauge", "Sealed KV pool entries the host published.", "sealed"),
    "pool_shared_entries": ("gauge", "Sealed KV pool entries the host published that another host loaded.",
                            "shared"),
    "pool_hits_total": ("counter", "KV pool loads by the host that hit (verified).", "pool_hits"),
    "pool_cross_host_hits_total": ("counter", "KV pool loads by the host of a block another host published.",
                                   "cross_hits"),
    "pool_pins": ("gauge", "KV pool pins the host holds now.", "pins"),
    "pool_allocations_in_flight": ("gauge", "KV pool allocations of the host not yet sealed.", "allocations"),
    "pool_unshared_bytes": ("gauge", "Bytes of the host's KV pool entries no other host loaded.", "unshared_bytes"),
    "pool_quota_bytes": ("gauge", "Unshared KV pool bytes the host may hold.", "quota_bytes"),
    "pool_host_evictions_total": ("counter", "The host's KV pool entries the firmware evicted.", "evicted"),
}
# Device-wide, when the device has a pool: name: (type, help, field of PoolTelemetry). Sealed and
# shared entries are the per-host series' sums (an entry has one publisher), so they are not here.
_POOL_METRICS = {
    "pool_slots": ("gauge", "Slots of the KV pool's index (one block each).", "pool_slots"),
    "pool_slot_bytes": ("gauge", "Bytes per KV pool slot.", "pool_slot_bytes"),
    "pool_used_slots": ("gauge", "KV pool slots holding an entry (allocated, sealed or being evicted).",
                        "pool_used"),
    "pool_evictions_total": ("counter", "KV pool entries the firmware evicted.", "pool_evictions"),
    "pool_quota_evictions_total": ("counter", "KV pool entries evicted to bring a host under its quota.",
                                   "pool_quota_evictions"),
    "pool_reaped_allocations_total": ("counter", "KV pool allocations of dead or dropped hosts the firmware dropped.",
                                      "pool_reaped_allocations"),
    "pool_cleared_pins_total": ("counter", "KV pool pin bytes of dead or dropped hosts the firmware cleared.",
                                "pool_cleared_pins"),
}
_LINK_COUNTERS = {
    "link_bytes_total": ("Bytes moved over the link.", "bytes", 1.0),
    "link_transfers_total": ("Transfers over the link, timed or not (the latency histogram counts the timed).", "transfers", 1.0),
    "link_busy_seconds_total": ("Time the link was occupied.", "busy_ns", 1e-9),
    "link_errors_total": ("Transfers refused (range or poison).", "errors", 1.0),
}


class _Families:
    """Samples grouped per metric family, in the order families first appear."""

    def __init__(self) -> None:
        self.meta: dict[str, tuple[str, str]] = {}
        self.samples: dict[str, list[Sample]] = {}

    def add(self, name: str, kind: str, help_text: str, value: float, suffix: str = "",
            **labels: str) -> None:
        self.meta.setdefault(name, (kind, help_text))
        self.samples.setdefault(name, []).append((suffix, labels, value))

    def metrics(self) -> list[Metric]:
        """prometheus_client families. A counter family is named without ``_total`` (OpenMetrics);
        its samples carry it, and the text format writes it back on the family."""
        out = []
        for name, (kind, help_text) in self.meta.items():
            full = f"cxlemu:{name}"
            family = Metric(full.removesuffix("_total") if kind == "counter" else full, help_text, kind)
            for suffix, labels, value in self.samples[name]:
                family.add_sample(full + suffix, labels, float(value))
            out.append(family)
        return out


def _device_metrics(fam: _Families, view: DeviceView) -> None:
    d = view.name
    fam.add("device_up", "gauge", "1 while a live firmware serves the device.", int(view.up), device=d)
    for state in STATES:
        fam.add("device_state", "gauge", "Device state (one series per state, 1 for the current one).",
                int(view.state == state), device=d, state=state)
    snap = view.snapshot
    if snap is None or view.state in ("gone", "not found"):
        return  # last-seen values of a vanished device would read as current
    if snap.firmware is not None:
        fw = snap.firmware
        for name, (kind, help_text, fld) in _FIRMWARE_GAUGES.items():
            scale = 1e-9 if fld == "uptime_ns" else 1
            fam.add(name, kind, help_text, getattr(fw, fld) * scale, device=d)
        for log in LOG_NAMES:
            fam.add("event_records", "gauge", "Records held in each event log.", getattr(fw, f"events_{log}"),
                    device=d, log=log)
        fam.add("chmu_hotlist_entries", "gauge", "Entries on the CHMU hotlist.", len(fw.hotlist), device=d)
        if snap.has("firmware", "state_save_failures"):  # layout 1.2 on; absent rather than a false 0
            fam.add("state_save_failures", "gauge", ("Failed saves of the device state since the last that "
                                                     "succeeded (0: saved)."), fw.state_save_failures, device=d)
        fam.add("telemetry_updated_timestamp_seconds", "gauge", "Unix time of the firmware's last publish.",
                fw.updated_ns * 1e-9, device=d)
    if snap.host is not None:
        host = snap.host
        for name, (kind, help_text, fld) in _HOST_METRICS.items():
            fam.add(name, kind, help_text, getattr(host, fld), device=d)
        for name, (kind, help_text, fld) in _SHARING_METRICS.items():
            if snap.has("host", fld):
                fam.add(name, kind, help_text, getattr(host, fld), device=d)
        fam.add("kv_stall_seconds_total", "counter", "Time compute waited for KV.", host.stall_ns * 1e-9, device=d)
        queues = (("dma_sq", "dma_sq_depth"), ("dma_cq", "dma_cq_depth"), ("prefetch", "prefetch_queue_depth"))
        for queue, fld in queues:
            fam.add("queue_depth", "gauge", "Entries waiting in each queue.", getattr(host, fld), device=d, queue=queue)
    if snap.pool is not None:
        _pool_metrics(fam, d, snap.pool)
    if view.link is not None:
        _link_metrics(fam, d, view.link)


def _pool_metrics(fam: _Families, d: str, pool: PoolTelemetry) -> None:
    """Per host port (label ``host``) its claim and extents; with a pool, the pool's totals and
    each host's state and share of it."""
    fam.add("host_ports", "gauge", "Host ports of the device.", pool.hosts, device=d)
    in_pool = pool.pool_hosts > 0
    if in_pool:
        for name, (kind, help_text, fld) in _POOL_METRICS.items():
            fam.add(name, kind, help_text, getattr(pool, fld), device=d)
    for h, row in enumerate(pool.host_rows):
        host = str(h)
        for name, (kind, help_text, fld) in _HOST_PORT_METRICS.items():
            value = int(row.pid != 0) if fld == "pid" else getattr(row, fld)
            fam.add(name, kind, help_text, value, device=d, host=host)
        if not in_pool or h >= pool.pool_hosts:
            continue
        phase = POOL_PHASES[row.pool_phase] if row.pool_phase < len(POOL_PHASES) else None
        for state in POOL_PHASES:
            fam.add("pool_host_state", "gauge",
                    "The host in the KV pool (one series per state, 1 for the current one).",
                    int(phase == state), device=d, host=host, state=state)
        for name, (kind, help_text, fld) in _POOL_HOST_METRICS.items():
            fam.add(name, kind, help_text, getattr(row, fld), device=d, host=host)


def _link_metrics(fam: _Families, d: str, link: dict[str, int]) -> None:
    for direction in linkstate.DIRECTIONS:
        for name, (help_text, fld, scale) in _LINK_COUNTERS.items():
            fam.add(name, "counter", help_text, link[f"{direction}_{fld}"] * scale, device=d, direction=direction)
        help_text = "Transfer latency (completion - request), from the log2-ns histogram."
        cumulative = 0
        for k in range(linkstate.HIST_BUCKETS - 1):  # bucket k: [2^k, 2^(k+1)) ns
            cumulative += link[f"{direction}_hist_{k:02d}"]
            fam.add("link_latency_seconds", "histogram", help_text, cumulative, "_bucket",
                    device=d, direction=direction, le=repr((1 << (k + 1)) * 1e-9))
        # the histogram's own total: an untimed transfer counts in link_transfers_total but has no latency
        timed = timed_transfers(link, direction)
        fam.add("link_latency_seconds", "histogram", help_text, timed, "_bucket",
                device=d, direction=direction, le="+Inf")
        fam.add("link_latency_seconds", "histogram", help_text, link[f"{direction}_latency_ns"] * 1e-9, "_sum",
                device=d, direction=direction)
        fam.add("link_latency_seconds", "histogram", help_text, timed, "_count",
                device=d, direction=direction)
    fam.add("copy_bytes_total", "counter", "Bytes copied inside the device.", link["copy_bytes"], device=d)


def families(views: Iterable[DeviceView]) -> list[Metric]:
    """The metric families for these device views. Pure: no I/O."""
    fam = _Families()
    for view in views:
        _device_metrics(fam, view)
    return fam.metrics()


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


def render_metrics(views: Iterable[DeviceView]) -> str:
    """The exposition text (format 0.0.4) for these device views. Pure: no I/O."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families(views)))
    return generate_latest(registry).decode()


Names = Iterable[str] | Callable[[], Iterable[str]] | None


class DeviceCollector(Collector):
    """A prometheus_client collector over the telemetry pages of some devices: each collect()
    reads every page now. ``names``: device names, a callable returning them (re-evaluated each
    scrape), or None for every device under the runtime dir."""

    def __init__(self, names: Names) -> None:
        self._names = names
        self._devices = DeviceSet(None if names is None or callable(names) else list(names))
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # DeviceSet keeps mappings and history: one scrape at a time
            if callable(self._names):
                self._devices = _resized(self._devices, list(self._names()))
            metrics = families(self._devices.poll())
        return iter(metrics)

    def close(self) -> None:
        """Unmap the devices."""
        with self._lock:
            self._devices.close()


def _resized(current: DeviceSet, names: list[str]) -> DeviceSet:
    """A DeviceSet for `names` that keeps the mappings of names it already watched."""
    if current.fixed == names:
        return current
    fresh = DeviceSet(names)
    for name, source in current.sources.items():
        if name in names:
            fresh.sources[name] = source
        else:
            source.close()
    return fresh


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood stderr; stay quiet like node_exporter."""


def _keep_names(accept: str) -> str:
    """The Accept header with each OpenMetrics range asking for names as they are.

    prometheus_client (0.26) escapes OpenMetrics *sample* names with the label-name alphabet
    unless ``escaping=allow-utf-8`` is asked for, turning ``cxlemu:kv_hits_total`` into
    ``cxlemu_kv_hits_total`` under a ``# TYPE cxlemu:kv_hits`` line; a Prometheus 2 scraper
    (which asks for OpenMetrics 1.0.0 first) would store renamed series. Our names are valid
    OpenMetrics names (colons included), so nothing needs escaping; the text format is left as
    negotiated."""
    ranges = []
    for accepted in accept.split(","):
        params = [p.strip() for p in accepted.split(";")]
        if params[0] == "application/openmetrics-text":
            keep = [p for p in params[1:] if not p.startswith("escaping=")]
            if not any(p.startswith("version=") for p in keep):
                keep.insert(0, "version=1.0.0")
            params = [params[0], *keep, "escaping=allow-utf-8"]
        ranges.append(";".join(params))
    return ",".join(ranges)


def _app(metrics_app: Callable[..., Any]) -> Callable[..., Any]:
    """/metrics to prometheus_client's app (which answers any path); a note at /; 404 elsewhere."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            if environ.get("HTTP_ACCEPT"):
                environ = {**environ, "HTTP_ACCEPT": _keep_names(environ["HTTP_ACCEPT"])}
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if path == "/":
            code, body = "200 OK", "cxlemu exporter: metrics at /metrics\n"
        else:
            code, body = "404 Not Found", f"no page {path}: metrics are at /metrics\n"
        data = body.encode()
        start_response(code, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))])
        return [data]

    return app


class ExporterServer:
    """An HTTP server answering /metrics from the telemetry pages of some devices."""

    def __init__(self, names: Names, host: str, port: int) -> None:
        self.collector = DeviceCollector(names)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._httpd = make_server(host, port, _app(make_wsgi_app(self.registry)), ThreadingWSGIServer,
                                  handler_class=_QuietHandler)
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def metrics(self) -> str:
        """Read every device's page now and render the exposition text (format 0.0.4)."""
        return generate_latest(self.registry).decode()

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def shutdown(self) -> None:
        """Stop serving, close the socket and unmap the devices."""
        if self.thread is not None:
            self._httpd.shutdown()
            self.thread.join()
            self.thread = None
        self._httpd.server_close()
        self.collector.close()


def start_exporter(names: Names = None, host: str = "127.0.0.1", port: int = 0) -> ExporterServer:
    """Serve /metrics in a daemon thread; returns the server (``.port``, ``.shutdown()``).

    ``names``: device names, a callable returning them (re-evaluated each scrape), or None for
    every device under the runtime dir. ``port=0`` picks a free port. Raises OSError when the
    address cannot be bound."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    server = ExporterServer(names, host, port)
    server.thread = threading.Thread(target=server.serve_forever, name="cxlemu-exporter", daemon=True)
    server.thread.start()
    return server
