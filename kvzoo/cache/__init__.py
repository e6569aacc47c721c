"""KV-cache strategies. Importing this package registers every built-in strategy."""

from kvzoo.cache.base import (CacheSpec, LayerCache, ModelCache, Positions, attend, fp16_kv_nbytes,
                              get_strategy, list_caches, register)
from kvzoo.cache import fp16, innerq, kivi  # noqa: F401  (register "fp16", "innerq", "kivi", "kivi-pre")
from kvzoo.cache import squat, xquant, xquant_cl  # noqa: F401  (register "squat", "squat-pre", "xquant", "xquant-cl")
from kvzoo.cache import alignedkv, kvpareto  # noqa: F401  (register "alignedkv", "kvpareto")

__all__ = ["CacheSpec", "LayerCache", "ModelCache", "Positions", "attend", "fp16_kv_nbytes",
           "get_strategy", "list_caches", "register"]
