"""The scheduler side's counters on a page beside the device, for a worker in another process.
Nothing here imports vLLM."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ManagerCounters"]


class ManagerCounters:
    """The scheduler side's counters on a page beside the device (``<device dir>/tier-manager``,
    ``tier-manager.h<h>`` for the engine on host port h > 0).

    With vLLM's default multiprocessing the scheduler (the tier's manager) and the worker run in
    different processes, and the worker publishes the device's telemetry page: it reads the
    manager's lookups, hits, evictions and chunks in use here, so ``cxlemu monitor`` shows the
    hit rate of such a run too. One writer, the manager's process; word 0 is its pid (0: none
    yet). Until the device's directory exists (a private device, made by the worker) writes are
    dropped, and the writer looks for it again at most every RETRY_S (it writes every scheduler
    step)."""

    FIELDS = ("lookups", "hits", "evictions", "chunks_in_use")
    FILE = "tier-manager"
    RETRY_S = 1.0

    def __init__(self, device: str, *, writer: bool, host: int = 0) -> None:
        self.device, self.writer = device, writer
        self.file = self.FILE if host == 0 else f"{self.FILE}.h{host}"  # one page per engine (host port)
        self._page: Any = None
        self._retry_at = 0.0
        self._open()

    def _open(self) -> Any:
        import time

        import numpy as np

        from emulator.device_dir import device_path

        if self._page is None and not (self.writer and time.monotonic() < self._retry_at):
            self._retry_at = time.monotonic() + self.RETRY_S
            path = device_path(self.device) / self.file
            size = 8 * (1 + len(self.FIELDS))
            try:
                if self.writer and path.parent.is_dir():
                    if not path.is_file() or path.stat().st_size != size:  # made whole, then renamed in:
                        tmp = path.with_suffix(f".{os.getpid()}")  # a reader never maps a short file
                        tmp.write_bytes(bytes(size))
                        os.replace(tmp, path)
                    self._page = np.memmap(path, np.uint64, mode="r+", shape=(1 + len(self.FIELDS),))
                    self._page[:] = 0  # nothing of an earlier run's
                elif not self.writer and path.is_file() and path.stat().st_size == size:
                    self._page = np.memmap(path, np.uint64, mode="r", shape=(1 + len(self.FIELDS),))
            except (OSError, ValueError):  # the device's directory went (a private device closing)
                self._page = None
        return self._page

    def write(self, counts: Mapping[str, int]) -> None:
        page = self._open()
        if page is not None:
            page[1:] = [counts[f] for f in self.FIELDS]
            page[0] = os.getpid()

    def read(self) -> dict[str, int] | None:
        """The manager's counters, or None while no manager has written them."""
        page = self._open()
        if page is None or not int(page[0]):
            return None
        return {f: int(v) for f, v in zip(self.FIELDS, page[1:], strict=True)}

    def close(self) -> None:
        if self._page is not None and self.writer:
            self._page.flush()
        self._page = None
