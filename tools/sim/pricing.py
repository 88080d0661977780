"""What a simulated row costs: USD per million output tokens from the hourly prices of its
accelerator and of the memory its mode adds (``cxlemu sim sweep --price/--pool-price/--host-price``)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tools.sim.grid import NA
from tools.sim.modes import CXL_MODES

__all__ = ["Prices", "cost_per_token", "hourly_cost"]


@dataclass(frozen=True, kw_only=True)
class Prices:
    """USD per hour of one accelerator (by name; a row pays for its ``tp`` of them), per GB-hour of CXL pool (charged to
    ``cxl-*`` rows for their ``pool_gb``) and of host memory (``host-lru`` rows, ``host_gb``)."""

    accelerator: dict[str, float] = field(default_factory=dict)
    pool_gb_hour: float = 0.0
    host_gb_hour: float = 0.0


def hourly_cost(row: Mapping[str, Any], prices: Prices) -> float | None:
    """The row's USD per hour, or None when its accelerator has no price."""
    acc = prices.accelerator.get(row.get("accelerator", ""))
    if acc is None:
        return None
    cost = float(acc) * int(row.get("tp", 1))  # an instance is tp accelerators
    if row.get("mode") in CXL_MODES and row.get("pool_gb", NA) != NA:
        cost += float(row["pool_gb"]) * prices.pool_gb_hour
    if row.get("mode") == "host-lru" and row.get("host_gb", NA) != NA:
        cost += float(row["host_gb"]) * prices.host_gb_hour
    return cost


def cost_per_token(rows: list[dict[str, Any]], prices: Prices) -> list[dict[str, Any]]:
    """Set ``usd_per_million_tokens`` = hourly cost / (output_tokens_per_s x 3600) x 1e6 on every
    priced row (None where the row failed or produced no tokens); rows whose accelerator has no
    price are left alone. Mutates and returns ``rows``."""
    for row in rows:
        cost = hourly_cost(row, prices)
        if cost is None:
            continue
        tps = row.get("output_tokens_per_s")
        if "error" in row or not isinstance(tps, (int, float)) or not math.isfinite(tps) or tps <= 0:
            row["usd_per_million_tokens"] = None
        else:
            row["usd_per_million_tokens"] = cost / (tps * 3600) * 1e6
    return rows
