"""Run one cache-less forward and collect something from every layer's attention input."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def per_layer_attention(model, ids: Tensor, fn: Callable) -> list:
    """fn(attn, x, pos) for every layer in order, x (1, T, hidden) the attention input (after RMSNorm) and
    pos its Positions, during one forward of ids (T,) without a cache: the list of what fn returns."""
    out = []
    handles = [block.attn.register_forward_pre_hook(lambda attn, args: out.append(fn(attn, args[0], args[1])))
               for block in model.layers]
    try:
        with torch.no_grad():
            model(ids[None].to(model.device))
    finally:
        for h in handles:
            h.remove()
    return out
