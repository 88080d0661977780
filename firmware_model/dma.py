"""DMA scheduling model: channels, a bounded queue, a shared link per direction, completion events.

The cost of a transfer is the one link model (:mod:`firmware_model.link`), the timed data
path's: a direction's link is busy for the bytes' occupancy only, latency pipelines::

    start      = max(now, link_free[direction])
    link_free' = start + occupancy(whole transactions)
    completion = start + occupancy + latency

Requests wait in a priority queue (lower value first, FIFO among equals) of at most
``queue_depth`` outstanding requests; up to ``channels`` are in flight. Every channel of one
direction shares that direction's link, so extra channels overlap queueing, never bandwidth:
bandwidth sharing is exactly the ``link_free`` serialisation above. A queued request can be
cancelled; one in flight always completes (hardware cannot recall a transfer).
"""
from __future__ import annotations

import heapq
import itertools
import numbers
from dataclasses import dataclass, field
from typing import Any, cast

import simpy

from firmware_model.link import Link, LinkParams

__all__ = ["DIRECTIONS", "DmaRequest", "DmaScheduler", "QueueFullError", "TransferCost"]

DIRECTIONS = ("read", "write")  # read: device -> host/accelerator; write: host -> device


@dataclass(frozen=True, kw_only=True, init=False)
class TransferCost(LinkParams):
    """The link model built from ns and GB/s numbers (0 = unthrottled), with the size of the KV
    block its callers move. It *is* a :class:`~firmware_model.link.LinkParams`: integers, time
    scale applied, transactions of ``txn_bytes``."""

    block_bytes: int = 0

    def __init__(self, *, read_latency_ns: float = 0, write_latency_ns: float = 0,
                 read_bandwidth_gbps: float = 0, write_bandwidth_gbps: float = 0,
                 time_scale: float = 1.0, txn_bytes: int = 64, block_bytes: int = 0) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, numbers.Integral):
            raise TypeError(f"block_bytes must be an integer, got {block_bytes!r}")
        if block_bytes < 0:
            raise ValueError(f"block_bytes must be >= 0, got {block_bytes}")
        link = LinkParams.from_rates(read_latency_ns=read_latency_ns, write_latency_ns=write_latency_ns,
                                     read_bandwidth_gbps=read_bandwidth_gbps,
                                     write_bandwidth_gbps=write_bandwidth_gbps, time_scale=time_scale,
                                     txn_bytes=txn_bytes)
        object.__setattr__(self, "lat_ns", link.lat_ns)
        object.__setattr__(self, "fs_per_byte", link.fs_per_byte)
        object.__setattr__(self, "txn_bytes", link.txn_bytes)
        object.__setattr__(self, "block_bytes", int(block_bytes))


class QueueFullError(RuntimeError):
    """The DMA queue already holds ``queue_depth`` outstanding requests; retry after a completion."""


@dataclass(eq=False)
class DmaRequest:
    """One transfer. ``done`` fires with the request when it completes (never if cancelled)."""

    direction: str
    nbytes: int
    priority: Any  # anything orderable; lower first
    tag: Any
    done: simpy.Event
    submitted_at: float
    dpa: int = 0  # where on the device: the transactions charged depend on its alignment
    started_at: float | None = None
    completed_at: float | None = None
    cancelled: bool = False
    channel: int | None = field(default=None)

    @property
    def state(self) -> str:
        if self.cancelled:
            return "cancelled"
        if self.completed_at is not None:
            return "done"
        return "queued" if self.started_at is None else "in_flight"


class DmaScheduler:
    """Schedules transfers on a simulated clock over the link model (the timed data path's)."""

    def __init__(self, env: simpy.Environment, cost: LinkParams, *, channels: int = 1,
                 queue_depth: int = 64) -> None:
        if channels < 1 or queue_depth < 1:
            raise ValueError(f"channels and queue_depth must be >= 1, got {channels}, {queue_depth}")
        self.env = env
        self.cost = cost
        self.link = Link(cost)
        self.channels = channels
        self.queue_depth = queue_depth
        self.bytes_done = {d: 0 for d in DIRECTIONS}
        self.transfers_done = {d: 0 for d in DIRECTIONS}
        self.max_queue_depth = 0
        self._queue: list[tuple[Any, int, DmaRequest]] = []
        self._free_channels = list(range(channels))
        self._in_flight = 0
        self._queued = 0
        self._seq = itertools.count()

    @property
    def link_free(self) -> dict[str, float]:
        """When each direction's link is next free (ns)."""
        return dict(zip(DIRECTIONS, self.link.free, strict=True))

    @property
    def queued(self) -> int:
        """Requests waiting for a channel (cancelled ones excluded)."""
        return self._queued

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, direction: str, nbytes: int, *, priority: Any = 0, tag: Any = None,
               dpa: int = 0) -> DmaRequest:
        """Queue a transfer of ``nbytes`` at ``dpa``; it starts at once if a channel is free.
        Raises QueueFullError."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'read' or 'write', got {direction!r}")
        if nbytes <= 0:
            raise ValueError(f"a transfer moves > 0 bytes, got {nbytes}")
        outstanding = self._queued + self._in_flight
        if outstanding >= self.queue_depth:
            raise QueueFullError(f"DMA queue full ({self.queue_depth} outstanding)")
        if dpa < 0:
            raise ValueError(f"dpa must be >= 0, got {dpa}")
        req = DmaRequest(direction, nbytes, priority, tag, self.env.event(), self.env.now, dpa)
        heapq.heappush(self._queue, (priority, next(self._seq), req))
        self._queued += 1
        self.max_queue_depth = max(self.max_queue_depth, outstanding + 1)
        self._dispatch()
        return req

    def cancel(self, req: DmaRequest) -> bool:
        """Cancel a queued request (True); a started or finished one cannot be (False)."""
        if req.started_at is not None or req.cancelled:
            return False
        req.cancelled = True
        self._queued -= 1
        return True

    def _dispatch(self) -> None:
        while self._free_channels and self._queue:
            _, _, req = heapq.heappop(self._queue)
            if req.cancelled:
                continue
            self._queued -= 1
            now = self.env.now
            done_at = self.link.transfer(req.direction, now, req.nbytes, req.dpa)
            req.started_at = now
            req.channel = heapq.heappop(self._free_channels)
            self._in_flight += 1
            timer = self.env.timeout(done_at - now, value=req)
            timer.callbacks.append(self._complete)

    def _complete(self, event: simpy.Event) -> None:
        req = cast(DmaRequest, event.value)
        req.completed_at = self.env.now
        self._in_flight -= 1
        assert req.channel is not None
        heapq.heappush(self._free_channels, req.channel)
        self.bytes_done[req.direction] += req.nbytes
        self.transfers_done[req.direction] += 1
        req.done.succeed(req)
        self._dispatch()
