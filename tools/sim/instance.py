"""One serving instance of a fleet: vLLM v1's scheduler, event-driven at step granularity.

What it models, step by step as ``tools.sim.engine.SimEngine`` does (vLLM's
``v1/core/sched/scheduler.py``): running requests first (a decode 1 token, a prefill what is left
within the token budget; a request whose blocks cannot grow preempts the last running one, by
recompute), then waiting requests in order while the budget and ``max_num_seqs`` allow, each
taking its HBM prefix-cache hits, then its KV home's hits after them (at most ``num_tokens - 1``
tokens in all); home hits load before the forward (``WAITING_FOR_REMOTE_KVS``: the request is
skipped until its transfer, started when the step ends, has landed); a request that cannot get
its blocks stops the admission. Prompt blocks are published to the prefix cache when their step
is scheduled and written to the home when it ends (vLLM's offload stores prompt blocks only).

What it does not do step by step: a run of steps that only decode, with nothing admitted or
preempted, is one *window* of ``k`` steps (to the first request's last token, a load landing or
the KV space running out); an arrival inside a window cuts it at the first step boundary after
it, where the next scheduling pass takes it, exactly as the step-by-step loop would. A window's
time is the sum of its steps' costs, each step's batch known in closed form (n sequences whose
context grows by one a step), summed over linear stretches of the cost (exact for the roofline
and linear costs, which are piecewise linear in the context).

The HBM KV space and its prefix cache of 512-token trace blocks are :mod:`tools.sim.kvspace`'s.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tools.sim.hardware import Batch, StepCost
from tools.sim.kvhome import KvHome, Store
from tools.sim.kvspace import DONE, LOADING, RUNNING, WAITING, FleetRequest, KvSpace, blocks_for, trace_block_end
from tools.sim.mooncake import TraceRequest, capped_hit_tokens
from tools.sim.window import DecodeWindow

__all__ = ["FleetRequest", "Instance"]

class Instance:
    """An instance's scheduler, KV space and prefix cache. The fleet calls :meth:`step` when the
    instance is free (it returns the step's end, or None when it idles), :meth:`end_step` at that
    end, and :meth:`cut` when a request arrives inside a window."""

    def __init__(self, index: int, cost: StepCost, *, kv_blocks: int, home: KvHome, block_tokens: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 on_store: Callable[[Store, list[int], float], None] | None = None, windows: bool = True) -> None:
        """``windows=False`` runs every decode step on its own (what the windows must equal)."""
        self.index, self.cost, self.home = index, cost, home
        self.bt, self.max_num_seqs, self.budget = block_tokens, max_num_seqs, max_num_batched_tokens
        self.total = kv_blocks - 1  # vLLM's null block
        self.store = home.store_of(index)
        self.on_store = on_store
        self.windows = windows
        self.kv = KvSpace(self.total, block_tokens)
        self.running: list[FleetRequest] = []
        self.waiting: deque[FleetRequest] = deque()
        self.queued = 0  # prefill tokens its requests still have to compute (the routers' queued work)
        self.loads: list[FleetRequest] = []  # admitted in this step, their transfers start when it ends
        self.loading: set[FleetRequest] = set()  # waiting for a transfer to land
        self.busy = False
        self.window: tuple[float, list[tuple[FleetRequest, int]], int, DecodeWindow | None] | None = None
        self.version = 0
        self.steps = self.preemptions = self.max_running = 0
        self.busy_ns = 0.0
        self.records: list[FleetRequest] = []
        self._per_token: float | None = None

    # --- what routers see ------------------------------------------------------------------
    def requests_in(self) -> int:
        return len(self.running) + len(self.waiting)

    def queued_prefill_tokens(self) -> int:
        return self.queued

    def cached_blocks(self, r: TraceRequest) -> tuple[int, int]:
        """Trace blocks of ``r`` its HBM cache holds, then how many more its home holds."""
        n = self.kv.prefix(r.hash_ids)
        return n, (self.store.prefix(r.hash_ids, n) if self.store is not None else 0)

    def cached_tokens(self, r: TraceRequest) -> int:
        hbm, home = self.cached_blocks(r)
        return capped_hit_tokens(r, hbm + home, self.bt)

    def committed_blocks(self) -> int:
        """Blocks its requests will hold at their last token (memory-aware admission)."""
        return sum(blocks_for(q.tr.input_length + q.tr.output_length, self.bt) for q in (*self.running, *self.waiting))

    def _left(self, req: FleetRequest, value: int) -> None:
        self.queued += value - req.est_left
        req.est_left = value

    def enqueue(self, req: FleetRequest, est_uncached: int) -> None:
        req.inst = self.index
        self._left(req, est_uncached)
        self.waiting.append(req)

    # --- admission -------------------------------------------------------------------------
    def _admit(self, req: FleetRequest, budget: int, now: float) -> tuple[str, int]:
        """A new or preempted request's hits, then its blocks, all or nothing: ("full", 0) when
        the KV space cannot take it; ("wait", 0) when home hits load first; ("ok", new tokens)."""
        r, bt = req.tr, self.bt
        hbm, home = self.cached_blocks(r)
        hbm_tok = capped_hit_tokens(r, hbm, bt)
        all_tok = capped_hit_tokens(r, hbm + home, bt)
        ext = all_tok - hbm_tok
        new = 0 if ext else min(req.num_tokens - all_tok, budget)
        held = r.hash_ids[:hbm]
        held_blocks = sum(self.kv.entries[h][0] for h in held)
        unfreed = sum(self.kv.entries[h][0] for h in held if self.kv.entries[h][1] == 0)
        # a request whose hits load first takes the blocks of its whole prompt now (vLLM takes the
        # hits' only): loaded requests holding just their hits can fill the KV space and never grow
        need = max(0, blocks_for(req.num_tokens if ext else all_tok + new, bt) - held_blocks)
        if need + unfreed > self.kv.available:
            return "full", 0
        for h in held:
            self.kv.hold(req, h)
        self.kv.alloc(need)
        req.own = need
        req.computed = all_tok
        if req.preemptions == 0:  # hits count once, at the first admission
            req.hbm_hit, req.home_hit = hbm_tok, ext
            req.prefill_ns = self.prefill_ns(all_tok, r.input_length)
        self._left(req, max(0, req.num_tokens - all_tok - 1))
        if ext:
            req.load_keys, req.load_tokens = r.hash_ids[hbm:hbm + home], ext
            self.store.pin(req.load_keys, int(now))  # type: ignore[union-attr]
            req.state, req.load_done = LOADING, float("inf")
            self.loads.append(req)
            self.loading.add(req)
            return "wait", 0
        return "ok", new

    def prefill_ns(self, done: int, prompt: int) -> float:
        """The prefill's compute alone (Mooncake's "prefill GPU time"): its uncached tokens in
        budget-sized chunks, each a step of its own."""
        t = 0.0
        while done < prompt:
            b = Batch()
            new = min(self.budget, prompt - done)
            b.add(new, done, done + new >= prompt)
            t += self.cost.step_ns(b)
            done += new
        return t

    def ns_per_prefill_token(self) -> float:
        """A full-budget prefill chunk's time per token (what the queue's prefill is predicted at)."""
        if self._per_token is None:
            self._per_token = self.prefill_ns(0, self.budget) / self.budget
        return self._per_token

    def _preempt(self, req: FleetRequest) -> None:
        self.kv.release(req)
        req.computed = 0
        req.state = WAITING
        req.preemptions += 1
        self.preemptions += 1
        self._left(req, req.num_tokens - 1)
        self.waiting.appendleft(req)

    def _run_first(self, batch: list[tuple[FleetRequest, int]], budget: int) -> tuple[int, bool]:
        """Running requests in order; preemption of the last when one cannot grow."""
        running = self.running
        i = 0
        preempted = False
        while i < len(running) and budget > 0:
            req = running[i]
            new = min(req.num_tokens - req.computed, budget)
            while not self.kv.grow(req, req.computed + new):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.append((req, new))
                self.kv.publish(req, req.computed + new)
                budget -= new
                i += 1
                continue
            break
        return budget, preempted

    def _schedule(self, now: float) -> tuple[list[tuple[FleetRequest, int]], bool]:
        """One scheduling pass: the batch, and whether it admitted or preempted anything."""
        batch: list[tuple[FleetRequest, int]] = []
        budget, changed = self._run_first(batch, self.budget)
        if changed:
            return batch, True
        skipped: list[FleetRequest] = []
        waiting, running = self.waiting, self.running
        full = False
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting[0]
            if req.state == LOADING:
                if req.load_done > now:
                    skipped.append(waiting.popleft())
                    continue
                new = self._landed(req, budget)
            else:
                got, new = self._admit(req, budget, now)
                if got == "full":
                    full = True
                    break
                if got == "wait":  # its load starts when this step ends: a window could not know when it lands
                    changed = True
                    skipped.append(waiting.popleft())
                    continue
            waiting.popleft()
            budget = self._run(req, new, batch, budget)
            changed = True
        if full:  # landed loads hold their blocks already: they run past a head that does not fit
            for req in sorted((q for q in self.loading if q.load_done <= now), key=lambda q: q.tr.index):
                if budget <= 0 or len(running) >= self.max_num_seqs:
                    break
                waiting.remove(req)
                budget = self._run(req, self._landed(req, budget), batch, budget)
                changed = True
        waiting.extendleft(reversed(skipped))
        self.max_running = max(self.max_running, len(running))
        return batch, changed

    def _landed(self, req: FleetRequest, budget: int) -> int:
        """A request whose load landed: its tokens this step (its blocks were taken at admission)."""
        new = min(req.num_tokens - req.computed, budget)
        if not self.kv.grow(req, req.computed + new):
            raise AssertionError("a landed load holds its prompt's blocks")
        self.store.unpin(req.load_keys)  # type: ignore[union-attr]
        req.load_keys = ()
        self.loading.discard(req)
        return new

    def _run(self, req: FleetRequest, new: int, batch: list[tuple[FleetRequest, int]], budget: int) -> int:
        req.state = RUNNING
        self.running.append(req)
        batch.append((req, new))
        self.kv.publish(req, req.computed + new)
        return budget - new

    # --- steps and windows -----------------------------------------------------------------
    def _window_steps(self, batch: list[tuple[FleetRequest, int]], s0: int, now: float) -> tuple[int, DecodeWindow]:
        """How many decode steps run as they are: to the first request's last token, while the
        KV space holds their growth, and to the first boundary after a load lands."""
        k = min(req.tr.output_length - req.generated for req, _ in batch)
        bt = self.bt

        def need(steps: int) -> int:
            return sum(max(0, blocks_for(req.computed + steps, bt) - req.pinned_blocks - req.own) for req, _ in batch)
        if k > 1 and need(k) > self.kv.available:
            lo, hi = 1, k  # the most steps whose blocks fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(mid) <= self.kv.available else (lo, mid - 1)
            k = lo
        dw = DecodeWindow(self.cost, len(batch), s0, k)
        land = min((q.load_done for q in self.loading), default=float("inf"))
        if k > 1 and land < float("inf"):
            k = dw.first_end_after(land - now)
        return k, dw

    def step(self, now: float) -> float | None:
        """Schedule at ``now`` (the instance is free): the step's (or window's) end, or None when
        nothing can run (loads admitted now start at once)."""
        batch, changed = self._schedule(now)
        while not batch and changed:  # all it ran was preempted (or only loads admitted): vLLM's next step retries
            self._start_loads(now)
            batch, changed = self._schedule(now)
        if not batch:
            self._start_loads(now)
            self.busy, self.window = False, None
            return None
        n = len(batch)
        if all(new == 1 and req.computed + 1 >= req.num_tokens for req, new in batch):
            s0 = sum(req.computed + 1 for req, _ in batch)
            if changed or not self.windows:
                k, dw = 1, DecodeWindow(self.cost, n, s0, 1)
            else:
                k, dw = self._window_steps(batch, s0, now)
            for req, _ in batch:
                self.kv.grow(req, req.computed + k)
            self.window = (now, batch, k, dw)
            end = now + dw.total(k)
        else:
            b = Batch()
            for req, new in batch:
                b.add(new, req.computed, req.computed + new >= req.num_tokens)
            self.window = (now, batch, 1, None)
            end = now + self.cost.step_ns(b)
        self.busy = True
        self.version += 1
        return end

    def cut(self, now: float) -> float | None:
        """A request arrived at ``now`` inside a window: end it at the first boundary after, the
        new end (None when the window ends then anyway)."""
        if self.window is None or self.window[2] <= 1:
            return None
        t0, batch, k, dw = self.window
        j = dw.first_end_after(now - t0)  # type: ignore[union-attr]
        if j >= k:
            return None
        self.window = (t0, batch, j, dw)
        self.version += 1
        return t0 + dw.total(j)  # type: ignore[union-attr]

    def end_step(self, end: float) -> list[FleetRequest]:
        """Apply the step (or window) ending at ``end``; the requests it finished."""
        t0, batch, k, dw = self.window  # type: ignore[misc]
        self.steps += k
        self.busy_ns += end - t0
        done = []
        if dw is not None:  # a decode window: every sequence samples each step
            first = t0 + dw.first_ns
            for req, _ in batch:
                req.computed += k
                req.generated += k
                req.num_tokens += k
                if req.first_token is None:
                    req.first_token = first
                if req.generated >= req.tr.output_length:
                    done.append(req)
        else:
            for req, new in batch:
                req.computed += new
                if req.computed >= req.num_tokens:
                    req.generated += 1
                    req.num_tokens += 1
                    if req.first_token is None:
                        req.first_token = end
                    if req.generated >= req.tr.output_length:
                        done.append(req)
                self._left(req, max(0, req.num_tokens - req.computed - 1))
                self._store(req, end)
        self._finish(done, end)
        self._start_loads(end)
        self.window = None
        return done

    def _finish(self, done: list[FleetRequest], now: float) -> None:
        if not done:
            return
        gone = set(map(id, done))
        self.running = [r for r in self.running if id(r) not in gone]
        for req in done:
            req.state, req.finish = DONE, now
            self.kv.release(req)
            self._left(req, 0)
            self.records.append(req)

    def _store(self, req: FleetRequest, now: float) -> None:
        """Write the prompt's trace blocks ``req`` has computed whole to the home."""
        store = self.store
        if store is None:
            return
        r = req.tr
        whole = req.stored
        upto = min(req.computed, r.input_length)
        while whole < len(r.hash_ids) and trace_block_end(r, whole) <= upto:
            whole += 1
        if whole > req.stored:
            keys = store.missing(r.hash_ids[req.stored:whole])
            if keys:
                pos = {h: i for i, h in enumerate(r.hash_ids[req.stored:whole], req.stored)}
                tokens = sum(r.block_tokens(pos[h]) for h in keys)
                landed = self.home.write(self.index, now, tokens)
                if self.on_store is not None:
                    self.on_store(store, keys, landed)
            req.stored = whole

    def _start_loads(self, now: float) -> None:
        """Submit the loads admitted in this step now that it ended (vLLM starts them after the
        forward)."""
        for req in self.loads:
            req.load_done = self.home.read(self.index, now, req.load_tokens)
        self.loads = []

    def next_load(self, now: float) -> float | None:
        """When the earliest load still in flight lands (the idle instance wakes then)."""
        t = min((q.load_done for q in self.loading if q.load_done > now), default=None)
        return None if t is None or t == float("inf") else t
