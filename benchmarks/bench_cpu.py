"""CPU benchmark: fp4attn's C backend (quantization included) next to torch's own CPU SDPA (FP32)
on the same shapes, in one run. Prints a table and writes bench_cpu.csv (headed by the command,
the CPU and the software versions, see provenance.py) and bench_cpu.png (if matplotlib exists)
into --out; the default writes the committed result set, benchmarks/results/.

    python benchmarks/bench_cpu.py [--quick] [--precision fp4|int8] [--decode] [--out benchmarks/results]

Target: at most 5x torch's CPU SDPA time at B=1, H=8, N=1024, D=64. --precision int8 times the
8-bit trainable attention instead, forward and forward + backward against torch's CPU SDPA with
its autograd, into bench_cpu_int8.csv / .png. --decode times fp4attn.decode on an FP4KVCache
(its C backend reads the FP4 rows) against torch's CPU SDPA on the same cache dequantized to FP32
beforehand (what the decode computes with; the dequantization is not timed), into
bench_cpu_decode.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4attn  # noqa: E402
from fp4attn.sdpa import ORIGINAL_SDPA  # noqa: E402
from provenance import ROOT, announce, cpu_description, write_csv  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: thread pool start, first-touch of buffers
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_int8(shapes, repeats: int) -> list[dict]:
    """Forward (no grad) and forward + backward of precision="int8" and of torch's SDPA."""
    rows = []
    for B, H, N, D, causal in shapes:
        q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, N, D)

        def fwd(fn):
            def run():
                with torch.no_grad():
                    fn(q, k, v, is_causal=causal)
            return run

        def fwd_bwd(fn):
            return lambda: fn(q, k, v, is_causal=causal).backward(g)

        int8 = lambda q, k, v, is_causal: fp4attn.sdpa(q, k, v, is_causal=is_causal, precision="int8")  # noqa: E731
        t = {name: median_time(make(fn), repeats) for name, make, fn in (
            ("int8_fwd", fwd, int8), ("torch_fwd", fwd, ORIGINAL_SDPA),
            ("int8_fwd_bwd", fwd_bwd, int8), ("torch_fwd_bwd", fwd_bwd, ORIGINAL_SDPA))}
        rows.append({"B": B, "H": H, "N": N, "D": D, "causal": causal,
                     **{f"{k}_ms": 1e3 * v for k, v in t.items()},
                     "fwd_ratio": t["int8_fwd"] / t["torch_fwd"],
                     "fwd_bwd_ratio": t["int8_fwd_bwd"] / t["torch_fwd_bwd"]})
    return rows


def report(rows: list[dict], header: list[str], cells, csv_path: str, head) -> None:
    """Prints rows as a markdown table (cells(row): its cell strings) and writes them to csv_path."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(cells(r)) + " |")
    os.makedirs(os.path.dirname(csv_path), exist_ok=True)
    write_csv(csv_path, head, rows)


def run_decode(quick: bool, repeats: int) -> list[dict]:
    """One decode call (nq query positions, the last of each sequence) on L cached tokens."""
    shapes = [(1, 9, 3, 4096, 64, 1), (4, 32, 8, 8192, 128, 1)]
    if not quick:
        shapes += [(1, 9, 3, 4096, 64, 4), (1, 32, 8, 8192, 128, 1), (1, 32, 32, 8192, 128, 1),
                   (1, 32, 8, 32768, 128, 1)]
    rows = []
    for B, Hq, Hkv, L, D, nq in shapes:
        cache = fp4attn.FP4KVCache(B, Hkv, D, dtype=torch.float32, device="cpu", max_tokens=L)
        k = torch.randn(B, Hkv, L, D)
        cache.append(k, torch.randn_like(k))
        q = torch.randn(B, Hq, nq, D)
        kd, vd = cache.dequantize()
        mask = torch.ones(nq, L, dtype=torch.bool).tril(L - nq)  # the last nq positions
        t_fp4 = median_time(lambda: fp4attn.decode(q, cache), repeats)
        t_ref = median_time(lambda: ORIGINAL_SDPA(q, kd, vd, attn_mask=mask, enable_gqa=Hq != Hkv), repeats)
        # the GQA group's query heads as query rows of their KV head (the same result, K and V
        # read once per KV head instead of once per query head)
        G = Hq // Hkv
        qf, mf = q.view(B, Hkv, G * nq, D), mask.repeat(G, 1)
        t_fold = median_time(lambda: ORIGINAL_SDPA(qf, kd, vd, attn_mask=mf), repeats) if G > 1 else t_ref
        rows.append({"B": B, "Hq": Hq, "Hkv": Hkv, "L": L, "D": D, "nq": nq, "fp4attn_decode_ms": 1e3 * t_fp4,
                     "torch_sdpa_fp32_dequantized_ms": 1e3 * t_ref,
                     "torch_sdpa_fp32_folded_ms": 1e3 * t_fold, "ratio": t_fp4 / min(t_ref, t_fold)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the target shape and one more")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precision", choices=("fp4", "int8"), default="fp4")
    ap.add_argument("--decode", action="store_true", help="decode on the FP4 KV cache instead")
    ap.add_argument("--out", default=RESULTS,
                    help="folder for bench_cpu.csv/.png (default: benchmarks/results)")
    args = ap.parse_args()
    head = announce(cpu_description())
    if args.decode:
        report(run_decode(args.quick, args.repeats),
               ["B", "heads (q/kv)", "L", "D", "nq", "fp4attn.decode ms",
                "torch SDPA FP32 (dequantized) ms", "the same, GQA folded ms", "ratio to the faster"],
               lambda r: [str(r["B"]), f"{r['Hq']}/{r['Hkv']}", str(r["L"]), str(r["D"]), str(r["nq"]),
                          f"{r['fp4attn_decode_ms']:.1f}", f"{r['torch_sdpa_fp32_dequantized_ms']:.1f}",
                          f"{r['torch_sdpa_fp32_folded_ms']:.1f}", f"{r['ratio']:.2f}x"],
               os.path.join(args.out, "bench_cpu_decode.csv"), head)
        return 0

    shapes = [(1, 8, 1024, 64, False), (1, 8, 1024, 64, True)]
    if not args.quick:
        shapes += [(1, 8, 256, 64, False), (1, 8, 2048, 64, False), (1, 8, 4096, 64, False),
                   (1, 8, 1024, 128, False), (1, 8, 2048, 128, True), (2, 9, 512, 64, True)]
    def shape_cells(r):
        return [str(r[k]) for k in ("B", "H", "N", "D", "causal")]

    if args.precision == "int8":
        report(run_int8(shapes, args.repeats),
               ["B", "H", "N", "D", "causal", "int8 fwd ms", "torch fwd ms", "ratio", "int8 fwd+bwd ms",
                "torch fwd+bwd ms", "ratio"],
               lambda r: shape_cells(r) + [f"{r['int8_fwd_ms']:.1f}", f"{r['torch_fwd_ms']:.1f}",
                                           f"{r['fwd_ratio']:.2f}x", f"{r['int8_fwd_bwd_ms']:.1f}",
                                           f"{r['torch_fwd_bwd_ms']:.1f}", f"{r['fwd_bwd_ratio']:.2f}x"],
               os.path.join(args.out, "bench_cpu_int8.csv"), head)
        return 0
    rows = []
    for B, H, N, D, causal in shapes:
        q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
        t_fp4 = median_time(lambda: fp4attn.sdpa(q, k, v, is_causal=causal), args.repeats)
        t_ref = median_time(lambda: ORIGINAL_SDPA(q, k, v, is_causal=causal), args.repeats)
        rows.append({"B": B, "H": H, "N": N, "D": D, "causal": causal,
                     "fp4attn_ms": 1e3 * t_fp4, "torch_sdpa_fp32_ms": 1e3 * t_ref,
                     "ratio": t_fp4 / t_ref})
    report(rows, ["B", "H", "N", "D", "causal", "fp4attn ms", "torch SDPA FP32 ms", "ratio"],
           lambda r: shape_cells(r) + [f"{r['fp4attn_ms']:.1f}", f"{r['torch_sdpa_fp32_ms']:.1f}",
                                       f"{r['ratio']:.2f}x"],
           os.path.join(args.out, "bench_cpu.csv"), head)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"N={r['N']} D={r['D']}{' c' if r['causal'] else ''}" for r in rows]
        x = range(len(rows))
        plt.figure(figsize=(8, 3.5))
        plt.bar([i - 0.2 for i in x], [r["fp4attn_ms"] for r in rows], 0.4, label="fp4attn (C)")
        plt.bar([i + 0.2 for i in x], [r["torch_sdpa_fp32_ms"] for r in rows], 0.4, label="torch SDPA FP32")
        plt.xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
        plt.ylabel("ms")
        plt.title(head["hardware"], fontsize=8)
        plt.legend()
        plt.tight_layout()
        plt.savefig(os.path.join(args.out, "bench_cpu.png"), dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")
    target = next(r for r in rows if (r["N"], r["D"], r["causal"]) == (1024, 64, False))
    print(f"target shape B=1 H=8 N=1024 D=64: {target['ratio']:.2f}x torch CPU SDPA (goal <= 5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
