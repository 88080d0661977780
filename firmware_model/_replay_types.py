"""The records trace replay reads and writes: :class:`Access` in, :class:`ReplayResult` out.

Apart from :mod:`firmware_model.replay` so that the demand-fill replayer and the prefetching one
(:mod:`firmware_model.prefetch_replay`) both build on them without importing each other.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Access", "ReplayResult"]


@dataclass(frozen=True, slots=True)
class Access:
    """One trace record: at step ``t`` sequence ``seq`` reads ``block`` while computing ``layer``."""

    t: int
    block: Hashable
    seq: Hashable = 0
    layer: int = 0


@dataclass(kw_only=True)
class ReplayResult:
    """What one replay measured; ``to_dict()`` is the ``--json`` document."""

    policy: str
    capacity: int
    accesses: int
    hits: int
    misses: int
    opt_hits: int
    evictions: int
    unique_blocks: int
    stall_ns: int = 0
    sim_ns: int = 0
    prefetch: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def opt_ratio(self) -> float:
        """Hits relative to OPT's (1.0 = as good as the oracle)."""
        return self.hits / self.opt_hits if self.opt_hits else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_ratio"] = round(self.hit_ratio, 6)
        out["opt_ratio"] = round(self.opt_ratio, 6)
        return out
