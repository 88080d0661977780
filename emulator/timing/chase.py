"""Pointer chases and the robust means their samples are summarised with: used by the
calibration (``calibration.py``), the local-memory measurement (``localmem.py``) and the latency
benchmarks (``tools/bench``). No C here: a chase in C is ``CCore.chase``; ``py_chase`` is the one
from Python, through the call a DataPath.read makes.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np


def build_chase_ring(media: memoryview, base: int, lines: int, seed: int = 1) -> int:
    """Write a random cyclic permutation of ``lines`` 64-B lines starting at ``base`` (64-B
    aligned): each line's first u64 holds the DPA of the next.  Random order defeats the
    prefetcher, as in MLC.  Returns the DPA to start the chase at."""
    if base % 64:
        raise ValueError(f"chase ring base must be 64-B aligned, got {base:#x}")
    order = np.random.default_rng(seed).permutation(lines).astype(np.uint64)
    words = np.frombuffer(media, dtype=np.uint64, count=lines * 8, offset=base)
    words[order * 8] = base + np.roll(order, -1) * 64
    return base + int(order[0]) * 64


def interquartile_mean(samples: list[int]) -> float:
    """Mean of the middle half: as robust as the median to preemptions and interpreter
    hiccups, finer than a clock that ticks in 10-ns steps on some VMs."""
    ordered = sorted(samples)
    q = len(ordered) // 4
    middle = ordered[q:len(ordered) - q] or ordered
    return sum(middle) / len(middle)


def trimmed_mean(samples: list[int], keep: float = 0.99) -> float:
    """Mean of the fastest ``keep`` fraction: drops hops hit by an interrupt or preemption
    (the host is shared; a 4 ms tick or a migration is not the device's latency)."""
    ordered = sorted(samples)
    kept = ordered[:max(1, int(len(ordered) * keep))]
    return sum(kept) / len(kept)


def py_chase(transfer: Any, dpa: int, hops: int) -> tuple[list[int], int]:
    """Dependent pointer chase from Python: each hop is one ``transfer(0, dpa, buf, -1, True)``
    call (the call a DataPath.read makes) of 8 bytes, then a jump to the DPA read.  Returns
    per-hop times in ns (perf_counter, one reading per hop in every mode) and the DPA where a
    following round continues the chain."""
    buf = bytearray(8)
    samples = [0] * hops
    clock = time.perf_counter_ns
    from_bytes = int.from_bytes
    prev = clock()
    for i in range(hops):
        transfer(0, dpa, buf, -1, True)
        dpa = from_bytes(buf, "little")
        t = clock()
        samples[i] = t - prev
        prev = t
    return samples, dpa
