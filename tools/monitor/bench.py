"""`cxlemu bench telemetry`: cost of the telemetry page's two sides, so the firmware runner's
budget is known.

    cxlemu bench telemetry [--rounds N] [--json]

Prints microseconds per call: a full firmware publish (256 hotlist entries, 16 events, 16 poison
records), a small and a full host publish, a pool publish of 8 host rows, and the firmware's census of
a KV pool's index of 87,338 slots (half of them sealed; the firmware takes it at each publish,
``firmware_model.kv_census``), a reader snapshot of every section, and the KV shim's
prefix-sharing gauges (``driver.kv._telemetry.sharing_gauges``) over the block tables of a small
and a large model (the shim computes them at each publish, ~10 times a second). Figures are wall-clock
means over N rounds on this machine: compare them with each other, not across machines.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import numpy as np

from emulator.spec.registers import BAR_SIZE
from emulator.telemetry import (
    EventEntry,
    HostTelemetry,
    PoisonEntry,
    PoolHost,
    TelemetryReader,
    TelemetryWriter,
)
from firmware_model import kv_index as K
from firmware_model.kv_census import census


def _mean_us(fn: Callable[[], object], rounds: int) -> float:
    fn()  # warm caches (dtype lookups, first-touch of the page)
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds * 1e6


def _tables(layers: int, batch: int, pieces: int, blocks: int, shared: int) -> Any:
    """What `sharing_gauges` reads of an engine: block tables (half their capacity in use, the
    first `shared` blocks of every row one chunk, as with a common prompt prefix) and the pool."""
    tables, nxt = [], 0
    for _ in range(layers):
        ids = np.full((batch, pieces, 2 * blocks), -1, np.int64)
        ids[:, :, :blocks] = np.arange(nxt, nxt + batch * pieces * blocks).reshape(batch, pieces, blocks)
        ids[:, :, :shared] = ids[0, :, :shared]
        nxt += batch * pieces * blocks
        tables.append(SimpleNamespace(chunks=SimpleNamespace(ids=ids)))
    used = layers * pieces * (batch * (blocks - shared) + shared)
    return SimpleNamespace(pool=SimpleNamespace(used=used), layout=SimpleNamespace(chunk_bytes=4096),
                           layers=tables)


def _pool_index(hosts: int = 8) -> K.KvIndex:
    """A 16 MiB index of 64-byte slots (87,338 of them), every other slot sealed by one of ``hosts``,
    each entry pinned by one host and read by another: what a census walks."""
    buf = bytearray(16 << 20)
    idx = K.KvIndex.format(buf, lambda i, e, v: True, base_dpa=0, slot_bytes=64, hosts=hosts)
    n = idx.slots // 2
    owners = np.arange(n, dtype=np.uint64) % np.uint64(hosts)
    rows = idx.table_words[::2][:n]
    rows[:, K.E_STATE] = np.uint64(K.SEALED) | owners << np.uint64(4) | np.uint64(1 << 8)
    rows[:, K.E_PINS] = np.uint64(1) << (np.uint64(8) * ((owners + np.uint64(1)) % np.uint64(hosts)))
    rows[:, K.E_READERS] = np.uint64(1) << ((owners + np.uint64(2)) % np.uint64(hosts))
    return idx


def run(rounds: int) -> dict[str, float]:
    from driver.kv import sharing_gauges

    bar = bytearray(BAR_SIZE)
    fw = TelemetryWriter(bar, "firmware")
    host = TelemetryWriter(bar, "host")
    pool = TelemetryWriter(bar, "pool")
    reader = TelemetryReader(bar)
    rows = [PoolHost(pid=100 + h, pool_phase=2, extents=1, extent_bytes=1 << 30, shared_extent_bytes=1 << 30,
                     sealed=1000, shared=10, pins=3, pool_hits=10**6, cross_hits=10**5) for h in range(8)]
    index = _pool_index()
    hotlist = [(u * 7, 1000 - u) for u in range(256)]
    events = [EventEntry(i, i % 5, f"event {i}: general media error") for i in range(16)]
    poison = [PoisonEntry(i * 4096, 64, 3) for i in range(16)]
    small, large = _tables(16, 1, 4, 32, 0), _tables(32, 4, 16, 512, 128)
    return {
        "firmware publish, full (256 hot, 16 events, 16 poison)": _mean_us(
            lambda: fw.publish(uptime_ns=1, capacity_bytes=1 << 30, hotlist=hotlist, recent_events=events,
                               recent_poison=poison), rounds),
        "firmware publish, 4 scalars": _mean_us(
            lambda: fw.publish(uptime_ns=2, timestamp_ns=3, temperature_c=40, media_status=1), rounds),
        "host publish, 6 counters": _mean_us(
            lambda: host.publish(hits=1, misses=2, loads=3, offloads=4, stall_ns=5, tokens_generated=6), rounds),
        "host publish, every field (as the KV shim publishes)": _mean_us(
            lambda: host.publish(**{f.name: 7 for f in fields(HostTelemetry)
                                    if f.name not in ("seq", "updated_ns", "writer_pid")}), rounds),
        "pool publish, 8 host rows": _mean_us(lambda: pool.publish(hosts=8, pool_hosts=8, pool_slots=1, host_rows=rows),
                                             rounds),
        f"pool census, {index.slots:,} slots, half sealed (the firmware, at each publish)": _mean_us(
            lambda: census(index), max(1, rounds // 10)),
        "reader snapshot, every section": _mean_us(reader.snapshot, rounds),
        "kv sharing gauges, 16 layers x 4 pieces x 32 blocks (bench kv's model)": _mean_us(
            lambda: sharing_gauges([small]), rounds),
        "kv sharing gauges, 32 x 4 seqs x 16 pieces x 512 blocks (1M references)": _mean_us(
            lambda: sharing_gauges([large]), max(1, rounds // 100)),
    }
