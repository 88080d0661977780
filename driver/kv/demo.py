"""The KV part of ``cxlemu demo``: a generation whose KV cache lives on the device.

A seeded random Llama generates for two prompts that share a prefix, with half of their KV
allowed on the accelerator; a progress bar follows the tokens, a closing table shows what the
shim did (tokens/s, hit rate, bytes per direction, stall time, prefix sharing), and the tokens
are checked against an all-resident ``DynamicCache`` run.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from driver.kv._recompute import cache_argument
from driver.kv.cache import CxlCache
from driver.kv.testing import padded_batch, tiny_llama

__all__ = ["run_kv_demo"]

NEW_TOKENS = 48
LAYERS = 8


class _Tick(LogitsProcessor):
    """Advances a progress bar once per generated token (logits untouched)."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self.progress, self.task = progress, task

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.progress.advance(self.task)
        return scores


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: object,
              processors: list) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              logits_processor=LogitsProcessorList(processors), **{cache_argument(model): cache})


def run_kv_demo(console: Console, device: str | None = None) -> bool:
    """Generate with the KV on ``device`` (a private one when None); True when the tokens equal
    the all-resident run's and blocks really came back from the device."""
    model = tiny_llama(layers=LAYERS, hidden=128, heads=4, kv_heads=2, vocab=512, intermediate=256)
    ids, mask = padded_batch([40, 40], vocab=512, prefix=32)
    head_dim = 128 // 4
    final = ids.shape[1] + NEW_TOKENS - 1
    kv_bytes = LAYERS * 2 * ids.shape[0] * final * 2 * head_dim * 4
    budget = kv_bytes // 2
    reference = _generate(model, ids, mask, DynamicCache(), [])
    cache = CxlCache(hbm_budget_bytes=budget, policy="reuse", block_tokens=16, device=device,
                     model=model, max_seq_len=final)
    try:
        with Progress(TextColumn("[bold]generating[/] on {task.fields[dev]}"), BarColumn(),
                      MofNCompleteColumn(), TextColumn("tokens"), console=console, transient=True) as bar:
            task = bar.add_task("gen", total=NEW_TOKENS, dev=cache.device_name or device or "a private device")
            t0 = time.perf_counter()
            out = _generate(model, ids, mask, cache, [_Tick(bar, task)])
            seconds = time.perf_counter() - t0
        stats = cache.stats()
        name = cache.device_name
    finally:
        cache.close()
    equal = torch.equal(out, reference)
    console.print(_table(stats, seconds, ids.shape[0], budget, kv_bytes, name, equal))
    return equal and stats["loads"] > 0 and stats["hbm_peak_bytes"] <= budget


def _table(stats: dict[str, int], seconds: float, batch: int, budget: int, kv_bytes: int,
           device: str | None, equal: bool) -> Table:
    lookups = stats["hits"] + stats["misses"] + stats["prefetch_late"]
    t = Table(title=f"KV cache on {device}: {LAYERS}-layer random Llama, batch {batch}, "
                    f"HBM budget {budget >> 10} KiB of {kv_bytes >> 10} KiB KV", show_header=False)
    rows = [
        ("tokens/s", f"{batch * NEW_TOKENS / seconds:.1f}"),
        ("layer hit rate", f"{stats['hits'] / lookups:.1%}" if lookups else "-"),
        ("prefetches (late)", f"{stats['prefetch_issued']} ({stats['prefetch_late']})"),
        ("device -> accelerator", f"{stats['bytes_loaded'] / 2**20:.2f} MiB in {stats['loads']} layer loads"),
        ("accelerator -> device", f"{stats['bytes_offloaded'] / 2**20:.2f} MiB in {stats['offloads']} saves"),
        ("stall time", f"{stats['stall_ns'] / 1e6:.1f} ms"),
        ("prefix sharing", f"{stats['shared_chunks']} chunks shared, "
                           f"{stats['dedup_write_bytes'] >> 10} KiB not written, "
                           f"{stats['dedup_load_bytes'] >> 10} KiB not read"),
        ("HBM peak / budget", f"{stats['hbm_peak_bytes'] >> 10} / {budget >> 10} KiB"),
        ("tokens equal all-resident", "[green]yes[/]" if equal else "[red]NO[/]"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t
