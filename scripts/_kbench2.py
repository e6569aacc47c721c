import sys, torch
sys.path.insert(0, '.')
import torch.nn.functional as F
from kvzoo.kernels.innerq_attention import innerq_decode_attention
from scripts._old_attn import innerq_decode_attention as old_attn
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

H, Hq, d = 8, 32, 128
for B, N in ((1, 131072), (8, 32768)):
    k = torch.randn(B, H, N, d, device='cuda', dtype=torch.float16); v = torch.randn_like(k)
    q = torch.randn(B, Hq, d, device='cuda', dtype=torch.float16)
    kq, vq = packed(k.float(), 2, -1, "asym"), packed(v.float(), 2, -2, "asym")
    win = k[:, :, :128].contiguous()
    print(B, N, "new", timeit(lambda: innerq_decode_attention(q, *kq, *vq, win, win, 2)) * 1e3,
          "old", timeit(lambda: old_attn(q, *kq, *vq, win, win, 2)) * 1e3)
    del k, v
