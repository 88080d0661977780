"""DMA scheduling model: channels, a bounded queue, a shared link per direction, completion events.

The cost function is the timed data path's (``emulator.timing.TimingConfig``), taken here as plain
numbers so that nothing of the emulator is imported::

    completion = max(now, link_free[direction]) + (latency + bytes / bandwidth) * time_scale
    link_free[direction] = completion

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

__all__ = ["DIRECTIONS", "DmaRequest", "DmaScheduler", "QueueFullError", "TransferCost"]

DIRECTIONS = ("read", "write")  # read: device -> host/accelerator; write: host -> device


@dataclass(frozen=True, kw_only=True)
class TransferCost:
    """Latency and bandwidth per direction; bandwidth 0 means unthrottled (``TimingConfig`` says
    ``None`` for that: convert with ``bandwidth or 0.0``; ``None`` here is a ``TypeError``)."""

    read_latency_ns: float = 0.0
    write_latency_ns: float = 0.0
    read_bandwidth_gbps: float = 0.0  # GB/s = bytes per ns
    write_bandwidth_gbps: float = 0.0
    time_scale: float = 1.0
    block_bytes: int = 0  # size of one KV block, for callers that move whole blocks

    def __post_init__(self) -> None:
        for name in ("read_latency_ns", "write_latency_ns", "read_bandwidth_gbps", "write_bandwidth_gbps",
                     "block_bytes", "time_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                unthrottled = " (0 = unthrottled; None is TimingConfig's spelling of it)" if "bandwidth" in name else ""
                raise TypeError(f"{name} must be a number{unthrottled}, got {value!r}")
        for name in ("read_latency_ns", "write_latency_ns", "read_bandwidth_gbps", "write_bandwidth_gbps",
                     "block_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")

    def duration_ns(self, direction: str, nbytes: int) -> float:
        """Latency plus serialisation time of ``nbytes`` in ``direction``, scaled."""
        if direction == "read":
            lat, bw = self.read_latency_ns, self.read_bandwidth_gbps
        elif direction == "write":
            lat, bw = self.write_latency_ns, self.write_bandwidth_gbps
        else:
            raise ValueError(f"direction must be 'read' or 'write', got {direction!r}")
        return (lat + (nbytes / bw if bw else 0.0)) * self.time_scale

    def read_ns(self, nbytes: int) -> float:
        return self.duration_ns("read", nbytes)

    def completion_ns(self, now: float, link_free: float, direction: str, nbytes: int) -> float:
        """When a transfer submitted at ``now`` finishes on a link busy until ``link_free``."""
        return max(now, link_free) + self.duration_ns(direction, nbytes)


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
    """Schedules transfers on a simulated clock with the timed data path's cost function."""

    def __init__(self, env: simpy.Environment, cost: TransferCost, *, channels: int = 1,
                 queue_depth: int = 64) -> None:
        if channels < 1 or queue_depth < 1:
            raise ValueError(f"channels and queue_depth must be >= 1, got {channels}, {queue_depth}")
        self.env = env
        self.cost = cost
        self.channels = channels
        self.queue_depth = queue_depth
        self.link_free = {d: 0.0 for d in DIRECTIONS}
        self.bytes_done = {d: 0 for d in DIRECTIONS}
        self.transfers_done = {d: 0 for d in DIRECTIONS}
        self.max_queue_depth = 0
        self._queue: list[tuple[Any, int, DmaRequest]] = []
        self._free_channels = list(range(channels))
        self._in_flight = 0
        self._queued = 0
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        """Requests waiting for a channel (cancelled ones excluded)."""
        return self._queued

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, direction: str, nbytes: int, *, priority: Any = 0, tag: Any = None) -> DmaRequest:
        """Queue a transfer; it starts at once if a channel is free. Raises QueueFullError."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'read' or 'write', got {direction!r}")
        if nbytes <= 0:
            raise ValueError(f"a transfer moves > 0 bytes, got {nbytes}")
        outstanding = self._queued + self._in_flight
        if outstanding >= self.queue_depth:
            raise QueueFullError(f"DMA queue full ({self.queue_depth} outstanding)")
        req = DmaRequest(direction, nbytes, priority, tag, self.env.event(), self.env.now)
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
            done_at = self.cost.completion_ns(now, self.link_free[req.direction], req.direction, req.nbytes)
            self.link_free[req.direction] = done_at
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
