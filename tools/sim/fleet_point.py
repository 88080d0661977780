"""One fleet run from plain values (``cxlemu sim fleet``, each task of ``cxlemu sim fleet-sweep``).

:class:`FleetPoint` pickles to a Dask worker; :func:`run_point` builds the instance's hardware
(the model's shape, the accelerator's roofline under ``tp``-way tensor parallelism, the KV space
the HBM leaves), loads the trace (once per process) and runs :class:`~tools.sim.fleet.Fleet`.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from tools.sim import hardware as hw
from tools.sim.fleet import ADMISSIONS, Fleet, FleetConfig, Prices
from tools.sim.kvhome import HOMES, RDMA_GBPS, RDMA_LATENCY_US
from tools.sim.mooncake import TraceRequest, load
from tools.sim.profile import COST_MODELS, step_cost
from tools.sim.router import ROUTERS

__all__ = ["FleetPoint", "instance_hardware", "run_point", "trace"]


@dataclass(frozen=True, kw_only=True)
class FleetPoint:
    trace: str
    model: str = "llama-3-70b"
    accelerator: str = "h100"
    tp: int = 8
    instances: int = 16
    router: str = "prefix"
    kv: str = "none"
    cache_tokens: int = 0
    speed: float = 1.0
    limit: int = 0  # 0: the whole trace
    admission: str = "fcfs"
    policy: str = "lru"
    cost: str = "roofline"
    slo_ttft_ms: float = 5000.0
    slo_tpot_ms: float = 100.0
    kv_blocks: int = 0  # 0: what the accelerators' memory leaves (hardware.kv_capacity)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    memory_utilization: float = hw.DEFAULT_MEMORY_UTILIZATION
    rdma_gbps: float = RDMA_GBPS
    rdma_latency_us: float = RDMA_LATENCY_US
    accelerator_hour: float = 0.0  # USD per accelerator-hour
    host_gb_hour: float = 0.0
    pool_gb_hour: float = 0.0

    def __post_init__(self) -> None:
        if self.model not in hw.MODELS:
            raise ValueError(f"unknown model {self.model!r}: choose from {', '.join(hw.MODELS)}")
        if self.accelerator not in hw.ACCELERATORS:
            raise ValueError(f"unknown accelerator {self.accelerator!r}: choose from {', '.join(hw.ACCELERATORS)}")
        for key, known in (("router", ROUTERS), ("kv", HOMES), ("admission", ADMISSIONS), ("cost", COST_MODELS)):
            if getattr(self, key) not in known:
                raise ValueError(f"unknown {key} {getattr(self, key)!r}: choose from {', '.join(known)}")
        if self.tp < 1 or self.instances < 1:
            raise ValueError("tp and instances must be >= 1")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def instance_hardware(p: FleetPoint) -> tuple[hw.StepCost, int, hw.ModelShape]:
    """An instance's step cost (``tools.sim.profile.step_cost``: Vidur's profile or the roofline,
    ``tp`` accelerators), its KV space in blocks (vLLM's null block included) and the model."""
    shape = hw.MODELS[p.model]
    cost = step_cost(p.cost, p.model, shape, p.accelerator, tp=p.tp)
    if p.kv_blocks:
        return cost, p.kv_blocks, shape
    cap = hw.kv_capacity(shape, hw.ACCELERATORS[p.accelerator], max_num_batched_tokens=p.max_num_batched_tokens,
                         memory_utilization=p.memory_utilization, tp=p.tp)
    blocks = int(cap["kv_tokens"] // 16)
    if blocks < 2:
        raise ValueError(f"{shape.name} leaves no KV space on {p.tp} x {p.accelerator} "
                         f"({cap['kv_bytes'] / 1e9:.1f} GB): give more accelerators (--tp)")
    return cost, blocks, shape


@functools.lru_cache(maxsize=4)
def trace(path: str, speed: float, limit: int) -> tuple[TraceRequest, ...]:
    """The trace's requests, read once per process (a sweep's tasks share a worker's copy)."""
    return tuple(load(path, speed, limit or None))


def run_point(p: FleetPoint) -> dict[str, Any]:
    """Run the point; ``{"fleet", "instances", "home", "point"}``."""
    cost, kv_blocks, shape = instance_hardware(p)
    cfg = FleetConfig(instances=p.instances, kv_blocks=kv_blocks, kv_bytes_per_token=shape.kv_bytes_per_token,
                      router=p.router, kv=p.kv, cache_tokens=p.cache_tokens, admission=p.admission, policy=p.policy,
                      max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens,
                      slo_ttft_ms=p.slo_ttft_ms, slo_tpot_ms=p.slo_tpot_ms, rdma_gbps=p.rdma_gbps,
                      rdma_latency_us=p.rdma_latency_us)
    prices = Prices(instance_hour=p.accelerator_hour * p.tp, host_gb_hour=p.host_gb_hour, pool_gb_hour=p.pool_gb_hour)
    out = Fleet(trace(p.trace, p.speed, p.limit), cfg, cost).run(prices)
    out["point"] = p.to_dict()
    return out
