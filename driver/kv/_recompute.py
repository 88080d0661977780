"""Recompute lost KV from the tokens: record the forward calls, replay them on a fresh cache.

The recorder keeps the token ids (and masks / positions) of every forward call made with the
``CxlCache``; replaying exactly those calls, with the same shapes, on a ``DynamicCache`` yields
bit-identical KV on a deterministic backend, so a chunk lost to a poisoned or failed load is
restored without changing a single token. It costs a re-run of the generation so far: the fault
path, not the fast path.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["ForwardRecorder"]


class ForwardRecorder:
    """A forward pre-hook on ``model`` recording the calls that use ``cache``."""

    def __init__(self, model: torch.nn.Module, cache: object) -> None:
        self.model = model
        self.cache = cache
        self.calls: list[dict[str, Any]] = []
        self._replaying = False
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
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
        lay = fresh.layers[layer]
        return lay.keys[:, :, :upto], lay.values[:, :, :upto]

    def remove(self) -> None:
        self._handle.remove()
        self.calls.clear()
