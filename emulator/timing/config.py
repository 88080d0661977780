"""Timing configuration of a device's link: latency, bandwidth, transaction size, time scale."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from emulator.spec.errors import ConfigError
from firmware_model import link as _link

#: LinkParams is the firmware model's: the integers both data-path implementations use, so the C
#: core and the Python twin compute bit-identical completion times (no float in the hot path),
#: and the firmware's DMA scheduling model the same ones. Time scale applied; 0 = unthrottled.
LinkParams = _link.LinkParams


_BANDWIDTHS = ("read_bandwidth_gbps", "write_bandwidth_gbps", "media_read_bandwidth_gbps",
               "media_write_bandwidth_gbps")


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """How much every access to the device costs.

    A transfer of n bytes in direction d is charged the whole ``transaction_bytes``-aligned
    transactions it touches and completes at
    ``max(now, link_free[d]) + latency_d + charged / bandwidth_d`` (all times multiplied by
    ``time_scale``); the link is then busy until ``max(now, link_free[d]) + charged / bandwidth_d``,
    so latency pipelines and bandwidth is shared. Latencies are *added* to what the emulator's
    own access costs (local DRAM). A bandwidth of ``None`` means unthrottled (zero bandwidth is a
    configuration error: nothing would ever arrive); latencies of 0 add nothing.

    ``media_*_bandwidth_gbps``: the device media's aggregate bandwidth, shared by all hosts of a
    pooled device (each with its own link above): a transfer then also waits for, and holds,
    the media (``firmware_model.link``). ``None`` (and a config.json without them): no media limit.
    """

    read_latency_ns: float = 0.0
    write_latency_ns: float = 0.0
    read_bandwidth_gbps: float | None = None  # GB/s (1e9 B/s); None = unthrottled
    write_bandwidth_gbps: float | None = None
    transaction_bytes: int = 64
    time_scale: float = 1.0
    media_read_bandwidth_gbps: float | None = None  # GB/s, all hosts together; None = no limit
    media_write_bandwidth_gbps: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name.endswith("bandwidth_gbps"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value!r}")
        for name in ("read_latency_ns", "write_latency_ns"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 ns, got {getattr(self, name)}")
        for name in _BANDWIDTHS:
            bw = getattr(self, name)
            if bw is not None and bw < 1e-3:
                raise ConfigError(f"{name} must be at least 0.001 GB/s (1 MB/s), got {bw}; "
                                  "leave it unset (None) for an unthrottled link")
        tb = self.transaction_bytes
        if not isinstance(tb, int) or not (64 <= tb <= 4096) or tb & (tb - 1):
            raise ConfigError(f"transaction_bytes must be a power of two from 64 to 4096, got {tb}")
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale must be > 0, got {self.time_scale}")

    @property
    def untimed(self) -> bool:
        return (self.read_latency_ns == 0 and self.write_latency_ns == 0
                and all(getattr(self, name) is None for name in _BANDWIDTHS))

    def link_params(self) -> LinkParams:
        """The firmware model's integer link (ns, femtoseconds per byte), time scale applied."""
        return LinkParams.from_rates(
            read_latency_ns=self.read_latency_ns, write_latency_ns=self.write_latency_ns,
            read_bandwidth_gbps=self.read_bandwidth_gbps or 0, write_bandwidth_gbps=self.write_bandwidth_gbps or 0,
            time_scale=self.time_scale, txn_bytes=self.transaction_bytes,
            media_read_bandwidth_gbps=self.media_read_bandwidth_gbps or 0,
            media_write_bandwidth_gbps=self.media_write_bandwidth_gbps or 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TimingConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown timing field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)
