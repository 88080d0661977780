"""The device-backed chunk store: chunk ``i`` is ``chunk_bytes`` of media at ``base + i * chunk_bytes``,
moved by the device's DMA engine over its timed link.

Each ``read`` / ``write`` is one scatter-gather submission of coalesced extents: the descriptors
are pipelined on the link, so a layer of a sequence costs one latency plus its bytes over the
bandwidth (``emulator.dma``). A poisoned line fails its descriptor with ``DmaError``, which the
engine retries and then recovers from.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from driver.kv._store import Extent
from emulator.dma import Descriptor, DmaEngine, DmaHandle
from emulator.spec import registers as R
from emulator.spec.errors import ConfigError, DmaError
from emulator.timing import DataPath

__all__ = ["DeviceBlockStore", "open_device_store"]


class _DmaTransfer:
    def __init__(self, handle: DmaHandle) -> None:
        self.handle = handle

    def done(self) -> bool:
        return self.handle.done()

    def wait(self) -> None:
        for result in self.handle.wait():
            if isinstance(result, DmaError):
                raise result


class DeviceBlockStore:
    """Chunks on an open ``MemDev``'s media, through a ``DmaEngine`` on its timed data path."""

    def __init__(self, memdev: Any, *, base: int = 0, size: int | None = None, channels: int = 2) -> None:
        capacity = memdev.config.capacity
        size = capacity - base if size is None else size
        if base < 0 or size <= 0 or base + size > capacity:
            raise ConfigError(f"KV region [{base:#x}, +{size:#x}) must lie within the device's "
                              f"{capacity:#x} bytes")
        self.memdev = memdev
        self.base = base
        self.size = size
        files = memdev.files
        link = memoryview(files.bar)[R.LINK_STATE_OFFSET:R.LINK_STATE_OFFSET + R.LINK_STATE_SIZE]
        self.datapath = DataPath(files.media, files.poison, link, memdev.config.timing)
        self.dma = DmaEngine(self.datapath, channels=channels)
        self.chunk_bytes = 0
        self.capacity_chunks = 0

    def configure(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.capacity_chunks = self.size // chunk_bytes

    def _descs(self, direction: str, extents: Sequence[Extent], host: np.ndarray) -> list[Descriptor]:
        cb = self.chunk_bytes
        return [Descriptor(direction, self.base + e.chunk * cb, host, e.host_offset, e.count * cb)
                for e in extents]

    def read(self, extents: Sequence[Extent], host: np.ndarray) -> _DmaTransfer:
        return _DmaTransfer(self.dma.submit(self._descs("read", extents, host)))

    def write(self, extents: Sequence[Extent], host: np.ndarray) -> _DmaTransfer:
        return _DmaTransfer(self.dma.submit(self._descs("write", extents, host)))

    def scrub(self, chunk: int) -> int:
        """Clear every poisoned line of ``chunk`` with the device's Clear Poison command (CXL 3.1
        8.2.9.9.4.3), so it can be rewritten; returns how many lines were cleared."""
        cleared = 0
        start, end = self.dpa(chunk), self.dpa(chunk + 1)
        while (bad := self.memdev.first_poisoned(start, end - start)) is not None:
            self.memdev.clear_poison(bad)
            cleared += 1
            start = bad + 64
        return cleared

    def dpa(self, chunk: int) -> int:
        """Device physical address of ``chunk`` (tests poison it)."""
        return self.base + chunk * self.chunk_bytes

    def close(self) -> None:
        self.dma.close()


class _OwnedStore(DeviceBlockStore):
    """A store that also closes the MemDev (and stops the private device) it was opened with."""

    def __init__(self, memdev: Any, stack: contextlib.ExitStack, **kw: Any) -> None:
        super().__init__(memdev, **kw)
        self._stack = stack

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stack.close()


def open_device_store(name: str | None, capacity: int, private_name: str) -> tuple[DeviceBlockStore, None, str]:
    """Open device ``name``, or serve a private in-process device when ``name`` is None."""
    from driver.memdev import MemDev
    from emulator.device import DeviceConfig, serve

    stack = contextlib.ExitStack()
    try:
        if name is None:
            name = stack.enter_context(serve(DeviceConfig(name=private_name, capacity=capacity))).name
        md = stack.enter_context(MemDev.open(name))
        return _OwnedStore(md, stack), None, name
    except BaseException:
        stack.close()
        raise
