"""The KV shim's telemetry on a served device, read back the way the monitor reads it: a batch
sharing a prompt prefix shows the device bytes that sharing saves, in the page, the monitor's KV
panel and the exporter's metrics."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kv_support import KV_HEADS, LAYERS, frame_bytes, generate, layout
from rich.console import Console
from transformers import LogitsProcessor

from driver.kv import CxlCache
from driver.kv._telemetry import count_shared
from driver.kv.testing import padded_batch
from emulator.telemetry import HostTelemetry
from tools.exporter import render_metrics
from tools.monitor import panels as P
from tools.monitor.source import DeviceSource, DeviceView

PIECES = 2 * KV_HEADS  # K and V of 2 kv heads
NEW = 8
PROMPT, PREFIX, BLOCK = 14, 8, 4  # the prefix is blocks 0 and 1 of every piece


def budget(batch: int) -> int:
    """Two frames of the final length: every layer is offloaded, so every prefix block is placed."""
    return 2 * frame_bytes(batch, PROMPT + NEW - 1)


class Watch(LogitsProcessor):
    """A monitor attached to the device, polled at every decode step of the generation."""

    def __init__(self, source: DeviceSource) -> None:
        self.source = source
        self.seen: list[HostTelemetry | None] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        snap = self.source.poll().snapshot
        self.seen.append(snap.host if snap else None)
        return scores


def published(source: DeviceSource) -> tuple[DeviceView, HostTelemetry]:
    """Poll the device as the monitor does; its host section must be there."""
    view = source.poll()
    assert view.snapshot is not None and view.snapshot.host is not None, view
    return view, view.snapshot.host


def pool_truth(cache: CxlCache) -> tuple[int, int, int]:
    """(chunks used, chunks shared, bytes saved) from the chunk pool's own reference counts."""
    engine = cache._engine
    refs = [b.ref_cnt for b in engine.pool.pool.blocks]
    saved = sum(r - 1 for r in refs if r > 1) * engine.layout.chunk_bytes
    return engine.pool.used, engine.pool.shared, saved


def text(renderable) -> str:
    console = Console(record=True, width=100, color_system=None, file=io.StringIO())
    console.print(renderable)
    return "\n".join(" ".join(line.split()) for line in console.export_text().splitlines())


def metrics(view: DeviceView) -> dict[str, float]:
    out = {}
    for line in render_metrics([view]).splitlines():
        if line.startswith("cxlemu:kv_") and f'device="{view.name}"' in line:
            key, value = line.rsplit(" ", 1)
            out[key.split("{")[0].removeprefix("cxlemu:")] = float(value)
    return out


def test_batch_sharing_a_prefix_shows_the_saving(model, served) -> None:
    """Three prompts with a common 8-token prefix: blocks 0 and 1 of every piece of every layer
    are one device chunk referenced three times, so each saves 2 chunks of device memory.
    The monitor watching the device sees the generation while it runs and the saving after it;
    closing the cache leaves the totals and zeroes what is held now."""
    batch = 3
    chunk = layout(batch, BLOCK).chunk_bytes
    assert chunk == BLOCK * 16 * 4 == 256
    shared = 2 * LAYERS * PIECES
    ids, mask = padded_batch([PROMPT] * batch, prefix=PREFIX)
    source = DeviceSource(served.name)
    watch = Watch(source)
    cache = CxlCache(hbm_budget_bytes=budget(batch), block_tokens=BLOCK, device=served.name)
    generate(model, ids, mask, cache, NEW, [watch])
    first = watch.seen[0]  # the publish at the prefill's first layer, unthrottled
    assert first is not None and first.writer_pid == os.getpid()
    assert (first.tokens_generated, first.hbm_budget_bytes) == (batch * PROMPT, budget(batch))
    assert len(watch.seen) == NEW

    stats = cache.stats()
    cache._telemetry.publish(force=True)  # the generation ended inside the publish period
    view, host = published(source)
    assert view.snapshot is not None and view.snapshot.has("host", "device_saved_bytes")
    assert host.chunk_bytes == chunk
    assert host.device_chunks_shared == shared
    assert host.device_saved_bytes == (batch - 1) * shared * chunk == 16 * 1024
    assert (host.device_chunks_used, host.device_chunks_shared, host.device_saved_bytes) == pool_truth(cache)
    assert host.dedup_chunks == stats["shared_chunks"] == (batch - 1) * shared
    assert host.dedup_write_bytes == stats["dedup_write_bytes"] == (batch - 1) * shared * chunk
    # every load reads a shared chunk once and copies it to the two other sequences
    assert host.dedup_load_bytes == stats["dedup_load_bytes"] == stats["loads"] * (batch - 1) * 2 * PIECES * chunk
    assert stats["loads"] > 0 and host.cow_copies == 0

    panel = text(P.kv_panel(view))
    assert f"│ sharing 32/{host.device_chunks_used} device chunks shared, 16.0 KiB saved │" in panel
    assert f"│ dedup 16.0 KiB unwritten, {P.fmt_bytes(host.dedup_load_bytes)} unread, 0 CoW │" in panel
    got = metrics(view)
    assert (got["kv_device_chunks_shared"], got["kv_device_saved_bytes"], got["kv_chunk_bytes"]) == (32, 16384, 256)
    assert (got["kv_dedup_chunks_total"], got["kv_dedup_write_bytes_total"]) == (64, 16384)
    assert got["kv_dedup_load_bytes_total"] == host.dedup_load_bytes
    assert got["kv_cow_copies_total"] == 0 and got["kv_device_chunks_used"] == host.device_chunks_used

    cache.close()
    _, after = published(source)
    source.close()
    assert (after.device_chunks_used, after.device_chunks_shared, after.device_saved_bytes) == (0, 0, 0)
    assert (after.dedup_chunks, after.dedup_write_bytes, after.writer_pid) == (64, 16384, 0)


def test_two_caches_on_one_device_publish_their_common_chunks(model, served) -> None:
    """A second cache with the same prompt, open beside the first, finds the first one's chunks by
    hash: the page counts the chunks both reference, exactly as the chunk pool does."""
    ids, mask = padded_batch([PROMPT])
    first = CxlCache(hbm_budget_bytes=budget(1), block_tokens=BLOCK, device=served.name)
    generate(model, ids, mask, first, NEW)
    second = CxlCache(hbm_budget_bytes=budget(1), block_tokens=BLOCK, device=served.name)
    generate(model, ids, mask, second, NEW)
    assert second._telemetry is first._telemetry  # one publisher per device per process
    second._telemetry.publish(force=True)
    source = DeviceSource(served.name)
    _, host = published(source)
    truth = pool_truth(second)
    dedup = first.stats()["shared_chunks"] + second.stats()["shared_chunks"]
    second.close()
    first.close()
    source.close()
    assert (host.device_chunks_used, host.device_chunks_shared, host.device_saved_bytes) == truth
    # the 14-token prompt's 3 full blocks of every piece of every layer, at least, are common
    assert host.device_chunks_shared >= 3 * LAYERS * PIECES
    assert host.device_saved_bytes == host.device_chunks_shared * layout(1, BLOCK).chunk_bytes  # two references each
    assert host.dedup_chunks == dedup >= 3 * LAYERS * PIECES


def test_divergence_publishes_the_copies_on_write(model, served) -> None:
    """Two sequences with one prompt share every prompt chunk; sampling makes them diverge, and
    the shared partial block of each offloaded layer is copied on write: the page counts it."""
    ids, mask = padded_batch([PROMPT, PROMPT], prefix=PROMPT)
    cache = CxlCache(hbm_budget_bytes=budget(2), block_tokens=BLOCK, device=served.name)
    torch.manual_seed(5)
    out = generate(model, ids, mask, cache, NEW, do_sample=True, top_k=0)
    assert not torch.equal(out[0], out[1])
    stats = cache.stats()
    cache._telemetry.publish(force=True)
    source = DeviceSource(served.name)
    _, host = published(source)
    truth = pool_truth(cache)
    cache.close()
    source.close()
    assert host.cow_copies == stats["cow_copies"] == (LAYERS - 1) * PIECES
    assert host.dedup_chunks == stats["shared_chunks"] == (3 * LAYERS + (LAYERS - 1)) * PIECES
    # after the copies, the 3 full prompt blocks of every piece stay shared
    assert (host.device_chunks_used, host.device_chunks_shared, host.device_saved_bytes) == truth
    assert host.device_chunks_shared == 3 * LAYERS * PIECES


@given(st.lists(st.integers(0, 1 << 20), max_size=200), st.booleans())
def test_count_shared_counts_repeated_ids(values: list[int], dense: bool) -> None:
    """Both counting paths (bincount for dense ids, sort for sparse) agree with np.unique."""
    ids = np.array([v % 64 for v in values] if dense else values, dtype=np.int64)
    _, counts = np.unique(ids, return_counts=True)
    assert count_shared(ids) == int(np.count_nonzero(counts > 1))
