"""Timing configuration of a device's link: latency, bandwidth, transaction size, time scale."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from emulator.spec.errors import ConfigError

#: 1 GB/s (1e9 B/s) is 1 ns per byte = 1e6 femtoseconds per byte.
_FS_PER_BYTE_AT_1GBPS = 1_000_000


@dataclass(frozen=True)
class LinkParams:
    """A TimingConfig reduced to the integers both data-path implementations use, so the C
    core and the Python twin compute bit-identical completion times (no float in the hot path).
    Time scale is applied; ``fs_per_byte == 0`` means unthrottled."""

    lat_ns: tuple[int, int]        # read, write
    fs_per_byte: tuple[int, int]   # read, write
    txn_bytes: int

    @property
    def untimed(self) -> bool:
        return self.lat_ns == (0, 0) and self.fs_per_byte == (0, 0)


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
    """

    read_latency_ns: float = 0.0
    write_latency_ns: float = 0.0
    read_bandwidth_gbps: float | None = None  # GB/s (1e9 B/s); None = unthrottled
    write_bandwidth_gbps: float | None = None
    transaction_bytes: int = 64
    time_scale: float = 1.0

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
        for name in ("read_bandwidth_gbps", "write_bandwidth_gbps"):
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
                and self.read_bandwidth_gbps is None and self.write_bandwidth_gbps is None)

    def link_params(self) -> LinkParams:
        """Integer parameters (ns, femtoseconds per byte), time scale applied."""
        k = self.time_scale

        def fs(gbps: float | None) -> int:
            # a configured bandwidth is a timed link, however fast (0 fs/B means unthrottled):
            # from 1e6 GB/s up it is 1 fs/B, the resolution
            return 0 if gbps is None else max(1, round(_FS_PER_BYTE_AT_1GBPS * k / gbps))

        return LinkParams(
            lat_ns=(round(self.read_latency_ns * k), round(self.write_latency_ns * k)),
            fs_per_byte=(fs(self.read_bandwidth_gbps), fs(self.write_bandwidth_gbps)),
            txn_bytes=self.transaction_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TimingConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown timing field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)
