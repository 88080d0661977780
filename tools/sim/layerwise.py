"""A forward that reads from a tier layer by layer, the firmware's prefetch queue ahead of it:
the offload tier's layer-wise loads (``engine.Tier``) and hot-page attention's page reads
(``hot.HotTier``) both run it."""
from __future__ import annotations

from collections.abc import Generator
from typing import Any, NamedTuple

import simpy

from firmware_model.dma import DmaScheduler
from firmware_model.prefetch import PrefetchQueue

__all__ = ["Forward", "layerwise"]


class Forward(NamedTuple):
    """What a forward waited for: the prefetches still in flight when their layer started
    (``late``) and the time its on-demand reads took (``demand_ns``)."""

    late: int
    demand_ns: float


def layerwise(env: simpy.Environment, dma: DmaScheduler, seq: Any, per_layer: int, compute_ns: float,
              layers: int, window: int, demand: int = 0) -> Generator[simpy.Event, Any, Forward]:
    """A forward of ``compute_ns`` over ``layers`` layers that reads ``per_layer`` bytes a layer
    ahead (a simpy process): the firmware's prefetch queue (``firmware_model.prefetch.PrefetchQueue``)
    is hinted every layer's read, issues the first ``window`` layers at once and layer l + window
    when layer l starts computing; a layer computes once its read landed (a late one is a stall).
    ``demand`` bytes a layer are read on demand once the layer's prefetch landed and before it
    computes or issues the next prefetch (what was not predicted: its latency and bytes on the
    same link, a stall every layer)."""
    c = compute_ns / layers
    pq = PrefetchQueue(dma, block_bytes=per_layer, window=window, layers=layers,
                       is_resident=lambda _k: False, on_arrival=lambda _k: True)
    waited = 0.0
    for layer in range(layers):
        pq.hint(seq, 0, layer, [(seq, layer)])
    try:
        for layer in range(layers):
            late = pq.demand((seq, layer))
            if late is not None:
                yield late.done
            if demand:
                asked = env.now
                yield dma.submit("read", demand, tag=("demand", seq, layer)).done
                waited += env.now - asked
            pq.progress(seq, 0, layer)
            yield env.timeout(c)
    finally:
        pq.end_sequence(seq)
    return Forward(pq.stats.late, waited)
