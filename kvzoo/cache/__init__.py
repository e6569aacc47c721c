"""KV-cache strategies. Importing this package registers every built-in strategy."""

from kvzoo.cache.base import (CacheSpec, Chunk, LayerCache, ModelCache, Positions, attend, fp16_kv_nbytes,
                              get_strategy, list_caches, register)
from kvzoo.cache.store import Codec, GroupCodec, Window, WindowedStore
from kvzoo.cache import fp16, innerq, kivi  # noqa: F401  (register "fp16", "innerq", "kivi", "kivi-pre")
from kvzoo.cache import squat, xquant, xquant_cl  # noqa: F401  (register "squat", "squat-pre", "xquant", "xquant-cl")
from kvzoo.cache import alignedkv, int8, kvpareto  # noqa: F401  (register "alignedkv", "int8", "kvpareto")

__all__ = ["CacheSpec", "Chunk", "Codec", "GroupCodec", "LayerCache", "ModelCache", "Positions", "Window",
           "WindowedStore", "attend", "fp16_kv_nbytes", "get_strategy", "list_caches", "register"]
