"""`cxlemu bench tier`: the vLLM tier's own cost per KV block (target: <= 2 us).

The worker of ``driver.vllm`` (``CxlOffloadingWorker``) runs as vLLM runs it: jobs of ``--blocks``
KV blocks, each block ``--layers`` pages, stored to the device and loaded back (``submit_store`` /
``submit_load``, then ``get_finished`` until every job is reported). The device is untimed
(preset ``none``: no link time at all). Steady state, as in a long serving run: a first pass over
every job maps the worker's pages and warms its code; each timed pass starts with the jobs' bytes
out of cache (a 64 MiB buffer written before it), as a serving run's blocks are.

Per block, in host CPU time (the process's: the calling thread's and the DMA channels'):
- ``CPU``: the whole path: the job's plan, its descriptors, the DMA submission, the data path's
  checks and copies, the completion, the counters and the telemetry;
- ``copies``: the data movement alone, measured in the same run on the same cold bytes: the same
  descriptors issued straight to the C data path (``cxl_issue_array``: per descriptor its bounds,
  device-state and poison checks, the copy, the link's counters), what a hardware DMA engine does;
- ``own`` = CPU - copies (the median over ``--reps`` alternated passes): what the emulator adds to
  the data movement. The target row: 64-B pages (the copies are small, though a cold 64-KiB job
  still costs ~10 us of memory traffic), ``runs`` pattern.
With ``--page-kib`` pages the same run shows the copies' share at a real page size (on hardware,
the DMA engine's work, not the host's). Two block patterns: ``runs`` (the KV blocks and the device
chunks consecutive, as vLLM's block pool hands them out to one request) and ``scattered`` (every
block alone: the worst case, one descriptor per block per layer). Wall time per block is shown
beside the CPU time.
"""
from __future__ import annotations

import os
import time
from typing import Any

TARGET_US = 2.0
EVICT_BYTES = 64 << 20  # above the last-level cache of the hosts this runs on


def _worker(name: str, chunks: int, layers: int, page: int, blocks: int) -> tuple[Any, Any]:
    import torch

    from driver.vllm import reset_tier_stats
    from driver.vllm.testing import bare_worker

    reset_tier_stats(name)
    tensors = [torch.zeros((blocks, page), dtype=torch.int8) for _ in range(layers)]
    return bare_worker(name, tensors, page, chunks), tensors


def _measure(worker: Any, jobs: list[tuple[list[int], list[int]]], load: bool) -> tuple[float, float]:
    """(process CPU us, wall us) per block for ``jobs`` in one direction, through the worker."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    specs = [(GPULoadStoreSpec(kv, [len(kv)], [0]), CPULoadStoreSpec(ch)) for kv, ch in jobs]
    n = sum(len(kv) for kv, _ in jobs)
    c0, w0 = time.process_time_ns(), time.perf_counter_ns()
    for job_id, (gpu, dev) in enumerate(specs):
        if load:
            worker.submit_load(job_id, dev, gpu)
        else:
            worker.submit_store(job_id, gpu, dev)
    worker.wait(set(range(len(specs))))  # as vLLM's connector does: wait, then collect once a step
    results = worker.get_finished()
    if len(results) != len(specs) or any(not r.success for r in results):
        raise RuntimeError("a transfer failed on an untimed device")
    return (time.process_time_ns() - c0) / 1e3 / n, (time.perf_counter_ns() - w0) / 1e3 / n


def _measure_copies(worker: Any, jobs: list[tuple[list[int], list[int]]], load: bool) -> float:
    """Process CPU us per block of the data movement alone: the same jobs' descriptors (planned
    before the clock starts) issued straight to the C data path (``cxl_issue_array``: the checks
    and the copy each descriptor costs, what a hardware DMA engine does), nothing else."""
    from emulator.timing.cimpl import ffi, lib

    arrays = [worker._planner.plan("read" if load else "write", kv, ch) for kv, ch in jobs]
    most = max(len(a) for a in arrays)
    codes, errs, failed = ffi.new("int64_t[]", most), ffi.new("uint64_t[]", most), ffi.new("uint64_t *")
    dp = worker.dma.datapath._core.dp
    n = sum(len(kv) for kv, _ in jobs)
    c0 = time.process_time_ns()
    for a in arrays:
        lib.cxl_issue_array(dp, a.cdescs, a.count, -1, codes, errs, failed)
        if failed[0]:
            raise RuntimeError("a transfer failed on an untimed device")
    return (time.process_time_ns() - c0) / 1e3 / n


def _evict(scratch: Any) -> None:
    """Write a buffer larger than the last-level cache, so every pass starts with the jobs'
    bytes out of cache, as a serving run's blocks are."""
    scratch += 1


def _rows(page: int, layers: int, blocks: int, jobs: int, reps: int) -> list[dict[str, Any]]:
    import random
    import statistics

    import numpy as np

    from driver.memdev import MemDev
    from emulator.device import DeviceConfig, serve

    name = f"tierbench{os.getpid() % 100000}"
    total = blocks * jobs
    capacity = -(-(total * layers * page) // (256 << 20)) * (256 << 20)
    scratch = np.zeros(EVICT_BYTES, np.uint8)
    rows = []
    with serve(DeviceConfig(name=name, capacity=capacity)):
        with MemDev.open(name) as md:  # fault the media in: first touch is the OS's cost
            md.write_untimed(0, np.zeros(total * layers * page, np.uint8))
        worker, _tensors = _worker(name, total, layers, page, total)
        try:
            rng = random.Random(0)
            patterns = {
                "runs": [(list(range(j * blocks, (j + 1) * blocks)), list(range(j * blocks, (j + 1) * blocks)))
                         for j in range(jobs)],
                "scattered": [(rng.sample(range(0, total, 2), blocks), rng.sample(range(0, total, 2), blocks))
                              for _ in range(jobs)],
            }
            for pattern, js in patterns.items():
                for load in (False, True):  # warm-up: the worker's own mapping of every page, the code
                    _measure(worker, js, load)
                for direction, load in (("store", False), ("load", True)):
                    runs = []
                    for _ in range(reps):  # the whole path and the copies alone, alternated
                        _evict(scratch)
                        cpu, wall = _measure(worker, js, load)
                        _evict(scratch)
                        runs.append((cpu, wall, _measure_copies(worker, js, load)))
                    cpu, wall, copies = (statistics.median(x) for x in zip(*runs))
                    own = statistics.median(c - k for c, _, k in runs)
                    descs = blocks * layers if pattern == "scattered" else layers
                    rows.append({"page_bytes": page, "pattern": pattern, "direction": direction,
                                 "blocks_per_job": blocks, "descriptors_per_job": descs,
                                 "cpu_us_per_block": round(cpu, 3), "wall_us_per_block": round(wall, 3),
                                 "copies_us_per_block": round(copies, 3), "own_us_per_block": round(own, 3),
                                 "target_us": TARGET_US if page == 64 else None,
                                 "pass": own <= TARGET_US if page == 64 else None})
        finally:
            worker.shutdown()
    return rows


def run(*, layers: int = 32, page: int = 16 << 10, blocks: tuple[int, ...] = (16, 64),
        jobs: int = 200, reps: int = 3) -> dict[str, Any]:
    rows = [r for b in blocks for r in _rows(64, layers, b, jobs, reps)] + \
        _rows(page, layers, blocks[0], max(1, jobs // 4), reps)
    return {"layers": layers, "page_bytes": page, "jobs": jobs, "reps": reps, "rows": rows,
            "ok": all(r["pass"] for r in rows if r["pattern"] == "runs" and r["page_bytes"] == 64)}
