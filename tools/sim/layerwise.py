"""A forward that reads from a tier layer by layer, the firmware's prefetch queue ahead of it:
the offload tier's layer-wise loads (``engine.Tier``) and hot-page attention's page reads
(``hot.HotTier``) both run it."""
from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from firmware_model.dma import DmaScheduler
from firmware_model.prefetch import PrefetchQueue

__all__ = ["layerwise"]


def layerwise(env: simpy.Environment, dma: DmaScheduler, seq: Any, per_layer: int, compute_ns: float,
              layers: int, window: int) -> Generator[simpy.Event, Any, int]:
    """A forward of ``compute_ns`` over ``layers`` layers that reads ``per_layer`` bytes a layer
    (a simpy process): the firmware's prefetch queue (``firmware_model.prefetch.PrefetchQueue``)
    is hinted every layer's read, issues the first ``window`` layers at once and layer l + window
    when layer l starts computing; a layer computes once its read landed (a late one is a stall).
    Returns the late reads."""
    c = compute_ns / layers
    pq = PrefetchQueue(dma, block_bytes=per_layer, window=window, layers=layers,
                       is_resident=lambda _k: False, on_arrival=lambda _k: True)
    for layer in range(layers):
        pq.hint(seq, 0, layer, [(seq, layer)])
    try:
        for layer in range(layers):
            late = pq.demand((seq, layer))
            if late is not None:
                yield late.done
            pq.progress(seq, 0, layer)
            yield env.timeout(c)
    finally:
        pq.end_sequence(seq)
    return pq.stats.late
