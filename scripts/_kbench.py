import sys, torch, time
sys.path.insert(0, '.')
import torch.nn.functional as F
from kvzoo.kernels.innerq_attention import innerq_decode_attention
from kvzoo.kernels.bench import *
from tests.test_kernels import packed

def timeit(fn, n=50):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n

x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x)
ms = timeit(lambda: y.copy_(x)); print(f"copy 1GiB: {2*2**30/ms/1e6:.0f} GB/s (read+write)")
del x, y
H, Hq, d = 8, 32, 128
for B, N in ((1, 131072), (8, 32768)):
    k = torch.randn(B, H, N, d, device='cuda', dtype=torch.bfloat16); v = torch.randn_like(k)
    q = torch.randn(B, Hq, 1, d, device='cuda', dtype=torch.bfloat16)
    ms = timeit(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    print(f"B={B} N={N} SDPA bf16: {ms*1e3:.1f} us, {2*k.nbytes/ms/1e6:.0f} GB/s")
    for mode in ("asym", "hybrid"):
        kq, vq = packed(k.float(), 2, -1, mode), packed(v.float(), 2, -2, mode)
        for dt in (torch.float16, torch.bfloat16):
            qq = q[:, :, 0].to(dt)
            win = k[:, :, :128].to(dt)
            nb = sum(t.nbytes for t in (*kq, *vq) if t is not None) + 2 * win.nbytes
            ms = timeit(lambda: innerq_decode_attention(qq, *kq, *vq, win, win, 2))
            print(f"B={B} N={N} innerq-2 {mode} {dt}: {ms*1e3:.1f} us, {nb/ms/1e6:.0f} GB/s, {nb/2**20:.0f} MiB")
    del k, v
