"""SQuat (Wang et al., ../shared/papers/squat.md), the strategy in kvzoo/cache/squat.py:
    analysis   Figure 2: query subspaces and the attention-score error of SQuat vs KIVI
    figure2    python -m repro.squat.figure2    Figure 2 on any model
    bench      python -m repro.squat.bench      Appendix C: SQuat's quantization cost on a CUDA GPU
"""


