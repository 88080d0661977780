"""The DMA engine's value types: ``Direction``, ``Descriptor``, ``DmaHandle`` and the pure-Python
channel claim word (``_PyChannelState``).

Import them from ``emulator.dma``, which re-exports them; they live here so the engine module
holds only the engine.  ``DmaHandle`` subclasses the C ``HandleBase`` of ``_dmacall.c`` where it
is built, else ``_PyHandleBase``, its Python twin with the same members (as ``_PyChannelState``
is the twin of the C ``ChannelState``: the fallback when ``emulator.timing._dmacall`` is missing
or the data path runs ``impl="py"``).  The engine passes ``Descriptor`` and ``DmaHandle`` to the
C ``ChannelState``, whose inline path type-checks the one and builds the other.
"""
from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from emulator.spec.errors import DmaError
from emulator.timing import host_view

__all__ = ["Descriptor", "DescriptorArray", "Direction", "DmaHandle", "PinnedHosts", "handle_base_is_c"]


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

    def c_descriptor(self) -> Any:
        """The C core's ``cxl_desc`` for this descriptor, built once (it pins the window), and
        its address (``_cdesc_addr``) for the one-call paths of ``_dmacall``."""
        cached = self.__dict__.get("_cdesc")
        if cached is not None:
            return cached
        from emulator.timing.cimpl import ffi

        window = self.window()
        host = ffi.from_buffer("uint8_t[]", window, require_writable=self.direction is Direction.READ)
        cdesc = ffi.new("cxl_desc *", {"dir": 0 if self.direction is Direction.READ else 1,
                                       "dpa": self.dpa, "host": host, "len": self.length})
        object.__setattr__(self, "_cdesc", cdesc)
        object.__setattr__(self, "_cdesc_addr", int(ffi.cast("uintptr_t", cdesc)))
        object.__setattr__(self, "_chost", host)  # keeps the pointer in cdesc valid
        return cdesc


class PinnedHosts:
    """Host buffers checked and pinned once for many ``DescriptorArray``s (a driver registers
    its buffers once, as it would register memory regions with an RDMA or DMA engine)."""

    def __init__(self, hosts: list[Any], *, writable: bool = True) -> None:
        import numpy as np

        from emulator.timing.cimpl import ffi

        if ffi is None:
            raise RuntimeError("PinnedHosts needs the C data path (build it: python -m emulator.timing._build)")
        self.writable = writable
        self.pins = [ffi.from_buffer("uint8_t[]", host_view(h, writable=writable), require_writable=writable)
                     for h in hosts]
        self.sizes = np.array([len(p) for p in self.pins], dtype=np.int64)
        self.bases = np.array([int(ffi.cast("uintptr_t", p)) for p in self.pins], dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.pins)


class DescriptorArray:
    """``n`` descriptors of one direction as arrays, the form a driver's descriptor ring takes:
    descriptor ``i`` moves ``lengths[i]`` bytes between ``dpas[i]`` and
    ``hosts[host_index[i]][host_offsets[i]:...]``. Built with numpy (no Python object per
    descriptor) and issued by the DMA engine in one call to the C core, so a list of thousands
    costs what a few ``Descriptor`` objects do; a driver moving KV blocks in bulk (the vLLM tier)
    uses it. Errors per descriptor (poison, range) are reported in the handle's results as for a
    list; a host range past its buffer is refused here (``ValueError``), before anything moves.
    Needs the C data path (``RuntimeError`` otherwise)."""

    # cxl_desc: int32 dir, 4 bytes of padding, uint64 dpa, uint8 *host, uint64 len (checked below)
    _DTYPE: ClassVar = (("dir", "<i4"), ("pad", "<i4"), ("dpa", "<u8"), ("host", "<u8"), ("len", "<u8"))
    _DTYPE_NP: Any = None

    @classmethod
    def _dtype(cls) -> Any:
        """The numpy dtype of ``cxl_desc``, checked once against the C core's layout."""
        if DescriptorArray._DTYPE_NP is None:
            import numpy as np

            from emulator.timing.cimpl import ffi

            if ffi is None:
                raise RuntimeError("DescriptorArray needs the C data path (build it: python -m emulator.timing._build)")
            dt = np.dtype(list(cls._DTYPE))
            if dt.itemsize != ffi.sizeof("cxl_desc") or dt.fields is None \
                    or dt.fields["len"][1] != ffi.offsetof("cxl_desc", "len"):
                raise RuntimeError("cxl_desc's layout differs from DescriptorArray's: rebuild the C data path")
            DescriptorArray._DTYPE_NP = dt
        return DescriptorArray._DTYPE_NP

    def __init__(self, direction: Direction | str, hosts: list[Any] | PinnedHosts, host_index: Any, dpas: Any,
                 host_offsets: Any, lengths: Any) -> None:
        import numpy as np

        dtype = self._dtype()
        self.direction = Direction(direction)
        writable = self.direction is Direction.READ
        idx, dpa, off, length = (np.asarray(host_index, np.int64), np.asarray(dpas, np.int64),
                                 np.asarray(host_offsets, np.int64), np.asarray(lengths, np.int64))
        n = len(dpa)
        if not (len(idx) == len(off) == len(length) == n):
            raise ValueError(f"DescriptorArray: {n} DPAs, {len(idx)} host indices, {len(off)} offsets and "
                             f"{len(length)} lengths: give one of each per descriptor")
        # (the checks are whole-array operations: a list of thousands costs what a few do)
        if n and ((dpa | off | length).min() < 0 or idx.view(np.uint64).max() >= len(hosts)):
            raise ValueError("DescriptorArray: DPAs, offsets and lengths must be >= 0 and host indices "
                             f"within the {len(hosts)} host buffers")
        if not isinstance(hosts, PinnedHosts):
            hosts = PinnedHosts(hosts, writable=writable)
        elif writable and not hosts.writable:
            raise ValueError("DescriptorArray: a read fills host buffers: pin them with PinnedHosts(writable=True)")
        self._hosts = hosts  # keeps the pins (and so the pointers below) valid
        end = off + length
        if n and (end > hosts.sizes[idx]).any():
            i = int(np.flatnonzero(end > hosts.sizes[idx])[0])
            raise ValueError(f"DescriptorArray: descriptor {i}'s host range [{off[i]:#x}, {end[i]:#x}) "
                             f"runs past host buffer {idx[i]} ({hosts.sizes[idx[i]]:#x} B)")
        # the C core's cxl_desc records, in numpy memory
        rec = np.empty(n, dtype)
        rec["dir"] = 0 if writable else 1
        rec["dpa"] = dpa
        rec["host"] = hosts.bases[idx] + off.view(np.uint64)
        rec["len"] = length
        self._adopt(rec)

    def _adopt(self, rec: Any) -> None:
        """Take ``rec`` (cxl_desc records in numpy memory, the host pointers pinned by
        ``self._hosts``) as this array's descriptors."""
        from emulator.timing.cimpl import ffi

        self._rec_array = rec
        self.cdescs = ffi.from_buffer("cxl_desc[]", rec)  # the records, as cxl_issue_array takes them
        self.count = len(rec)
        self.total = int(rec["len"].sum())

    def split(self, k: int) -> list[DescriptorArray]:
        """``k`` arrays of equal consecutive parts of this one (``BlockRuns.plan``'s: one per
        buffer), sharing its records."""
        if k < 1 or self.count % k:
            raise ValueError(f"cannot split {self.count} descriptors into {k} equal parts")
        per = self.count // k
        parts = []
        for j in range(k):
            part = DescriptorArray.__new__(DescriptorArray)
            part.direction, part._hosts = self.direction, self._hosts
            part._adopt(self._rec_array[j * per:(j + 1) * per])
            parts.append(part)
        return parts

    def __len__(self) -> int:
        return self.count

    @property
    def records(self) -> Any:
        """The descriptors as ``cxl_desc`` records (numpy: ``dir``, ``dpa``, ``host``, ``len``)."""
        return self._rec_array

    def descriptor(self, i: int) -> Any:
        """Descriptor ``i``'s direction, DPA and length (for its error message)."""
        rec = self._rec_array[i]
        return _Where(self.direction, int(rec["dpa"]), int(rec["len"]))


_DIRECTIONS = {"read": Direction.READ, "write": Direction.WRITE, Direction.READ: Direction.READ,
               Direction.WRITE: Direction.WRITE}


class BlockRuns:
    """The descriptors moving blocks ``blocks[i]`` <-> device chunks ``chunks[i]`` of every
    buffer of ``hosts`` at once: a paged KV cache, one buffer per layer, block ``b`` of buffer
    ``t`` at ``b * strides[t]`` in it and chunk ``c`` at DPA ``offsets[t] + c * pages[t]``,
    ``pages[t]`` bytes each. ``plan`` makes one ``DescriptorArray`` per job in one C call
    (``cxl_plan_runs``), not a dozen numpy calls: one descriptor per run where both lists advance
    by one (where every buffer's stride is its page) and buffer, buffer-major, so
    ``split(len(hosts))`` gives each buffer's part. The layout is checked and handed to C once.
    One thread plans at a time (a driver's submitting thread): plans share an output cell."""

    def __init__(self, hosts: PinnedHosts, num_chunks: int, strides: Any, offsets: Any, pages: Any) -> None:
        import numpy as np

        from emulator.timing.cimpl import ffi

        if ffi is None:
            raise RuntimeError("BlockRuns needs the C data path (build it: python -m emulator.timing._build)")
        self.hosts, self.num_chunks, self.nbuf = hosts, int(num_chunks), len(hosts)
        self._arrays = [np.ascontiguousarray(x, np.int64) for x in (strides, offsets, pages)]
        if any(len(x) != self.nbuf for x in self._arrays) or self.num_chunks < 0 \
                or any((x < 0).any() for x in self._arrays):
            raise ValueError(f"BlockRuns: give a stride, an offset and a page (each >= 0) per buffer: "
                             f"{self.nbuf} buffers, {[len(x) for x in self._arrays]} given")
        self._c = [ffi.from_buffer("uint64_t[]", hosts.bases), ffi.from_buffer("uint64_t[]", hosts.sizes)] + \
            [ffi.from_buffer("int64_t[]", x) for x in self._arrays]
        self._total = ffi.new("uint64_t *")
        self._dtype = DescriptorArray._dtype()
        from emulator.timing.cimpl import lib

        self._np, self._ffi, self._lib = np, ffi, lib  # plan() runs once a job: no imports there

    def plan(self, direction: Direction | str, blocks: Any, chunks: Any) -> DescriptorArray:
        """One job's descriptors. A block past its buffer or a chunk outside
        ``[0, num_chunks)``: ValueError naming it, nothing planned."""
        np, ffi, lib = self._np, self._ffi, self._lib
        arr = DescriptorArray.__new__(DescriptorArray)
        try:
            arr.direction = _DIRECTIONS[direction]
        except (KeyError, TypeError):  # not one of the four: Direction says what it takes
            arr.direction = Direction(direction)
        writable = arr.direction is Direction.READ
        if writable and not self.hosts.writable:
            raise ValueError("DescriptorArray: a read fills host buffers: pin them with PinnedHosts(writable=True)")
        b, c = np.ascontiguousarray(blocks, np.int64), np.ascontiguousarray(chunks, np.int64)
        n = len(b)
        if n != len(c):
            raise ValueError(f"BlockRuns.plan: {n} blocks for {len(c)} chunks: give one chunk per block")
        rec = np.empty(n * self.nbuf, self._dtype)
        cdescs = ffi.from_buffer("cxl_desc[]", rec)
        got = lib.cxl_plan_runs(ffi.from_buffer("int64_t[]", b), ffi.from_buffer("int64_t[]", c), n,
                                self.num_chunks, *self._c, self.nbuf, 0 if writable else 1, cdescs, self._total)
        if got < 0:
            i = -1 - got
            raise ValueError(f"BlockRuns.plan: block {int(b[i])} <-> chunk {int(c[i])} (pair {i}) is out of "
                             f"range: blocks within the {self.nbuf} buffers, chunks in [0, {self.num_chunks})")
        arr._hosts = self.hosts  # keeps the pins (and so the pointers in the records) valid
        arr._rec_array = rec[:got] if got < len(rec) else rec
        arr.cdescs = cdescs  # its first ``got`` records are the array's
        arr.count = got
        arr.total = self._total[0]
        return arr


@dataclass(frozen=True)
class _Where:
    direction: Direction
    dpa: int
    length: int


#: Guards the completion state of every handle (held for a few instructions: completions
#: are rare next to the work behind them, and a handle then needs no lock of its own).
_HANDLE_LOCK = threading.Lock()


class _PyHandleBase:
    """DmaHandle's fields where the C core's ``HandleBase`` is not built (the same members)."""

    __slots__ = ("_callbacks", "_event", "_results", "channel", "count", "id")
    id: int
    channel: int
    count: int
    _results: list[int | DmaError] | None
    _event: threading.Event | None
    _callbacks: list[Callable[[DmaHandle], None]] | None

    def __init__(self, handle_id: int, channel: int, count: int,
                 results: list[int | DmaError] | None = None) -> None:
        self.id, self.channel, self.count, self._results = handle_id, channel, count, results
        self._event = self._callbacks = None

    def done(self) -> bool:
        """Whether the submission has completed."""
        return self._results is not None

    def wait(self, timeout: float | None = None) -> list[int | DmaError]:
        """Per-descriptor results in submission order: the completion time (ns) or the
        ``DmaError`` of a descriptor that failed.  Raises ``TimeoutError`` if not done in time."""
        results = self._results
        return list(results) if results is not None else self._wait_pending(timeout)

    def _wait_pending(self, timeout: float | None) -> list[int | DmaError]:
        raise NotImplementedError


def _handle_base() -> type:
    """The C ``HandleBase`` (``_dmacall.c``: a handle built in ~0.1 µs, a third of what a
    Python ``__init__`` costs; the inline DMA path builds one per transfer), else the twin."""
    try:
        from emulator.timing.cimpl import handle_base
    except ImportError:
        return _PyHandleBase
    return handle_base or _PyHandleBase


if TYPE_CHECKING:  # the C base has the same members, which type checkers cannot see
    _HandleBase = _PyHandleBase
else:
    _HandleBase = _handle_base()


def handle_base_is_c() -> bool:
    """Whether DmaHandle's fields live in the C ``HandleBase`` (what ``inline1`` builds)."""
    return _HandleBase is not _PyHandleBase


#: A waiter whose handle completes further off than this naps on the handle's event until
#: REAP_MARGIN_NS before the completion, then spins the rest and completes the handle itself.
REAP_SLEEP_ABOVE_NS = 500_000
REAP_MARGIN_NS = 250_000


class DmaHandle(_HandleBase):
    """One submission: poll ``done()``, block in ``wait(timeout=None)`` (per-descriptor results
    in submission order: the completion time in ns, or the ``DmaError`` of a descriptor that
    failed; ``TimeoutError`` if not done in time), or add a callback.

    ``DmaHandle(handle_id, channel, count, results=None)``: ``_results`` is None until the
    handle completes.  The event a waiter blocks on is made only when someone waits before
    completion: a submission that completes inline never pays for one.

    Whoever asks first completes it. Once its descriptors are issued, the engine knows when the
    handle completes (``_reap``: the completion time, the results, the engine); from then a
    ``done()`` past that time, or a ``wait()``, completes it in the caller's thread rather than
    waiting for the channel's thread to wake (two thread wake-ups: tens of µs on a VM, where a
    64-B transfer on a 1-µs link should take a microsecond). The channel's thread still waits
    for it, so the channel's order is unchanged; it finds the handle complete and moves on."""

    __slots__ = ("_reap",)

    def done(self) -> bool:
        """Whether the submission has completed (completing it if its time has passed)."""
        if self._results is not None:
            return True
        reap = getattr(self, "_reap", None)  # unset on handles built by the C inline path
        if reap is None or reap[2]._now_ns() < reap[0]:
            return False
        self._complete(reap[1], reap[2]._cq_append)
        return True

    # wait() comes from the base: the C one answers a done handle without a Python frame (the
    # inline path's round trip is submit + wait); a pending one comes here.
    def _wait_pending(self, timeout: float | None) -> list[int | DmaError]:
        reap = getattr(self, "_reap", None)
        if reap is not None:
            latest, results, engine = reap
            left = latest - engine._now_ns()
            if timeout is None or left <= timeout * 1e9:
                if left > REAP_SLEEP_ABOVE_NS and self._event_wait((left - REAP_MARGIN_NS) / 1e9):
                    return list(self._results)  # type: ignore[arg-type]
                engine.datapath.wait_until(latest)  # spins, the GIL released
                self._complete(results, engine._cq_append)
                return list(self._results)  # type: ignore[arg-type]
        if not self._event_wait(timeout):
            raise TimeoutError(f"DMA handle {self.id} not complete after {timeout} s")
        return list(self._results)  # type: ignore[arg-type]

    def _event_wait(self, timeout: float | None) -> bool:
        """Block until the handle completes (True) or ``timeout`` s pass (False)."""
        with _HANDLE_LOCK:
            if self._results is None and self._event is None:
                self._event = threading.Event()
            event = self._event
        return event is None or event.wait(timeout)

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
        return [r for r in self._results or () if isinstance(r, DmaError)]

    def add_done_callback(self, fn: Callable[[DmaHandle], None]) -> None:
        """Call ``fn(handle)`` on completion (from the thread that completes it: the channel's,
        or a caller of ``done()`` / ``wait()``; keep it short), or now if already done."""
        if self._results is None:
            with _HANDLE_LOCK:
                if self._results is None:
                    self._callbacks = (self._callbacks or []) + [fn]
                    return
        fn(self)

    def _complete(self, results: list[int | DmaError], cq_append: Callable[[DmaHandle], None]) -> bool:
        """Complete once: post to the completion queue, wake waiters, run callbacks. False if
        someone already had (the channel's thread and a caller may both try)."""
        with _HANDLE_LOCK:
            if self._results is not None:
                return False
            self._results = results
            self._reap = None
            cq_append(self)
            event, callbacks, self._callbacks = self._event, self._callbacks, None
        if event is not None:
            event.set()
        for fn in callbacks or ():
            fn(self)
        return True

    def __repr__(self) -> str:
        state = "done" if self._results is not None else "pending"
        return f"<DmaHandle {self.id} ch{self.channel} {self.count} desc {state}>"


class _PyChannelState:
    """Who may run a submission on a channel: the twin of the C ``ChannelState`` (a word
    claimed with one compare-and-swap; see ``_dmacall.c``), from threading primitives."""

    __slots__ = ("_closed", "_count_lock", "_owner", "_queued")

    def __init__(self) -> None:
        self._owner = threading.Lock()
        self._count_lock = threading.Lock()
        self._queued = 0
        self._closed = False

    def try_claim(self) -> bool:
        """Own the channel if it is idle, nothing is queued on it and it is open."""
        if not self._owner.acquire(False):
            return False
        with self._count_lock:
            idle = self._queued == 0 and not self._closed
        if not idle:
            self._owner.release()
        return idle

    def claim(self) -> None:
        """Own the channel whatever is queued (the channel's thread)."""
        self._owner.acquire()

    def release(self) -> None:
        self._owner.release()

    def add_queued(self, n: int) -> None:
        with self._count_lock:
            self._queued += n

    def close(self) -> None:
        with self._count_lock:
            self._closed = True

    def snapshot(self) -> tuple[bool, int, bool]:
        """(owned, queued, closed)."""
        return self._owner.locked(), self._queued, self._closed
