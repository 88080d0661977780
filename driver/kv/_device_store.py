"""The device-backed chunk store: chunk ``i`` is ``chunk_bytes`` of media at ``base + i * chunk_bytes``,
moved by the device's DMA engine over its timed link.

Each ``read`` / ``write`` is one scatter-gather submission of coalesced extents: the descriptors
are pipelined on the link, so a layer of a sequence costs one latency plus its bytes over the
bandwidth (``emulator.dma``). A poisoned line fails its descriptor with ``DmaError``, which the
engine retries and then recovers from.

Descriptors for a registered host buffer (a layer frame, a staging buffer) are kept and
resubmitted when the same extents move again, as a driver keeps rings of DMA descriptors: a
layer's load repeats step after step, and building a descriptor (and the DMA engine's pinned
view of its window) per transfer is host time on the compute thread and the channel thread.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from driver.kv._chunks import ChunkPool
from driver.kv._store import Extent, configure_chunks
from emulator import liveness
from emulator.dma import Descriptor, DescriptorArray, DmaEngine, DmaHandle, PinnedHosts
from emulator.spec import registers as R
from emulator.spec.errors import ConfigError, CxlemuError, DmaError
from emulator.timing import DataPath

__all__ = ["DeviceBlockStore", "DeviceInUse", "claim_kv", "open_device_store"]


SPIN_BELOW_NS = 300_000  # sleep until this close to a completion, then let the data path spin


class SleepingDataPath(DataPath):
    """The device's data path, but a DMA channel waits for a completion mostly asleep.

    The data path spins until a transfer completes (precise to tens of ns, and right for a probe
    measuring latency). A KV load overlaps model compute: on a host with fewer free cores than
    busy threads, a spinning channel takes the very core the compute needs, so the overlap the
    shim exists for would be measured away. Sleeping until ``SPIN_BELOW_NS`` before the deadline,
    then spinning, keeps completions on time (a VM wakes 60-120 us late) at a fraction of the CPU.
    """

    def wait_until(self, completion_ns: int) -> None:
        if self.clock is None:
            remaining = completion_ns - time.monotonic_ns()
            if remaining > SPIN_BELOW_NS:
                time.sleep((remaining - SPIN_BELOW_NS) / 1e9)
        super().wait_until(completion_ns)


class _DmaTransfer:
    """One submission, or descriptors ``[lo, hi)`` of a submission shared with others (see
    :meth:`DeviceBlockStore.batched`: its handle is set when the batch is submitted)."""

    __slots__ = ("handle", "hi", "lo")

    def __init__(self, handle: DmaHandle | None, lo: int = 0, hi: int | None = None) -> None:
        self.handle, self.lo, self.hi = handle, lo, hi

    def _handle(self) -> DmaHandle:
        if self.handle is None:
            raise RuntimeError("transfer of a batch not submitted yet: leave DeviceBlockStore.batched() first")
        return self.handle

    def done(self) -> bool:
        return self._handle().done()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """``fn()`` on completion, from the DMA channel thread (or now, if done)."""
        self._handle().add_done_callback(lambda _h: fn())

    def wait(self) -> None:
        results = self._handle().wait()
        for result in results if self.hi is None else results[self.lo:self.hi]:
            if isinstance(result, DmaError):
                raise result


class _Batch(threading.local):
    """The descriptors and transfers of an open :meth:`DeviceBlockStore.batched` (per thread:
    caches on one device may run on several threads)."""

    def __init__(self) -> None:
        self.descs: list[Descriptor] | None = None
        self.transfers: list[_DmaTransfer] = []


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
        # the handle's state check: once its firmware is gone, DMA fails (DeviceGone) untouched
        state = (liveness.state_view(files.bar), memdev.datapath.state[1]) if memdev.datapath.state else None
        self.datapath = SleepingDataPath(files.media, files.poison, link, memdev.config.timing,
                                         state=state, name=memdev.name,
                                         media_link=memdev.datapath.media_mmap)  # the device's shared media
        self.dma = DmaEngine(self.datapath, channels=channels)
        self.chunk_bytes = 0
        self.capacity_chunks = 0
        self.pool: ChunkPool | None = None
        self.telemetry: Any = None  # a HostPublisher when shared through open_device_store
        self.timing = memdev.config.timing  # the link the prefetch window is sized for
        self._batch = _Batch()
        # id(host) -> (host, {(direction, extents): descriptors}); holding host keeps its id unique
        self._regions: dict[int, tuple[np.ndarray, dict[tuple[str, tuple[Extent, ...]], list[Descriptor]]]] = {}

    def configure(self, chunk_bytes: int) -> None:
        configure_chunks(self, chunk_bytes, self.size)

    REGION_PLANS = 64  # descriptor lists kept per registered buffer (a frame sees each layer)

    def register(self, host: np.ndarray) -> None:
        if id(host) not in self._regions:
            self._regions[id(host)] = (host, {})

    def unregister(self, host: np.ndarray) -> None:
        region = self._regions.get(id(host))
        if region is not None and region[0] is host:
            del self._regions[id(host)]

    def _descs(self, direction: str, extents: Sequence[Extent], host: np.ndarray) -> list[Descriptor]:
        cb = self.chunk_bytes
        feed = self.memdev.access_feed  # the device's CHMU counts what the KV cache touches
        if feed.enabled and extents:
            feed.note_many(np.fromiter((self.base + e.chunk * cb for e in extents), np.int64, len(extents)),
                           np.fromiter((e.nbytes for e in extents), np.int64, len(extents)), direction == "write")
        region = self._regions.get(id(host))
        plans = region[1] if region is not None and region[0] is host else None
        key = (direction, tuple(extents))
        if plans is not None and key in plans:
            return plans[key]
        descs = [Descriptor(direction, self.base + e.chunk * cb, host, e.host_offset, e.nbytes)
                 for e in extents]
        if plans is not None:
            if len(plans) >= self.REGION_PLANS:
                del plans[next(iter(plans))]  # the oldest: a layer whose table changed since
            plans[key] = descs
        return descs

    def read(self, extents: Sequence[Extent], host: np.ndarray) -> _DmaTransfer:
        return self._submit(self._descs("read", extents, host))

    def write(self, extents: Sequence[Extent], host: np.ndarray) -> _DmaTransfer:
        return self._submit(self._descs("write", extents, host))

    def read_runs(self, chunks: np.ndarray, host_offsets: np.ndarray, nbytes: np.ndarray,
                  host: np.ndarray, urgent: bool = False, pinned: PinnedHosts | None = None) -> _DmaTransfer:
        """``read`` of many extents given as arrays (first chunk, host offset, bytes): one
        ``DescriptorArray``, no Python object per extent. Hot-page attention reads scattered
        pages, a new list every step, where a frame's load repeats the same few extents.
        ``urgent``: the caller waits for it at once, so it is issued in the caller's thread
        whatever its size (``DmaEngine.submit(inline=True)``). ``pinned``: ``host`` already pinned
        (``PinnedHosts([host])``), by a caller that reads into it more than once."""
        dpas = self.base + chunks.astype(np.int64) * self.chunk_bytes
        feed = self.memdev.access_feed  # the device's CHMU counts what the KV cache touches
        if feed.enabled:
            feed.note_many(dpas, nbytes, False)
        if self._batch.descs is not None:  # inside batched(): as a list, with the others
            return self.read([Extent(*e) for e in zip(chunks.tolist(), nbytes.tolist(), host_offsets.tolist(),
                                                        strict=True)], host)
        arr = DescriptorArray("read", pinned or [host], np.zeros(dpas.size, np.int64), dpas, host_offsets, nbytes)
        return _DmaTransfer(self.dma.submit(arr, inline=urgent))

    def _submit(self, descs: list[Descriptor]) -> _DmaTransfer:
        batch = self._batch
        if batch.descs is None:
            return _DmaTransfer(self.dma.submit(descs))
        transfer = _DmaTransfer(None, len(batch.descs), len(batch.descs) + len(descs))
        batch.descs += descs
        batch.transfers.append(transfer)
        return transfer

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Reads and writes issued inside go to the DMA engine as one submission when the block
        ends (an eviction's write-back and the load that takes its frame: one descriptor list,
        one channel wake-up). Their transfers may be waited on only after the block."""
        batch = self._batch
        if batch.descs is not None:  # nested: the outer block submits
            yield
            return
        batch.descs, batch.transfers = [], []
        try:
            yield
        finally:
            descs, transfers = batch.descs, batch.transfers
            batch.descs, batch.transfers = None, []
            if descs:
                handle = self.dma.submit(descs)
                for t in transfers:
                    t.handle = handle

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


class _SharedStore:
    """One store per device per process, shared by every cache on that device: they share its
    chunk pool (so prefix sharing spans generations) and never overlap on the media."""

    def __init__(self, store: DeviceBlockStore, stack: contextlib.ExitStack) -> None:
        from driver.kv._telemetry import HostPublisher

        self.store = store
        self.stack = stack
        self.users = 0
        store.telemetry = HostPublisher(store.memdev, store.dma)
        stack.callback(store.telemetry.close)


_OPEN: dict[str, _SharedStore] = {}
_LOCK = threading.Lock()


class _StoreHandle:
    """A cache's reference to a shared device store; ``close`` drops it, the last one closes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._shared: _SharedStore | None = _OPEN[name]

    def __getattr__(self, attr: str) -> Any:
        shared = self.__dict__.get("_shared")
        if shared is None:
            raise AttributeError(attr)
        return getattr(shared.store, attr)

    def close(self) -> None:
        with _LOCK:
            shared, self._shared = self._shared, None
            if shared is None:
                return
            shared.users -= 1
            if shared.users:
                return
            del _OPEN[self.name]
        try:
            shared.store.close()
        finally:
            shared.stack.close()


class DeviceInUse(CxlemuError):
    """Another process keeps its KV cache on this device: sharing its media would corrupt both."""

    def __init__(self, name: str, pid: str) -> None:
        super().__init__(f"device {name!r} already holds the KV cache of process {pid or '?'}: "
                         "serve another device for this process (caches within one process share one)")


def claim_kv(md: Any, stack: contextlib.ExitStack) -> None:
    """One process's KV cache per device host port: an flock on the device's kv.lock (kv.h<h>.lock
    for port h > 0), held while it is open (released by the kernel if the process dies), so a
    second process is refused, never overlapped."""
    host = md.files.host
    path = md.files.path / ("kv.lock" if host == 0 else f"kv.h{host}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise DeviceInUse(md.name, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    stack.callback(os.close, fd)


def open_device_store(name: str | None, capacity: int, private_name: str) -> tuple[Any, str]:
    """A handle on device ``name``'s store, or on a private in-process device when None."""
    from driver.memdev import MemDev
    from emulator.device import DeviceConfig, serve

    with _LOCK:
        if name is not None and name in _OPEN:
            _OPEN[name].users += 1
            return _StoreHandle(name), name
        stack = contextlib.ExitStack()
        try:
            if name is None:
                name = stack.enter_context(serve(DeviceConfig(name=private_name, capacity=capacity))).name
            md = stack.enter_context(MemDev.open(name))
            claim_kv(md, stack)
            _OPEN[name] = _SharedStore(DeviceBlockStore(md), stack)
        except BaseException:
            stack.close()
            raise
        _OPEN[name].users += 1
        return _StoreHandle(name), name
