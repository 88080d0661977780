"""A fleet of serving instances behind a router, on a Mooncake trace (``cxlemu sim fleet``).

:class:`Fleet` runs :class:`~tools.sim.instance.Instance` schedulers on one event queue (a heap
of step ends, store landings and wake-ups, the trace's arrivals merged in): an arrival is routed
(:mod:`tools.sim.router`), admitted (``fcfs``: always, as vLLM; ``memory-aware``: Mooncake's early
rejection, :func:`admissible`) and queued at its instance, which schedules at once when idle or
cuts its decode window at the next step boundary. KV homes are :mod:`tools.sim.kvhome`'s.

:func:`summarize` gives the ``fleet`` metrics and the same per instance: TTFT p50/p99, TPOT,
throughput, goodput (requests within both SLOs per second; rejected ones are not), hit rate by
tier (prompt tokens served from HBM's prefix cache and from the home, over prompt tokens), bytes
per link, the prefill compute alone (Mooncake's prefill GPU time) and $/M output tokens.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from firmware_model.link import READ
from tools.sim.hardware import StepCost
from tools.sim.instance import FleetRequest, Instance
from tools.sim.kvhome import HOMES, KvHome, Store
from tools.sim.metrics import percentile
from tools.sim.mooncake import TraceRequest, capped_hit_tokens, theoretical_hit_rate
from tools.sim.router import ROUTERS, make_router
from tools.sim.window import decode_step_ns

__all__ = ["ADMISSIONS", "Fleet", "FleetConfig", "Prices", "admissible", "summarize"]

ADMISSIONS = ("fcfs", "memory-aware")
_STORE, _STEP, _WAKE = 0, 1, 1  # heap priorities at one time: landings first


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    instances: int
    kv_blocks: int  # each instance's HBM KV space, vLLM's null block included
    kv_bytes_per_token: int
    router: str = "prefix"
    kv: str = "none"
    cache_tokens: int = 0  # each instance's share of its KV home
    admission: str = "fcfs"
    policy: str = "lru"  # the CXL pool's eviction policy (any firmware_model policy or module:Class)
    block_tokens: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    slo_ttft_ms: float = 5000.0
    slo_tpot_ms: float = 100.0
    host_link: str = "pcie5-host"
    cxl_link: str = "beluga-switch"
    rdma_gbps: float = 87.0
    rdma_latency_us: float = 25.0
    decode_windows: bool = True  # False: every decode step on its own (the windows' reference)

    def __post_init__(self) -> None:
        for k in ("instances", "block_tokens", "max_num_seqs", "max_num_batched_tokens", "kv_bytes_per_token"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.kv_blocks < 2:
            raise ValueError(f"kv_blocks must be >= 2 (one is vLLM's null block), got {self.kv_blocks}")
        if self.cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {self.cache_tokens}")
        for key, known in (("router", ROUTERS), ("kv", HOMES), ("admission", ADMISSIONS)):
            if getattr(self, key) not in known:
                raise ValueError(f"unknown {key} {getattr(self, key)!r}: choose from {', '.join(known)}")
        if not (self.slo_ttft_ms > 0 and self.slo_tpot_ms > 0):
            raise ValueError("slo_ttft_ms and slo_tpot_ms must be > 0")


@dataclass(frozen=True, kw_only=True)
class Prices:
    """USD per hour of one instance (all its accelerators), per GB-hour of host DRAM (``host``;
    ``rdma``'s store is host DRAM too) and of CXL pool (``cxl-pool``)."""

    instance_hour: float = 0.0
    host_gb_hour: float = 0.0
    pool_gb_hour: float = 0.0


def admissible(inst: Instance, req: FleetRequest, cfg: FleetConfig, home: KvHome) -> bool:
    """Mooncake's early rejection, by predicted load: the request is taken only when the
    instance's queued prefill plus its own uncached prefill and home load fit the TTFT SLO, one
    more sequence keeps a decode step within the TPOT SLO, and every request there, at its last
    token, still fits in HBM (no preemption)."""
    r = req.tr
    hbm, more = inst.cached_blocks(r)
    cached = capped_hit_tokens(r, hbm + more, cfg.block_tokens)
    ext = cached - capped_hit_tokens(r, hbm, cfg.block_tokens)
    ttft = inst.queued * inst.ns_per_prefill_token() + inst.prefill_ns(cached, r.input_length)
    if ext and home.links:
        ttft += home.links[inst.index].params.duration_ns(READ, ext * cfg.kv_bytes_per_token)
    if ttft > cfg.slo_ttft_ms * 1e6:
        return False
    seqs = inst.requests_in() + 1
    context = sum(q.num_tokens for q in (*inst.running, *inst.waiting)) + r.input_length
    if decode_step_ns(inst.cost, seqs, context + seqs) > cfg.slo_tpot_ms * 1e6:
        return False
    need = -(-(r.input_length + r.output_length) // cfg.block_tokens)
    return inst.committed_blocks() + need <= inst.total


class Fleet:
    """Instances, a router, a KV home and the trace, on one event queue; :meth:`run` serves the
    whole trace and returns :func:`summarize`'s metrics."""

    def __init__(self, requests: Sequence[TraceRequest], cfg: FleetConfig, cost: StepCost) -> None:
        self.cfg, self.cost = cfg, cost
        self.trace = list(requests)
        self.home = KvHome(cfg.kv, cfg.instances, cfg.cache_tokens, policy=cfg.policy,
                           kv_bytes_per_token=cfg.kv_bytes_per_token, host_link=cfg.host_link,
                           cxl_link=cfg.cxl_link, rdma_gbps=cfg.rdma_gbps, rdma_latency_us=cfg.rdma_latency_us)
        self.router = make_router(cfg.router)
        self.instances = [Instance(i, cost, kv_blocks=cfg.kv_blocks, home=self.home, block_tokens=cfg.block_tokens,
                                   max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   on_store=self._stored, windows=cfg.decode_windows) for i in range(cfg.instances)]
        longest = max((r.input_length + r.output_length for r in self.trace), default=0)
        if -(-longest // cfg.block_tokens) > cfg.kv_blocks - 1:
            raise ValueError(f"a request of {longest} tokens needs {-(-longest // cfg.block_tokens)} KV blocks; an "
                             f"instance holds {cfg.kv_blocks - 1}: give more HBM (--tp, a larger accelerator) or a "
                             "trace of shorter requests")
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = itertools.count()
        self.rejected: list[FleetRequest] = []

    def _push(self, t: float, prio: int, obj: Any, version: int = 0) -> None:
        heapq.heappush(self.heap, (t, prio, next(self.seq), obj, version))

    def _stored(self, store: Store, keys: list[int], landed: float) -> None:
        self._push(landed, _STORE, (store, keys))

    def _go(self, inst: Instance, now: float) -> None:
        end = inst.step(now)
        if end is not None:
            self._push(end, _STEP, inst, inst.version)
            return
        wake = inst.next_load(now)
        if wake is not None:
            self._push(wake, _WAKE, inst, -1)

    def _arrive(self, tr: TraceRequest) -> None:
        now = tr.arrival_ns
        req = FleetRequest(tr)
        inst = self.instances[self.router.pick(tr, self.instances)]
        if self.cfg.admission == "memory-aware" and not admissible(inst, req, self.cfg, self.home):
            req.rejected = True
            req.inst = inst.index
            self.rejected.append(req)
            return
        inst.enqueue(req, tr.input_length - inst.cached_tokens(tr))
        if not inst.busy:
            self._go(inst, now)
            return
        end = inst.cut(now)
        if end is not None:
            self._push(end, _STEP, inst, inst.version)

    def run(self, prices: Prices | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        trace, heap = self.trace, self.heap
        ai = 0
        while ai < len(trace) or heap:
            if ai < len(trace) and (not heap or trace[ai].arrival_ns <= heap[0][0]):
                self._arrive(trace[ai])
                ai += 1
                continue
            t, prio, _, obj, version = heapq.heappop(heap)
            if prio == _STORE:
                store, keys = obj
                store.landed(keys, int(t))
            elif version == -1:  # a wake-up: an idle instance's load landed
                if not obj.busy:
                    self._go(obj, t)
            elif version == obj.version:
                obj.end_step(t)
                self._go(obj, t)
        left = sum(inst.requests_in() for inst in self.instances)
        if left:  # every request finishes: a scheduler that strands one is a bug, not a result
            raise RuntimeError(f"{left} requests were never served")
        return summarize(self, time.perf_counter() - t0, prices or Prices())


# --- metrics -------------------------------------------------------------------------------------
def _within_slos(r: FleetRequest, cfg: FleetConfig) -> bool:
    return (r.first_token - r.arrival) <= cfg.slo_ttft_ms * 1e6 and (
        r.generated <= 1 or (r.finish - r.first_token) / (r.generated - 1) <= cfg.slo_tpot_ms * 1e6)


def _metrics(records: list[FleetRequest], rejected: int, cfg: FleetConfig, span_ns: float) -> dict[str, Any]:
    """The metrics of one set of served requests (a fleet's, an instance's)."""
    n = len(records)
    ttft = np.array([(r.first_token - r.arrival) / 1e6 for r in records], dtype=float)
    tpot = np.array([(r.finish - r.first_token) / 1e6 / (r.generated - 1) for r in records if r.generated > 1],
                    dtype=float)
    prompt = sum(r.tr.input_length for r in records)
    hbm = sum(r.hbm_hit for r in records)
    home = sum(r.home_hit for r in records)
    out_tokens = sum(r.generated for r in records)
    within = [r for r in records if _within_slos(r, cfg)]
    good, good_tokens = len(within), sum(r.generated for r in within)
    span_s = span_ns / 1e9 if span_ns > 0 else math.nan
    return {"requests": n, "rejected": rejected,
            "hit_rate": (hbm + home) / prompt if prompt else 0.0,
            "hit_rate_hbm": hbm / prompt if prompt else 0.0, "hit_rate_home": home / prompt if prompt else 0.0,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
            "throughput_tok_s": out_tokens / span_s, "output_tokens": out_tokens,
            "goodput": good / span_s, "good_requests": good,
            "goodput_fraction": good / (n + rejected) if n + rejected else 0.0, "good_tokens": good_tokens,
            "prefill_s": sum(r.prefill_ns for r in records) / 1e9}


def summarize(fleet: Fleet, wall_s: float, prices: Prices) -> dict[str, Any]:
    """``{"fleet": {...}, "instances": [...], "setup": {...}}``; the span is the trace's first
    arrival to the last finish, shared by the instances so their rates add up to the fleet's."""
    cfg, home = fleet.cfg, fleet.home
    records = [r for inst in fleet.instances for r in inst.records]
    start = min((r.arrival_ns for r in fleet.trace), default=0.0)
    end = max((r.finish for r in records), default=start)
    span = end - start
    out = _metrics(records, len(fleet.rejected), cfg, span)
    insts = []
    for inst in fleet.instances:
        m = _metrics(inst.records, sum(1 for r in fleet.rejected if r.inst == inst.index), cfg, span)
        m.update(instance=inst.index, steps=inst.steps, busy_s=inst.busy_ns / 1e9, preemptions=inst.preemptions,
                 max_running=inst.max_running, kv_capacity_tokens=inst.total * cfg.block_tokens,
                 bytes_read=home.bytes_read[inst.index] if home.links else 0,
                 bytes_written=home.bytes_written[inst.index] if home.links else 0)
        insts.append(m)
    out.update(kv_capacity_tokens=(cfg.kv_blocks - 1) * cfg.block_tokens, home_capacity_tokens=home.capacity_tokens(),
               theoretical_hit_rate=theoretical_hit_rate(fleet.trace, cfg.block_tokens),
               bytes_read=sum(home.bytes_read), bytes_written=sum(home.bytes_written),
               steps=sum(i.steps for i in fleet.instances), preemptions=sum(i.preemptions for i in fleet.instances),
               sim_s=span / 1e9, wall_s=wall_s)
    out.update(_costs(cfg, prices, out))
    return {"fleet": out, "instances": insts, "home": home.describe()}


def _costs(cfg: FleetConfig, prices: Prices, m: dict[str, Any]) -> dict[str, Any]:
    """USD per hour of the fleet and per million output tokens (all, and those of requests
    within the SLOs)."""
    gb = cfg.cache_tokens * cfg.instances * cfg.kv_bytes_per_token / 1e9 if cfg.kv != "none" else 0.0
    per_gb = prices.pool_gb_hour if cfg.kv == "cxl-pool" else prices.host_gb_hour
    hourly = cfg.instances * prices.instance_hour + gb * per_gb
    span_h = m["sim_s"] / 3600 if m["sim_s"] else math.nan

    def per_m(tokens: int) -> float | None:
        return hourly * span_h / tokens * 1e6 if tokens and hourly else None
    return {"home_gb": gb, "usd_per_hour": hourly, "usd_per_m_output_tokens": per_m(m["output_tokens"]),
            "usd_per_m_good_tokens": per_m(m["good_tokens"])}
