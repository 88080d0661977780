"""The firmware's half of the telemetry page: section (a), published ~10 times a second.

Monitors and the Prometheus exporter read the page without asking the firmware anything
(emulator/telemetry/layout.py has the layout); this module gathers what the firmware knows — media
state, health, event and poison counts, failed saves of its state, the running background operation, the CHMU — and
publishes it from the runner's thread, its only writer, into every host port's BAR (the event
counts and recent events are that port's logs; the rest is the device's). The pool section
(layout 1.3) is the device's too: each port's claimer, its Dynamic Capacity extents, and the
shared KV index's census (``firmware_model.kv_census``) when the device holds one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from emulator import liveness
from emulator.dcd import NO_TAG
from emulator.device_dir import host_pid_name
from emulator.spec import registers as R
from emulator.telemetry import EventEntry, PoisonEntry, PoolHost, TelemetryWriter
from firmware_model.kv_census import census

if TYPE_CHECKING:
    from emulator.firmware import Firmware

PUBLISH_PERIOD_NS = 100_000_000  # 10 Hz: a monitor's refresh is 2-4 Hz; publishing costs ~0.2 ms
MAX_LISTED = 16                  # events and poison records the page lists (layout 1.0)


class FirmwarePublisher:
    """A runner service: `service(now_ns)` publishes when the period has passed."""

    def __init__(self, fw: "Firmware") -> None:
        self.fw = fw
        self.writers = [TelemetryWriter(p.bar, "firmware") for p in fw.ports]
        self.pool_writers = [TelemetryWriter(p.bar, "pool") for p in fw.ports]
        self._last_ns = 0

    def service(self, now_ns: int) -> None:
        if now_ns - self._last_ns < PUBLISH_PERIOD_NS:
            return
        self._last_ns = now_ns
        self.publish(now_ns)

    def publish(self, now_ns: int) -> None:
        fw = self.fw
        running, percent, opcode, _ = fw.background_status
        records = fw.poison.records
        unit = fw.chmu.unit
        # device-wide facts, read once for every port's page: the DPA space is the static
        # capacity and the DC regions (the media file holds both, and "used" counts its blocks)
        device = dict(
            uptime_ns=now_ns - fw.boot_ns, timestamp_ns=fw.timestamp_ns(),
            capacity_bytes=fw.config.media_bytes, capacity_used_bytes=fw.capacity_used_bytes,
            media_status=fw.regs.get_field(R.MEMDEV_STATUS, "MEDIA_STATUS"),
            health_status=fw.health.health_status(), temperature_c=fw.health.temperature,
            life_used_pct=fw.health.life_used, poison_count=len(records),
            bg_running=int(running), bg_opcode=opcode, bg_percent=percent,
            recent_poison=[PoisonEntry(r.dpa, r.length, int(r.source)) for r in records[:MAX_LISTED]],
            chmu_enabled=int(unit.enabled), chmu_epoch_count=unit.status.epochs,
            chmu_unit_size=unit.config.unit_size, hotlist=unit.hotlist.peek()[-256:],
            state_save_failures=min(fw.persist.failures, 0xFFFF_FFFF))
        for port, writer in zip(fw.ports, self.writers):
            logs = port.events
            info, warn, fail, fatal, dcd = logs.counts()
            writer.publish(
                **device, events_info=info, events_warn=warn, events_fail=fail, events_fatal=fatal,
                events_dcd=dcd,
                recent_events=[EventEntry(t, g, s) for t, g, s in list(logs.recent)[:MAX_LISTED]])
        pool = self.pool_values()
        for writer in self.pool_writers:
            writer.publish(**pool)

    def pool_values(self) -> dict[str, Any]:
        """The pool section's fields: per port its claimer and DC extents, and the KV index's census."""
        fw = self.fw
        idx = fw.kv_pool.index
        pool = census(idx) if idx is not None else None
        rows = []
        for h, port in enumerate(fw.dcd.ports):
            row: dict[str, int] = dict(
                pid=liveness.firmware_pid(fw.files.path, host_pid_name(h)) or 0,
                extents=len(port.accepted), pending_extents=len(port.pending),
                extent_bytes=sum(e.length for e in port.accepted),
                shared_extent_bytes=sum(e.length for e in port.accepted if e.tag != NO_TAG))
            if pool is not None and h < len(pool.hosts):
                c = pool.hosts[h]
                row.update(pool_phase=c.phase, pool_pid=c.pid & 0xFFFF_FFFF, sealed=c.sealed, shared=c.shared,
                           unshared_bytes=c.unshared_bytes, quota_bytes=c.quota_bytes, pins=c.pins,
                           allocations=c.allocations, pool_hits=c.hits, cross_hits=c.cross_hits, evicted=c.evicted)
            rows.append(PoolHost(**row))
        values: dict[str, Any] = dict(hosts=len(fw.ports), host_rows=rows, pool_hosts=0, pool_slots=0,
                                      pool_slot_bytes=0, pool_used=0, pool_sealed=0, pool_shared=0,
                                      pool_evictions=0, pool_quota_evictions=0, pool_reaped_allocations=0,
                                      pool_cleared_pins=0)
        if pool is not None:
            values.update(pool_hosts=len(pool.hosts), pool_slots=pool.slots, pool_slot_bytes=pool.slot_bytes,
                          pool_used=pool.used, pool_sealed=pool.sealed, pool_shared=pool.shared,
                          pool_evictions=pool.evictions, pool_quota_evictions=pool.quota_evictions,
                          pool_reaped_allocations=pool.reaped_allocations, pool_cleared_pins=pool.cleared_pins)
        return values

    def close(self) -> None:
        for writer in self.writers + self.pool_writers:
            writer.close()
