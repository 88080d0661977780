"""DMA engine: scatter-gather transfers between device media and host buffers, timed.

::

    submit([Descriptor, ...])
      ├─ <= INLINE_BYTES (or inline=True), channel k idle: issued here, in the caller (io_uring's inline issue)
      │    completion already passed → returned done (one C call for one descriptor: issue,
      │    done handle, CQ entry); else → at the head of channel k, for its thread to wait on
      └─ otherwise → channel k's submission queue (depth queue_depth, FIFO); its thread issues
    issue: each descriptor in order, none waited for (the link pipelines them):
        validate host range → DmaError, never a copy
        C core: one call per descriptor (cxl_issue), or per list of 4+ (cxl_issue_batch)
        poison / no DC extent / device range → DmaError for that descriptor
    channel thread: wait until the latest completion (DataPath.wait_until, GIL released)
      ▼
    DmaHandle.done() / .wait() ◄── completion queue (poll_completions(), completion order)

Ordering (what a caller may rely on):

- Descriptors of one ``submit`` are issued in list order on one channel; each pays the
  link's latency, but they are pipelined on the link (the channel does not wait between
  them), so one submit of 32 blocks costs one latency plus 32 blocks of link time.
- Submissions to the same channel complete in submission order (FIFO); pass ``channel=k``
  to keep dependent transfers ordered.  Across channels there is no order.  A channel runs
  one submission at a time, from issue to completion, whether its thread runs it or the
  submitter does (inline).
- The handle completes when the last descriptor's completion time has passed.  Host buffers
  written by a ``read`` descriptor hold their data only once the handle is done; media written
  by a ``write`` descriptor may be visible to other readers a little earlier (as with posted
  writes).
- A small submission (<= ``INLINE_BYTES``) to an idle channel (nothing queued or running on
  it) is issued inline, in ``submit``, as io_uring issues a request that needs no worker.  It
  also completes inline when its completion time has passed by the end of the issue (always
  on an untimed link, and on a zero-latency one with the link free) or is at most
  ``INLINE_WAIT_NS`` (10 µs) away, which ``submit`` then waits out (cheaper than the two thread
  wake-ups of handing it over); otherwise the channel's thread waits for it, so ``submit``
  never waits longer for the link.
- Whoever asks first completes a handle: once its descriptors are issued, a ``wait()`` (or a
  ``done()`` past its completion time) completes it in the caller's thread rather than waiting
  for the channel's thread to wake; callbacks run in the thread that completes it.
- A failed descriptor (poison, a DC block without an extent, out of range) is reported as a
  ``DmaError`` in its slot of the results and moves no byte; the other descriptors of the submit
  still run.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

from emulator._dma_types import (
    BlockRuns,
    Descriptor,
    DescriptorArray,
    Direction,
    DmaHandle,
    PinnedHosts,
    _PyChannelState,
    handle_base_is_c,
)
from emulator.spec.errors import DeviceGone, DmaError, MediaDisabled, NoExtent, PoisonError
from emulator.timing import DataPath, host_view

__all__ = ["BlockRuns", "Descriptor", "DescriptorArray", "Direction", "DmaEngine", "DmaHandle", "PinnedHosts"]


#: Submissions of at most this many bytes may be issued inline (a copy this size takes a few
#: µs, less than handing it to a channel thread costs).
INLINE_BYTES = 64 << 10
#: An inline submission whose completion is at most this far off waits for it in ``submit``:
#: handing the wait to the channel's thread costs two thread wake-ups (10-70 µs on a VM).
INLINE_WAIT_NS = 10_000
#: From this many descriptors a submission goes to the C core in one call; below it, setting
#: up the call's arrays costs more than one call per descriptor.
BATCH_MIN = 4

# A queued submission: (handle, descriptors to issue) — or, for one issued inline whose
# completion had not passed, (handle, None) with its results and latest completion.
_Item = tuple[DmaHandle, "list[Descriptor] | None", "list[int | DmaError] | None", int]


class _Channel:
    """One channel.  ``state`` is claimed by whoever runs a submission, from issue to
    completion (the channel's thread, or a submitter running one inline), so a channel runs
    one at a time.  ``state`` also counts the queued submissions, each counted before it is
    queued and uncounted once complete: an inline submitter claims only with none queued,
    so nothing of its channel is ahead of it.  ``lock`` guards ``items`` (the FIFO) and
    ``closed``."""

    __slots__ = ("closed", "err", "err_addr", "items", "lock", "room", "scratch", "state", "thread", "work")

    def __init__(self, state: Any, err: Any, err_addr: int) -> None:
        self.state = state
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)   # the thread: an item queued, or closed
        self.room = threading.Condition(self.lock)   # submitters: the queue has room
        self.items: deque[_Item] = deque()
        self.closed = False
        # the C core's error-DPA cell: one per channel, since channels issue at once
        self.err, self.err_addr = err, err_addr
        self.thread: threading.Thread | None = None
        #: cxl_issue_array's output (codes, error DPAs, their cdata, the failure count), grown
        #: as needed; used only by whoever owns the channel, as ``err`` is
        self.scratch: tuple[Any, ...] | None = None


class DmaEngine:
    """``channels`` channels, each with a thread and a FIFO submission queue of
    ``queue_depth`` handles, moving data through a ``DataPath`` (so every transfer is timed
    and accounted on the link)."""

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
        # The completion queue keeps the latest completions only (a ring, as in hardware):
        # callers holding handles need never poll it.
        self._cq: deque[DmaHandle] = deque(maxlen=4 * channels * queue_depth)
        self._ids = itertools.count(1)
        self._rr = itertools.cycle(range(channels))  # round-robin channel choice
        self._cq_append = self._cq.append
        self._c = datapath.impl == "c"
        self._c_issue: Any = None      # cffi's cxl_issue
        self._c_issue_array: Any = None  # cffi's cxl_issue_array
        self._ffi: Any = None
        self._fast_issue: Any = None   # _dmacall.issue / inline1, where built
        self._inline1: Any = None
        self._state_type: Any = None   # _dmacall.ChannelState, where built
        # the clock completions are stamped on: the C core's (its TSC anchor), or the twin's
        self._now_ns: Callable[[], int] = time.monotonic_ns
        errs = self._bind_c_core(channels) if self._c else [(None, 0)] * channels
        self._chans = [_Channel(self._channel_state(k, addr), err, addr)
                       for k, (err, addr) in enumerate(errs)]
        for k, ch in enumerate(self._chans):
            ch.thread = threading.Thread(target=self._channel_loop, args=(ch,), daemon=True,
                                         name=f"cxlemu-dma-{k}")
            ch.thread.start()

    def _channel_state(self, k: int, err_addr: int) -> Any:
        """Channel k's claim word: the C one carries what ``inline1`` needs to run an inline
        submission alone (the channel, its error cell, the types, the ids, the CQ)."""
        if self._state_type is None:
            return _PyChannelState()
        return self._state_type(k, err_addr, Descriptor, DmaHandle, self._ids, self._cq_append,
                                INLINE_BYTES)

    def _bind_c_core(self, channels: int) -> list[tuple[Any, int]]:
        """The C core's entry points; one error-DPA cell per channel: (cell, its address)."""
        from emulator.timing import cimpl

        self._c_issue, self._now_ns = cimpl.lib.cxl_issue, cimpl.lib.cxl_link_now
        self._c_issue_array, self._ffi = cimpl.lib.cxl_issue_array, cimpl.ffi
        self._fast_issue = cimpl.fast_issue
        if handle_base_is_c() and cimpl.channel_state is not None:
            self._inline1, self._state_type = cimpl.fast_inline1, cimpl.channel_state
        cells = [cimpl.ffi.new("uint64_t *") for _ in range(channels)]
        return [(cell, cimpl.address(cell)) for cell in cells]

    # -- host side ------------------------------------------------------------------------------
    @staticmethod
    def register(buffer: Any) -> memoryview:
        """Validate a host buffer once and return the flat byte view descriptors may reuse
        (the engine's equivalent of registering a memory region: only it can be written)."""
        return host_view(buffer, writable=True)

    def submit(self, descriptors: Sequence[Descriptor] | Iterable[Descriptor] | DescriptorArray, *,
               channel: int | None = None, timeout: float | None = None, inline: bool = False) -> DmaHandle:
        """Queue a scatter-gather list; returns at once unless the channel's submission
        queue is full (then it blocks up to ``timeout`` s and raises ``TimeoutError``).  A
        small one to an idle channel is issued (and maybe completed) inline: see the module.
        ``inline=True``: issued inline whatever its size when the channel is idle (a caller
        that waits for it at once saves the hand-off to the channel's thread)."""
        # The inline path is the hot one (a small transfer from Python): no copy of a list it
        # consumes before returning, no Python lock (the channel is claimed by one CAS in C),
        # one C call for a single built descriptor, one per descriptor otherwise.
        if isinstance(descriptors, DescriptorArray):
            return self._submit_array(descriptors, channel, timeout, inline)
        descs = descriptors if descriptors.__class__ is list else list(descriptors)
        k = self._channel_for(channel)
        ch = self._chans[k]
        if self._inline1 is not None:
            # one C call for one built descriptor: claim the channel if idle, issue, and if
            # complete, a done handle in the CQ; None if not for it; if not complete, the
            # channel still claimed, (handle id, completion still ahead or error code)
            dp = self.datapath
            got = self._inline1(ch.state, dp._core.dp_addr, descs,
                                -1 if dp.clock is None else int(dp.clock.now_ns()))
            if got is not None:
                if got.__class__ is not tuple:
                    return got  # type: ignore[no-any-return]
                handle_id, rc = got
                try:
                    results = [rc if rc >= 0 else self._error(0, descs[0], rc, ch.err[0])]
                    return self._finish_inline(ch, handle_id, k, 1, results, max(rc, 0))
                finally:
                    ch.state.release()
        total = 0
        for d in descs:
            if d.__class__ is not Descriptor:
                i = descs.index(d)
                raise TypeError(f"descriptor {i} must be an emulator.dma.Descriptor, got {type(d).__name__}")
            total += d.length
        handle_id = next(self._ids)
        if (inline or total <= INLINE_BYTES) and ch.state.try_claim():
            try:  # idle, nothing queued, open: nothing of this channel's is ahead of us
                return self._finish_inline(ch, handle_id, k, len(descs), *self._issue(ch, descs))
            finally:
                ch.state.release()
        return self._enqueue(ch, DmaHandle(handle_id, k, len(descs)), list(descs), timeout)

    def _channel_for(self, channel: int | None) -> int:
        if channel is None:
            return next(self._rr)
        if isinstance(channel, int) and 0 <= channel < self.channels:
            return channel
        raise ValueError(f"channel must be an int from 0 to {self.channels - 1}, got {channel!r}")

    def _submit_array(self, arr: DescriptorArray, channel: int | None, timeout: float | None,
                      inline: bool = False) -> DmaHandle:
        """A ``DescriptorArray``: one submission, issued in one C call (inline when small and the
        channel idle, as a list is)."""
        if not self._c:
            raise RuntimeError("a DescriptorArray needs the C data path")
        k = self._channel_for(channel)
        handle_id = next(self._ids)
        if inline or arr.total <= INLINE_BYTES:
            # inline=True without a channel: the first idle one from k (the others may be busy
            # with a read-ahead this caller is not waiting for)
            tries = range(self.channels) if inline and channel is None else range(1)
            for j in ((k + i) % self.channels for i in tries):
                ch = self._chans[j]
                if ch.state.try_claim():
                    try:
                        return self._finish_inline(ch, handle_id, j, len(arr), *self._issue_array(ch, arr))
                    finally:
                        ch.state.release()
        return self._enqueue(self._chans[k], DmaHandle(handle_id, k, len(arr)), arr, timeout)  # type: ignore[arg-type]

    def _issue_array(self, ch: _Channel, arr: DescriptorArray) -> tuple[list[int | DmaError], int]:
        """Issue ``arr`` in one C call, into the channel's scratch (the caller owns the channel)."""
        n = arr.count
        if n == 0:
            return [], 0
        scratch = ch.scratch
        if scratch is None or len(scratch[0]) < n:
            import numpy as np

            ffi = self._ffi
            codes, errs = np.empty(max(n, 64), np.int64), np.empty(max(n, 64), np.uint64)
            scratch = ch.scratch = (codes, errs, ffi.from_buffer("int64_t[]", codes),
                                    ffi.from_buffer("uint64_t[]", errs), ffi.new("uint64_t *"))
        codes, errs, c_codes, c_errs, failed = scratch
        dp = self.datapath
        latest = self._c_issue_array(dp._core.dp, arr.cdescs, n, -1 if dp.clock is None else int(dp.clock.now_ns()),
                                     c_codes, c_errs, failed)
        results: list[int | DmaError] = codes[:n].tolist()
        if failed[0]:
            for i in range(n):
                if results[i] < 0:  # type: ignore[operator]
                    results[i] = self._error(i, arr.descriptor(i), int(codes[i]), int(errs[i]))
        return results, max(int(latest), 0)

    def poll_completions(self, max_handles: int | None = None) -> list[DmaHandle]:
        """Pop completed handles from the completion queue, oldest completion first (it keeps
        the latest ``4 * channels * queue_depth``)."""
        out: list[DmaHandle] = []
        while self._cq and (max_handles is None or len(out) < max_handles):
            out.append(self._cq.popleft())
        return out

    def now_ns(self) -> int:
        """Now on the link's clock: the clock of the completion times ``DmaHandle.wait()`` gives."""
        return self._now_ns()

    def pending(self) -> int:
        """Handles queued or in flight on all channels (a gauge: a handle just completed may
        count until its channel's thread lets the channel go, a moment later)."""
        n = 0
        for ch in self._chans:
            owned, queued, _closed = ch.state.snapshot()
            # a queued one runs owned; an inline one is owned alone (the thread that closed
            # keeps the channel owned when it exits)
            n += queued or int(owned and ch.thread is not None and ch.thread.is_alive())
        return n

    def close(self) -> None:
        """Stop accepting submissions, finish what is queued, join the channel threads."""
        for ch in self._chans:
            with ch.lock:
                ch.closed = True
                ch.state.close()
                ch.work.notify()
                ch.room.notify_all()
        for ch in self._chans:
            if ch.thread is not None and ch.thread is not threading.current_thread():
                ch.thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submission -----------------------------------------------------------------------------
    def _finish_inline(self, ch: _Channel, handle_id: int, k: int, count: int,
                       results: list[int | DmaError], latest: int) -> DmaHandle:
        """An inline submission issued (the channel still owned): done if its completion has
        passed or is at most INLINE_WAIT_NS away (waited for here), else its wait queued at the
        head of the channel, before anything submitted since."""
        if (latest and self.datapath.clock is None
                and 0 < latest - self._now_ns() <= INLINE_WAIT_NS):
            self.datapath.wait_until(latest)
        if latest == 0 or self.datapath.clock is not None or latest <= self._now_ns():
            handle = DmaHandle(handle_id, k, count, results)
            self._cq.append(handle)
            return handle
        handle = DmaHandle(handle_id, k, count)
        handle._reap = (latest, results, self)  # its waiter may complete it (see DmaHandle)
        with ch.lock:
            ch.state.add_queued(1)
            ch.items.appendleft((handle, None, results, latest))
            ch.work.notify()
        return handle

    def _enqueue(self, ch: _Channel, handle: DmaHandle, descs: list[Descriptor],
                 timeout: float | None) -> DmaHandle:
        deadline = None if timeout is None else time.monotonic() + timeout
        with ch.lock:
            while len(ch.items) >= self.queue_depth and not ch.closed:
                if deadline is None:
                    ch.room.wait()
                elif (left := deadline - time.monotonic()) <= 0 or not ch.room.wait(left):
                    raise TimeoutError(f"DMA channel {handle.channel} submission queue full "
                                       f"({self.queue_depth}) for {timeout} s")
            if ch.closed:
                raise RuntimeError("DmaEngine is closed")
            ch.state.add_queued(1)
            ch.items.append((handle, descs, None, 0))
            ch.work.notify()
        return handle

    # -- channel side ---------------------------------------------------------------------------
    def _channel_loop(self, ch: _Channel) -> None:
        while True:
            with ch.lock:
                while not ch.items and not ch.closed:
                    ch.work.wait()
            ch.state.claim()  # after a submission running inline, if any
            with ch.lock:
                if not ch.items:  # closed and drained: stay claimed, so none runs inline
                    return
                handle, descs, results, latest = ch.items.popleft()
                ch.room.notify()
            try:
                try:
                    if descs is not None:
                        results, latest = self._issue(ch, descs)
                        if latest and self.datapath.clock is None:
                            handle._reap = (latest, results, self)  # its waiter may complete it
                    if latest:
                        self.datapath.wait_until(latest)
                except Exception as exc:  # noqa: BLE001 (the data path closed under the engine...):
                    # every descriptor fails with the cause, rather than the waiters hanging
                    results = [DmaError(i, f"DMA channel failed: {exc!r}") for i in range(handle.count)]
                handle._complete(results, self._cq_append)  # type: ignore[arg-type]
            finally:
                ch.state.add_queued(-1)
                ch.state.release()

    def _issue(self, ch: _Channel, descs: list[Descriptor]) -> tuple[list[int | DmaError], int]:
        """Issue every descriptor in order, waiting for none: (per-descriptor completion time
        or DmaError, the latest completion or 0)."""
        if descs.__class__ is DescriptorArray:
            return self._issue_array(ch, descs)  # type: ignore[arg-type]
        if not self._c:
            return self._issue_py(descs)
        if len(descs) >= BATCH_MIN:
            return self._issue_batch(descs)
        dp, fast = self.datapath, self._fast_issue
        now = -1 if dp.clock is None else int(dp.clock.now_ns())
        results: list[int | DmaError] = []
        latest = 0
        for i, d in enumerate(descs):
            try:
                cdesc = d.c_descriptor()
            except DmaError as exc:
                results.append(DmaError(i, exc.reason))
                continue
            if fast is not None:
                rc = fast(dp._core.dp_addr, d.__dict__["_cdesc_addr"], now, ch.err_addr)
            else:
                rc = self._c_issue(dp._core.dp, cdesc, now, ch.err)
            if rc < 0:
                results.append(self._error(i, d, rc, ch.err[0]))
                continue
            results.append(rc)
            latest = max(latest, rc)
        return results, latest

    def _issue_batch(self, descs: list[Descriptor]) -> tuple[list[int | DmaError], int]:
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
            return results, 0
        codes, errs = self.datapath.issue_batch(cdescs)
        latest = 0
        for j, i in enumerate(index):
            rc = codes[j]
            if rc >= 0:
                results[i] = rc
                latest = max(latest, rc)
            else:
                results[i] = self._error(i, descs[i], rc, errs[j])
        return results, latest

    def _issue_py(self, descs: list[Descriptor]) -> tuple[list[int | DmaError], int]:
        """The Python twin: each descriptor through ``DataPath.read/write(wait=False)``."""
        results: list[int | DmaError] = []
        latest = 0
        for i, d in enumerate(descs):
            try:
                window = d.window()
                if d.direction is Direction.READ:
                    done = self.datapath.read(d.dpa, window, wait=False)
                else:
                    done = self.datapath.write(d.dpa, window, wait=False)
            except DmaError as exc:
                results.append(DmaError(i, exc.reason))
                continue
            except (PoisonError, NoExtent, DeviceGone, MediaDisabled, ValueError) as exc:
                err = DmaError(i, str(exc))
                err.__cause__ = exc  # typed, as the C path's _error gives it
                results.append(err)
                continue
            latest = max(latest, done)
            results.append(done)
        return results, latest

    def _error(self, i: int, d: Descriptor, rc: int, err_dpa: int) -> DmaError:
        """Descriptor ``i``'s error, worded as ``DataPath.read/write`` word it."""
        what = "read" if d.direction is Direction.READ else "write"
        cause = self.datapath.error_for(rc, what, d.dpa, d.length, err_dpa)
        err = DmaError(i, str(cause))
        err.__cause__ = cause  # what failed, typed: PoisonError, NoExtent, DeviceGone, MediaDisabled, ...
        return err
