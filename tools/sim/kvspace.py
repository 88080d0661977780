"""An instance's HBM KV space and its prefix cache, in the fleet's terms (``tools.sim.instance``).

The KV space is vLLM's blocks (16 tokens; its null block left out). The prefix cache holds whole
trace blocks (512 tokens = 32 of vLLM's blocks; a prompt's last, shorter one its whole 16-token
blocks), each an *entry* shared by the requests that hit or published it, evicted least recently
freed first once no request holds it (vLLM's free queue and its lazy eviction; a request frees its
last blocks first). A request holds its entries (``pinned``, in prompt order) and its own blocks
(``own``: the rest of its tokens).
"""
from __future__ import annotations

from collections import OrderedDict

from tools.sim.mooncake import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["DONE", "LOADING", "RUNNING", "WAITING", "FleetRequest", "KvSpace", "blocks_for", "trace_block_end"]

WAITING, LOADING, RUNNING, DONE = range(4)


class FleetRequest:
    __slots__ = ("arrival", "computed", "est_left", "finish", "first_token", "generated", "hbm_hit", "home_hit",
                 "inst", "load_done", "load_keys", "load_tokens", "num_tokens", "own", "pinned", "pinned_blocks",
                 "preemptions", "prefill_ns", "rejected", "state", "stored", "tr")

    def __init__(self, tr: TraceRequest) -> None:
        self.tr = tr
        self.arrival = tr.arrival_ns
        self.num_tokens = tr.input_length
        self.computed = self.generated = self.own = self.pinned_blocks = self.stored = 0
        self.pinned: list[int] = []
        self.state = WAITING
        self.inst = -1
        self.load_done = 0.0
        self.load_keys: tuple[int, ...] = ()
        self.load_tokens = 0
        self.first_token: float | None = None
        self.finish: float | None = None
        self.hbm_hit = self.home_hit = self.preemptions = 0
        self.prefill_ns = 0.0
        self.est_left = 0
        self.rejected = False


def blocks_for(tokens: int, bt: int) -> int:
    return -(-tokens // bt)


def trace_block_end(r: TraceRequest, i: int) -> int:
    return min((i + 1) * TRACE_BLOCK_TOKENS, r.input_length)


class KvSpace:
    """``total`` blocks: requests' own, cached entries (held or evictable), free."""

    def __init__(self, total: int, block_tokens: int) -> None:
        self.total, self.bt = total, block_tokens
        self.entries: dict[int, list[int]] = {}  # trace block id -> [vLLM blocks, requests holding it]
        self.lru: OrderedDict[int, None] = OrderedDict()  # entries no request holds, evicted first-in first
        self.cached = self.own_total = self.evictable = 0

    def prefix(self, ids: tuple[int, ...]) -> int:
        """How many of ``ids``, from the first, it holds."""
        n = 0
        entries = self.entries
        while n < len(ids) and ids[n] in entries:
            n += 1
        return n

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free ones and cached ones no request holds."""
        return self.total - self.own_total - self.cached + self.evictable

    def alloc(self, n: int) -> None:
        while self.total - self.own_total - self.cached < n:
            h, _ = self.lru.popitem(last=False)
            blocks = self.entries.pop(h)[0]
            self.cached -= blocks
            self.evictable -= blocks
        self.own_total += n

    def grow(self, req: FleetRequest, tokens: int) -> bool:
        need = blocks_for(tokens, self.bt) - req.pinned_blocks - req.own
        if need <= 0:
            return True
        if need > self.available:
            return False
        self.alloc(need)
        req.own += need
        return True

    def hold(self, req: FleetRequest, h: int) -> None:
        e = self.entries[h]
        if e[1] == 0:
            del self.lru[h]
            self.evictable -= e[0]
        e[1] += 1
        req.pinned.append(h)
        req.pinned_blocks += e[0]

    def release(self, req: FleetRequest) -> None:
        for h in reversed(req.pinned):
            e = self.entries[h]
            e[1] -= 1
            if e[1] == 0:
                self.lru[h] = None
                self.evictable += e[0]
        self.own_total -= req.own
        req.pinned, req.pinned_blocks, req.own = [], 0, 0

    def publish(self, req: FleetRequest, tokens: int) -> None:
        """Publish ``req``'s trace blocks that are whole once it has ``tokens`` computed (vLLM
        caches full blocks when their step is scheduled): each becomes an entry it holds (one
        another request published first is shared, its copy freed)."""
        r = req.tr
        upto = min(tokens, r.input_length)
        ids = r.hash_ids
        while len(req.pinned) < len(ids) and trace_block_end(r, len(req.pinned)) <= upto:
            i = len(req.pinned)
            h = ids[i]
            if h in self.entries:
                self.hold(req, h)
                blocks = self.entries[h][0]
            else:
                blocks = r.block_tokens(i) // self.bt
                self.entries[h] = [blocks, 1]
                self.cached += blocks
                req.pinned.append(h)
                req.pinned_blocks += blocks
            req.own -= blocks
            self.own_total -= blocks
