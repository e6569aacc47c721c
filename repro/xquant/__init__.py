"""XQuant (Tomar, Hooper et al., ../shared/papers/xquant.md), the strategy in kvzoo/cache/xquant.py:
    analysis   Appendix B statistics: the outlier channel of X U_k, predicted from the weights
    outliers   python -m repro.xquant.outliers   Appendix B (Table B.2) on any model
    bench      python -m repro.xquant.bench      §3.4: the rematerializing decode step on a CUDA GPU
"""


