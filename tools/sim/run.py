"""One simulated point — (model, accelerator, workload, mode, concurrency) — from plain data.

:class:`Point` is what ``cxlemu sim serve`` and every task of ``cxlemu sim sweep`` run: all plain
values (it pickles to a Dask worker), :func:`simulate` builds the engine and returns the metrics
of :func:`summarize` (the same definitions as ``cxlemu bench serve``'s).

Modes: :mod:`tools.sim.modes` (``none``, ``host-lru``, ``cxl-lru``, ``cxl-smart``; a point also takes
``cxlemu bench serve``'s ``all-resident`` and ``cxl-arc-forward``, which ``cxlemu sim validate`` runs).
``attention="hot"`` (mode ``none``): hot-page attention, the KV in the CXL pool behind ``cxl_link``
in ``kv_format``, the KV space holding each decoding request's working set (:mod:`tools.sim.hot`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tools.sim import hardware as hw
from tools.sim import modes
from tools.sim.engine import EngineConfig, SimEngine, TierConfig
from tools.sim.hot import ATTENTIONS, HOT_PREDICTED, HOT_WHEN, KV_FORMATS, HotAttention, HotConfig, check_predicted
from tools.sim.metrics import summarize
from tools.sim.profile import COST_MODELS, step_cost
from tools.sim.workload import ClientScript, WorkloadConfig

__all__ = ["MAX_CLIENTS", "ConcurrencyError", "Point", "build_scripts", "simulate"]

GB = 10**9
#: the most clients one point takes, whatever its KV space (a huge --kv-blocks): 2^16 clients'
#: scripts are ~100 MB and a run of them minutes; vLLM itself runs at most max_num_seqs (256) at once
MAX_CLIENTS = 1 << 16


class ConcurrencyError(ValueError):
    """More clients than the KV space can hold at one block each (``Point.check_concurrency``)."""

    def __init__(self, message: str, bound: int) -> None:
        super().__init__(message)
        self.bound = bound


@dataclass(frozen=True, kw_only=True)
class Point:
    mode: str = "none"
    concurrency: int = 1
    model: str = "llama-2-7b"
    accelerator: str = "h100"
    tp: int = 1  # tensor parallelism: the accelerators of one instance (weights and KV split over them)
    workload: dict[str, Any] = field(default_factory=lambda: {"kind": "fixed", "context": 4096,
                                                              "output_tokens": 128, "requests": 4})
    pool_gb: float = 1024.0  # the CXL pool (cxl-* modes)
    host_gb: float = 256.0  # host memory the offload may use (host-lru)
    host_link: str = "pcie-host"
    cxl_link: str = "leo-x16"
    smart_policy: str = "arc"
    preemption: str = "recompute"
    block_tokens: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    memory_utilization: float = hw.DEFAULT_MEMORY_UTILIZATION
    kv_blocks: int = 0  # 0: derived from the accelerator's memory (hardware.kv_capacity)
    mfu: float = hw.DEFAULT_MFU
    mbu: float = hw.DEFAULT_MBU
    overhead_us: float = hw.DEFAULT_OVERHEAD_US
    time_scale: float = 1.0  # multiplies link times (the bench's k)
    jitter: float = 0.0  # relative noise on each step's cost (EngineConfig.jitter)
    seed: int = 0
    policy: str = ""  # the tier's eviction policy instead of the mode's
    prefetch: str = ""  # "forward" or "layer" instead of the mode's
    tier_blocks: int = 0  # the tier's size in blocks instead of pool_gb / host_gb
    offload_prompt_only: bool = True  # vLLM's default: decode-filled blocks are not stored
    cost_model: str = "roofline"  # or "profile": Vidur's measured operators where profiled (tools.sim.profile)
    step_cost: dict[str, float] | None = None  # a fitted LinearCost instead of either
    model_shape: dict[str, Any] | None = None  # a shape of one's own instead of ``model``'s
    attention: str = "dense"  # or "hot": hot-page attention over the CXL pool (tools.sim.hot)
    page_budget: float = 0.1  # hot: the share of a sequence's pages each decode step attends to
    kv_format: str = "native"  # hot: the device's KV format (native, int8, int4)
    hot_when: str = "always"  # hot: "always" once the prompt is computed, or "full": when the KV space is full
    hot_predicted: float = HOT_PREDICTED  # hot: the share of the chosen pages read a layer ahead (the rest on demand)

    def __post_init__(self) -> None:
        if self.mode not in modes.MODES:
            raise ValueError(f"unknown mode {self.mode!r}: choose from {', '.join(modes.MODES)}")
        if self.preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.model_shape is None and self.model not in hw.MODELS:
            raise ValueError(f"unknown model {self.model!r}: choose from {', '.join(hw.MODELS)}")
        if self.step_cost is None and self.accelerator not in hw.ACCELERATORS:
            raise ValueError(f"unknown accelerator {self.accelerator!r}: choose from {', '.join(hw.ACCELERATORS)}")
        for k in ("pool_gb", "host_gb"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be > 0, got {getattr(self, k)}")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"unknown cost model {self.cost_model!r}: choose from {', '.join(COST_MODELS)}")
        self._check_attention()
        if self.tp != 1:
            self.shape().check_tp(self.tp)
            if self.step_cost is None:
                hw.allreduce_ns(hw.ACCELERATORS[self.accelerator], self.tp, 0)  # no NVLink: refused

    def _check_attention(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {self.attention!r}: choose from {', '.join(ATTENTIONS)}")
        if self.hot_when not in HOT_WHEN:
            raise ValueError(f"unknown hot_when {self.hot_when!r}: choose from {', '.join(HOT_WHEN)}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"unknown kv_format {self.kv_format!r}: choose from {', '.join(KV_FORMATS)}")
        check_predicted(self.hot_predicted)
        if self.attention == "dense":
            if self.kv_format != "native":
                raise ValueError("kv_format is the device's format under hot-page attention: dense attention "
                                 "keeps its KV in HBM (native)")
            return
        if modes.MODES[self.mode].tier is not None or self.preemption != "recompute":
            raise ValueError(f"hot-page attention keeps the KV in the CXL pool itself: it runs in mode 'none' with "
                             f"recompute preemption, not {self.mode!r} with {self.preemption}")
        self.hot()  # a page_budget out of (0, 1] or a shape int4 cannot pack: refused here

    def hot(self) -> HotAttention | None:
        """Hot-page attention's arithmetic for this point, or None (dense)."""
        if self.attention == "dense":
            return None
        return HotAttention.for_shape(self.shape(), page_budget=self.page_budget, kv_format=self.kv_format,
                                      block_tokens=self.block_tokens)

    @property
    def label(self) -> str:
        """The mode and how it attends: ``none``, or ``none hot 0.1 int4``."""
        if self.attention == "dense":
            return self.mode
        when = "" if self.hot_when == "always" else f" when {self.hot_when}"
        return f"{self.mode} hot {self.page_budget:g} {self.kv_format}{when}"

    @property
    def instance(self) -> str:
        """The accelerators of one instance: ``h100``, or ``4 x h100`` under tensor parallelism."""
        return self.accelerator if self.tp == 1 else f"{self.tp} x {self.accelerator}"

    def shape(self) -> hw.ModelShape:
        return hw.ModelShape(**self.model_shape) if self.model_shape is not None else hw.MODELS[self.model]

    def cost(self) -> hw.StepCost:
        if self.step_cost is not None:
            c = self.step_cost
            return hw.LinearCost(c["a_ns"], c["b_ns_per_token"], c["c_ns_per_pair"], c["d_ns_per_seq"],
                                 c.get("e_ns_per_padded_pair", 0.0), c.get("f_ns_per_decode_context", 0.0))
        return step_cost(self.cost_model, self.model if self.model_shape is None else "", self.shape(),
                         self.accelerator, tp=self.tp, mfu=self.mfu, mbu=self.mbu, overhead_us=self.overhead_us)

    def kv_space(self) -> tuple[int, dict[str, float] | None]:
        if self.kv_blocks:
            return self.kv_blocks, None
        cap = hw.kv_capacity(self.shape(), hw.ACCELERATORS[self.accelerator],
                             max_num_batched_tokens=self.max_num_batched_tokens,
                             memory_utilization=self.memory_utilization, tp=self.tp)
        return int(cap["kv_tokens"] // self.block_tokens), cap

    def client_bound(self) -> int:
        """The most clients the KV space holds at once: a request in the engine holds at least one
        block, and block 0 is vLLM's null block. Past it a client can never be admitted while the
        others run, and each costs memory and time for nothing."""
        return min(max(self.kv_space()[0] - 1, 0), MAX_CLIENTS)

    def check_concurrency(self) -> None:
        """Raise :class:`ConcurrencyError` (a ``ValueError``) when ``concurrency`` exceeds
        :meth:`client_bound`. A point with no KV space at all is left to :func:`simulate`, which
        says so."""
        bound = self.client_bound()
        if bound == MAX_CLIENTS and self.concurrency > bound:
            raise ConcurrencyError(f"{self.concurrency} clients is more than the simulator takes: at most {bound} "
                                   "(tools.sim.run.MAX_CLIENTS)", bound)
        if bound and self.concurrency > bound:
            raise ConcurrencyError(f"{self.concurrency} clients is more than {self.shape().name} on {self.instance} "
                                   f"can hold: at most {bound} (its KV space is {bound + 1} blocks of "
                                   f"{self.block_tokens} tokens, one block a request, one the null block)", bound)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_lifetime_s(cost: hw.StepCost, *, context: int, output_tokens: int, concurrency: int,
                       max_num_batched_tokens: int) -> float:
    """About how long one fixed request lives at ``concurrency``: its prompt's prefill (in
    ``max_num_batched_tokens`` chunks) and ``output_tokens`` decode steps of ``concurrency``
    sequences at half their context. The stagger of the clients' starts (``workload.fixed``)."""
    prompt = context - output_tokens
    t = 0.0
    done = 0
    while done < prompt:
        b = hw.Batch()
        new = min(max_num_batched_tokens, prompt - done)
        b.add(new, done, done + new >= prompt)
        t += cost.step_ns(b)
        done += new
    b = hw.Batch()
    for _ in range(concurrency):
        b.add(1, context // 2, True)
    return (t + output_tokens * cost.step_ns(b)) / 1e9


def build_scripts(workload: dict[str, Any], concurrency: int, point: Point | None = None) -> list[ClientScript]:
    """The clients of ``workload`` at ``concurrency``; a fixed workload with ``stagger: "auto"``
    (the default) spreads its clients' starts over one request's lifetime on ``point``'s cost."""
    from tools.sim import workload as wl

    spec = dict(workload)
    kind = spec.pop("kind", None)
    if kind == "fixed":
        stagger = spec.pop("stagger", "auto")
        if stagger == "auto":
            stagger = 0.0 if point is None else request_lifetime_s(
                point.cost(), context=spec["context"], output_tokens=spec["output_tokens"],
                concurrency=concurrency, max_num_batched_tokens=point.max_num_batched_tokens)
        return wl.fixed(clients=concurrency, stagger_s=float(stagger), **spec)
    if kind == "sessions":
        return wl.sessions(concurrency=concurrency, **spec)
    if kind == "trace":
        from tools.sim import mooncake

        with open(spec["path"]) as f:
            first = next((line for line in f if line.strip()), "")
            f.seek(0)
            if mooncake.is_mooncake(first):  # Mooncake's format, read as it is: one open-loop client a request
                return mooncake.to_scripts(list(mooncake.read(f, spec.get("speed", 1.0))))
            return wl.load_trace(f)
    if kind == "bench":
        return wl.from_bench(WorkloadConfig(**spec["config"]), concurrency, spec["think_s"])
    raise ValueError(f"unknown workload kind {kind!r}: fixed, sessions, trace or bench")


def tier_config(p: Point, shape: hw.ModelShape) -> TierConfig | None:
    # a block is the instance's whole KV of its tokens: under tensor parallelism the tp accelerators'
    # shares together, moved over the one link of the mode's preset (the instance's host or pool link)
    block_bytes = p.block_tokens * shape.kv_bytes_per_token
    mode = modes.MODES[p.mode]
    if mode.tier is None:
        if p.preemption != "swap":
            return None
        return TierConfig(link=hw.link_params(p.host_link, p.time_scale), capacity_blocks=1 << 40,
                          block_bytes=block_bytes, layers=shape.layers, store="preempted", name="swap")
    link, size = (p.host_link, p.host_gb) if mode.tier == "host" else (p.cxl_link, p.pool_gb)
    policy = p.policy or (p.smart_policy if mode.smart else mode.policy)
    prefetch = p.prefetch or mode.prefetch
    blocks = p.tier_blocks or int(size * GB // block_bytes)
    if blocks < 1:
        raise ValueError(f"a tier of {size} GB holds no {block_bytes}-byte block")
    return TierConfig(link=hw.link_params(link, p.time_scale), capacity_blocks=blocks, block_bytes=block_bytes,
                      layers=shape.layers, policy=policy, prefetch=prefetch, prompt_only=p.offload_prompt_only,
                      name=p.mode)


def simulate(p: Point, scripts: list[ClientScript] | None = None) -> dict[str, Any]:
    """Run one point to the end of its workload; its metrics (``summarize``) and its setup."""
    import time

    shape = p.shape()
    kv_blocks, capacity = p.kv_space()
    if kv_blocks < 2:  # one is vLLM's null block
        raise ValueError(f"{shape.name} leaves no KV space on {p.instance} "
                         f"({(capacity or {}).get('kv_bytes', 0) / GB:.1f} GB): split it over more accelerators "
                         "(tensor parallelism, tp)")
    cfg = EngineConfig(block_tokens=p.block_tokens, kv_blocks=kv_blocks, max_num_seqs=p.max_num_seqs,
                       max_num_batched_tokens=p.max_num_batched_tokens,
                       long_prefill_token_threshold=p.long_prefill_token_threshold, jitter=p.jitter, seed=p.seed)
    if scripts is None:
        p.check_concurrency()
        scripts = build_scripts(p.workload, p.concurrency, p)
    tier = tier_config(p, shape)
    attention = p.hot()
    hot = None if attention is None else HotConfig(attention=attention, link=hw.link_params(p.cxl_link, p.time_scale),
                                                   capacity_bytes=int(p.pool_gb * GB), when=p.hot_when,
                                                   predicted=p.hot_predicted)
    t0 = time.perf_counter()
    cost = p.cost()
    engine = SimEngine(scripts, cost, cfg, tier=tier, hot=hot)
    records = engine.run()
    wall = time.perf_counter() - t0
    out = summarize(records)
    out.update(mode=p.mode, label=p.label, attention=p.attention, page_budget=p.page_budget if hot else None,
               kv_format=p.kv_format, hot_when=p.hot_when if hot else None,
               hot_predicted=p.hot_predicted if hot else None, concurrency=p.concurrency,
               model=shape.name, accelerator=p.accelerator, tp=p.tp,
               cost=cost.describe()["kind"],
               max_concurrency=engine.stats.max_running, steps=engine.stats.steps,
               kv_blocks=kv_blocks, kv_tokens=kv_blocks * p.block_tokens,
               sim_s=engine.env.now / 1e9, busy_s=engine.stats.busy_ns / 1e9, wall_s=wall)
    if engine.tier is not None:
        c = engine.tier.counters()
        out.update(tier_blocks=engine.tier.cfg.capacity_blocks, bytes_loaded=c["bytes_loaded"],
                   bytes_stored=c["bytes_stored"], tier_evictions=c["evictions"], stall_s=c["stall_ns"] / 1e9)
    elif engine.hot is not None:
        out.update(tier_blocks=0, bytes_loaded=0, bytes_stored=0, tier_evictions=0, **engine.hot.counters())
    else:
        out.update(tier_blocks=0, bytes_loaded=0, bytes_stored=0, tier_evictions=0, stall_s=0.0)
    return out

