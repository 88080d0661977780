"""Recompute lost KV from the tokens: record the forward calls, replay them on a fresh cache.

The recorder keeps the token ids (and masks / positions) of every forward call made with the
``CxlCache``; replaying exactly those calls, with the same shapes, on a ``DynamicCache`` yields
bit-identical KV on a deterministic backend, so a chunk lost to a poisoned or failed load is
restored without changing a single token. It costs a re-run of the generation so far: the fault
path, not the fast path.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from driver.kv._chunkio import ChunkTables, LayerChunks
from driver.kv._mover import host_bytes
from driver.kv._store import BlockStore, Extent, Transfer
from emulator.spec.errors import CxlemuError, DmaError, PoisonError

__all__ = ["FailedLoad", "ForwardRecorder", "KVLoadError", "LoadRecovery", "cache_argument"]

Recompute = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class KVLoadError(CxlemuError):
    """A chunk could not be read back after every retry and could not be recomputed."""


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword a model's forward / generate take a cache under: ``cache`` from transformers
    5.24 on (``past_key_values`` still works there, with a deprecation warning), else
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ForwardRecorder:
    """A forward pre-hook on ``model`` recording the calls that use ``cache``."""

    def __init__(self, model: torch.nn.Module, cache: object) -> None:
        self.model = model
        self.cache = cache
        self.calls: list[dict[str, Any]] = []
        self._replaying = False
        self._cache_arg = cache_argument(model)
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._replaying:
            return
        if kwargs.get("cache") is not self.cache and kwargs.get("past_key_values") is not self.cache:
            return
        call = {k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        if args:
            call["input_ids"] = args[0].detach().clone()
        self.calls.append(call)

    def recompute(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for tokens ``[0, upto)``, by replaying the recorded calls."""
        from transformers import DynamicCache

        fresh = DynamicCache()
        self._replaying = True
        try:
            with torch.no_grad():
                for call in self.calls:
                    if fresh.get_seq_length() >= upto:
                        break
                    self.model(**call, **{self._cache_arg: fresh}, use_cache=True)
        finally:
            self._replaying = False
        if fresh.get_seq_length() < upto:
            raise RuntimeError(f"replay produced {fresh.get_seq_length()} tokens, {upto} needed")
        lay: Any = fresh.layers[layer]
        return lay.keys[:, :, :upto], lay.values[:, :, :upto]

    def remove(self) -> None:
        self._handle.remove()
        self.calls.clear()


class FailedLoad(Protocol):
    """What recovery needs of a load (the engine's ``_Load``)."""

    host: np.ndarray
    cap: int
    transfer: Transfer
    extents: list[Extent]
    firsts: dict[int, tuple[int, int]] | None
    chunks: LayerChunks | None
    seq_len: int
    attempts: int


class LoadRecovery:
    """The residency engine's fault path (a part it owns): retry a failed load, then recompute
    what stays unreadable from the tokens and rewrite it in place."""

    def __init__(self, *, store: BlockStore, chunks: ChunkTables, counters: dict[str, int],
                 dtype: torch.dtype, max_retries: int, recompute: Recompute | None) -> None:
        self.store = store
        self.chunks = chunks
        self.counters = counters
        self.dtype = dtype
        self.max_retries = max_retries
        self.recompute = recompute

    def wait_load(self, layer: int, ld: FailedLoad) -> None:
        """Wait for the read of ``layer``; retry a failure, then recompute what stays unreadable."""
        while True:
            try:
                ld.transfer.wait()
                return
            except (DmaError, PoisonError) as exc:
                if ld.attempts > self.max_retries:
                    self._recover(layer, ld, exc)
                    return
                ld.attempts += 1
                self.counters["load_retries"] += 1
                ld.transfer = self.store.read(ld.extents, ld.host)

    def _recover(self, layer: int, ld: FailedLoad, cause: Exception) -> None:
        """Read chunk by chunk; recompute the unreadable ones from the tokens and rewrite them."""
        bad = []
        if ld.firsts is not None:
            firsts = ld.firsts
        else:
            assert ld.chunks is not None
            firsts = self.chunks.chunk_map(ld.chunks, ld.cap, ld.seq_len)[0]
        for c, (off, n) in firsts.items():
            try:
                self.store.read([Extent(c, n, off)], ld.host).wait()
            except (DmaError, PoisonError):
                bad.append((c, off, n))
        if not bad:
            return
        if self.recompute is None:
            raise KVLoadError(f"layer {layer}: {len(bad)} KV chunk(s) unreadable after "
                              f"{self.max_retries} retries ({cause}); pass model= to CxlCache so "
                              "lost chunks can be recomputed from the tokens") from cause
        keys, values = self.recompute(layer, ld.seq_len)
        image = torch.stack([keys, values]).to("cpu", self.dtype).contiguous()
        for c, off, n in bad:
            ld.host[off:off + n] = host_bytes(image)[self._image_to_image(off, ld.cap, ld.seq_len):][:n]
            self.store.scrub(c)  # same bytes back in place: its key and every sharer stay valid
            self.store.write([Extent(c, n, off)], ld.host).wait()
        self.counters["recomputed_chunks"] += len(bad)

    def _image_to_image(self, off: int, cap: int, new_cap: int) -> int:
        """Translate a byte offset in an image of ``cap`` tokens to one of ``new_cap`` tokens."""
        assert self.chunks.layout is not None
        tb = self.chunks.layout.piece_token_bytes
        run, token = divmod(off // tb, cap)
        return (run * new_cap + token) * tb
