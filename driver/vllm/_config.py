"""The tier's configuration (vLLM's ``kv_connector_extra_config``) and its counters.

Nothing here imports vLLM: ``cxlemu bench serve`` and the tests build configurations and read
counters whether or not vLLM is installed.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from emulator.spec.errors import ConfigError
from firmware_model.policies import POLICY_NAMES, resolve_policy

__all__ = ["PREFETCH_MODES", "ManagerCounters", "TierConfig", "TierStats", "chunk_of_dpa", "hotlist_unit", "kv_transfer_config",
           "live_manager", "parse_extra_config", "tier_stats"]

PREFETCH_MODES = ("forward", "layer")
"""``forward``: a request's blocks are loaded before its forward starts (vLLM's offload).
``layer``: its forward starts at once and layer l waits only for layer l's blocks."""

_KNOWN = {"spec_name", "spec_module_path", "device", "policy", "cxl_bytes_to_use", "prefetch",
          "channels", "block_size", "offload_prompt_only", "self_describing_kv_events",
          "store_threshold", "max_tracker_size", "hotlist_every", "window", "staging", "staging_bytes"}


@dataclass(frozen=True)
class TierConfig:
    """What the tier takes from ``kv_connector_extra_config``, checked."""

    device: str | None  # a served device's name; None: a private device in-process
    policy: str  # a firmware_model policy name or "package.module:Class"
    cxl_bytes_to_use: int  # the tier's share of the device, bytes
    prefetch: str = "forward"
    channels: int = 2  # DMA channels: loads on one, stores on the other
    hotlist_every: int = 64  # "hotness": read the CHMU's hotlist every this many scheduler steps
    window: str = "auto"  # layer-wise: layers issued ahead, firmware_model.prefetch.resolve_window
    staging: bool | None = None  # KV through a host bounce buffer; None: where the KV is not on the CPU
    staging_bytes: int = 2 << 30  # the bounce buffer: whole blocks (>= 1); a 7B's 4096-token context at fp16


def _int(extra: Mapping[str, Any], key: str, default: int | None, low: int) -> int:
    value = extra.get(key, default)
    if value is None:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] is required (an int >= {low})")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an int >= {low}, got {value!r}")
    return value


def parse_extra_config(extra: Mapping[str, Any]) -> TierConfig:
    """The tier's settings from vLLM's ``kv_connector_extra_config``; ``ConfigError`` (a
    ``ValueError``) naming the key and what it takes for anything else."""
    unknown = sorted(set(extra) - _KNOWN)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                          f"the cxlemu tier takes {', '.join(sorted(_KNOWN))}")
    device = extra.get("device")
    if device is not None and (not isinstance(device, str) or not device):
        raise ConfigError(f"kv_connector_extra_config['device'] must be a served device's name, got {device!r}")
    policy = extra.get("policy", "lru")
    if not isinstance(policy, str):
        raise ConfigError(f"kv_connector_extra_config['policy'] must be a string: one of "
                          f"{', '.join(POLICY_NAMES)} or 'package.module:Class', got {policy!r}")
    if policy == "opt":
        raise ConfigError("kv_connector_extra_config['policy']: 'opt' needs the future and cannot run a "
                          "cache; choose one of " + ", ".join(n for n in POLICY_NAMES if n != "opt"))
    try:  # an unknown name or a class that does not fit: refused now, not at the first eviction
        resolve_policy(policy)
    except ValueError as exc:
        raise ConfigError(f"kv_connector_extra_config['policy']: {exc}") from None
    prefetch = extra.get("prefetch", "forward")
    if prefetch not in PREFETCH_MODES:
        raise ConfigError(f"kv_connector_extra_config['prefetch'] must be one of {PREFETCH_MODES}, got {prefetch!r}")
    window = extra.get("window", "auto")
    try:
        from firmware_model.prefetch import resolve_window

        resolve_window(window)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"kv_connector_extra_config['window']: {exc}") from None
    staging = extra.get("staging")
    if staging is not None and not isinstance(staging, bool):
        raise ConfigError(f"kv_connector_extra_config['staging'] must be true, false or absent (staged where "
                          f"the KV is not in host memory: CUDA), got {staging!r}")
    return TierConfig(device=device, policy=policy, cxl_bytes_to_use=_int(extra, "cxl_bytes_to_use", None, 1),
                      prefetch=prefetch, channels=_int(extra, "channels", 2, 1),
                      hotlist_every=_int(extra, "hotlist_every", 64, 1), window=window, staging=staging,
                      staging_bytes=_int(extra, "staging_bytes", 2 << 30, 1))


def kv_transfer_config(*, device: str | None = None, policy: str = "lru", prefetch: str = "forward",
                       cxl_bytes_to_use: int, recompute_failed_loads: bool = True,
                       **extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for the cxlemu tier through :class:`CxlConnector`.

    ``recompute_failed_loads``: vLLM's ``kv_load_failure_policy`` "recompute" (a block that fails
    to load is computed again; the request goes on) rather than "fail" (the request ends with an
    error)."""
    cfg = {"device": device, "policy": policy, "prefetch": prefetch, "cxl_bytes_to_use": cxl_bytes_to_use,
           **extra}
    if device is None:
        del cfg["device"]
    parse_extra_config(cfg)
    return {"kv_connector": "CxlConnector", "kv_connector_module_path": "driver.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute" if recompute_failed_loads else "fail",
            "kv_connector_extra_config": cfg}


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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:  # a few times per job: the fields are the instance's dict entries
            fields_ = self.__dict__
            for name, n in counts.items():
                fields_[name] += n

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


_MANAGERS: dict[str, Any] = {}


class ManagerCounters:
    """The scheduler side's counters on a page beside the device (``<device dir>/tier-manager``).

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

    def __init__(self, device: str, *, writer: bool) -> None:
        self.device, self.writer = device, writer
        self._page: Any = None
        self._retry_at = 0.0
        self._open()

    def _open(self) -> Any:
        import time

        import numpy as np

        from emulator.device_dir import device_path

        if self._page is None and not (self.writer and time.monotonic() < self._retry_at):
            self._retry_at = time.monotonic() + self.RETRY_S
            path = device_path(self.device) / self.FILE
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


def live_manager(device: str) -> Any:
    """The tier's scheduler-side manager on ``device`` in this process, or None (vLLM builds one
    spec per role: the worker's spec has no manager, so tests and the telemetry find it here)."""
    return _MANAGERS.get(device)


def hotlist_unit(page: int) -> int:
    """The CHMU unit for pages of ``page`` bytes: the largest power of two dividing it, within
    the unit sizes a CHMU offers (256 B to 2 MiB), so no unit straddles two pages."""
    if isinstance(page, bool) or not isinstance(page, int) or page <= 0:
        raise ValueError(f"page must be an int > 0 bytes, got {page!r}")
    return min(max(page & -page, 256), 2 << 20)


def chunk_of_dpa(dpa: int, page: int, num_chunks: int) -> int:
    """The chunk a DPA of the tier's region belongs to, for equal pages of ``page`` bytes per
    layer (the worker's layer-major layout, driver/vllm/_worker.py)."""
    return (dpa // page) % num_chunks



_STATS: dict[str, TierStats] = {}
_STATS_LOCK = threading.Lock()


def tier_stats(name: str) -> TierStats:
    """The counters of the tier on device ``name`` in this process (created empty on first use)."""
    with _STATS_LOCK:
        return _STATS.setdefault(name, TierStats())


def reset_tier_stats(name: str) -> None:
    with _STATS_LOCK:
        _STATS.pop(name, None)
