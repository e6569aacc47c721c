"""AlignedKV (Tan et al., ../shared/papers/alignedkv.md), the strategy in kvzoo/cache/alignedkv.py:
    analysis   Figure 9 and Table 1 replayed on real caches (bits read, QKᵀ / SV error)
    figure9    python -m repro.alignedkv.figure9    Figure 9 and Table 1 on any model
    greedy     python -m repro.alignedkv.greedy     Table 3: greedy generation equals fp16's
    bench      python -m repro.alignedkv.bench      Figure 10: decode attention latency on a CUDA GPU
"""


