"""The seam between a model's attention and a cache that chooses what attention reads.

transformers calls ``cache.update(k, v, layer)`` and then the attention function the model's
``config._attn_implementation`` names, with the query, the keys and values ``update`` returned and
the mask (``LlamaAttention.forward``); ``update`` never sees the query. A cache whose attention
reads only some KV (hot pages, heavy hitters) therefore routes its model's attention through
:func:`attention`, registered in transformers' ``AttentionInterface`` (and ``sdpa``'s mask
function in its ``AttentionMaskInterface``) as :data:`NAME`: its ``update`` leaves a
:class:`Pending` for the layer (:func:`expect`), and the function hands that layer's attention to
it. Without one it is ``sdpa`` itself, so a model routed here still serves any other cache as
before. A pending attention that no attention function took (the model's attention was not routed
here) is found at the next ``update`` of the thread, before a wrong token is produced, and raises.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NAME", "AttentionNotRouted", "Pending", "attention", "check", "expect", "repeat_mask", "route", "taken",
           "unroute"]

NAME = "cxlemu"  # the name the attention function and its mask are registered under

#: ``f(module, query, attention_mask, **kwargs) -> (attn_output (B, q, Hq, D), attn_weights | None)``
Pending = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

_slot = threading.local()  # .layer, .fn: the attention the last update left, not taken yet
_routes: dict[int, tuple[int, str]] = {}  # id(model) -> (caches routing it, its implementation before)
_lock = threading.Lock()
_registered = False


class AttentionNotRouted(RuntimeError):
    """A cache choosing what attention reads ran on a model whose attention is not routed to it."""


def expect(owner: object, layer: int, fn: Pending) -> None:
    """Layer ``layer``'s attention is ``fn`` (called by ``owner``'s ``update``, just before it)."""
    check(owner)
    _slot.owner, _slot.layer, _slot.fn = owner, layer, fn


def check(owner: object) -> None:
    """Raise if the attention ``owner``'s last ``update`` left was never taken. (Another
    owner's is dropped: its forward ended in an exception between update and attention.)"""
    fn = getattr(_slot, "fn", None)
    if fn is not None:
        _slot.fn = None
        if _slot.owner is owner:
            raise AttentionNotRouted(
                f"layer {_slot.layer}'s attention did not go through driver.kv's attention function: pass "
                "the model to the cache (CxlCache(..., model=model)), which routes it there, or set "
                f"model.set_attn_implementation({NAME!r}) after importing driver.kv.cache")


def taken(owner: object) -> None:
    """``owner`` computes its pending attention itself (a direct call, not through the model)."""
    if getattr(_slot, "owner", None) is owner:
        _slot.fn = None


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention function: the pending attention of ``module``'s layer, else sdpa."""
    fn = getattr(_slot, "fn", None)
    if fn is not None and _slot.layer == getattr(module, "layer_idx", None):
        _slot.fn = None
        return fn(module, query, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


def route(model: Any) -> None:
    """Route ``model``'s attention here (counted: :func:`unroute` restores it after the last)."""
    _register()
    with _lock:
        count, before = _routes.get(id(model), (0, model.config._attn_implementation))
        if not count:
            model.set_attn_implementation(NAME)
        _routes[id(model)] = (count + 1, before)


def unroute(model: Any) -> None:
    """One cache no longer needs ``model`` routed; the last one gives back its implementation."""
    with _lock:
        count, before = _routes.pop(id(model), (0, ""))
        if count > 1:
            _routes[id(model)] = (count - 1, before)
        elif count == 1:
            model.set_attn_implementation(before)


def repeat_mask(mask: torch.Tensor | None, positions: torch.Tensor, groups: int, q: int,
                kv_len: int) -> torch.Tensor | None:
    """The columns ``positions`` ``(B, Hkv, L)`` of a bool mask ``(B, 1|Hq, q, kv_len)`` for every
    query head, ``(B, Hq, q, L)``; None (no mask: nothing is padding) builds the causal one
    when ``q > 1`` (a query may read keys up to its own position) and stays None for one query."""
    if mask is None:
        if q == 1:
            return None
        rows = torch.arange(kv_len - q, kv_len, device=positions.device).view(1, 1, q, 1)
        mask = torch.arange(kv_len, device=positions.device).view(1, 1, 1, kv_len) <= rows
    b = positions.shape[0]
    pos = positions.repeat_interleave(groups, dim=1)  # (B, Hq, L)
    full = mask[..., :kv_len].expand(b, pos.shape[1], q, kv_len)
    return full.gather(-1, pos.unsqueeze(2).expand(-1, -1, q, -1))
