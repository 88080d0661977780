"""How often each KV chunk was read: the counts hot-page attention breaks ties with.

On a device (``DeviceBlockStore``), the device's own CHMU: programmed through its registers
(``driver.chmu.ChmuRegs``, as the vLLM tier's ``DeviceHotlist`` does) to count reads of the KV
region in units of one chunk (or the largest power of two dividing it), in 10 ms epochs; the
store feeds it every transfer's DPAs (its access feed), the firmware publishes the hotlist at
each epoch's end, and :meth:`DeviceHeat.refresh` (once per decode step) drains the hotlist into a
count per unit. Elsewhere (a memory store, a compressing store whose chunks are not the
device's), the CHMU's counting model (``firmware_model.hotness.HotnessUnit``) counts the reads
the engine makes. Either way ``counts(chunks)`` is the count of each chunk's unit.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from firmware_model.hotness import HotnessConfig, HotnessUnit

__all__ = ["DeviceHeat", "ModelHeat", "page_heat"]

EPOCH_NS = 10_000_000  # the CHMU's epoch: counts reach the hotlist this late at most


def _unit(chunk_bytes: int) -> int:
    """The CHMU unit for chunks of ``chunk_bytes``: the largest power of two dividing it, 256 B to
    2 MiB (the sizes a CHMU offers), so no unit straddles two chunks."""
    return min(max(chunk_bytes & -chunk_bytes, 256), 2 << 20)


class ModelHeat:
    """The CHMU's counting model over the KV chunks, fed the engine's reads."""

    fed_by_engine = True  # the engine calls read() with the chunks it chose

    def __init__(self, chunks: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.unit = HotnessUnit(max(1, chunks) * chunk_bytes, HotnessConfig(unit_size=_unit(chunk_bytes)))
        self._shift = self.unit.config.unit_size.bit_length() - 1

    def read(self, chunks: np.ndarray) -> None:
        self.unit.record(chunks.ravel().astype(np.uint64) * np.uint64(self.chunk_bytes))

    def refresh(self) -> None:
        """Nothing to collect: the model counts as it is fed."""

    def counts(self, chunks: np.ndarray) -> np.ndarray:
        return self.unit.counters[(np.maximum(chunks, 0) * self.chunk_bytes) >> self._shift]


class DeviceHeat:
    """The device's CHMU, counting the store's reads; its hotlist drained into counts per unit."""

    fed_by_engine = False  # the store's transfers feed it (read() is a no-op)

    def __init__(self, store: Any) -> None:
        from driver.chmu import ChmuRegs

        self.store = store
        self.unit_size = _unit(store.chunk_bytes)
        self.regs = ChmuRegs.of_bar(store.memdev.bar)
        self.regs.configure(unit_size=self.unit_size, threshold=1, mode="epoch", epoch_ns=EPOCH_NS, track="r")
        self._counts = np.zeros(-(-store.memdev.config.capacity // self.unit_size), np.int64)

    def read(self, chunks: np.ndarray) -> None:
        """Nothing to do: the store's transfers reach the CHMU through the device's access feed."""

    def refresh(self) -> None:
        self.store.memdev.access_feed.flush()  # the reads noted since the last step, to the firmware
        for dpa, count in self.regs.read_hotlist():
            unit = dpa // self.unit_size
            if 0 <= unit < self._counts.size:
                self._counts[unit] += count

    def counts(self, chunks: np.ndarray) -> np.ndarray:
        dpas = self.store.base + np.maximum(chunks, 0) * self.store.chunk_bytes
        return self._counts[dpas // self.unit_size]

    def total(self) -> int:
        return int(self._counts.sum())


def page_heat(store: Any, chunk_bytes: int) -> ModelHeat | DeviceHeat:
    """The device's CHMU when ``store`` is a device's, else the counting model."""
    if getattr(store, "memdev", None) is not None and getattr(store, "chunk_bytes", 0) == chunk_bytes:
        return DeviceHeat(store)
    return ModelHeat(store.capacity_chunks, chunk_bytes)
