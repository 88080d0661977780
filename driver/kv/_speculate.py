"""Layer l+1's query, guessed during layer l (InfiniGen, OSDI'24): what hot attention prefetches by.

The residual stream changes little from one layer to the next, so layer l+1's query projection
applied to layer l's attention input (already normalised by layer l's input norm) is close to the
query layer l+1 will compute. A forward pre-hook on every attention module of the model keeps its
input and rotary embedding; :meth:`Speculator.query` projects layer l's with layer l+1's ``q_proj``
and rotates it (Llama's rotary embedding, ``rotate_half``). InfiniGen projects with a partial
weight to save compute; the whole ``q_proj`` is one matrix-vector product per layer in decode.
A model whose attention modules have no ``q_proj`` and ``layer_idx`` gets no speculation (the
engine then predicts from the previous step's choice).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Speculator"]


class Speculator:
    """Hooks on ``model``'s attention modules; :meth:`query` guesses the next layer's query."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._modules: dict[int, torch.nn.Module] = {}
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._handles = []
        for module in model.modules():
            layer = getattr(module, "layer_idx", None)
            if isinstance(layer, int) and isinstance(getattr(module, "q_proj", None), torch.nn.Module):
                self._modules[layer] = module
                self._handles.append(module.register_forward_pre_hook(self._keep(layer), with_kwargs=True))

    def _keep(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            rotary = kwargs.get("position_embeddings")
            if isinstance(hidden, torch.Tensor) and isinstance(rotary, tuple) and len(rotary) == 2:
                self._seen[layer] = (hidden[:, -1:], rotary[0][:, -1:], rotary[1][:, -1:])
        return hook

    def query(self, layer: int, source: int) -> torch.Tensor | None:
        """Layer ``layer``'s query for the last token, ``(B, Hq, 1, D)``, from layer ``source``'s
        input; None when there is nothing to guess from."""
        module, seen = self._modules.get(layer), self._seen.get(source)
        if module is None or seen is None:
            return None
        hidden, cos, sin = seen
        proj = module.q_proj
        # a plain Linear is F.linear exactly; the module call costs several times the product here
        q = F.linear(hidden, proj.weight, proj.bias) if type(proj) is torch.nn.Linear else proj(hidden)
        # q: (B, 1, Hq * D)
        head_dim = cos.shape[-1]
        q = q.view(*hidden.shape[:2], -1, head_dim).transpose(1, 2)  # (B, Hq, 1, D)
        half = head_dim // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()
