"""int8: the smallest strategy, written to be copied. Keys (after RoPE) and values as 8-bit codes, one
scale and zero per token and head, every token quantized as it is stored (no windows).

Paper: none; round-to-nearest per-token quantization, the simplest KV quantizer (KV Pareto's per-token
granularity with one group per head vector).

Stored per layer, in the shared store (kvzoo/cache/store.py), B rows, H = n_kv_heads, d = head_dim:
    codes  int32 (B, H, L, d/4)   four 8-bit codes per word, K and V each
    scale, zero  fp16 (B, H, L, 1)  per token and head, K and V each
Bytes per token, per layer and KV head: 2 * (d + 4); d = 64: 136 against 256 for fp16 (0.53).
Decode: eagerly through the store (WindowedStore.attend); in a CUDA graph (WholeStep) through the fused kernel of
kvzoo/kernels/outer_attention.py over the codes (WindowedStore.attend_token_kernel), whose quantized runs on an
H100/H200 at head_dim 128 take kvzoo/kernels/token_hopper.py.
Option bits=16 keeps the rows at the model's precision: the lossless setting every strategy has.
"""

from dataclasses import dataclass

from kvzoo.cache.base import Chunk, LayerCache, StaticStep, register
from kvzoo.cache.store import GroupCodec, Window, WindowedStore
from kvzoo.graphs import WholeStep


@dataclass(frozen=True)
class Int8Options:
    bits: int = 8

    def __post_init__(self):
        if self.bits not in (8, 16):
            raise ValueError(f"int8 bits must be 8, or 16 (not quantized), got {self.bits}")


@register("int8")
class Int8Cache(WholeStep, LayerCache):
    Options = Int8Options
    window = Window(sink=0, recent=0, group=1)      # what is quantized when: every token, as it is stored

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        w, d, lead = layer.q_proj.weight, layer.head_dim, (batch_size, layer.n_kv_heads)
        # one group of d channels per token (per_channel=False), buffers for max_len tokens
        codecs = {name: GroupCodec(lead, max_len, d, self.opts.bits, d, False, w.dtype, w.device) for name in "kv"}
        self.store = WindowedStore(self.window, codecs, lead, w.dtype, w.device)

    def append(self, x, q, k, v, pos, held=False) -> Chunk:
        q, k = self.attn.rope(q, k, pos.ids)
        self.length, seen, after = self.store.append_read(self.length, {"k": k, "v": v}, held)
        return Chunk(q, seen["k"], seen["v"], *((after["k"], after["v"]) if held else ()))

    def decode(self, x, q, k, v, pos):
        """One token: attention computed from the codes (store.attend), then the token stored."""
        if not self.length:
            return self.prefill(x, q, k, v, pos)
        q, k = self.attn.rope(q, k, pos.ids)
        out = self.store.attend(q, self.length, {"k": k, "v": v}, pos.mask)
        self.length = self.store.append(self.length, {"k": k, "v": v})
        return out

    # ---- the static step (WholeStep: CUDA graphs, kvzoo/graphs.py): one fused kernel over the codes ----------
    def can_decode_static(self, padded: bool) -> bool:
        return not self.simulated and self.length > 0 and self.store.token_kernel_serves(padded, self.attn,
                                                                                         self.max_len)

    def static_phase(self) -> str:
        return self.store.phases(self.length)

    def decode_static(self, x, q, k, v, step: StaticStep):
        q, k = self.attn.rope(q, k, step.ids)
        return self.store.attend_token_kernel(q, self.length, step, {"k": k, "v": v})

    def nbytes(self) -> int:
        return self.store.nbytes(self.length)

    def formula_nbytes(self, length: int) -> int:
        return self.store.formula_nbytes(length)
