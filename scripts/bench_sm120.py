"""Quick throughput check of the sm120 FP4 attention kernel (kernel=2) against the generic
FP16-MMA FP4 kernel (kernel=1) and torch SDPA, end to end (quantization pre-pass included).

On an RTX 50xx / RTX PRO Blackwell (compute capability 12.x) built with sm_120a this times the
native block-scaled FP4 MMA kernel; anywhere else kernel=2 is the exact emulation (slow by
design: it only proves correctness). TOPS = 4*B*H*Nq*Nk*D / t, halved for causal.

    python scripts/bench_sm120.py [--heads 16] [--dims 64 128] [--lens 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F

import fp4attn  # noqa: F401  (registers torch.ops.fp4attn)


def time_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    ops = torch.ops.fp4attn
    cc = torch.cuda.get_device_capability()
    print(f"device {torch.cuda.get_device_name()} (cc {cc[0]}.{cc[1]}), torch {torch.__version__}")
    print(f"{'D':>4} {'N':>6} {'causal':>6} | {'sm120':>8} {'fp16mma':>8} {'sdpa':>8}   TOPS")
    for D in args.dims:
        for N in args.lens:
            for causal in (False, True):
                q, k, v = (
                    torch.randn(args.batch, args.heads, N, D, device="cuda", dtype=torch.float16)
                    for _ in range(3)
                )
                flops = 4.0 * args.batch * args.heads * N * N * D / (2 if causal else 1)
                row = []
                for fn in (
                    functools.partial(ops.attention, q, k, v, None, causal, D**-0.5, False, 2),
                    functools.partial(ops.attention, q, k, v, None, causal, D**-0.5, False, 1),
                    functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal),
                ):
                    row.append(flops / time_ms(fn, args.reps) / 1e9)
                print(f"{D:>4} {N:>6} {causal!s:>6} | " + " ".join(f"{x:8.1f}" for x in row))


if __name__ == "__main__":
    main()
