"""Where KV chunks live off the accelerator: one small interface, two backings, one fault injector.

The residency engine only ever calls :class:`BlockStore`: ``read`` / ``write`` a list of extents
(runs of consecutive chunk ids) from / into a host staging buffer, returning a :class:`Transfer`
that completes asynchronously. :class:`MemoryBlockStore` is a plain numpy array (for tests of
the engine itself); ``_device_store.DeviceBlockStore`` moves the bytes through the device's
timed DMA engine. :class:`FaultInjectingStore` wraps either to fail, poison or delay reads, the
way SGLang's HiCache ships a delay / failure injector for its tests.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple, Protocol

import numpy as np

from driver.kv._chunks import ChunkPool
from emulator.spec.errors import ConfigError, DmaError, PoisonError

__all__ = ["BlockStore", "Extent", "FaultInjectingStore", "MemoryBlockStore", "Transfer", "coalesce"]


class Extent(NamedTuple):
    """``nbytes`` from the start of chunk ``chunk`` (and the chunks after it) <-> ``host_offset``."""

    chunk: int
    nbytes: int
    host_offset: int


def coalesce(runs: Sequence[tuple[int, int, int]], chunk_bytes: int) -> list[Extent]:
    """Merge (chunk, nbytes, host offset) runs that continue each other on both sides (a whole
    chunk followed by the next chunk id at the next host byte) into one extent: one DMA
    descriptor."""
    out: list[Extent] = []
    for c, n, h in runs:
        if out:
            last = out[-1]
            if (last.nbytes % chunk_bytes == 0 and c == last.chunk + last.nbytes // chunk_bytes
                    and h == last.host_offset + last.nbytes):
                out[-1] = Extent(last.chunk, last.nbytes + n, last.host_offset)
                continue
        out.append(Extent(c, n, h))
    return out


class Transfer(Protocol):
    """An asynchronous transfer; ``wait`` raises ``DmaError`` / ``PoisonError`` on failure."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class BlockStore(Protocol):
    """Chunk-addressed storage off the accelerator, with the pool that owns its chunk ids."""

    chunk_bytes: int
    capacity_chunks: int
    pool: ChunkPool | None

    def configure(self, chunk_bytes: int) -> None:
        """Fix the chunk size (known at the first update); sets ``capacity_chunks`` and ``pool``.
        A store already configured with another size refuses (its chunks would overlap)."""

    def read(self, extents: Sequence[Extent], host: np.ndarray) -> Transfer: ...

    def write(self, extents: Sequence[Extent], host: np.ndarray) -> Transfer: ...

    def register(self, host: np.ndarray) -> None:
        """``host`` is a long-lived buffer (a frame, a staging buffer): the store may keep what
        it builds for transfers to and from it (DMA descriptors) and reuse it when the same
        extents move again, until :meth:`unregister`."""

    def unregister(self, host: np.ndarray) -> None:
        """Forget what :meth:`register` let the store keep for ``host``."""

    def batched(self) -> AbstractContextManager[None]:
        """A block whose reads and writes the store may issue together when it ends (their
        transfers are waited on only after it)."""

    def scrub(self, chunk: int) -> int:
        """Clear poison in ``chunk`` before it is rewritten; returns the lines cleared."""

    def close(self) -> None: ...


def configure_chunks(store: BlockStore, chunk_bytes: int, region_bytes: int) -> None:
    """Shared ``configure``: first caller fixes the chunk size and creates the pool."""
    if store.pool is not None:
        if chunk_bytes != store.chunk_bytes:
            raise ConfigError(f"this device already holds KV chunks of {store.chunk_bytes} bytes; a "
                              f"cache with {chunk_bytes}-byte chunks (another model shape or "
                              "block_tokens) needs its own device")
        return
    store.chunk_bytes = chunk_bytes
    store.capacity_chunks = region_bytes // chunk_bytes
    store.pool = ChunkPool(store.capacity_chunks)


class CompletedTransfer:
    """A transfer that finished (or failed) before it was returned."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        if self._error is not None:
            raise self._error

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        fn()


class MemoryBlockStore:
    """Chunks in a host numpy array; every transfer completes at once (no timing)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = 0
        self.capacity_chunks = 0
        self.pool: ChunkPool | None = None
        self._media = np.zeros(capacity_bytes, dtype=np.uint8)
        self.bytes_read = 0
        self.bytes_written = 0

    def configure(self, chunk_bytes: int) -> None:
        configure_chunks(self, chunk_bytes, self.capacity_bytes)

    def read(self, extents: Sequence[Extent], host: np.ndarray) -> Transfer:
        cb = self.chunk_bytes
        for e in extents:
            n = e.nbytes
            host[e.host_offset:e.host_offset + n] = self._media[e.chunk * cb:e.chunk * cb + n]
            self.bytes_read += n
        return CompletedTransfer()

    def write(self, extents: Sequence[Extent], host: np.ndarray) -> Transfer:
        cb = self.chunk_bytes
        for e in extents:
            n = e.nbytes
            self._media[e.chunk * cb:e.chunk * cb + n] = host[e.host_offset:e.host_offset + n]
            self.bytes_written += n
        return CompletedTransfer()

    def register(self, host: np.ndarray) -> None:
        """Nothing to keep: a copy needs no descriptor."""

    def unregister(self, host: np.ndarray) -> None:
        """See :meth:`register`."""

    def batched(self) -> AbstractContextManager[None]:
        """Nothing to batch: every copy is done when it returns."""
        return nullcontext()

    def scrub(self, chunk: int) -> int:
        return 0

    def close(self) -> None:
        self._media = np.zeros(0, dtype=np.uint8)


class _DelayedTransfer:
    """Starts the inner read only after ``delay_s``: the bytes really arrive late."""

    def __init__(self, start: Callable[[], Transfer], delay_s: float) -> None:
        self._inner: Transfer | None = None
        self._error: BaseException | None = None
        self._started = threading.Event()
        self._start = start
        self._timer = threading.Timer(delay_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        try:
            self._inner = self._start()
        except BaseException as exc:  # surfaced by wait()
            self._error = exc
        self._started.set()

    def done(self) -> bool:
        return self._started.is_set() and (self._inner is None or self._inner.done())

    def wait(self) -> None:
        self._started.wait()
        if self._error is not None:
            raise self._error
        assert self._inner is not None
        self._inner.wait()


class FaultInjectingStore:
    """Wraps a store; fails the next reads, poisons chunks, or delays every read.

    * ``fail_next_reads(n)``: the next ``n`` reads fail with ``DmaError`` (transient: a retry works);
    * ``poison(chunk)``: every read touching ``chunk`` fails with ``PoisonError`` until the chunk is
      scrubbed (as Clear Poison does on the device);
    * ``read_delay_s``: each read starts that much later (for copy / compute race tests).
    """

    def __init__(self, inner: BlockStore, *, read_delay_s: float = 0.0) -> None:
        self.inner = inner
        self.read_delay_s = read_delay_s
        self._fail_reads = 0
        self._poisoned: set[int] = set()
        self.injected = 0

    @property
    def chunk_bytes(self) -> int:  # type: ignore[override]
        return self.inner.chunk_bytes

    @property
    def capacity_chunks(self) -> int:  # type: ignore[override]
        return self.inner.capacity_chunks

    @property
    def pool(self) -> ChunkPool | None:  # type: ignore[override]
        return self.inner.pool

    def configure(self, chunk_bytes: int) -> None:
        self.inner.configure(chunk_bytes)

    def fail_next_reads(self, n: int) -> None:
        self._fail_reads += n

    def poison(self, chunk: int) -> None:
        self._poisoned.add(chunk)

    def read(self, extents: Sequence[Extent], host: np.ndarray) -> Transfer:
        if self._fail_reads > 0:
            self._fail_reads -= 1
            self.injected += 1
            return CompletedTransfer(DmaError(0, "injected transfer failure"))
        for e in extents:
            span = -(-e.nbytes // self.chunk_bytes)
            bad = self._poisoned.intersection(range(e.chunk, e.chunk + span))
            if bad:
                self.injected += 1
                return CompletedTransfer(PoisonError(min(bad) * self.chunk_bytes))
        if self.read_delay_s > 0:
            return _DelayedTransfer(lambda: self.inner.read(extents, host), self.read_delay_s)
        return self.inner.read(extents, host)

    def write(self, extents: Sequence[Extent], host: np.ndarray) -> Transfer:
        return self.inner.write(extents, host)

    def register(self, host: np.ndarray) -> None:
        self.inner.register(host)

    def unregister(self, host: np.ndarray) -> None:
        self.inner.unregister(host)

    def batched(self) -> AbstractContextManager[None]:
        return self.inner.batched()

    def scrub(self, chunk: int) -> int:
        cleared = int(chunk in self._poisoned)
        self._poisoned.discard(chunk)
        return cleared + self.inner.scrub(chunk)

    def close(self) -> None:
        self.inner.close()
