"""The timed data path: every access to a device's media pays its link's latency and bandwidth.

``DataPath`` is the one entry point; ``impl="c"`` uses the cffi core (``_datapath.c``),
``impl="py"`` the pure-Python twin (``_pyimpl.py``), ``"auto"`` the C core when the extension
is built.  A transfer of n bytes in direction d completes at
``max(now, link_free[d]) + latency_d + charged_bytes / bandwidth_d`` (see ``TimingConfig``);
``link_free`` lives in the BAR's link-state page (``linkstate``) so every thread and process
of one device shares one link.

Real time (``clock=None``): the call returns when the transfer has completed, having spun in
C with the GIL released.  Simulated (``clock=ManualClock()``): nothing waits; the completion time
is returned for the caller's event loop.
"""
from __future__ import annotations

import sys
from typing import Any, Self

from emulator.spec.errors import ConfigError, DeviceGone, MediaDisabled, NoExtent, PoisonError
from emulator.timing import linkstate
from emulator.timing._buffers import host_view, non_negative_int
from emulator.timing._pyimpl import E_DISABLED, E_GONE, E_NO_EXTENT, E_POISON, E_RANGE, PyCore, first_poisoned
from emulator.timing.access import AccessMap
from emulator.timing.clock import WallClock
from emulator.timing.config import LinkParams, TimingConfig
from firmware_model.clock import Clock, ManualClock

__all__ = ["Clock", "DataPath", "HostBuffer", "LinkParams", "ManualClock", "TimingConfig", "WallClock",
           "c_available", "first_poisoned", "host_view"]

_WALL = WallClock()

_IMPLS = ("auto", "c", "py")


def c_available() -> bool:
    """Whether the cffi extension is built and importable."""
    try:
        import emulator.timing.cimpl  # noqa: F401
    except ImportError:
        return False
    return True


class HostBuffer:
    """A host buffer registered with the C data path: checked and pinned once (its memory
    cannot be resized or unmapped while registered), then passed to ``read``/``write`` with
    no per-call conversion, as RDMA memory regions or CUDA-pinned buffers are registered.
    ``release()`` (or ``with``) unpins it."""

    __slots__ = ("cdata", "nbytes", "obj", "writable")

    def __init__(self, obj: Any, cdata: Any, nbytes: int, writable: bool) -> None:
        self.obj, self.cdata, self.nbytes, self.writable = obj, cdata, nbytes, writable

    def release(self) -> None:
        if self.cdata is not None:
            from emulator.timing.cimpl import ffi

            ffi.release(self.cdata)
            self.cdata = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _ClosedCore:
    """Stands in for a closed data path's core: every use raises, none touches freed memory."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("DataPath is closed")


_CLOSED = _ClosedCore()


def _unwrap(buf: Any) -> Any:
    return buf.obj if buf.__class__ is HostBuffer else buf


class DataPath:
    """Timed reads, writes and copies between a device's media and host buffers."""

    def __init__(self, media: Any, poison_bits: Any, link_state: Any, config: TimingConfig, *,
                 impl: str = "auto", clock: Clock | None = None,
                 state: tuple[memoryview, int] | None = None, name: str = "", media_link: Any = None,
                 access_bits: Any = None, access_base: int = 0, access_block: int = 0) -> None:
        """``state``: (a one-element u64 view of the device state word, the value it must hold
        for media access: ``emulator.liveness``); every transfer fails with ``DeviceGone`` or
        ``MediaDisabled`` while it holds anything else.  None: nothing is checked (a bare data
        path over buffers).  ``name`` names the device in those errors.  ``media_link``: the device's
        shared media block (``linkstate.open_media``'s mapping, shared by every host's data
        path) where the config limits the media's bandwidth; None: a block of its own (one
        host), and without a media limit none is used.  ``access_bits``: this host's access
        bitmap over the device's Dynamic Capacity (``emulator.timing.access``: 1 bit per
        ``access_block``-byte block from DPA ``access_base``, written by the firmware alone): a
        transfer touching a block whose bit is clear fails with ``NoExtent``, checked at the
        transfer; None: nothing is checked (a device without DC)."""
        if not isinstance(config, TimingConfig):
            raise ConfigError(f"config must be a TimingConfig, got {type(config).__name__}")
        if impl not in _IMPLS:
            raise ConfigError(f"impl must be one of {', '.join(_IMPLS)}, got {impl!r}")
        if clock is not None and not isinstance(clock, Clock):
            raise ConfigError(f"clock must have now_ns() -> int (e.g. ManualClock), got {type(clock).__name__}")
        self.config = config
        self.clock = clock
        self.name = name
        self.state = state
        self.media = host_view(media, writable=True)
        self.size = self.media.nbytes
        self.poison_bits = None if poison_bits is None else host_view(poison_bits, writable=False)
        need = -(-self.size // 512)
        if self.poison_bits is not None and self.poison_bits.nbytes < need:
            raise ConfigError(f"poison_bits has {self.poison_bits.nbytes} bytes; media of "
                              f"{self.size} B needs {need} (1 bit per 64-B line)")
        self.access = None if access_bits is None else \
            AccessMap.from_args(access_bits, access_base, access_block, self.size)
        self._link = linkstate.words(link_state)
        linkstate.initialize(self._link)
        params = config.link_params()
        if media_link is None and params.media_limited:
            media_link = bytearray(linkstate.USED_BYTES)
        self._media_link = None if media_link is None else linkstate.media_words(media_link)
        #: the shared media block's mapping when ``for_device`` opened it (this data path closes it)
        self.media_mmap: Any = None
        self.impl = self._choose_impl(impl)
        self._core = self._make_core(params)
        # the C core's one-call entry for host buffers (None on the Python twin, or where
        # _fastcall is not built: then CCore.transfer converts with ffi.from_buffer)
        self._fast: Any = None
        self._fast_read_bytes: Any = None
        self._from_buffer: Any = None
        if self.impl == "c":
            from emulator.timing.cimpl import fast_read_bytes, fast_transfer, ffi

            self._from_buffer, self._fast = ffi.from_buffer, fast_transfer
            self._fast_read_bytes = fast_read_bytes
            self._dp_addr, self._err_addr = self._core.dp_addr, self._core.err_addr

    def _choose_impl(self, impl: str) -> str:
        if impl == "py" or c_available():
            return "c" if impl != "py" else "py"
        if impl == "c":
            raise ConfigError("impl='c' but the cffi extension emulator.timing._cdatapath is not "
                              "built: run `pip install -e .` or `python -m emulator.timing._build`")
        print("cxlemu: note: timing C extension not built; using the pure-Python data path "
              "(slower, less precise)", file=sys.stderr)
        return "py"

    def _make_core(self, params: LinkParams) -> Any:
        if self.impl == "py":
            return PyCore(self.media, self.poison_bits, self._link, params, state=self.state,
                          media_link=self._media_link, access=self.access)
        from emulator.timing.cimpl import CCore
        from emulator.timing.calibration import calibrated_comp_ns

        comp = (0, 0) if self.clock is not None or params.untimed else calibrated_comp_ns()
        return CCore(self.media, self.poison_bits, self._link, params, comp, state=self.state,
                     media_link=self._media_link, access=self.access)

    # -- helpers --------------------------------------------------------------------------
    def _now(self) -> int:
        return -1 if self.clock is None else int(self.clock.now_ns())

    def _check(self, rc: int, what: str, dpa: int, n: int) -> int:
        if rc >= 0:
            return rc
        raise self.error_for(rc, what, dpa, n, self._core.err_dpa)

    def check_range(self, dpa: int, n: int, what: str = "read") -> None:
        """Raise what a transfer of ``n`` bytes at ``dpa`` would (bad DPA, or past the end of
        the media) without moving anything: for callers that allocate ``n`` bytes first."""
        dpa = self._dpa(dpa, what)
        if n > self.size - dpa:
            raise self.error_for(E_RANGE, what, dpa, n, 0)

    def error_for(self, rc: int, what: str, dpa: int, n: int, err_dpa: int) -> Exception:
        """The exception a core's error code stands for (PoisonError, NoExtent, or ValueError
        naming the bound), so every path words its errors alike."""
        if rc == E_POISON:
            return PoisonError(err_dpa)
        if rc == E_NO_EXTENT:
            return NoExtent(err_dpa)
        if rc in (E_GONE, E_DISABLED):
            word = self.state[0][0] if self.state is not None else 0
            expected = self.state[1] if self.state is not None else 0
            if rc == E_DISABLED:
                return MediaDisabled(self.name, f"{what} of {n} B at DPA {dpa:#x}")
            return DeviceGone(self.name, linkstate.gone_reason(word, expected) or "its firmware stopped")
        if rc == E_RANGE:
            return ValueError(f"{what} of {n} B at DPA {dpa:#x} runs past the end of the media "
                              f"({self.size:#x} B): the last byte must be below {self.size:#x}")
        return RuntimeError(f"data path returned unknown code {rc}")

    @staticmethod
    def _dpa(dpa: Any, what: str) -> int:
        """The slow path of DPA checking: numpy integers accepted, bools and negatives not."""
        value = non_negative_int(dpa)
        if value is None:
            raise ValueError(f"{what}: DPA must be an int >= 0, got {dpa!r}")
        return value

    # -- the API --------------------------------------------------------------------------
    def register(self, buf: Any, *, writable: bool = True) -> HostBuffer:
        """Register a host buffer for repeated transfers (see ``HostBuffer``).  On the
        Python twin registration only validates."""
        view = host_view(buf, writable=writable)
        cdata = None
        if self.impl == "c":
            cdata = self._from_buffer("uint8_t[]", view, require_writable=writable)
        return HostBuffer(view, cdata, view.nbytes, writable)

    # read/write are the hot path (one call per KV block, per pointer-chase hop from Python): a
    # host buffer goes to the C core in one call (_fastcall: borrowed through the buffer
    # protocol, registered or not); anything else (torch tensors, bad buffers) through the
    # core's host_view() conversion, which converts it or raises the error saying what to change.
    def read(self, dpa: int, out: Any, *, wait: bool = True) -> int:
        """Fill ``out`` from media at ``dpa``; returns the completion time (ns).  With
        ``wait=False`` a real-time call returns at once (after the copy): the caller must not
        consider the data arrived before ``wait_until(completion)`` (the DMA engine's use)."""
        if dpa.__class__ is not int or dpa < 0:
            dpa = self._dpa(dpa, "read")
        now = -1 if self.clock is None else int(self.clock.now_ns())
        buf = out
        if out.__class__ is HostBuffer:
            buf = out.cdata if self._fast is None and out.cdata is not None and out.writable else out.obj
        if self._fast is not None:
            try:
                rc = self._fast(self._dp_addr, self._err_addr, 0, dpa, buf, now, wait)
            except (TypeError, ValueError, BufferError):
                rc = self._core.transfer(0, dpa, buf, now, wait)
        else:
            rc = self._core.transfer(0, dpa, buf, now, wait)
        if rc < 0:
            self._check(rc, "read", dpa, host_view(_unwrap(out), writable=True).nbytes)
        return rc

    def read_bytes(self, dpa: int, n: int) -> bytes:
        """A timed read of ``n`` bytes at ``dpa`` into a new ``bytes`` (``MemDev.read``): one
        allocation and the transfer's one copy, the allocation inside the link time of a read
        longer than the short path (see ``_fastcall.c``'s read_bytes)."""
        if dpa.__class__ is not int or dpa < 0:
            dpa = self._dpa(dpa, "read")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"size must be an int >= 0, got {n!r}")
        if self._fast_read_bytes is not None:
            now = -1 if self.clock is None else int(self.clock.now_ns())
            got = self._fast_read_bytes(self._dp_addr, self._err_addr, dpa, n, now)
            if got.__class__ is int:
                raise self.error_for(got, "read", dpa, n, self._core.err_dpa)
            return got
        self.check_range(dpa, n, "read")
        out = bytearray(n)
        self.read(dpa, out)
        return bytes(out)

    def write(self, dpa: int, src: Any, *, wait: bool = True) -> int:
        """Write ``src`` to media at ``dpa`` (poisoned lines may be written); returns completion."""
        if dpa.__class__ is not int or dpa < 0:
            dpa = self._dpa(dpa, "write")
        now = -1 if self.clock is None else int(self.clock.now_ns())
        buf = src
        if src.__class__ is HostBuffer:
            buf = src.cdata if self._fast is None and src.cdata is not None else src.obj
        if self._fast is not None:
            try:
                rc = self._fast(self._dp_addr, self._err_addr, 1, dpa, buf, now, wait)
            except (TypeError, ValueError, BufferError):
                rc = self._core.transfer(1, dpa, buf, now, wait)
        else:
            rc = self._core.transfer(1, dpa, buf, now, wait)
        if rc < 0:
            self._check(rc, "write", dpa, host_view(_unwrap(src), writable=False).nbytes)
        return rc

    def copy(self, src_dpa: int, dst_dpa: int, n: int, *, wait: bool = True) -> int:
        """Device-internal copy (overlap allowed, memmove semantics); returns completion."""
        src_dpa, dst_dpa = self._dpa(src_dpa, "copy source"), self._dpa(dst_dpa, "copy destination")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"copy: length must be an int >= 0, got {n!r}")
        rc = self._core.copy(src_dpa, dst_dpa, n, self._now(), wait)
        if rc == E_RANGE:
            bad = src_dpa if src_dpa + n > self.size else dst_dpa
            return self._check(rc, "copy", bad, n)
        return self._check(rc, "copy", src_dpa, n)

    def issue_batch(self, cdescs: list[Any]) -> tuple[list[int], list[int]]:
        """C core only: issue ``cxl_desc *`` elements in order without waiting (the DMA
        engine's path); returns each one's completion time or error code, and the poisoned
        DPA for those that hit poison.  The caller waits for the latest completion."""
        if self.impl != "c":
            raise RuntimeError("issue_batch needs the C data path")
        from emulator.timing.cimpl import ffi, lib

        n = len(cdescs)
        results, errs = ffi.new("int64_t[]", n), ffi.new("uint64_t[]", n)
        lib.cxl_issue_batch(self._core.dp, ffi.new("cxl_desc *[]", cdescs), n, self._now(),
                            results, errs)
        return list(results), list(errs)

    def read_untimed(self, dpa: int, out: Any) -> None:
        """Fill ``out`` without timing or accounting (setup, inspection); poison still fails."""
        mv = host_view(out, writable=True)
        dpa = self._dpa(dpa, "read")
        self._check(self._core.untimed(linkstate.DIR_READ, dpa, mv), "read", dpa, mv.nbytes)

    def write_untimed(self, dpa: int, src: Any) -> None:
        """Write without timing or accounting (setup)."""
        mv = host_view(src, writable=False)
        dpa = self._dpa(dpa, "write")
        self._check(self._core.untimed(linkstate.DIR_WRITE, dpa, mv), "write", dpa, mv.nbytes)

    def wait_until(self, completion_ns: int) -> None:
        """Block until a completion time returned by ``wait=False`` calls (real time only)."""
        if self.clock is None and completion_ns > 0:
            if self.impl == "c":
                from emulator.timing.cimpl import wait_until

                wait_until(completion_ns)
            else:
                from emulator.timing._pyimpl import wait_until as py_wait

                py_wait(completion_ns)

    def now_ns(self) -> int:
        """The data path's clock: the simulated clock, or the wall clock (CLOCK_MONOTONIC)."""
        return (self.clock or _WALL).now_ns()

    def counters(self) -> dict[str, int]:
        """Bytes, transfers, busy and latency ns, errors and the log2 latency histogram per
        direction, ``link_free_ns``, device-internal copies (see ``linkstate.snapshot``)."""
        return linkstate.snapshot(self._link)

    def media_counters(self) -> dict[str, int]:
        """The shared media's counters in ``counters()``'s names (``read_link_free_ns`` is the
        media's free time; ``busy_ns`` its occupancy), or {} where no media block is used."""
        return {} if self._media_link is None else linkstate.snapshot(self._media_link)

    @classmethod
    def for_device(cls, files: Any, *, config: TimingConfig | None = None, impl: str = "auto",
                   clock: Clock | None = None, state: tuple[memoryview, int] | None = None,
                   media_link: Any = None, access_bits: Any = None, access_base: int = 0,
                   access_block: int = 0) -> DataPath:
        """The data path of a device: its media, poison bitmap and the link-state page of
        its BAR (``emulator.device.DeviceFiles`` or anything with those mmaps and ``config``).
        Every host that opens the device this way shares its one link.  ``media_link``: the
        device's shared media block; ``access_bits``, ``access_base``, ``access_block``: the
        host's DC access bitmap (its mapping stays the caller's to close), as for ``DataPath``.

        Opened on a served device, it checks the device state word on every transfer (see
        ``emulator.liveness``): once that firmware stops, dies or is restarted every transfer
        raises ``DeviceGone``, and while the media is disabled ``MediaDisabled``.  Opened on a
        device no firmware serves (its files alone, for setup), nothing is checked."""
        from emulator.spec.registers import LINK_STATE_OFFSET, LINK_STATE_SIZE

        link = memoryview(files.bar)[LINK_STATE_OFFSET:LINK_STATE_OFFSET + LINK_STATE_SIZE]
        cfg = config or files.config.timing
        owned = None
        if media_link is None and cfg.link_params().media_limited and getattr(files, "path", None) is not None:
            # every host's data path of this device maps the one media.link: they share the media
            media_link = owned = linkstate.open_media(files.path)
        if state is None:
            word = linkstate.state_view(files.bar)
            if word[0] & linkstate.UP:
                state = (word, linkstate.serving_word(word[0]))
            else:
                word.release()
        dp = cls(files.media, files.poison, link, cfg,
                 impl=impl, clock=clock, state=state, name=getattr(files, "name", ""), media_link=media_link,
                 access_bits=access_bits, access_base=access_base, access_block=access_block)
        dp.media_mmap = owned
        return dp

    def close(self) -> None:
        """Release the views of media, poison bitmap and BAR (so their mmaps can close).  A
        closed data path refuses every transfer (the C core's addresses are forgotten first)."""
        self._fast = None
        core, self._core = self._core, _CLOSED
        if core is not _CLOSED:
            core.close()
        for view in (self.media, self.poison_bits, self._link, self._media_link,
                     self.state[0] if self.state else None, self.access.bits if self.access else None):
            if view is not None:
                view.release()
        if self.media_mmap is not None:  # the device's media.link, mapped by for_device
            try:
                self.media_mmap.close()
            except BufferError:  # another data path (the KV store's) still views it; it closes with the GC
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DataPath(impl={self.impl!r}, size={self.size:#x}, config={self.config})"
