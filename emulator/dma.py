"""DMA engine: scatter-gather transfers between device media and host buffers, timed.

::

    submit([Descriptor, ...]) ──► channel k's submission queue (depth queue_depth, FIFO)
                                      │  channel thread: for each descriptor, in order:
                                      │    validate host range → DmaError, never a copy
                                      │    DataPath.read/write(wait=False) → completion ns
                                      │    (poison / device range → DmaError for that one)
                                      │  wait until the latest completion (GIL released)
                                      ▼
    DmaHandle.done() / .wait() ◄── completion queue (poll_completions(), completion order)

Ordering (what a caller may rely on):

- Descriptors of one ``submit`` are issued in list order on one channel; each pays the
  link's latency, but they are pipelined on the link (the channel does not wait between
  them), so one submit of 32 blocks costs one latency plus 32 blocks of link time.
- Submissions to the same channel complete in submission order (FIFO); pass ``channel=k``
  to keep dependent transfers ordered.  Across channels there is no order.
- The handle completes when the last descriptor's completion time has passed.  Host buffers
  written by a ``read`` descriptor hold their data only once the handle is done; media written
  by a ``write`` descriptor may be visible to other readers a little earlier (as with posted
  writes).
- On an untimed link (zero latency, unthrottled) a small submission (<= ``INLINE_BYTES``) to
  an idle channel completes inline, in ``submit``, as io_uring completes requests that need
  no waiting; order is unchanged (a channel issues one submission at a time, inline or not).
- A failed descriptor (poison, out of range) is reported as a ``DmaError`` in its slot of the
  results and moves no byte; the other descriptors of the submit still run.
"""
from __future__ import annotations

import enum
import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from emulator.spec.errors import DmaError, PoisonError
from emulator.timing import DataPath, HostBuffer, host_view

__all__ = ["Descriptor", "Direction", "DmaEngine", "DmaHandle"]


class Direction(enum.Enum):
    """``READ``: device media → host buffer; ``WRITE``: host buffer → device media."""

    READ = "read"
    WRITE = "write"


@dataclass(frozen=True)
class Descriptor:
    """One scatter-gather element: ``length`` bytes between ``dpa`` and
    ``host_buffer[host_offset:host_offset + length]``.  ``host_buffer`` is any C-contiguous
    buffer (bytearray, numpy array, CPU torch tensor or a view from ``DmaEngine.register``)."""

    direction: Direction | str
    dpa: int
    host_buffer: Any
    host_offset: int
    length: int

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "direction", Direction(self.direction))
        except ValueError:
            raise ValueError(f"direction must be 'read' or 'write', got {self.direction!r}") from None
        for name in ("dpa", "host_offset", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Descriptor.{name} must be an int >= 0, got {value!r}")

    def window(self) -> memoryview:
        """The host bytes this descriptor moves, checked once and kept (descriptor lists are
        often built once and resubmitted, as rings of DMA descriptors are)."""
        cached = self.__dict__.get("_window")
        if cached is not None:
            return cached
        try:
            view = host_view(self.host_buffer, writable=self.direction is Direction.READ)
        except (TypeError, ValueError) as exc:
            raise DmaError(-1, f"host buffer: {exc}") from None
        end = self.host_offset + self.length
        if end > view.nbytes:
            raise DmaError(-1, f"host range [{self.host_offset:#x}, {end:#x}) runs past the host "
                               f"buffer ({view.nbytes:#x} B)")
        window = view[self.host_offset:end]
        object.__setattr__(self, "_window", window)
        return window

    def registered(self) -> HostBuffer:
        """The window registered with the C core (one pointer conversion per descriptor's
        life rather than per transfer); the plain window on the Python twin's side."""
        cached = self.__dict__.get("_registered")
        if cached is None:
            self.c_descriptor()
            cached = HostBuffer(self.window(), self.__dict__["_chost"], self.length,
                                self.direction is Direction.READ)
            object.__setattr__(self, "_registered", cached)
        return cached

    def c_descriptor(self) -> Any:
        """The C core's ``cxl_desc`` for this descriptor, built once (it pins the window)."""
        cached = self.__dict__.get("_cdesc")
        if cached is not None:
            return cached
        from emulator.timing._cimpl import ffi

        window = self.window()
        host = ffi.from_buffer("uint8_t[]", window, require_writable=self.direction is Direction.READ)
        cdesc = ffi.new("cxl_desc *", {"dir": 0 if self.direction is Direction.READ else 1,
                                       "dpa": self.dpa, "host": host, "len": self.length})
        object.__setattr__(self, "_cdesc", cdesc)
        object.__setattr__(self, "_chost", host)  # keeps the pointer in cdesc valid
        return cdesc


class DmaHandle:
    """One submission: poll ``done()``, block in ``wait()``, or add a callback.

    The event a waiter blocks on is made only when someone waits before completion: a
    submission that completes inline never pays for one."""

    __slots__ = ("_callbacks", "_done", "_event", "_lock", "_results", "channel", "count", "id")

    def __init__(self, handle_id: int, channel: int, count: int) -> None:
        self.id = handle_id
        self.channel = channel
        self.count = count
        self._done = False
        self._event: threading.Event | None = None
        self._results: list[int | DmaError] = []
        self._callbacks: list[Callable[[DmaHandle], None]] | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> list[int | DmaError]:
        """Per-descriptor results in submission order: the completion time (ns) or the
        ``DmaError`` of a descriptor that failed.  Raises ``TimeoutError`` if not done in time."""
        if not self._done:
            with self._lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise TimeoutError(f"DMA handle {self.id} not complete after {timeout} s")
        return list(self._results)

    def check(self, timeout: float | None = None) -> list[int]:
        """Like ``wait`` but raises the first descriptor's ``DmaError``: for callers that
        treat any failure as fatal for the whole transfer."""
        results = self.wait(timeout)
        for r in results:
            if isinstance(r, DmaError):
                raise r
        return results  # type: ignore[return-value]

    @property
    def errors(self) -> list[DmaError]:
        return [r for r in self._results if isinstance(r, DmaError)]

    def add_done_callback(self, fn: Callable[[DmaHandle], None]) -> None:
        """Call ``fn(handle)`` on completion (from the channel thread; keep it short), or now
        if already done."""
        with self._lock:
            if not self._done:
                self._callbacks = (self._callbacks or []) + [fn]
                return
        fn(self)

    def _complete(self, results: list[int | DmaError]) -> None:
        self._results = results
        with self._lock:
            self._done = True
            event, callbacks, self._callbacks = self._event, self._callbacks, None
        if event is not None:
            event.set()
        for fn in callbacks or ():
            fn(self)

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<DmaHandle {self.id} ch{self.channel} {self.count} desc {state}>"


_STOP = object()
INLINE_BYTES = 64 << 10
#: From this many descriptors a submission goes to the C core in one call; below it, setting
#: up the call's arrays costs more than issuing each descriptor from Python.
BATCH_MIN = 4


class DmaEngine:
    """``channels`` threads, each with a FIFO submission queue of ``queue_depth`` handles,
    moving data through a ``DataPath`` (so every transfer is timed and accounted on the link)."""

    def __init__(self, datapath: DataPath, channels: int = 4, queue_depth: int = 64) -> None:
        if not isinstance(datapath, DataPath):
            raise TypeError(f"datapath must be an emulator.timing.DataPath, got {type(datapath).__name__}")
        if isinstance(channels, bool) or not isinstance(channels, int) or not 1 <= channels <= 64:
            raise ValueError(f"channels must be an int from 1 to 64, got {channels!r}")
        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1:
            raise ValueError(f"queue_depth must be an int >= 1, got {queue_depth!r}")
        self.datapath = datapath
        self.channels = channels
        self.queue_depth = queue_depth
        self._sq: list[queue.Queue[Any]] = [queue.Queue(queue_depth) for _ in range(channels)]
        # The completion queue keeps the latest completions only (a ring, as in hardware):
        # callers holding handles need never poll it.
        self._cq: deque[DmaHandle] = deque(maxlen=4 * channels * queue_depth)
        self._ids = itertools.count(1)
        self._rr = itertools.count()
        self._closed = False
        self._submit_lock = threading.Lock()
        # busy[k]: submissions queued or running on channel k; issuing[k] is held while a
        # submission's descriptors are issued, so channel order holds for inline ones too.
        self._busy = [0] * channels
        self._issuing = [threading.Lock() for _ in range(channels)]
        self._inline_ok = datapath.config.untimed or datapath.clock is not None
        self._c = datapath.impl == "c"
        self._threads = [threading.Thread(target=self._channel_loop, args=(k,), daemon=True,
                                          name=f"cxlemu-dma-{k}") for k in range(channels)]
        for t in self._threads:
            t.start()

    # -- host side ------------------------------------------------------------------------------
    @staticmethod
    def register(buffer: Any) -> memoryview:
        """Validate a host buffer once and return the flat byte view descriptors may reuse
        (the engine's equivalent of registering a memory region: only it can be written)."""
        return host_view(buffer, writable=True)

    def submit(self, descriptors: Sequence[Descriptor] | Iterable[Descriptor], *,
               channel: int | None = None, timeout: float | None = None) -> DmaHandle:
        """Queue a scatter-gather list; returns at once unless the channel's submission
        queue is full (then it blocks up to ``timeout`` s and raises ``TimeoutError``)."""
        descs = list(descriptors)
        total = 0
        for d in descs:
            if d.__class__ is not Descriptor:
                i = descs.index(d)
                raise TypeError(f"descriptor {i} must be an emulator.dma.Descriptor, got {type(d).__name__}")
            total += d.length
        if channel is not None and not (isinstance(channel, int) and 0 <= channel < self.channels):
            raise ValueError(f"channel must be an int from 0 to {self.channels - 1}, got {channel!r}")
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("DmaEngine is closed")
            k = next(self._rr) % self.channels if channel is None else channel
            handle = DmaHandle(next(self._ids), k, len(descs))
            inline = self._inline_ok and self._busy[k] == 0 and total <= INLINE_BYTES
            self._busy[k] += 1
        if inline:
            with self._issuing[k]:
                results = self._run(descs)
            self._finish(k, handle, results)
            return handle
        try:
            self._sq[k].put((handle, descs), timeout=timeout)
        except queue.Full:
            with self._submit_lock:
                self._busy[k] -= 1
            raise TimeoutError(f"DMA channel {k} submission queue full ({self.queue_depth}) "
                               f"for {timeout} s") from None
        return handle

    def poll_completions(self, max_handles: int | None = None) -> list[DmaHandle]:
        """Pop completed handles from the completion queue, oldest completion first (it keeps
        the latest ``4 * channels * queue_depth``)."""
        out: list[DmaHandle] = []
        while self._cq and (max_handles is None or len(out) < max_handles):
            out.append(self._cq.popleft())
        return out

    def pending(self) -> int:
        """Handles queued or in flight on all channels."""
        with self._submit_lock:
            return sum(self._busy)

    def close(self) -> None:
        """Stop accepting submissions, finish what is queued, join the channel threads."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        for q in self._sq:
            q.put(_STOP)
        for t in self._threads:
            t.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- channel side ---------------------------------------------------------------------------
    def _channel_loop(self, k: int) -> None:
        q = self._sq[k]
        while True:
            item = q.get()
            try:
                if item is _STOP:
                    return
                handle, descs = item
                with self._issuing[k]:
                    results = self._run(descs)
                self._finish(k, handle, results)
            finally:
                q.task_done()

    def _finish(self, k: int, handle: DmaHandle, results: list[int | DmaError]) -> None:
        self._cq.append(handle)
        with self._submit_lock:
            self._busy[k] -= 1
        handle._complete(results)

    def _run(self, descs: list[Descriptor]) -> list[int | DmaError]:
        if self.datapath.impl == "c" and len(descs) >= BATCH_MIN:
            return self._run_c(descs)
        results: list[int | DmaError] = []
        latest = 0
        for i, d in enumerate(descs):
            try:
                done = self._issue(d)
            except DmaError as exc:
                results.append(DmaError(i, exc.reason))
                continue
            latest = max(latest, done)
            results.append(done)
        if latest:
            self.datapath.wait_until(latest)
        return results

    def _run_c(self, descs: list[Descriptor]) -> list[int | DmaError]:
        """The whole list in one call to the C core (``cxl_issue_batch``): per descriptor only
        its cached ``cxl_desc`` is touched from Python."""
        results: list[int | DmaError] = [0] * len(descs)
        cdescs, index = [], []
        for i, d in enumerate(descs):
            try:
                cdescs.append(d.c_descriptor())
                index.append(i)
            except DmaError as exc:
                results[i] = DmaError(i, exc.reason)
        if not cdescs:
            return results
        codes, errs = self.datapath.issue_batch(cdescs)
        latest = 0
        for j, i in enumerate(index):
            rc = codes[j]
            if rc >= 0:
                results[i] = rc
                latest = max(latest, rc)
            else:
                d = descs[i]
                what = "read" if d.direction is Direction.READ else "write"
                error = self.datapath.error_for(rc, what, d.dpa, d.length, errs[j])
                results[i] = DmaError(i, str(error))
        self.datapath.wait_until(latest)
        return results

    def _issue(self, d: Descriptor) -> int:
        """Start one descriptor's transfer; DmaError(reason) for anything that would copy a
        byte outside the device or the host buffer, or return poison."""
        window = d.registered() if self._c else d.window()
        try:
            if d.direction is Direction.READ:
                return self.datapath.read(d.dpa, window, wait=False)
            return self.datapath.write(d.dpa, window, wait=False)
        except PoisonError as exc:
            raise DmaError(-1, str(exc)) from None
        except ValueError as exc:
            raise DmaError(-1, str(exc)) from None
