"""The tier's counters in this process (``TierStats`` per device) and its live scheduler-side
managers. Nothing here imports vLLM: ``cxlemu bench serve`` and the tests read counters whether
or not vLLM is installed."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["TierStats", "live_manager", "register_manager", "reset_tier_stats", "tier_stats", "unregister_manager"]


@dataclass
class TierStats:
    """Counters of one tier (one device) in this process; the scheduler side and the worker side
    add into the same object when vLLM runs in-process."""

    lookups: int = 0  # blocks looked up in the tier
    hits: int = 0  # ... found there
    blocks_loaded: int = 0  # blocks moved device -> KV space (successfully)
    blocks_stored: int = 0  # blocks moved KV space -> device
    bytes_loaded: int = 0
    bytes_stored: int = 0
    link_bytes_loaded: int = 0  # bytes the link moved for them: encoded where kv_format compresses
    link_bytes_stored: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    failed_loads: int = 0  # load jobs that failed (poison, DMA error, device gone)
    failed_blocks: int = 0  # KV-space blocks reported to vLLM as not loaded
    failed_stores: int = 0
    evictions: int = 0  # blocks evicted from the tier by its policy
    dropped: int = 0  # blocks forgotten because a transfer of theirs failed (their copy is lost)
    stall_ns: int = 0  # time the forward waited for loads (layer-wise waits, wait())
    layer_waits: int = 0
    device_lost: int = 0  # 1 once the device's firmware was found gone
    host_ns: int = 0  # the tier's own time in submit / get_finished (the emulator's cost)
    host_blocks: int = 0  # blocks those calls handled
    hotlist_entries: int = 0  # CHMU hotlist entries the "hotness" policy took as heat
    pool_lookups: int = 0  # shared=True: blocks the tier lacked, looked up in the device's pool
    pool_hits: int = 0  # ... found there (published by any engine on the device, this one too)
    pool_loaded: int = 0  # ... copied from the pool into the tier (then loaded as tier hits)
    pool_load_misses: int = 0  # ... gone or torn when loaded (vLLM recomputes them)
    pool_published: int = 0  # blocks this engine stored and the pool took
    pool_errors: int = 0  # pool operations that raised (the engine went on with its own tier)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:  # a few times per job: the fields are the instance's dict entries
            fields_ = self.__dict__
            for name, n in counts.items():
                fields_[name] += n

    def mark_lost(self) -> bool:
        """Record that the device was found gone; True for the one caller that records it first
        (a manager and a worker in one process may both find it: the loss is reported once)."""
        with self._lock:
            first, self.device_lost = not self.device_lost, 1
            return first

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


_MANAGERS: dict[str, Any] = {}
_STATS: dict[str, TierStats] = {}
_STATS_LOCK = threading.Lock()


def tier_stats(name: str) -> TierStats:
    """The counters of the tier on device ``name`` in this process (created empty on first use)."""
    with _STATS_LOCK:
        return _STATS.setdefault(name, TierStats())


def reset_tier_stats(name: str) -> None:
    with _STATS_LOCK:
        _STATS.pop(name, None)


def live_manager(device: str) -> Any:
    """The tier's scheduler-side manager on ``device`` in this process, or None (vLLM builds one
    spec per role: the worker's spec has no manager, so tests and the telemetry find it here)."""
    return _MANAGERS.get(device)


def register_manager(device: str, manager: Any) -> None:
    _MANAGERS[device] = manager


def unregister_manager(device: str, manager: Any) -> None:
    """Forget ``manager`` if it is still the one registered for ``device``."""
    if _MANAGERS.get(device) is manager:
        del _MANAGERS[device]
