"""Runs one fp4attn attention config a few times (for ncu / nsight): D, N, B, H, causal from argv."""
import sys

import torch

import fp4attn

D, N, B, H = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (128, 8192, 2, 16)
causal = len(sys.argv) > 5 and sys.argv[5] == "1"
q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
for _ in range(3):
    fp4attn.sdpa(q, k, v, is_causal=causal)
torch.cuda.synchronize()
print("ok")
