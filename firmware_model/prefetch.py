"""Prefetch queue: host hints turned into DMA ahead of need, triggered by compute progress.

The host says what it will compute ("sequence S computes layer L at step t, reading these
blocks") with :meth:`PrefetchQueue.hint`, and reports progress with :meth:`progress` when it
reaches a point. Progress — not a timer — triggers the transfers: when S reaches point p, every
hinted point up to p + ``window`` is issued. The window comes from :func:`window_points`: just
enough points of compute to hide one point's transfer; a larger window only holds blocks early
and pushes out useful ones.

Accounting, per prefetched block:

* **useful** — it arrived before the compute that needed it;
* **late** — it was still queued or in flight when needed (the compute waited for it);
* **wasted** — it arrived but left (eviction, sequence end) unused, or arrived after every
  sequence that wanted it had ended;
* **cancelled** — still queued when the last sequence that wanted it ended or was preempted: it
  never transfers. A block hinted by several sequences (a shared prefix) lives on while any of
  them does.

Duplicate hints for a block already resident, queued or in flight are counted and dropped.
"""
from __future__ import annotations

import functools
import heapq
import inspect
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from firmware_model.dma import DmaRequest, DmaScheduler, QueueFullError
from firmware_model.link import READ, LinkParams
from firmware_model.policies.base import PolicyProtocolError, import_spec, spec_label

__all__ = ["WINDOW_SIGNATURE", "PrefetchQueue", "PrefetchStats", "WindowFunction", "WindowSpec",
           "resolve_window", "window_points"]

WindowFunction = Callable[[LinkParams, int, float, int], int]
"""What sizes the prefetch window: ``f(link, bytes_per_point, compute_ns_per_point, max_window)``
-> points ahead, an int >= 0 (see :func:`window_points`, the default)."""

WindowSpec = str | WindowFunction
"""What names a window function: ``"auto"`` (:func:`window_points`), ``"package.module:function"``
(a function of your own, importable from ``sys.path``) or the callable itself."""

WINDOW_SIGNATURE = "f(link, bytes_per_point, compute_ns_per_point, max_window) -> int >= 0"


def window_points(cost: LinkParams, bytes_per_point: int, compute_ns_per_point: float,
                  max_window: int = 64) -> int:
    """How many progress points ahead to prefetch: ceil(transfer time / compute time), >= 1.

    One point's transfer on an idle link (the link model's latency + occupancy of the point's
    whole transactions) must finish within the compute of the points before it. If the link
    cannot move a point's bytes in one point's compute, no window hides it; the result is then
    capped at ``max_window`` and the compute will stall.
    """
    if compute_ns_per_point <= 0:
        return max_window
    ratio = cost.duration_ns(READ, bytes_per_point) / compute_ns_per_point
    if ratio >= max_window:  # also a ratio too large for ceil (a subnormal compute time)
        return max(1, max_window)
    return max(1, min(max_window, math.ceil(ratio)))


class _CheckedWindow:
    """A user's window function, called positionally, its result checked (an int >= 0)."""

    __slots__ = ("fn", "label")

    def __init__(self, fn: Callable[..., Any], label: str) -> None:
        self.fn, self.label = fn, label

    def __call__(self, link: LinkParams, bytes_per_point: int, compute_ns_per_point: float,
                 max_window: int) -> int:
        got = self.fn(link, bytes_per_point, compute_ns_per_point, max_window)
        if isinstance(got, bool) or not isinstance(got, int) or got < 0:
            raise PolicyProtocolError(
                f"prefetch window function {self.label} returned {got!r} for bytes_per_point="
                f"{bytes_per_point}, compute_ns_per_point={compute_ns_per_point}, max_window={max_window}: "
                f"expected an int >= 0 (points ahead; {WINDOW_SIGNATURE})")
        return got

    def __repr__(self) -> str:
        return f"<window function {self.label}>"


def resolve_window(spec: WindowSpec) -> WindowFunction:
    """The window function ``spec`` names (see :data:`WindowSpec`), checked against
    :data:`WINDOW_SIGNATURE`.

    Raises ``ValueError`` for a malformed name or a module path that does not import (naming
    the module and the reason), and :class:`~firmware_model.policies.PolicyProtocolError` (a
    ``TypeError`` and a ``ValueError``) for something not callable or that cannot be called
    with the four arguments. A function of your own comes back wrapped so that a result that is
    not an int >= 0 raises ``PolicyProtocolError`` naming it; ``"auto"`` is :func:`window_points`.
    """
    if spec == "auto" or spec is window_points:
        return window_points
    if isinstance(spec, str):
        if ":" not in spec:
            raise ValueError(f"unknown prefetch window {spec!r}: use 'auto' (firmware_model.prefetch."
                             "window_points) or name your own function as 'package.module:function'")
        fn = import_spec(spec, "prefetch window function", "'package.module:function'")
    else:
        fn = spec
    label = spec_label(spec)
    if not callable(fn) or isinstance(fn, type):
        raise PolicyProtocolError(f"prefetch window function {label} is {fn!r}: expected a function "
                                  f"{WINDOW_SIGNATURE}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        sig = None
    if sig is not None:
        try:
            sig.bind(None, 0, 0.0, 0)
        except TypeError:
            bare = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                           for p in sig.parameters.values()],
                               return_annotation=inspect.Signature.empty)
            raise PolicyProtocolError(
                f"prefetch window function {label}{bare} cannot be called as f(link, bytes_per_point, "
                f"compute_ns_per_point, max_window) (expected {WINDOW_SIGNATURE})") from None
    return _CheckedWindow(fn, label)


@dataclass
class PrefetchStats:
    issued: int = 0
    useful: int = 0
    late: int = 0
    wasted: int = 0
    cancelled: int = 0
    deduplicated: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(eq=False)
class _Pending:
    key: Hashable
    seqs: set[Hashable]  # sequences that hinted it (a shared prefix block has several); empty: orphaned
    request: DmaRequest | None = None
    arrived: bool = False
    demanded: bool = False  # needed while still in flight (counted late)


@dataclass
class _SeqHints:
    points: dict[int, list[tuple[int, tuple[Hashable, ...]]]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # heap of hinted points not yet issued
    reached: int = -1


class PrefetchQueue:
    """Issues hinted blocks through a :class:`DmaScheduler` when progress comes within the window.

    ``is_resident(key)`` tells whether a block is already in the cache; ``on_arrival(key)`` is
    called when a prefetched block lands (the cache inserts it; return False if it could not).

    ``dma`` is what issues a block: the simulated :class:`DmaScheduler`, or anything with its
    ``submit(direction, nbytes, priority=, tag=)`` (raising ``QueueFullError`` to be retried at
    the next progress) returning a request whose ``done.callbacks`` are called when it lands,
    and ``cancel(request) -> bool``. The KV shim (``driver.kv``) passes its frame loads on the
    device's DMA engine, so this class decides the shim's prefetches too.
    """

    def __init__(self, dma: DmaScheduler, *, block_bytes: int, window: int, layers: int,
                 is_resident: Callable[[Hashable], bool],
                 on_arrival: Callable[[Hashable], bool]) -> None:
        if block_bytes <= 0 or window < 0 or layers < 1:
            raise ValueError(f"need block_bytes > 0, window >= 0, layers >= 1; got {block_bytes}, {window}, {layers}")
        self.dma = dma
        self.block_bytes = block_bytes
        self.window = window
        self.layers = layers
        self.is_resident = is_resident
        self.on_arrival = on_arrival
        self.stats = PrefetchStats()
        self._seqs: dict[Hashable, _SeqHints] = {}
        self._pending: dict[Hashable, _Pending] = {}  # key -> queued, in flight, or arrived unused

    def point(self, step: int, layer: int) -> int:
        """Position of (step, layer) in a sequence's compute order."""
        return step * self.layers + layer

    def hint(self, seq: Hashable, step: int, layer: int, blocks: Iterable[Hashable], priority: int = 0) -> None:
        """Sequence ``seq`` will compute ``layer`` at ``step``, reading ``blocks``."""
        hints = self._seqs.setdefault(seq, _SeqHints())
        p = self.point(step, layer)
        if p not in hints.points:
            heapq.heappush(hints.order, p)
        hints.points.setdefault(p, []).append((priority, tuple(blocks)))
        if p <= hints.reached + self.window:
            self._issue_due(seq, hints)

    def progress(self, seq: Hashable, step: int, layer: int) -> None:
        """``seq`` reached (step, layer): issue every hinted point within the window."""
        hints = self._seqs.setdefault(seq, _SeqHints())
        hints.reached = max(hints.reached, self.point(step, layer))
        self._issue_due(seq, hints)

    def demand(self, key: Hashable) -> DmaRequest | None:
        """The compute reads ``key`` now. Returns the request to wait for if the prefetch is late."""
        pending = self._pending.get(key)
        if pending is None:
            return None
        if pending.arrived:
            del self._pending[key]
            self.stats.useful += 1
            return None
        if not pending.demanded:
            pending.demanded = True
            self.stats.late += 1
        return pending.request

    def evicted(self, key: Hashable) -> None:
        """The cache dropped ``key``; a prefetched block never used is wasted."""
        pending = self._pending.get(key)
        if pending is not None and pending.arrived:
            del self._pending[key]
            self.stats.wasted += 1

    def end_sequence(self, seq: Hashable) -> None:
        """``seq`` ended or was preempted: drop its hints, cancel what only it was waiting for."""
        self._seqs.pop(seq, None)
        for key, pending in list(self._pending.items()):
            if seq not in pending.seqs:
                continue
            pending.seqs.discard(seq)
            if pending.seqs:
                continue  # another sequence still wants it
            if pending.arrived:
                self.stats.wasted += 1
                del self._pending[key]
            elif pending.request is not None and self.dma.cancel(pending.request):
                self.stats.cancelled += 1
                del self._pending[key]
            # else: in flight, now orphaned: it will land and be counted wasted

    preempt = end_sequence

    def _issue_due(self, seq: Hashable, hints: _SeqHints) -> None:
        """Issue every hinted point up to reached + window, earliest point first."""
        while hints.order and hints.order[0] <= hints.reached + self.window:
            p = hints.order[0]
            entries = sorted(hints.points[p], key=lambda x: x[0])
            for i, (priority, blocks) in enumerate(entries):
                for j, key in enumerate(blocks):
                    if not self._issue_one(seq, key, (priority, p)):  # DMA queue full: retry later
                        hints.points[p] = [(priority, blocks[j:])] + entries[i + 1:]
                        return
            heapq.heappop(hints.order)
            del hints.points[p]

    def _issue_one(self, seq: Hashable, key: Hashable, priority: tuple[int, int]) -> bool:
        pending = self._pending.get(key)
        if pending is not None or self.is_resident(key):
            if pending is not None:
                pending.seqs.add(seq)
            self.stats.deduplicated += 1
            return True
        try:
            request = self.dma.submit("read", self.block_bytes, priority=priority, tag=key)
        except QueueFullError:
            return False
        pending = _Pending(key, {seq}, request)
        request.done.callbacks.append(functools.partial(self._on_done, pending))
        self._pending[key] = pending
        self.stats.issued += 1
        return True

    def _on_done(self, pending: _Pending, _event: object) -> None:
        self._arrived(pending)

    def _arrived(self, pending: _Pending) -> None:
        if not pending.seqs:  # every sequence that wanted it has ended
            self.stats.wasted += 1
            del self._pending[pending.key]
            return
        landed = self.on_arrival(pending.key)
        if pending.demanded or not landed:
            del self._pending[pending.key]  # late: already accounted; not landed: nowhere to go
            if not landed and not pending.demanded:
                self.stats.wasted += 1
            return
        pending.arrived = True

    def landed(self, key: Hashable) -> bool:
        """True while ``key`` arrived by prefetch and has not been used yet (keep it resident)."""
        pending = self._pending.get(key)
        return pending is not None and pending.arrived

    def outstanding(self) -> int:
        """Blocks queued, in flight, or arrived and not yet used."""
        return len(self._pending)

