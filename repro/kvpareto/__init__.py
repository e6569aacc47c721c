"""KV Pareto (../shared/papers/kv-pareto.md), the strategy in kvzoo/cache/kvpareto.py and the 4-bit weights of
kvzoo/weightquant:
    analysis       configurations, their memory and accuracy, the frontier and the chosen point (§4, Figure 2)
    memory_model   total inference memory, the Appendix I estimate beside the measurement
    frontier       python -m repro.kvpareto.frontier      Figure 2: the frontier search
    memory         python -m repro.kvpareto.memory        Appendix I: estimated against measured memory
    weights_ppl    python -m repro.kvpareto.weights_ppl   §4.3: 4-bit weights' (RTN, AWQ) cost on perplexity
    bench          python -m repro.kvpareto.bench         §4.3: the W4A16 matmul kernel on a CUDA GPU
"""


