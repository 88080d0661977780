"""The C core (cffi extension ``_cdatapath``) behind the same interface as ``PyCore``, and the
extension's entry points that the DMA engine (``emulator.dma``) and the benches call as well.
Importing it raises ImportError where the extension is not built (``c_available()`` says).

The calibration of the emulator's own per-access cost, which the C core deducts from real-time
waits, is in ``calibration.py``; the pointer-chase helpers in ``chase.py``.
"""
from __future__ import annotations

from typing import Any

from emulator.timing import linkstate as ls
from emulator.timing._buffers import host_view
from emulator.timing.access import AccessMap
from emulator.timing._cdatapath import __file__ as _LIBRARY  # its file holds two more modules
from emulator.timing._cdatapath import ffi, lib  # ImportError when not built
from emulator.timing.config import LinkParams

_ABI_VERSION = 7  # CXL_ABI_VERSION in _datapath.h
if getattr(lib, "CXL_ABI_VERSION", 1) != _ABI_VERSION:
    raise ImportError("emulator.timing._cdatapath is a stale build of the C core: rebuild it "
                      "(`pip install -e .` or `python -m emulator.timing._build`)")


def _load_module(name: str) -> Any:
    """``emulator.timing.<name>``, a plain CPython module compiled into the extension's own file
    (``_fastcall.c``, ``_dmacall.c``), or None where it is not compiled in (Python < 3.11): then
    plain buffers go through from_buffer and the DMA engine issues through cffi."""
    import importlib.machinery
    import importlib.util

    qualified = f"emulator.timing.{name}"
    loader = importlib.machinery.ExtensionFileLoader(qualified, _LIBRARY)
    spec = importlib.util.spec_from_file_location(qualified, _LIBRARY, loader=loader)
    try:
        return importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    except ImportError:
        return None


_from_buffer, _read, _write, _U8 = ffi.from_buffer, lib.cxl_read, lib.cxl_write, ffi.typeof("uint8_t[]")
_FASTCALL = _load_module("_fastcall")
_DMACALL = _load_module("_dmacall")
#: ``transfer(dp, err, dir, dpa, buffer, now, wait)``: a host buffer to the C core in one call,
#: borrowed through the buffer protocol.  Addresses as ints (``address()``).  None without the
#: module (see _load_module).
fast_transfer: Any = getattr(_FASTCALL, "transfer", None)
#: ``read_bytes(dp, err, dpa, n, now)``: a timed read into a new bytes object (or a CXL_E_* code).
fast_read_bytes: Any = getattr(_FASTCALL, "read_bytes", None)
#: The DMA engine's (``_dmacall.c``): ``issue(dp, desc, now, err)``, one DMA descriptor; the C
#: base of ``emulator.dma.DmaHandle`` (its fields); the inline path for one descriptor (issue,
#: and a done handle if complete); a DMA channel's claim word (atomic; inline1 claims an idle
#: channel with one CAS).  None without the module.
fast_issue: Any = getattr(_DMACALL, "issue", None)
handle_base: Any = getattr(_DMACALL, "HandleBase", None)
fast_inline1: Any = getattr(_DMACALL, "inline1", None)
channel_state: Any = getattr(_DMACALL, "ChannelState", None)


def address(cdata: Any) -> int:
    """The address a cdata pointer holds, for _fastcall and _dmacall (valid while ``cdata`` lives)."""
    return int(ffi.cast("uintptr_t", cdata))


class CCore:
    """Owns the ``cxl_dp`` struct and keeps the buffers it points into alive."""

    def __init__(self, media: memoryview, poison: memoryview | None, link: memoryview,
                 params: LinkParams, comp_ns: tuple[float, float] = (0.0, 0.0),
                 state: tuple[memoryview, int] | None = None, media_link: memoryview | None = None,
                 access: AccessMap | None = None) -> None:
        """``media_link``: the shared media block (``linkstate.media_words``), used only where
        ``params`` limit the media.  ``access``: the host's DC access bitmap (None: no check)."""
        self._keep: list[Any] = []
        dp = ffi.new("cxl_dp *")
        dp.media = self._ptr(media)
        dp.media_size = media.nbytes
        if poison is not None:
            dp.poison = self._ptr(poison)
            dp.poison_size = poison.nbytes
        dp.link = ffi.cast("uint64_t *", self._ptr(link))
        dp.lat_ns = list(params.lat_ns)
        dp.fs_per_byte = list(params.fs_per_byte)
        dp.txn_bytes = params.txn_bytes
        dp.comp_ps = [round(1000 * c) for c in comp_ns]
        dp.untimed = int(params.untimed)
        if state is not None:  # (a writable view of the device state word, the value it must hold)
            dp.state = ffi.cast("uint64_t *", self._ptr(state[0]))
            dp.state_ok = state[1]
        if media_link is not None and params.media_limited:  # else NULL: no media to reserve
            dp.media_link = ffi.cast("uint64_t *", self._ptr(media_link))
            dp.media_fs_per_byte = list(params.media_fs_per_byte)
        if access is not None:
            dp.access = self._ptr(access.bits)
            dp.access_size = access.bits.nbytes
            dp.access_base = access.base
            dp.access_shift = access.shift
        self.dp = dp
        self.params = params
        self.err = ffi.new("uint64_t *")
        # the addresses _fastcall takes (valid while self.dp / self.err live)
        self.dp_addr, self.err_addr = address(dp), address(self.err)

    def _ptr(self, buf: memoryview) -> Any:
        cdata = ffi.from_buffer("uint8_t[]", buf, require_writable=not buf.readonly)
        self._keep.append(cdata)
        return cdata

    def close(self) -> None:
        for cdata in self._keep:
            ffi.release(cdata)
        self._keep.clear()

    @property
    def err_dpa(self) -> int:
        return int(self.err[0])

    def transfer(self, d: int, dpa: int, host: Any, now: int, wait: bool) -> int:
        """Any C-contiguous buffer goes to C as is; anything else through ``host_view``
        (torch tensors, or a clear error for a buffer that cannot be used)."""
        if isinstance(host, ffi.CData):  # a registered HostBuffer's pinned view
            buf = host
        else:
            if fast_transfer is not None:
                try:
                    return fast_transfer(self.dp_addr, self.err_addr, d, dpa, host, now, wait)
                except (TypeError, ValueError, BufferError):
                    pass  # not a plain buffer: host_view() below converts it or says why
            try:
                buf = _from_buffer(_U8, host, require_writable=d == 0)
            except (TypeError, ValueError, BufferError):
                buf = _from_buffer(_U8, host_view(host, writable=d == 0), require_writable=d == 0)
        if d == 0:
            return _read(self.dp, dpa, buf, len(buf), now, wait, self.err)
        return _write(self.dp, dpa, buf, len(buf), now, wait, self.err)

    def copy(self, src: int, dst: int, n: int, now: int, wait: bool) -> int:
        return lib.cxl_copy(self.dp, src, dst, n, now, wait, self.err)

    def untimed(self, d: int, dpa: int, host: memoryview) -> int:
        if d == ls.DIR_READ:
            buf = ffi.from_buffer("uint8_t[]", host, require_writable=True)
            return lib.cxl_read_untimed(self.dp, dpa, buf, host.nbytes, self.err)
        return lib.cxl_write_untimed(self.dp, dpa, ffi.from_buffer("uint8_t[]", host),
                                     host.nbytes, self.err)

    def chase(self, dpa: int, hops: int, timed: bool, nsamples: int = 0) -> tuple[int, list[int]]:
        """Dependent pointer chase (see ``cxl_chase``): total ns and per-hop samples."""
        samples = ffi.new("int64_t[]", max(nsamples, 1))
        end = ffi.new("uint64_t *")
        total = lib.cxl_chase(self.dp, dpa, hops, int(timed), samples, nsamples, end)
        if total < 0:
            raise ValueError(f"pointer chase left the media at hop from DPA {dpa:#x} (code {total})")
        self.last_end = int(end[0])  # where a following round continues the chain
        return int(total), list(samples[0:nsamples])


def now_ns() -> int:
    return int(lib.cxl_now())


def wait_until(deadline: int) -> None:
    lib.cxl_wait_until(deadline)
