"""Decode benchmark: one generation step of attention on a long KV cache, torch SDPA (flash and
cuDNN backends) on an FP16 cache against fp4attn.decode on the FP4 cache (docs/SPEC.md section 6),
on the same keys and values in the same run.

For every (B, L, Hq/Hkv, D, nq): q [B, Hq, nq, D] against L cached tokens. Timing as
bench_attention.py (L2 flushed before every call, warm-up, CUDA events, median of --reps).
Bandwidth counts the bytes each method must read: the FP16 cache for torch (2 x B x Hkv x L x D x 2),
the FP4 cache for fp4attn (codes, E4M3 scales and the row scales of K and V, and the residual
ring of the newest tokens), against the device-to-device copy bandwidth; fp4attn_no_residual_ms
times the same cache's stored rows alone (decode_paged without the ring): the residual's cost. nq > 1 (speculative decoding) runs torch without a mask (its
is_causal is top-left, not "the last nq positions"); the bytes read are the same.
Torch runs twice per backend with GQA: as a user calls it (enable_gqa=True), and with the group's
query heads folded into the query rows (q viewed as [B, Hkv, G nq, D]: the same result without a
mask, K and V read once per KV head; its flash path otherwise reads them once per query head at
nq > 1). speedup_vs_best_torch is against the fastest of all; speedup_vs_torch_as_called against
the faster unfolded backend.
A last column times the same call without a cache, fp4attn.sdpa on the FP16 keys and values (FP4
attention quantizing them on the fly: the fused decode kernel where the dispatch picks it), against
flash: the cost of plain decode-shaped calls.
Prints a table and writes bench_decode.csv into --out (default: benchmarks/results/).
Configurations whose FP16 cache would exceed --max-gb are skipped.

  python benchmarks/bench_decode.py
  python benchmarks/bench_decode.py --quick --out bench_out
  python benchmarks/bench_decode.py --quick --dims 64     # the quick sweep at head dim 64
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4attn  # noqa: E402
from bench_attention import RESULTS, start_gpu_run  # noqa: E402
from provenance import print_table, write_csv  # noqa: E402

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover
    SDPBackend = sdpa_kernel = None


def torch_fn(name, q, k, v, folded=False):
    """Torch SDPA on one backend; folded: the GQA group's query heads as query rows of their KV
    head (the unmasked result is the same, as a view of q's memory)."""
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]
    B, Hq, nq, D = q.shape
    if folded:
        q = q.view(B, k.shape[1], (Hq // k.shape[1]) * nq, D)

    def fn():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])

    return fn


def best_torch_tbps(row) -> float:
    """Bandwidth of the faster torch backend on the FP16 cache (its time: fp4attn's x speedup)."""
    return row["fp16_cache_mb"] / 1e3 / (row["fp4attn_ms"] * row["speedup_vs_best_torch"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="B in {1, 8}, L in {8K, 32K}, D=128 (or --dims)")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-gb", type=float, default=40.0, help="largest FP16 cache to build")
    ap.add_argument("--dims", default=None, help="comma-separated head dims (overrides the sweep's)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA GPU")
        return 1
    os.makedirs(args.out, exist_ok=True)
    if args.quick:
        batches, lens, heads, dims, nqs = [1, 8], [8192, 32768], [(32, 8), (32, 32)], [128], [1, 4]
    else:
        batches, lens, heads, dims, nqs = [1, 8, 64], [8192, 32768, 131072], [(32, 8), (32, 32)], [64, 128], [1, 4]
    if args.dims:
        dims = [int(d) for d in args.dims.split(",")]
    timer, bw, head = start_gpu_run()
    rows, t0 = [], time.time()
    path = os.path.join(args.out, "bench_decode.csv")
    for D, (Hq, Hkv), B, L, nq in itertools.product(dims, heads, batches, lens, nqs):
        fp16_bytes = 2 * B * Hkv * L * D * 2
        if fp16_bytes > args.max_gb * 1e9:
            continue
        g = torch.Generator(device="cuda").manual_seed(B + L + D)
        k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16, generator=g)
        q = torch.randn(B, Hq, nq, D, device="cuda", dtype=torch.float16, generator=g)
        cache = fp4attn.FP4KVCache(B, Hkv, D, dtype=torch.float16, device="cuda", max_tokens=L)
        cache.append(k, v)
        # what the decode reads: the pages and the residual ring
        fp4_bytes = sum(t.numel() * t.element_size() for t in (*cache.storage()[:6], cache.res_k, cache.res_v))
        row = {"D": D, "Hq": Hq, "Hkv": Hkv, "B": B, "L": L, "nq": nq,
               "fp16_cache_mb": fp16_bytes / 1e6, "fp4_cache_mb": fp4_bytes / 1e6}
        ms = timer.time(lambda: fp4attn.decode(q, cache), args.reps)
        row["fp4attn_ms"], row["fp4attn_tbps"] = ms, fp4_bytes / ms / 1e9
        # the same cache's stored rows only (no residual split): what the residual costs
        row["fp4attn_no_residual_ms"] = timer.time(
            lambda: fp4attn.decode_paged(q, *cache.storage(), cache.seq_lens), args.reps)
        best = as_called = float("inf")  # the fastest torch call's ms, and unfolded
        for name, folded in itertools.product(("flash", "cudnn"), (False, True)):
            col = f"{name}_folded" if folded else name
            if folded and Hq == Hkv:  # nothing to fold
                row[f"{col}_ms"] = float("nan")
                continue
            try:
                ms_b = timer.time(torch_fn(name, q, k, v, folded), args.reps)
            except RuntimeError as exc:
                print(f"  {col} unavailable: {str(exc).splitlines()[0][:90]}")
                ms_b = float("nan")
            row[f"{col}_ms"] = ms_b
            if not folded:
                row[f"{name}_tbps"] = fp16_bytes / ms_b / 1e9
            if ms_b == ms_b:
                best = min(best, ms_b)
                as_called = as_called if folded else min(as_called, ms_b)
        row["speedup_vs_best_torch"] = best / ms
        row["speedup_vs_torch_as_called"] = as_called / ms
        row["fp4attn_frac_copy_bw"] = row["fp4attn_tbps"] * 1e3 / bw
        # the same call without a cache: fp4attn.sdpa on the FP16 keys and values (FP4 attention,
        # quantized on the fly: the fused decode kernel where the dispatch picks it)
        row["sdpa_ms"] = timer.time(lambda: fp4attn.sdpa(q, k, v, enable_gqa=Hq != Hkv), args.reps)
        row["sdpa_vs_flash"] = row["sdpa_ms"] / row["flash_ms"]
        rows.append(row)
        write_csv(path, head, rows)  # after every row: a run cut short keeps what it measured
        print(f"D={D:<3} {Hq}/{Hkv:<2} B={B:<2} L={L:<6} nq={nq} | fp4attn {ms:7.3f} ms "
              f"{row['fp4attn_tbps']:4.2f} TB/s ({100 * row['fp4attn_frac_copy_bw']:3.0f}% copy; "
              f"{row['fp4attn_no_residual_ms']:7.3f} without the residual) | "
              f"flash {row['flash_ms']:7.3f} cudnn {row['cudnn_ms']:7.3f} ms "
              f"folded {row['flash_folded_ms']:7.3f} / {row['cudnn_folded_ms']:7.3f} ms "
              f"({best_torch_tbps(row):4.2f} TB/s) | "
              f"x{row['speedup_vs_best_torch']:.2f} | sdpa {row['sdpa_ms']:7.3f} ms "
              f"({row['sdpa_vs_flash']:.2f}x flash)", flush=True)
        del k, v, q, cache
        torch.cuda.empty_cache()
    print(f"\nwrote {path} ({time.time() - t0:.0f} s)")
    print()
    print_table(["D", "Hq/Hkv", "B", "L", "nq", "fp4attn ms", "TB/s", "% copy", "flash ms", "cuDNN ms",
                 "flash / cuDNN folded ms", "best torch TB/s", "speedup vs best torch",
                 "vs torch as called", "sdpa ms (no cache)", "sdpa / flash"],
                [[str(r["D"]), f"{r['Hq']}/{r['Hkv']}", str(r["B"]), f"{r['L'] // 1024}K", str(r["nq"]),
                  f"{r['fp4attn_ms']:.3f}", f"{r['fp4attn_tbps']:.2f}", f"{100 * r['fp4attn_frac_copy_bw']:.0f}",
                  f"{r['flash_ms']:.3f}", f"{r['cudnn_ms']:.3f}",
                  f"{r['flash_folded_ms']:.3f} / {r['cudnn_folded_ms']:.3f}", f"{best_torch_tbps(r):.2f}",
                  f"{r['speedup_vs_best_torch']:.2f}", f"{r['speedup_vs_torch_as_called']:.2f}",
                  f"{r['sdpa_ms']:.3f}", f"{r['sdpa_vs_flash']:.2f}"] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
