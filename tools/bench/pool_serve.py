"""`cxlemu bench pool` (without ``--races``): several vLLM-CPU engines on one device, one shared KV
pool against per-engine private tiers of the same total size, on prefixes from the Mooncake trace.

Workload (``trace_workload``): the first ``window`` requests of the public Mooncake conversation
trace (``hash_ids``: one id per 512-token block, a prefix chain), each cut to its first
``max_blocks`` ids; kept are the requests that reuse more than the common first block of an
earlier one, in trace order, each with that earlier one (the request that last held the reused
prefix), until ``requests`` are kept (one more where the last pair would split). Scaled down: a
trace block becomes ``tokens_per_hash`` tokens (one vLLM block of 128 by default), its tokens
drawn from the block's id, so two requests sharing ids share tokens; every prompt ends in a tail
of its own. Request j goes to engine j mod E (round-robin), one request at a time in trace order,
so a prefix is in the pool before the request that reuses it is sent, and a TTFT is one request's
prefill and loads, with no queue.

Modes, on the same E engine processes (one host port of the device each):

* ``alone``    vLLM alone: the reference tokens and the recompute TTFT;
* ``private``  each engine a private tier of ``tier_blocks / E`` blocks on its port;
* ``shared``   one pool of ``tier_blocks`` blocks in the device's shared extent, every engine
               looking up and publishing there (``shared=True``: a pool hit is read straight
               into the engine's KV block); each engine keeps a tier of ``staging_blocks`` of its
               own, which what it publishes passes through (its stores), so the shared mode has
               ``E x staging_blocks`` blocks more than the private one.

The link: vLLM alone runs first and its prefill cost per token here sets the time scale k of
the ``beluga-switch`` preset (each host's own x16 link, the media shared), so that link time :
compute for a context is a 7B's on an H100-class accelerator (``tools.sim.hardware.time_scale``);
the device then serves the private and shared modes at that scale.

Measured per mode: ``hit_rate`` (prompt tokens served from a cache, vLLM's ``num_cached_tokens``,
over the prompts' whole blocks), ``ttft_p50_ms``, ``tokens_equal`` (against ``alone``), and for
the requests whose reused prefix another engine computed ("cross" requests) their hit rate and
TTFT p50. Goals (issue 25): cross-engine hit rate of ``shared`` >= 2x ``private``'s; the cross
requests' TTFT p50 in ``shared`` <= 1/3 of recompute (``alone``).
"""
from __future__ import annotations

import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools.bench._pool_engine import EngineError
from tools.sim.hardware import ModelSpec

__all__ = ["MODES", "EngineError", "PoolBenchConfig", "Request", "analyse", "compute_s_per_token", "default_trace",
           "plot", "pool_device", "prompt_ids", "run", "trace_workload"]

MODES = ("alone", "private", "shared")
TRACE_NAME = Path("shared") / "traces" / "mooncake-conversation.jsonl"  # the team's, beside the checkout
BLOCK_TOKENS = 128  # vLLM-CPU's block; each engine reports its own and a mismatch is an error
TAIL_TOKENS = 16  # each prompt's own last tokens: never a whole block, never shared
MiB = 1 << 20
PRESET = "beluga-switch"  # each host on its own x16 link, the pool's media shared


@dataclass(frozen=True)
class PoolBenchConfig:
    engines: int = 2
    requests: int = 40
    window: int = 3000  # trace lines scanned for prefix reuse
    max_blocks: int = 8  # trace blocks kept per request
    tokens_per_hash: int = BLOCK_TOKENS  # one 512-token trace block -> this many tokens
    output_tokens: int = 4
    tier_blocks: int = 512  # the tiers' total, in vLLM blocks: the pool, or split over private tiers
    staging_blocks: int = 32  # shared mode: each engine's own tier, where pool blocks land
    model: ModelSpec = field(default_factory=lambda: ModelSpec(layers=4, hidden=512, heads=8, kv_heads=2,
                                                               intermediate=1408, vocab=2048))
    trace: str = ""  # "": default_trace()

    @property
    def kv_blocks(self) -> int:
        """vLLM's KV space per engine: one request's blocks and a few more (its own prefix cache
        keeps little between requests: what is reused comes from the tiers)."""
        return -(-(self.max_blocks * self.tokens_per_hash + TAIL_TOKENS + self.output_tokens) // BLOCK_TOKENS) + 2


@dataclass(frozen=True)
class Request:
    index: int  # its line in the trace
    hash_ids: tuple[int, ...]
    parent: int | None  # the kept request (its position in the workload) whose prefix it reuses
    reused: int  # leading blocks it shares with earlier requests


def trace_workload(lines: list[dict[str, Any]], cfg: PoolBenchConfig) -> list[Request]:
    """The requests the bench sends (see the module doc); pure."""
    holder: dict[int, int] = {}  # hash id -> the latest request (trace line) whose prefix held it
    reuse: dict[int, tuple[int, int]] = {}  # trace line -> (reused blocks, parent trace line)
    cut = [tuple(rec["hash_ids"][:cfg.max_blocks]) for rec in lines[:cfg.window]]
    for i, ids in enumerate(cut):
        k = 0
        while k < len(ids) and ids[k] in holder:
            k += 1
        if k >= 2:
            reuse[i] = (k, holder[ids[k - 1]])
        for h in ids:
            holder[h] = i
    chosen: set[int] = set()
    for line in sorted(reuse):  # reusers in trace order, each with the request it reuses
        if len(chosen) >= cfg.requests:
            break
        chosen.update((line, reuse[line][1]))
    keep = sorted(chosen)
    pos = {line: j for j, line in enumerate(keep)}
    out = []
    for line in keep:
        k, parent = reuse.get(line, (0, None))
        if parent is not None and parent not in pos:
            k, parent = 0, None
        out.append(Request(index=line, hash_ids=cut[line], parent=None if parent is None else pos[parent], reused=k))
    return out


def prompt_ids(req: Request, tokens_per_hash: int, vocab: int) -> list[int]:
    """A request's token ids: each trace block's tokens drawn from its id, then its own tail."""
    ids: list[int] = []
    for h in req.hash_ids:
        rng = random.Random(h)
        ids.extend(rng.randrange(4, vocab) for _ in range(tokens_per_hash))
    rng = random.Random(f"tail-{req.index}")
    return ids + [rng.randrange(4, vocab) for _ in range(TAIL_TOKENS)]


def default_trace() -> Path | None:
    """The Mooncake trace beside the checkout (``../shared/traces/``, or one level further up for a
    worktree), or None."""
    root = Path(__file__).resolve().parents[2]
    for up in (root.parent, root.parent.parent):
        if (up / TRACE_NAME).is_file():
            return up / TRACE_NAME
    return None


def load_trace(path: str, window: int) -> list[dict[str, Any]]:
    out = []
    with open(path) as f:
        for line in f:
            if len(out) >= window:
                break
            out.append(json.loads(line))
    return out


def _mode_specs(cfg: PoolBenchConfig, mode: str, model_dir: str, device: str, block_bytes: int) -> list[Any]:
    from tools.bench._pool_engine import EngineSpec

    specs = []
    length = (cfg.kv_blocks - 1) * BLOCK_TOKENS  # vLLM keeps one block back (its null block)
    for e in range(cfg.engines):
        if mode == "alone":
            specs.append(EngineSpec(model_dir=model_dir, kv_blocks=cfg.kv_blocks, max_model_len=length))
        elif mode == "private":
            specs.append(EngineSpec(model_dir=model_dir, kv_blocks=cfg.kv_blocks, device=device, host=e,
                                    tier_bytes=cfg.tier_blocks // cfg.engines * block_bytes, max_model_len=length))
        else:
            specs.append(EngineSpec(model_dir=model_dir, kv_blocks=cfg.kv_blocks, device=device, host=e, shared=True,
                                    tier_bytes=cfg.staging_blocks * block_bytes, max_model_len=length))
    return specs


def run_mode(engines: list[Any], specs: list[Any], prompts: list[list[int]], cfg: PoolBenchConfig,
             progress: Callable[[str], None], mode: str) -> dict[str, Any]:
    """Start each engine on its spec, send the prompts round-robin in order, stop them."""
    t = time.perf_counter()
    for eng, spec in zip(engines, specs):
        eng.send("start", spec)
    infos = [eng.reply("ready")[0] for eng in engines]
    bad = [i["block_tokens"] for i in infos if i["block_tokens"] != BLOCK_TOKENS]
    if bad:
        raise RuntimeError(f"vLLM's block is {bad[0]} tokens here; the bench maps trace blocks to {BLOCK_TOKENS}")
    start_s = time.perf_counter() - t
    results: list[dict[str, Any]] = []
    counters = [dict[str, int]() for _ in engines]
    for j, ids in enumerate(prompts):
        e = j % len(engines)
        (out,), got = engines[e].run([ids], cfg.output_tokens)
        out["engine"] = e
        results.append(out)
        for k, v in got.items():
            counters[e][k] = counters[e].get(k, 0) + v
        progress(f"{mode}: request {j + 1}/{len(prompts)}")
    for eng in engines:
        eng.stop()
    return {"results": results, "tier": counters, "engine_start_s": start_s}


@contextlib.contextmanager
def pool_device(name: str, hosts: int, static_bytes: int, pool_bytes: int, slot_bytes: int,
                timing: Any = None) -> Iterator[str]:
    """A device served in this process with ``hosts`` ports, ``static_bytes`` of static capacity
    (the private tiers) and a KV pool of ``pool_bytes`` data (slots of ``slot_bytes``) in a shared
    Dynamic Capacity extent offered to every port; yields its name. The pool is created through
    port 0, closed again before any engine claims it."""
    from driver.memdev import MemDev
    from emulator.device import DeviceConfig, serve
    from firmware_model.kv_index import layout_slots

    size = pool_bytes + pool_bytes // 8  # the index's header and entries besides the data
    while layout_slots(size, slot_bytes)[0] * slot_bytes < pool_bytes:
        size += slot_bytes
    region = -(-size // (256 * MiB)) * 256 * MiB
    extra = {} if timing is None else {"timing": timing}
    with serve(DeviceConfig(name=name, capacity=static_bytes, hosts=hosts, dc_regions=(region,), **extra)):
        with MemDev.open(name, host=0) as md:
            md.fm_create_pool(-(-size // (2 * MiB)) * 2 * MiB, slot_bytes=slot_bytes)
        yield name


def compute_s_per_token(results: list[dict[str, Any]], prompts: list[list[int]]) -> float:
    """This host's prefill cost per token: the median over vLLM alone's requests of TTFT over
    the tokens it computed (its prompt less what its own prefix cache held)."""
    return statistics.median(r["ttft_s"] / (len(p) - r["cached"]) for r, p in zip(results, prompts))


def run(cfg: PoolBenchConfig, *, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Every mode on the same engines (see the module doc). vLLM alone runs first: its prefill
    cost per token sets the link's time scale (``tools.sim.serve_workload.time_scale``: link
    time : compute for a context as a 7B's on an H100-class accelerator), and the device,
    ``beluga-switch``'s per-host link and shared media at that scale, serves the other modes."""
    import os
    from dataclasses import replace

    from emulator import presets
    from tools.bench._pool_engine import EngineProcess
    from tools.bench._serve_engine import build_model
    from tools.sim.hardware import time_scale

    workload = trace_workload(load_trace(cfg.trace or str(default_trace()), cfg.window), cfg)
    prompts = [prompt_ids(r, cfg.tokens_per_hash, cfg.model.vocab) for r in workload]
    block_bytes = BLOCK_TOKENS * cfg.model.kv_bytes_per_token
    private_bytes = -(-cfg.tier_blocks // cfg.engines) * block_bytes
    static = cfg.engines * (-(-max(private_bytes, cfg.staging_blocks * block_bytes) // (256 * MiB)) * 256 * MiB)
    report: dict[str, Any] = {"config": {**asdict(cfg), "kv_blocks": cfg.kv_blocks, "block_bytes": block_bytes,
                                         "block_tokens": BLOCK_TOKENS, "preset": PRESET},
                              "workload": [asdict(r) for r in workload], "modes": {}}
    with tempfile.TemporaryDirectory(prefix="cxlemu-pool-") as tmp:
        model_dir = str(Path(tmp) / "model")
        build_model(model_dir, cfg.model)
        engines = [EngineProcess() for _ in range(cfg.engines)]
        try:
            progress(f"alone: starting {cfg.engines} engines")
            alone = run_mode(engines, _mode_specs(cfg, "alone", model_dir, "", block_bytes), prompts, cfg, progress,
                             "alone")
            report["modes"]["alone"] = alone
            scale = time_scale(kv_bytes_per_token=cfg.model.kv_bytes_per_token,
                               compute_s_per_token=compute_s_per_token(alone["results"], prompts))
            report["time_scale"] = scale
            timing = replace(presets.load(PRESET).timing, time_scale=scale["time_scale"])
            name = f"bpool{os.getpid() % 10**6}"
            with pool_device(name, cfg.engines, static, cfg.tier_blocks * block_bytes, block_bytes,
                             timing) as device:
                for mode in MODES[1:]:
                    progress(f"{mode}: starting {cfg.engines} engines")
                    specs = _mode_specs(cfg, mode, model_dir, device, block_bytes)
                    report["modes"][mode] = run_mode(engines, specs, prompts, cfg, progress, mode)
        finally:
            for eng in engines:
                eng.close()
    return report


def _p50_ms(xs: list[float]) -> float | None:
    return statistics.median(xs) * 1e3 if xs else None


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    """Per mode: hit_rate, ttft_p50_ms, tokens_equal, and the cross requests' figures; the goals."""
    cfg = report["config"]
    workload = report["workload"]
    engines = cfg["engines"]
    cross = [j for j, r in enumerate(workload) if r["parent"] is not None and r["parent"] % engines != j % engines]
    whole = [len(r["hash_ids"]) * cfg["tokens_per_hash"] for r in workload]  # each prompt's whole blocks
    ref = [r["tokens"] for r in report["modes"]["alone"]["results"]]
    out: dict[str, Any] = {"modes": {}, "cross_requests": len(cross), "requests": len(workload)}
    for mode, data in report["modes"].items():
        res = data["results"]
        cached = [min(r["cached"], w) for r, w in zip(res, whole)]
        out["modes"][mode] = {
            "hit_rate": sum(cached) / sum(whole),
            "ttft_p50_ms": _p50_ms([r["ttft_s"] for r in res]),
            "tokens_equal": [r["tokens"] for r in res] == ref,
            "cross_hit_rate": sum(cached[j] for j in cross) / max(1, sum(whole[j] for j in cross)),
            "cross_ttft_p50_ms": _p50_ms([res[j]["ttft_s"] for j in cross]),
            "pool_hits": sum(c.get("pool_hits", 0) for c in data["tier"]),
            "pool_published": sum(c.get("pool_published", 0) for c in data["tier"]),
        }
    modes = out["modes"]
    shared, private, alone = modes["shared"], modes["private"], modes["alone"]
    # None where the workload has no cross request (or private mode hit none of them)
    ratio = shared["cross_hit_rate"] / private["cross_hit_rate"] if private["cross_hit_rate"] else None
    ttft = (shared["cross_ttft_p50_ms"] / alone["cross_ttft_p50_ms"]) if cross else None
    out["goals"] = {
        "cross_hit_rate_ratio": ratio, "cross_hit_rate_goal_met": ratio is not None and ratio >= 2.0,
        "cross_ttft_over_recompute": ttft, "cross_ttft_goal_met": ttft is not None and ttft <= 1 / 3,
        "tokens_equal": all(m["tokens_equal"] for m in modes.values()),
    }
    return out


def plot(analysis: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(analysis["modes"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    xs = range(len(modes))
    panels = (("hit_rate", "cross_hit_rate", "prompt tokens served from a cache", "hit rate"),
              ("ttft_p50_ms", "cross_ttft_p50_ms", "TTFT p50 (ms)", "time to first token"))
    for ax, (key, cross, ylabel, title) in zip(axes, panels):
        ax.bar([x - width / 2 for x in xs], [analysis["modes"][m][key] for m in modes], width, label="all requests")
        ax.bar([x + width / 2 for x in xs], [analysis["modes"][m][cross] for m in modes], width,
               label="prefix computed by another engine")
        ax.set_xticks(list(xs), modes)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"cxlemu bench pool: {len(analysis['modes'])} modes, {analysis['requests']} Mooncake-derived "
                 f"requests ({analysis['cross_requests']} cross-engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
