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
import types
from typing import Any

TARGET_US = 2.0
EVICT_BYTES = 64 << 20  # above the last-level cache of the hosts this runs on


def _worker(name: str, chunks: int, layers: int, page: int, blocks: int) -> tuple[Any, Any]:
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from driver.vllm import CxlOffloadingWorker, TierConfig, reset_tier_stats, tier_stats

    reset_tier_stats(name)
    tensors = [torch.zeros((blocks, page), dtype=torch.int8) for _ in range(layers)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                           [[CanonicalKVCacheRef(i, page) for i in range(layers)]])
    spec = types.SimpleNamespace(tier=TierConfig(device=name, policy="lru", cxl_bytes_to_use=chunks * layers * page),
                                 stats=tier_stats(name), num_chunks=chunks, device_name=name,
                                 device_capacity=None)
    return CxlOffloadingWorker(spec, kv), tensors


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


def register(bench: Any) -> None:
    p = bench.add_parser("tier", help="the vLLM tier's own cost per KV block (needs vLLM)")
    p.add_argument("--layers", type=int, default=32, help="KV pages per block (attention layers; 32 as a 7B)")
    p.add_argument("--page-kib", type=int, default=16, help="bytes per layer page, KiB (default 16)")
    p.add_argument("--blocks", default="16,64", help="KV blocks per job, comma-separated sizes (default 16,64)")
    p.add_argument("--jobs", type=int, default=200, help="jobs per pattern and direction (default 200)")
    p.add_argument("--reps", type=int, default=3, help="timed passes per row, alternated with the copies' "
                                                       "(medians; default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tier)


def cmd_tier(args: Any) -> int:
    from tools.common import VLLM_MODULE, CliError, need_extra, print_json

    for flag in ("layers", "page_kib", "jobs", "reps"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    try:
        blocks = tuple(int(b) for b in args.blocks.split(","))
    except ValueError:
        blocks = ()
    if not blocks or min(blocks) < 1:
        raise CliError(f"--blocks must be sizes >= 1 separated by commas (e.g. 16,64), got {args.blocks!r}")
    need_extra(VLLM_MODULE, "vllm", "bench tier")
    result = run(layers=args.layers, page=args.page_kib << 10, blocks=blocks, jobs=args.jobs, reps=args.reps)
    if args.json:
        print_json(result)
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"cxlemu bench tier: the tier's own cost per KV block ({result['layers']} layers, "
                        "untimed device)")
        for col in ("page", "blocks/job", "pattern", "direction", "descs/job", "CPU us/block",
                    "copies us/block", "own us/block", "wall us/block", "target (own)"):
            t.add_column(col)
        for r in result["rows"]:
            if r["target_us"] is None:
                verdict = "(real page: copies)"
            elif r["pattern"] == "runs":
                verdict = f"<= {TARGET_US:g} us " + ("[green]pass[/green]" if r["pass"] else "[red]FAIL[/red]")
            else:
                verdict = f"{'within' if r['pass'] else 'over'} (worst case)"
            t.add_row(f"{r['page_bytes']} B", str(r["blocks_per_job"]), r["pattern"], r["direction"],
                      str(r["descriptors_per_job"]), f"{r['cpu_us_per_block']:g}", f"{r['copies_us_per_block']:g}",
                      f"{r['own_us_per_block']:g}", f"{r['wall_us_per_block']:g}", verdict)
        Console().print(t)
    return 0 if result["ok"] else 1
