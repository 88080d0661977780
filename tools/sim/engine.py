"""A vLLM-like serving engine as a discrete-event simulation on the firmware model's clock.

One simpy environment (``firmware_model.clock.SimpyClock``; 1 time unit = 1 ns) runs:

* the **engine loop**: schedule a step, advance the clock by the step's cost
  (:mod:`tools.sim.hardware`), apply it; idle until an arrival or a load completes;
* the **clients**: closed loops over their scripts (:mod:`tools.sim.workload`), each turn arriving
  its think time after the previous one finished;
* the **offload tier** (:class:`Tier`): the firmware model's eviction policy over the tier's
  blocks and its DMA scheduler over the one link model; loads before the forward or layer by layer
  (through ``firmware_model.prefetch.PrefetchQueue``, its window from ``window_points``), stores
  of the prompt's blocks as they fill (vLLM's ``offload_prompt_only``);
* or **hot-page attention** (:mod:`tools.sim.hot`, no offload tier): a request that computed its
  prompt keeps its KV on the device and only its working set in the KV space, and each decode
  step reads its chosen pages over the device's link, the next layer's while one computes.

The scheduler is vLLM v1's (``vllm/v1/core/sched/scheduler.py``), step by step:

1. running requests first, in order: each gets its remaining tokens (a decode: 1; a prefill:
   what is left, at most ``long_prefill_token_threshold`` and the token budget); when its blocks
   cannot be allocated, the last running request is preempted (by recompute: its blocks freed,
   kept in the prefix cache until reused; by swap: also written to the host first), and so on
   until it fits or it was preempted itself;
2. then, if nothing was preempted in this step, waiting requests in order while the budget and
   ``max_num_seqs`` allow: a new (or preempted) request first takes its local prefix-cache hits
   (the KV block pool, ``firmware_model.block_pool.BlockPool``: vLLM 0.32's free queue, lazy
   eviction of cached blocks, uncached blocks reused first, one null block), then the tier's hits
   after them (at most ``num_tokens - 1`` tokens
   in all, as vLLM caps them); with tier hits and loads before the forward it allocates and
   waits (``WAITING_FOR_REMOTE_KVS``: skipped, put back in front), its load starting when the
   step's forward ends (vLLM starts asynchronous loads after the forward), otherwise it is
   scheduled with its hits counted computed; a request whose blocks cannot be allocated stops the
   admission.

A request that has computed its whole prompt samples a token at the end of the step (the first
one is its TTFT); it finishes when it has ``output_tokens``. Full blocks are published to the
prefix cache when their step is scheduled (vLLM's ``allocate_slots``) and stored to the tier after
it (``store="computed"``: vLLM's offload connector) or only on preemption (``store="preempted"``:
swap). A step that reuses a block a tier write still reads, or preempts a request with writes in
flight, first waits for those writes (vLLM's offload worker: ``jobs_to_flush``).
"""
from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from firmware_model.block_pool import BlockPool
from firmware_model.clock import SimpyClock
from firmware_model.dma import DmaScheduler
from firmware_model.hotness import HotnessConfig, HotnessUnit
from firmware_model.link import LinkParams
from firmware_model.policies import HotnessPolicy, NoVictimError, make_policy
from firmware_model.prefetch import window_points
from tools.sim.hardware import Batch, StepCost
from tools.sim.hot import HotConfig, HotTier
from tools.sim.layerwise import layerwise
from tools.sim.workload import ClientScript, Turn

__all__ = ["EngineConfig", "Request", "SimEngine", "Tier", "TierConfig"]

WAITING, LOADING, RUNNING, DONE = range(4)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    block_tokens: int = 16
    kv_blocks: int = 1024  # vLLM's num_gpu_blocks: one of them is its null block
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0  # 0: none
    enable_prefix_caching: bool = True
    #: relative noise on each step's cost (a mean-one lognormal of this sigma, seeded): a measured
    #: engine's steps scatter around any cost model, and a closed loop turns that scatter into
    #: different orders of arrival and eviction; 0 = the cost model exactly
    jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for k in ("block_tokens", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.kv_blocks < 2:
            raise ValueError(f"kv_blocks must be >= 2 (one is vLLM's null block), got {self.kv_blocks}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    link: LinkParams
    capacity_blocks: int
    block_bytes: int
    layers: int
    policy: str = "lru"
    prefetch: str = "forward"  # "forward": load, then schedule; "layer": load inside the step, layer by layer
    store: str = "computed"  # "computed": every full block (offload); "preempted": a preempted request's (swap)
    #: store only blocks of the prompt, not those decode fills: vLLM's offload default
    #: (``offload_prompt_only``, vllm/v1/kv_offload/base.py), so a turn's answer is recomputed
    prompt_only: bool = True
    name: str = "tier"

    def __post_init__(self) -> None:
        if self.prefetch not in ("forward", "layer"):
            raise ValueError(f"prefetch must be 'forward' or 'layer', got {self.prefetch!r}")
        if self.store not in ("computed", "preempted"):
            raise ValueError(f"store must be 'computed' or 'preempted', got {self.store!r}")
        if self.capacity_blocks < 1 or self.block_bytes < 1 or self.layers < 1:
            raise ValueError("capacity_blocks, block_bytes and layers must be >= 1")


class Tier:
    """The offload tier: which blocks it holds (a firmware_model policy decides who leaves), and
    its transfers on one link (``DmaScheduler``: reads are loads, writes are stores)."""

    def __init__(self, env: simpy.Environment, cfg: TierConfig) -> None:
        self.env, self.cfg = env, cfg
        self.clock = SimpyClock(env)  # what the policies and the CHMU are told: whole ns
        self.policy = make_policy(cfg.policy, cfg.capacity_blocks)
        self.dma = DmaScheduler(env, cfg.link, channels=64, queue_depth=1 << 30)
        self.storing: set[Any] = set()
        self.loading: dict[Any, int] = {}
        self.blocks_loaded = self.blocks_stored = self.evictions = self.dropped_stores = 0
        self.stall_ns = 0.0
        self.prefetch_late = 0
        self._layer_steps = 0
        self.chmu: _Chmu | None = None
        if isinstance(self.policy, HotnessPolicy):  # the smart firmware's heat: the device's own CHMU
            self.chmu = _Chmu(self.clock, self.policy, cfg.capacity_blocks, cfg.block_bytes)

    def __contains__(self, key: Any) -> bool:
        return key in self.policy

    def hits(self, keys: Iterable[Any]) -> int:
        """Consecutive keys from the first that the tier holds (stored, not in flight); reads
        ``keys`` only up to the first miss."""
        n = 0
        for k in keys:
            if k not in self.policy:
                break
            n += 1
        return n

    def _pin(self, keys: Sequence[Any]) -> None:
        now = self.clock.now_ns()
        for k in keys:
            self.loading[k] = self.loading.get(k, 0) + 1
            self.policy.touch(k, now)
        self.blocks_loaded += len(keys)
        if self.chmu is not None:
            self.chmu.access(keys, write=False)

    def _unpin(self, keys: Sequence[Any]) -> None:
        for k in keys:
            left = self.loading[k] - 1
            if left:
                self.loading[k] = left
            else:
                del self.loading[k]

    def load(self, keys: Sequence[Any]) -> simpy.Event:
        """Load ``keys`` before the forward: one transfer; the event fires when it landed."""
        return self.start_load(self.pin_load(keys))

    def pin_load(self, keys: Sequence[Any]) -> tuple[Any, ...]:
        """Reserve ``keys`` for a load started later (``start_load``): counted as loaded, kept
        from eviction, touched for the policy, as vLLM's manager does when the load is prepared."""
        pinned = tuple(keys)
        self._pin(pinned)
        return pinned

    def start_load(self, pinned: tuple[Any, ...]) -> simpy.Event:
        """Submit the transfer of keys ``pin_load`` reserved; the event fires when it landed."""
        req = self.dma.submit("read", len(pinned) * self.cfg.block_bytes, tag=pinned)

        def landed(_event: simpy.Event) -> None:
            self._unpin(pinned)
        req.done.callbacks.append(landed)
        return req.done

    def load_layerwise(self, keys: Sequence[Any], compute_ns: float) -> Generator[simpy.Event, Any, None]:
        """Load ``keys`` inside a forward of ``compute_ns`` (a simpy process), one transfer a
        layer (as the tier's worker issues one descriptor array a layer) through
        :func:`layerwise`, its window from ``window_points``: the link time of a layer's share
        over its compute."""
        env = self.env
        layers = self.cfg.layers
        per_layer = max(1, len(keys) * self.cfg.block_bytes // layers)
        w = window_points(self.cfg.link, per_layer, compute_ns / layers, max_window=layers)
        self._pin(keys)
        self._layer_steps += 1
        start = env.now
        try:
            late = (yield from layerwise(env, self.dma, self._layer_steps, per_layer, compute_ns, layers, w)).late
        finally:
            self._unpin(keys)
        self.stall_ns += env.now - start - compute_ns
        self.prefetch_late += late

    def store(self, keys: Sequence[Any]) -> tuple[simpy.Event | None, tuple[Any, ...]]:
        """Write the blocks of ``keys`` the tier lacks; each becomes a hit when the write lands.
        Returns the write's completion and the keys it carries (None, () when nothing to write)."""
        todo = tuple(k for k in keys if k not in self.policy and k not in self.storing)
        if not todo:
            return None, ()
        self.storing.update(todo)
        req = self.dma.submit("write", len(todo) * self.cfg.block_bytes, tag=todo)
        req.done.callbacks.append(lambda _e: self._stored(todo))
        return req.done, todo

    def _stored(self, keys: tuple[Any, ...]) -> None:
        now = self.clock.now_ns()
        pol = self.policy
        for k in keys:
            self.storing.discard(k)
            if k in pol:
                continue
            if len(pol) >= self.cfg.capacity_blocks:
                try:
                    victim = pol.evict(self.loading)
                except NoVictimError:
                    self.dropped_stores += 1
                    continue
                self.evictions += 1
                if self.chmu is not None:
                    self.chmu.release(victim)
            pol.insert(k, now)
            self.blocks_stored += 1
        if self.chmu is not None:
            self.chmu.access(keys, write=True)

    def counters(self) -> dict[str, Any]:
        return {"blocks_loaded": self.blocks_loaded, "blocks_stored": self.blocks_stored,
                "bytes_loaded": self.blocks_loaded * self.cfg.block_bytes,
                "bytes_stored": self.blocks_stored * self.cfg.block_bytes, "evictions": self.evictions,
                "prefetch_late": self.prefetch_late,
                "dropped_stores": self.dropped_stores, "stall_ns": self.stall_ns, "resident": len(self.policy)}


class _Chmu:
    """The tier's hotness monitoring unit (``firmware_model.hotness.HotnessUnit``, CXL 3.2 CHMU
    semantics): each block the tier holds has a slot of DPA space; loads and stores are counted
    there; at each epoch's end (100 ms) the hotlist is read, its units mapped back to blocks, and
    their counts added to the hotness policy's heat (as the vLLM tier feeds a served device's)."""

    def __init__(self, clock: SimpyClock, policy: HotnessPolicy, slots: int, block_bytes: int) -> None:
        self.policy = policy
        self.unit = 1 << max(8, (block_bytes - 1).bit_length())  # a power of two >= 256 B holding a block
        self.unit_shift = self.unit.bit_length() - 1
        self.hw = HotnessUnit(slots * self.unit, HotnessConfig(unit_size=self.unit, threshold=1, epoch_ns=100_000_000,
                                                               hotlist_size=4096), clock=clock)
        self.slot_of: dict[Any, int] = {}
        self.key_at: dict[int, Any] = {}
        self.free: list[int] = []
        self.next_slot = 0
        self.fed = 0

    def _slot(self, key: Any) -> int:
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self.free.pop() if self.free else self.next_slot
            self.next_slot += slot == self.next_slot
            self.slot_of[key], self.key_at[slot] = slot, key
        return slot

    def release(self, key: Any) -> None:
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            del self.key_at[slot]
            self.free.append(slot)

    def access(self, keys: Sequence[Any], *, write: bool) -> None:
        dpas = np.array([self._slot(k) << self.unit_shift for k in keys if k in self.policy], dtype=np.uint64)
        self.hw.record(dpas, is_write=write)  # at the clock's time
        entries = self.hw.hotlist.consume()
        if entries:
            hot = [(self.key_at[u], c) for u, c in entries if u in self.key_at]
            self.policy.feed_hotlist(hot)
            self.fed += len(hot)


class Request:
    __slots__ = (
        "arrival",
        "blocks",
        "cached",
        "client",
        "computed",
        "finish",
        "first_token",
        "generated",
        "hot",
        "keys",
        "kind",
        "load_event",
        "local_hit_tokens",
        "num_tokens",
        "preemptions",
        "spec",
        "state",
        "stored",
        "tier_hit_tokens",
        "turn",
    )

    def __init__(self, client: int, kind: str, turn: int, spec: Turn, arrival: float) -> None:
        self.client, self.kind, self.turn, self.spec, self.arrival = client, kind, turn, spec, arrival
        self.num_tokens = spec.prompt_tokens
        self.generated = self.computed = self.cached = self.stored = 0
        self.blocks: list[Any] = []
        self.keys: list[Any] = []
        self.first_token: float | None = None
        self.finish: float | None = None
        self.local_hit_tokens = self.tier_hit_tokens = self.preemptions = 0
        self.state = WAITING
        self.load_event: simpy.Event | None = None
        self.hot = False  # hot-page attention: its KV is on the device, HBM holds its working set

    def key(self, i: int, block_tokens: int) -> Any:
        keys = self.keys
        while len(keys) <= i:
            j = len(keys)
            keys.append((self.spec.owner_at((j + 1) * block_tokens - 1), j))
        return keys[i]


@dataclass
class _Stats:
    steps: int = 0
    busy_ns: float = 0.0
    max_running: int = 0
    preemptions: int = 0
    fence_ns: float = 0.0  # steps held until tier writes of reallocated blocks landed
    records: list[Request] = field(default_factory=list)
    log: list[tuple[float, float, list[tuple[Request, int, int]]]] | None = None  # (t0 ns, dt ns, batch)


class SimEngine:
    """The engine, its clients and its tier on one simpy clock. ``run()`` serves every script to
    its end and returns the finished requests (in completion order)."""

    def __init__(self, scripts: Sequence[ClientScript], cost: StepCost, cfg: EngineConfig, *,
                 tier: TierConfig | None = None, clock: SimpyClock | None = None, log_steps: bool = False,
                 hot: HotConfig | None = None) -> None:
        """``log_steps``: keep every step as (start ns, length ns, [(request, new tokens, computed
        before)]), the shape ``cxlemu bench serve`` records vLLM's steps in. ``hot``: hot-page
        attention (:mod:`tools.sim.hot`): a request that has computed its prompt keeps its KV on
        the device and only its working set in the KV space."""
        self.clock = clock or SimpyClock()
        self.env = self.clock.env
        self.cost, self.cfg, self.scripts = cost, cfg, list(scripts)
        self.pool = BlockPool(cfg.kv_blocks, uncached_first=True)  # vLLM 0.32's free queue (uncached blocks first)
        self.pool.get_new_blocks(1)  # vLLM's null block: taken at start, never used for KV
        #: block id -> the tier write still reading it; a step that reallocates the block (or
        #: preempts its request) first waits for that write, as vLLM's offload worker does
        #: (``jobs_to_flush``: ``worker.wait`` before the forward)
        self._storing_blocks: dict[int, simpy.Event] = {}
        self._fence: list[simpy.Event] = []
        self._loads: list[tuple[Request, tuple[Any, ...]]] = []  # admitted, started when the step ends
        self.tier = Tier(self.env, tier) if tier is not None else None
        if hot is not None and tier is not None:
            raise ValueError("hot-page attention keeps the KV on the device itself: run it without an offload tier")
        self.hot = HotTier(self.env, hot) if hot is not None else None
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.stats = _Stats(log=[] if log_steps else None)
        self._wake: simpy.Event | None = None
        self._open = len(self.scripts)
        max_tokens = max((t.prompt_tokens + t.output_tokens for s in self.scripts for t in s.turns), default=0)
        need = self._blocks_for(max_tokens)
        if need > cfg.kv_blocks - 1:
            raise ValueError(f"a request of {max_tokens} tokens needs {need} KV blocks; the KV space holds "
                             f"{cfg.kv_blocks - 1} (and vLLM's null block): give a larger KV space or shorter "
                             "requests")
        if hot is not None:  # the device holds every client's whole KV at once: no eviction of running KV
            a = hot.attention
            total = len(self.scripts) * a.write_bytes(a.pages(max_tokens))
            if total > hot.capacity_bytes:
                raise ValueError(f"hot-page attention keeps every request's KV on the device: {len(self.scripts)} "
                                 f"requests of {max_tokens} tokens take {total / 1e9:.1f} GB in {a.kv_format}, the "
                                 f"pool holds {hot.capacity_bytes / 1e9:.1f} GB: give a larger pool")

    # --- clients -------------------------------------------------------------------------------
    def _arrive_later(self, client: int, turn: int) -> None:
        script = self.scripts[client]
        spec = script.turns[turn]
        ev = self.env.timeout(spec.think_s * 1e9)
        ev.callbacks.append(lambda _e: self._arrive(client, turn))

    def _arrive(self, client: int, turn: int) -> None:
        script = self.scripts[client]
        self.waiting.append(Request(client, script.kind, turn, script.turns[turn], self.env.now))
        self._kick()

    def _kick(self, _e: object = None) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _finished(self, req: Request) -> None:
        req.state, req.finish = DONE, self.env.now
        self.stats.records.append(req)
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks = []
        script = self.scripts[req.client]
        if req.turn + 1 < len(script.turns):
            self._arrive_later(req.client, req.turn + 1)
        else:
            self._open -= 1

    # --- blocks --------------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_tokens)

    def _decoding_hot(self, req: Request) -> bool:
        """Whether ``req`` attends hot: every decoding request (``when="always"``), or one the full
        KV space sent there (``when="full"``, :meth:`_demote_one`)."""
        if self.hot is None:
            return False
        return req.computed >= req.spec.prompt_tokens if self.hot.cfg.when == "always" else req.hot

    def _demotable(self) -> list[tuple[Request, int]]:
        """``when="full"``: the running requests decoding densely whose working set is smaller than
        their blocks, last first, each with the blocks it would keep."""
        if self.hot is None or self.hot.cfg.when != "full":
            return []
        out = []
        for req in reversed(self.running):
            if not req.hot and req.computed >= req.spec.prompt_tokens:
                keep = self.hot.attention.decode(req.computed + 1)[0]
                if keep < len(req.blocks):
                    out.append((req, keep))
        return out

    def _demote_one(self, need: int = 0) -> bool:
        """``when="full"``: the KV space cannot give a request the blocks it needs, so the last
        running request decoding densely goes hot (its complete pages are on the device already,
        written as they filled) and frees the rest, instead of a preemption or a wait. False
        when none can, or when all of them together could not free ``need`` blocks."""
        cand = self._demotable()
        if not cand or self.pool.get_num_free_blocks() + sum(len(r.blocks) - k for r, k in cand) < need:
            return False
        req, keep = cand[0]
        self.pool.free_blocks(reversed(req.blocks[keep:]))
        del req.blocks[keep:]
        req.hot = True
        self.hot.demoted += 1  # type: ignore[union-attr]
        return True

    def _grow(self, req: Request, tokens: int) -> bool:
        """Give ``req`` the blocks for ``tokens`` tokens; False (nothing taken) when too few free.
        Under hot-page attention a decoding request holds its working set: fewer blocks than
        its prefill did (the rest are freed: their KV is on the device)."""
        if self._decoding_hot(req):
            need = self.hot.attention.decode(tokens)[0] - len(req.blocks)  # type: ignore[union-attr]
            if need < 0:
                self.pool.free_blocks(reversed(req.blocks[need:]))
                del req.blocks[need:]
                req.hot = True
        else:
            need = self._blocks_for(tokens) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.pool.get_num_free_blocks():
            return False
        req.blocks += self._take(need)
        return True

    def _take(self, n: int) -> list[Any]:
        """``n`` blocks from the free queue; a block a tier write still reads fences this step."""
        blocks = self.pool.get_new_blocks(n)
        if self._storing_blocks:
            for b in blocks:
                self._fence_on(b.block_id, reused=True)
        return blocks

    def _fence_on(self, block_id: int, *, reused: bool) -> None:
        """This step waits for the tier write still reading ``block_id`` (if any); a reused
        block's write is forgotten here, its landing no longer concerns the block."""
        ev = self._storing_blocks.pop(block_id, None) if reused else self._storing_blocks.get(block_id)
        if ev is not None and not ev.triggered:
            self._fence.append(ev)

    def _track_store(self, req: Request, first: int, written: tuple[Any, ...], done: simpy.Event | None) -> None:
        """Remember which of ``req``'s blocks (from ``first``) the write ``done`` reads."""
        if done is None:
            return
        bt = self.cfg.block_tokens
        wanted = set(written)
        self._track_ids([req.blocks[i].block_id for i in range(first, len(req.blocks)) if req.key(i, bt) in wanted],
                        done)

    def _track_ids(self, ids: list[int], done: simpy.Event) -> None:
        """Blocks ``ids`` are read by the write ``done``: a step that reuses one first waits for it."""
        for bid in ids:
            self._storing_blocks[bid] = done

        def landed(_e: simpy.Event, ids: list[int] = ids) -> None:
            for bid in ids:
                if self._storing_blocks.get(bid) is done:
                    del self._storing_blocks[bid]
        done.callbacks.append(landed)

    def _local_hits(self, req: Request, cap: int) -> list[Any]:
        if not self.cfg.enable_prefix_caching:
            return []
        out = []
        for i in range(cap):
            blk = self.pool.get_cached_block(req.key(i, self.cfg.block_tokens))
            if blk is None:
                break
            out.append(blk)
        return out

    def _cache(self, req: Request, tokens: int) -> None:
        """Publish the blocks that are full once ``req`` has ``tokens`` computed, when its step is
        scheduled (vLLM's ``allocate_slots`` caches them then: a request scheduled later in the same
        step already hits them, the forward writing each layer's KV before its attention)."""
        if not self.cfg.enable_prefix_caching or req.hot:  # a working set's blocks are no token positions
            return
        bt = self.cfg.block_tokens
        full = min(tokens // bt, len(req.blocks))
        for i in range(req.cached, full):
            self.pool.cache_full_block(req.blocks[i], req.key(i, bt))
        req.cached = max(req.cached, full)

    def _store(self, req: Request) -> None:
        """After a step: the blocks ``req`` has filled go to the tier (vLLM's offload connector
        stores computed blocks; the tier skips those it holds or is writing)."""
        if self.hot is not None:
            self._store_hot(req)
            return
        tier = self.tier
        if tier is None or tier.cfg.store != "computed":
            return
        bt = self.cfg.block_tokens
        computed = min(req.computed, req.spec.prompt_tokens) if tier.cfg.prompt_only else req.computed
        full = min(computed // bt, len(req.blocks))
        if full > req.stored:
            landed, written = tier.store([req.key(i, bt) for i in range(req.stored, full)])
            self._track_store(req, req.stored, written, landed)
            req.stored = full

    def _store_hot(self, req: Request) -> None:
        """Hot-page attention: the pages ``req`` completed go to the device (in its format). A
        prefill's blocks are freed when it starts decoding: until its write landed, a step that
        reuses one waits for it."""
        full = req.computed // self.cfg.block_tokens
        if full > req.stored:
            done = self.hot.write(full - req.stored)  # type: ignore[union-attr]
            self._track_ids([req.blocks[i].block_id for i in range(req.stored, min(full, len(req.blocks)))], done)
            req.stored = full

    def _preempt(self, req: Request) -> None:
        if self.tier is not None and self.tier.cfg.store == "preempted":
            bt = self.cfg.block_tokens
            done, written = self.tier.store([req.key(i, bt) for i in range(min(req.computed // bt, len(req.blocks)))])
            self._track_store(req, 0, written, done)
        for b in req.blocks:  # vLLM flushes a preempted request's pending writes before the step
            self._fence_on(b.block_id, reused=False)
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks, req.computed, req.cached, req.stored, req.hot = [], 0, 0, 0, False
        req.state = WAITING
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    # --- one step ------------------------------------------------------------------------------
    def _admit(self, req: Request, budget: int) -> tuple[str, int, list[Any]]:
        """A new or preempted request's hits, then its blocks, all or nothing: ("full", 0, [])
        when the KV space cannot take it (nothing taken); ("wait", 0, []) when its tier hits load
        before the forward (blocks taken, load started); ("ok", new tokens, keys to load inside
        the step)."""
        bt = self.cfg.block_tokens
        cap = (req.num_tokens - 1) // bt
        local = self._local_hits(req, cap)
        tier = self.tier
        ext = tier.hits(req.key(i, bt) for i in range(len(local), cap)) if tier is not None else 0
        hits = len(local) + ext
        forward = ext > 0 and tier is not None and tier.cfg.prefetch == "forward"
        new = 0 if forward else self._chunk(req.num_tokens - hits * bt, budget)
        evictable = sum(1 for b in local if b.ref_cnt == 0)
        if evictable + self._blocks_for(hits * bt + new) - len(local) > self.pool.get_num_free_blocks():
            return "full", 0, []
        self.pool.touch(local)
        req.blocks = local + self._take(self._blocks_for(hits * bt + new) - len(local))
        req.cached = len(local)
        req.computed = hits * bt
        req.local_hit_tokens += len(local) * bt
        req.tier_hit_tokens += ext * bt
        keys = [req.key(i, bt) for i in range(len(local), hits)]
        if forward:  # the transfer starts when this step's forward ends (_start_loads)
            self._loads.append((req, tier.pin_load(keys)))  # type: ignore[union-attr]
            req.load_event = None
            req.state = LOADING
            return "wait", 0, []
        return "ok", new, keys

    def _start_loads(self) -> None:
        """Submit the loads admitted in this step, now that its forward ended: vLLM starts an
        asynchronous load after the forward (``start_load_kv`` after the forward launch, which on
        a CPU returns when the forward is done), and an empty step at once."""
        loads, self._loads = self._loads, []
        for req, pinned in loads:
            req.load_event = self.tier.start_load(pinned)  # type: ignore[union-attr]
            req.load_event.callbacks.append(self._kick)

    def _chunk(self, remaining: int, budget: int) -> int:
        thr = self.cfg.long_prefill_token_threshold
        return min(remaining, thr, budget) if thr else min(remaining, budget)

    def _schedule(self) -> tuple[list[tuple[Request, int]], list[Any]]:
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        out: list[tuple[Request, int]] = []
        layer_keys: list[Any] = []
        preempted = False
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            req = running[i]
            new = self._chunk(req.num_tokens - req.computed, budget)
            while not self._grow(req, req.computed + new):
                if self._demote_one():
                    continue
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append((req, new))
                self._cache(req, req.computed + new)
                budget -= new
                i += 1
                continue
            break
        if not preempted:
            skipped: list[Request] = []
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                req = waiting[0]
                if req.state == LOADING and (req.load_event is None or not req.load_event.triggered):
                    skipped.append(waiting.popleft())
                    continue
                if req.state == WAITING and not req.blocks:
                    got, new, keys = self._admit(req, budget)
                    while got == "full" and self._demote_one(self._blocks_for(req.num_tokens)):
                        got, new, keys = self._admit(req, budget)
                    if got == "full":
                        break
                    if got == "wait":
                        skipped.append(waiting.popleft())
                        continue
                    layer_keys += keys
                else:  # its load landed (or it holds blocks from an earlier try)
                    new = self._chunk(req.num_tokens - req.computed, budget)
                    if not self._grow(req, req.computed + new):
                        break
                waiting.popleft()
                req.state = RUNNING
                running.append(req)
                out.append((req, new))
                self._cache(req, req.computed + new)
                budget -= new
            waiting.extendleft(reversed(skipped))
        self.stats.max_running = max(self.stats.max_running, len(running))
        return out, layer_keys

    def _apply(self, batch: list[tuple[Request, int]]) -> None:
        now = self.env.now
        done = []
        for req, new in batch:
            req.computed += new
            if req.computed >= req.num_tokens:
                req.generated += 1
                req.num_tokens += 1
                if req.first_token is None:
                    req.first_token = now
                if req.generated >= req.spec.output_tokens:
                    done.append(req)
            self._store(req)
        if done:
            gone = set(map(id, done))
            self.running = [r for r in self.running if id(r) not in gone]
            for req in done:
                self._finished(req)

    def _loop(self) -> Any:
        env = self.env
        stats = self.stats
        jitter = self.cfg.jitter
        rng = random.Random(f"steps:{self.cfg.seed}")
        while True:
            batch, layer_keys = self._schedule()
            if not batch:
                self._start_loads()
                if self._open == 0 and not self.waiting and not self.running:
                    return
                self._wake = env.event()
                yield self._wake
                continue
            b = Batch()
            hot_read = 0
            for req, new in batch:
                if self._decoding_hot(req):  # the working set and the chosen pages, not the whole KV
                    _, attended, read = self.hot.attention.decode(req.computed + new)  # type: ignore[union-attr]
                    b.add(new, attended - new, req.computed + new >= req.num_tokens)
                    hot_read += read
                else:
                    b.add(new, req.computed, req.computed + new >= req.num_tokens)
            t = self.cost.step_ns(b)
            if jitter:
                t *= math.exp(rng.gauss(-jitter * jitter / 2, jitter))
            start = env.now
            if self._fence:
                fence, self._fence = self._fence, []
                yield simpy.AllOf(env, fence)
                stats.fence_ns += env.now - start
            if layer_keys:
                yield from self.tier.load_layerwise(layer_keys, t)  # type: ignore[union-attr]
            elif hot_read:
                yield from self.hot.step(hot_read, t)  # type: ignore[union-attr]
            else:
                yield env.timeout(t)
            self._start_loads()
            t = env.now - start
            if stats.log is not None:  # nothing moves a scheduled request's count until _apply
                stats.log.append((start, t, [(req, new, req.computed) for req, new in batch]))
            stats.steps += 1
            stats.busy_ns += t
            self._apply(batch)

    def run(self, until_ns: float | None = None) -> list[Request]:
        for i, script in enumerate(self.scripts):
            if script.turns:
                self._arrive_later(i, 0)
            else:
                self._open -= 1
        proc = self.env.process(self._loop())
        self.clock.run(until=proc if until_ns is None else until_ns)
        return self.stats.records
