"""Timing configuration of a device's link: latency, bandwidth, transaction size, time scale."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from emulator.spec.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """How much every access to the device costs.

    A transfer of n bytes in direction d completes at
    ``max(now, link_free[d]) + latency_d + n / bandwidth_d`` (all times multiplied by
    ``time_scale``). ``bandwidth_gbps == 0`` means unthrottled; latencies of 0 add nothing.
    """

    read_latency_ns: float = 0.0
    write_latency_ns: float = 0.0
    read_bandwidth_gbps: float = 0.0  # GB/s (1e9 B/s); 0 = unthrottled
    write_bandwidth_gbps: float = 0.0
    transaction_bytes: int = 64
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("read_latency_ns", "write_latency_ns"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 ns, got {getattr(self, name)}")
        for name in ("read_bandwidth_gbps", "write_bandwidth_gbps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be > 0 GB/s (or 0 for unthrottled), got {getattr(self, name)}")
        tb = self.transaction_bytes
        if not (64 <= tb <= 4096) or tb & (tb - 1):
            raise ConfigError(f"transaction_bytes must be a power of two from 64 to 4096, got {tb}")
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale must be > 0, got {self.time_scale}")

    @property
    def untimed(self) -> bool:
        return (self.read_latency_ns == 0 and self.write_latency_ns == 0
                and self.read_bandwidth_gbps == 0 and self.write_bandwidth_gbps == 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TimingConfig":
        return cls(**data)
