"""The uncompressed baseline: keys (after RoPE) and values kept at the model's activation precision.

Paper: none; this is the "fp16 cache" every KV-compression paper compares against.

Stored, per layer, in buffers preallocated for the whole generation (fixed shapes, index writes):
    k: (B, n_kv_heads, max_len, head_dim)   post-RoPE keys
    v: (B, n_kv_heads, max_len, head_dim)   values
Bytes per token: 2 * n_layers * n_kv_heads * head_dim * bytes(dtype), i.e. 2 bytes per element when the
model runs in fp16/bf16 (SmolLM2-135M: 2 * 30 * 3 * 64 * 2 = 23,040 B/token). Running the model in fp32
keeps the cache in fp32 too, so that this cache reproduces a cache-less forward exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvzoo.cache.base import Chunk, LayerCache, Positions, StaticStep, attend, register, used_nbytes
from kvzoo.graphs import WholeStep


@register("fp16")
class FP16Cache(WholeStep, LayerCache):
    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        weight = layer.q_proj.weight
        shape = (batch_size, layer.n_kv_heads, max_len, layer.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=weight.dtype, device=weight.device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=weight.dtype, device=weight.device), persistent=False)

    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        q, k = self.attn.rope(q, k, pos.ids)
        end = pos.start + q.shape[2]
        self.k[:, :, pos.start:end] = k
        self.v[:, :, pos.start:end] = v
        self.length = end
        return Chunk(q, self.k[:, :, :end], self.v[:, :, :end])

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        q, k = self.attn.rope(q, k, step.ids)
        self.k.index_copy_(2, step.slot, k)                       # k (B, Hkv, 1, d) into slot step.slot
        self.v.index_copy_(2, step.slot, v)
        return attend(q, self.k, self.v, step.mask)               # all max_len slots, unwritten ones masked

    def can_decode_static(self, padded: bool) -> bool:
        return True

    def nbytes(self) -> int:
        return used_nbytes(self.k, self.v, length=self.length)

    def formula_nbytes(self, length: int) -> int:
        attn = self.attn
        return self.batch_size * 2 * attn.n_kv_heads * attn.head_dim * self.k.element_size() * length
