"""Training-step attention benchmark: forward + backward of the 8-bit attention (SPEC_INT8) vs
torch SDPA's flash and cuDNN backends, on the same inputs.

For every (head dim, N, causal, dtype) it times out = attention(q, k, v); out.backward(dO):
  int8attn      fp4attn.sdpa(..., precision="int8") end to end (preparation kernels included)
  int8_fwd / int8_bwd / int8_prepare   device times of the forward kernel, the backward kernel and
                everything else the step launches (psi of the operands, dO terms, the dQ
                accumulator's memset and finish, the gradients' zero fills), from torch.profiler
                with the L2 flushed before each step
  int8det       the same step under torch.use_deterministic_algorithms(True) (dQ's key blocks
                added in a fixed order; int8det_bwd_ms its backward kernel)
  flash, cudnn  torch.nn.functional.scaled_dot_product_attention pinned to a backend
SageAttention (bench_attention.py's peer column) has no backward: sageattn 1.0.6 is a Triton
forward only, so it has no column here.
TFLOPS = 3.5 x the forward's 4*B*H*N^2*D (the backward counted as 2.5x the forward, as
FlashAttention does), halved for causal. Timing as bench_attention.py: L2 flushed before every
step, warm-up, CUDA events, median of --reps. Writes bench_backward.csv and .png into --out
(default: the committed result set, benchmarks/results/).

  python benchmarks/bench_backward.py                      # full sweep -> benchmarks/results
  python benchmarks/bench_backward.py --quick --out bench_out
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4attn  # noqa: E402
from bench_attention import (RESULTS, int_list, plot_tflops, profiled_kernels, sdpa_backend_fn,  # noqa: E402
                             start_gpu_run)
from provenance import print_table, write_csv  # noqa: E402


def step_fn(attn, q, k, v, grad):
    def fn():
        for t in (q, k, v):
            t.grad = None
        attn().backward(grad)

    return fn


def breakdown(fn, flush, calls: int = 3) -> tuple[float, float, float]:
    """(forward kernel, backward kernel, everything else the step launches: the preparation
    kernels, the dQ accumulator's memset and the gradients' allocations) ms per step, from
    torch.profiler, the L2 flushed before each step as for the end-to-end time."""
    fwd = bwd = other = 0.0
    for name, ms in profiled_kernels(fn, calls, flush):
        if "int8_forward" in name:
            fwd += ms / calls
        elif "int8_backward" in name:
            bwd += ms / calls
        else:
            other += ms / calls
    return fwd, bwd, other


def deterministic_times(fn, timer, reps) -> tuple[float, float]:
    """(step ms, backward kernel ms) of fn under torch.use_deterministic_algorithms(True), without
    the mode's NaN fill of new tensors (which the default mode does not pay either)."""
    import torch.utils.deterministic as det

    fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = False
    try:
        return timer.time(fn, reps), breakdown(fn, timer.flush)[1]
    finally:
        torch.use_deterministic_algorithms(False)
        det.fill_uninitialized_memory = fill


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sweep (~1 minute)")
    ap.add_argument("--out", default=RESULTS, help="output folder (default: benchmarks/results)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=16384, help="B*N per config")
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--dims", default=None, help="comma-separated head dims")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_backward: needs a CUDA GPU")
        return 1
    os.makedirs(args.out, exist_ok=True)
    seqs, dims = ([1024, 4096, 16384], [64, 128]) if args.quick else ([1024, 2048, 4096, 8192, 16384], [64, 128])
    dtypes = [torch.bfloat16] if args.quick else [torch.float16, torch.bfloat16]
    reps = args.reps or (5 if args.quick else 15)
    seqs = int_list(args.seqs) if args.seqs else seqs
    dims = int_list(args.dims) if args.dims else dims
    timer, _, head = start_gpu_run()
    rows, t_start = [], time.time()
    for dtype in dtypes:
        for D in dims:
            H = 2048 // D
            for N in seqs:
                B = max(1, args.tokens // N)
                for causal in (False, True):
                    g = torch.Generator(device="cuda").manual_seed(N + D)
                    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g)
                                     for _ in range(4))
                    for t in (q, k, v):
                        t.requires_grad_()
                    flops = 3.5 * 4 * B * H * N * N * D * (0.5 if causal else 1.0)
                    row = {"dtype": str(dtype).replace("torch.", ""), "D": D, "N": N, "B": B, "H": H,
                           "causal": causal}
                    ours = step_fn(lambda: fp4attn.sdpa(q, k, v, is_causal=causal, precision="int8"),
                                   q, k, v, dout)
                    ms = timer.time(ours, reps)
                    row["int8attn_ms"], row["int8attn_tflops"] = ms, flops / ms / 1e9
                    row["int8_fwd_ms"], row["int8_bwd_ms"], row["int8_prepare_ms"] = \
                        breakdown(ours, timer.flush)
                    ms_d, row["int8det_bwd_ms"] = deterministic_times(ours, timer, reps)
                    row["int8det_ms"], row["int8det_tflops"] = ms_d, flops / ms_d / 1e9
                    for name in ("flash", "cudnn"):
                        try:
                            ms_b = timer.time(step_fn(sdpa_backend_fn(name, q, k, v, causal), q, k, v, dout), reps)
                        except RuntimeError as exc:  # backend unavailable for this config
                            print(f"  {name} unavailable: {str(exc).splitlines()[0][:100]}")
                            ms_b = float("nan")
                        row[f"{name}_ms"], row[f"{name}_tflops"] = ms_b, flops / ms_b / 1e9
                    rows.append(row)
                    print(f"{row['dtype']:>8} D={D:<3} N={N:<6} causal={int(causal)} "
                          f"int8 {row['int8attn_tflops']:6.1f} TFLOPS ({ms:.2f} ms: fwd {row['int8_fwd_ms']:.2f} "
                          f"bwd {row['int8_bwd_ms']:.2f} prepare {row['int8_prepare_ms']:.2f}; "
                          f"deterministic {row['int8det_tflops']:6.1f}, bwd {row['int8det_bwd_ms']:.2f}) | "
                          f"flash {row['flash_tflops']:6.1f} cudnn {row['cudnn_tflops']:6.1f}", flush=True)
                    del q, k, v, dout
    path = os.path.join(args.out, "bench_backward.csv")
    write_csv(path, head, rows)
    print(f"\nwrote {path} ({time.time() - t_start:.0f} s)")
    plot(rows, os.path.join(args.out, "bench_backward.png"), head["hardware"])
    print("\nforward + backward TFLOPS (median):\n")
    print_table(["dtype", "D", "N", "causal", "int8attn", "int8det", "flash", "cudnn", "int8/flash",
                 "int8/cudnn", "fwd / bwd / prepare ms"],
                [[r["dtype"], str(r["D"]), str(r["N"]), str(int(r["causal"])), f"{r['int8attn_tflops']:.1f}",
                  f"{r['int8det_tflops']:.1f}", f"{r['flash_tflops']:.1f}", f"{r['cudnn_tflops']:.1f}",
                  f"{r['int8attn_tflops'] / r['flash_tflops']:.2f}",
                  f"{r['int8attn_tflops'] / r['cudnn_tflops']:.2f}",
                  f"{r['int8_fwd_ms']:.2f} / {r['int8_bwd_ms']:.2f} / {r['int8_prepare_ms']:.2f}"]
                 for r in rows])
    return 0


def plot(rows, path, dev):
    plot_tflops(rows, path, dev, [("int8attn", "fp4attn int8"), ("flash", "sdpa flash"),
                                  ("cudnn", "sdpa cudnn")], title="fwd+bwd ",
                ylabel="TFLOPS (bwd = 2.5 fwd)")


if __name__ == "__main__":
    sys.exit(main())
