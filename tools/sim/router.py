"""The fleet's request routers (``cxlemu sim fleet --router``).

* ``rr``            round-robin, in arrival order;
* ``least-loaded``  the instance with the fewest requests in it (waiting, loading or running), then
                    the least queued prefill work, then the lowest index;
* ``prefix``        Mooncake's Conductor / a KV-aware router: the least ``uncached prefill tokens
                    + queued prefill tokens``, where the uncached tokens are the request's prompt
                    less what the instance would find cached (its HBM prefix cache, then its KV
                    home's blocks), and the queued tokens the prefill its queue still has to
                    compute; ties to the lowest index.

A router sees each instance through :class:`InstanceView` (what a real router learns from the
instances' load reports and their cache events).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tools.sim.mooncake import TraceRequest

__all__ = ["ROUTERS", "InstanceView", "Router", "make_router"]

ROUTERS = ("rr", "least-loaded", "prefix")


class InstanceView(Protocol):
    index: int

    def requests_in(self) -> int: ...

    def queued_prefill_tokens(self) -> int: ...

    def cached_tokens(self, req: TraceRequest) -> int: ...


class Router:
    """Picks an instance for each arriving request."""

    name = "?"

    def pick(self, req: TraceRequest, instances: Sequence[InstanceView]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "rr"

    def __init__(self) -> None:
        self.next = 0

    def pick(self, req: TraceRequest, instances: Sequence[InstanceView]) -> int:
        i = self.next % len(instances)
        self.next += 1
        return i


class LeastLoaded(Router):
    name = "least-loaded"

    def pick(self, req: TraceRequest, instances: Sequence[InstanceView]) -> int:
        return min(instances, key=lambda v: (v.requests_in(), v.queued_prefill_tokens(), v.index)).index


class PrefixAware(Router):
    name = "prefix"

    def pick(self, req: TraceRequest, instances: Sequence[InstanceView]) -> int:
        return min(instances, key=lambda v: (self.score(req, v), v.index)).index

    @staticmethod
    def score(req: TraceRequest, v: InstanceView) -> int:
        return req.input_length - v.cached_tokens(req) + v.queued_prefill_tokens()


def make_router(name: str) -> Router:
    if name == "rr":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix":
        return PrefixAware()
    raise ValueError(f"unknown router {name!r}: choose from {', '.join(ROUTERS)}")
