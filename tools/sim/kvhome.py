"""Where a fleet's KV lives beyond each instance's HBM: the KV homes of ``cxlemu sim fleet``.

* ``none``     HBM's prefix cache alone;
* ``host``     each host's own DRAM, reached over its host link (``pcie5-host``: an H100/H200 host's
               PCIe 5.0 x16, the emulator's preset), ``cache_tokens`` per host, LRU (vLLM's CPU
               offload evicts LRU);
* ``rdma``     one store shared by all (Mooncake Store over its transfer engine): each node reads
               and writes through its own NICs, ``RDMA_GBPS`` per node and ``RDMA_LATENCY_US`` a
               transfer; it holds ``instances x cache_tokens``, LRU (Mooncake Store's eviction);
* ``cxl-pool`` one CXL pool shared by a rack (Beluga): each host on its own switch port, all
               sharing the pool's media (the ``beluga-switch`` preset: 64 GB/s a host, 1 TB/s in
               all, through ``firmware_model.link``'s ``Link`` / ``MediaLink``); it holds
               ``instances x cache_tokens``, evicted by any firmware_model policy.

A store keeps whole trace blocks (512 tokens, :data:`tools.sim.mooncake.TRACE_BLOCK_TOKENS`): its
capacity is ``tokens // 512`` of them. A block becomes a hit when its write lands; a block being
loaded is protected from eviction.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from firmware_model.link import READ, WRITE, Link, LinkParams, MediaLink
from firmware_model.policies import NoVictimError, make_policy
from tools.sim.mooncake import TRACE_BLOCK_TOKENS

__all__ = ["HOMES", "RDMA_GBPS", "RDMA_LATENCY_US", "KvHome", "Store", "make_home"]

HOMES = ("none", "host", "rdma", "cxl-pool")

#: Mooncake's transfer engine: 87 GB/s per node on 4 x 200 Gb/s RoCE, a 40 GB transfer (the KV of
#: 128k Llama-3-70B tokens) (kvcache-ai/Mooncake README and doc/en/transfer-engine.md, "Performance").
RDMA_GBPS = 87.0
#: One store read or write: an RDMA one-sided read is a few us on RoCE; a Mooncake Store get or put
#: also asks the master service where the object lives (an RPC). 25 us is an assumption, named as
#: such (``--rdma-latency-us``), not a measurement.
RDMA_LATENCY_US = 25.0


class Store:
    """One store of trace blocks: its policy, the writes in flight, the loads in flight
    (protected), and its counters."""

    def __init__(self, capacity_tokens: int, policy: Any = "lru") -> None:
        self.capacity = max(0, capacity_tokens // TRACE_BLOCK_TOKENS)
        self.policy = make_policy(policy, self.capacity) if self.capacity else None
        self.storing: set[Hashable] = set()
        self.loading: dict[Hashable, int] = {}
        self.evictions = self.dropped = self.blocks_stored = self.blocks_loaded = 0

    def __contains__(self, key: object) -> bool:
        return self.policy is not None and key in self.policy

    def prefix(self, keys: Sequence[Hashable], start: int) -> int:
        """How many of ``keys[start:]`` it holds, from ``start`` to the first it lacks."""
        pol = self.policy
        if pol is None:
            return 0
        n = start
        while n < len(keys) and keys[n] in pol:
            n += 1
        return n - start

    def pin(self, keys: Sequence[Hashable], now: int) -> None:
        for k in keys:
            self.loading[k] = self.loading.get(k, 0) + 1
            self.policy.touch(k, now)  # type: ignore[union-attr]
        self.blocks_loaded += len(keys)

    def unpin(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            left = self.loading[k] - 1
            if left:
                self.loading[k] = left
            else:
                del self.loading[k]

    def missing(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """The keys neither held nor being written; marked as being written."""
        out = [k for k in keys if k not in self.storing and k not in self]
        self.storing.update(out)
        return out

    def landed(self, keys: Sequence[Hashable], now: int) -> None:
        """Writes of ``keys`` landed: each becomes a hit, a victim leaving when full."""
        pol = self.policy
        for k in keys:
            self.storing.discard(k)
            if pol is None or k in pol:
                continue
            if len(pol) >= self.capacity:
                try:
                    pol.evict(self.loading)
                except NoVictimError:
                    self.dropped += 1
                    continue
                self.evictions += 1
            pol.insert(k, now)
            self.blocks_stored += 1


@dataclass(frozen=True)
class HomeLinks:
    """Per-instance link parameters of a home and whether one media is shared by all."""

    params: LinkParams
    shared_media: bool
    source: str


def home_links(kind: str, instances: int, *, host_link: str = "pcie5-host", cxl_link: str = "beluga-switch",
               rdma_gbps: float = RDMA_GBPS, rdma_latency_us: float = RDMA_LATENCY_US) -> HomeLinks | None:
    """The link each instance reaches its home by (None for ``none``)."""
    from tools.sim.hardware import link_params

    if kind == "none":
        return None
    if kind == "host":
        return HomeLinks(link_params(host_link), False, f"emulator preset {host_link}")
    if kind == "cxl-pool":
        return HomeLinks(link_params(cxl_link), True, f"emulator preset {cxl_link}")
    if kind == "rdma":
        lat = rdma_latency_us * 1e3
        # every node serves the store's share it holds through its own NICs: the aggregate is
        # instances x the per-node figure, the reader's NICs the usual bound
        p = LinkParams.from_rates(read_latency_ns=lat, write_latency_ns=lat, read_bandwidth_gbps=rdma_gbps,
                                  write_bandwidth_gbps=rdma_gbps, media_read_bandwidth_gbps=rdma_gbps * instances,
                                  media_write_bandwidth_gbps=rdma_gbps * instances)
        return HomeLinks(p, True, f"Mooncake transfer engine: {rdma_gbps:g} GB/s per node, {rdma_latency_us:g} us "
                                  "a transfer")
    raise ValueError(f"unknown KV home {kind!r}: choose from {', '.join(HOMES)}")


class KvHome:
    """A fleet's KV home: the store each instance uses (its own for ``host``, one for the shared
    kinds) and each instance's link; transfers return their completion (ns)."""

    def __init__(self, kind: str, instances: int, cache_tokens: int, *, policy: Any = "lru",
                 kv_bytes_per_token: int, **link_kw: Any) -> None:
        if kind not in HOMES:
            raise ValueError(f"unknown KV home {kind!r}: choose from {', '.join(HOMES)}")
        self.kind = kind
        self.kv_bytes_per_token = kv_bytes_per_token
        self.links_spec = home_links(kind, instances, **link_kw)
        if kind == "none":
            self.stores: list[Store] = []
        elif kind == "host":  # vLLM's CPU offload evicts LRU
            self.stores = [Store(cache_tokens, "lru") for _ in range(instances)]
        else:
            shared = Store(cache_tokens * instances, policy if kind == "cxl-pool" else "lru")
            self.stores = [shared] * instances
        media = MediaLink()
        spec = self.links_spec
        self.links = [] if spec is None else [Link(spec.params, media if spec.shared_media else None)
                                              for _ in range(instances)]
        self.bytes_read = [0] * instances
        self.bytes_written = [0] * instances

    @property
    def enabled(self) -> bool:
        return bool(self.stores) and self.stores[0].capacity > 0

    def store_of(self, instance: int) -> Store | None:
        return self.stores[instance] if self.enabled else None

    def read(self, instance: int, now: float, tokens: int) -> float:
        n = tokens * self.kv_bytes_per_token
        self.bytes_read[instance] += n
        return self.links[instance].transfer(READ, now, n)

    def write(self, instance: int, now: float, tokens: int) -> float:
        n = tokens * self.kv_bytes_per_token
        self.bytes_written[instance] += n
        return self.links[instance].transfer(WRITE, now, n)

    def capacity_tokens(self) -> int:
        unique = {id(s): s for s in self.stores}.values()
        return sum(s.capacity for s in unique) * TRACE_BLOCK_TOKENS

    def describe(self) -> dict[str, Any]:
        spec = self.links_spec
        return {"kind": self.kind, "capacity_tokens": self.capacity_tokens(),
                "link": None if spec is None else spec.source,
                "policy": None if not self.enabled else type(self.stores[0].policy).__name__}
