"""Attention forward benchmark: fp4attn (end to end and kernel only) vs torch SDPA backends.

For every (head dim, N, causal, dtype) it times, on the same inputs:
  fp4attn      fp4attn.sdpa end to end (quantization pre-pass included): the mean of a timing
               before and one after the baselines (fp4attn_spread: how far apart, relative; a row
               above 5 %, or end to end below the kernel alone, is flagged to rerun); with
               --precision int8 the 8-bit attention (SPEC_INT8), columns int8attn / int8_kernel /
               int8_prepass
  fp4_kernel   the attention kernel alone (median of its device times over 5 profiled calls,
               L2 flushed before each as for the end-to-end time), and fp4_prepass the pre-pass
               kernels alone (their summed device times per call, the mean of those calls); both
               from torch.profiler, so they do not add up to the end-to-end time (which includes
               the launches and the gaps between kernels)
  flash, cudnn, efficient   torch.nn.functional.scaled_dot_product_attention pinned to a backend
  sage         SageAttention's sageattn (INT8 Q K^T, FP16 P V; Triton) on the same inputs, when the
               package is importable (pip install sageattention==1.0.6: pure Python)
Timing: L2 flushed before every call (a 256 MB write), warm-up, CUDA events, median of --reps.
prepass % copy bw: bytes the pre-pass moves (prepass_bytes: each input read once, what it writes)
per second, over the device-to-device copy bandwidth (read + written).
TFLOPS = 4*B*H*N^2*D / t, halved for causal. Tokens per config: B*N = --tokens (B >= 1), H*D = 2048.
The kernel is the one fp4attn.sdpa picks; FP4ATTN_KERNEL forces one and is recorded in the header.
--short times the issue's short calls instead (B = 1, 32 query / 8 KV heads, head dim 128, N = 512,
1K, 2K, BF16, causal and not; torch and SageAttention with GQA as they offer it) into
bench_attention_short[_int8].csv.
Prints a table and writes bench_attention.csv (headed by the command, the GPU and the software
versions, see provenance.py) and bench_attention.png (bench_attention_int8.* for int8) into --out;
the default writes the committed result set, benchmarks/results/ (the full sweep). --quick fits in
about two minutes on an H200.

  python benchmarks/bench_attention.py                           # full sweep -> benchmarks/results
  python benchmarks/bench_attention.py --precision int8          # the 8-bit forward
  python benchmarks/bench_attention.py --quick --out bench_out
  python benchmarks/bench_attention.py --precision int8 --short  # B = 1, GQA 32/8, N <= 2K
  FP4ATTN_KERNEL=sm120 python benchmarks/bench_attention.py --quick --out bench_sm120
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover
    SDPBackend = sdpa_kernel = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4attn  # noqa: E402
from fp4attn.sdpa import PRECISIONS  # noqa: E402
from provenance import ROOT, announce, cpu_name, gpu_description, write_csv  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
# Names of the attention kernels per precision (every other kernel fp4attn launches is the
# pre-pass): attention_fwd_kernel (mma.sync), attention_fwd_sm90_kernel (wgmma),
# attention_sm120_kernel; int8_forward_kernel.
FWD_KERNELS = {"fp4": ("attention_fwd", "attention_sm120"), "int8": ("int8_forward",)}


class Timer:
    def __init__(self):
        self.flush_buf = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")

    def flush(self) -> None:
        """Evict the L2 (a 256 MB write)."""
        self.flush_buf.zero_()

    def time(self, fn, reps: int, warmup: int = 3) -> float:
        """Median milliseconds of fn() over reps calls, L2 flushed before each."""
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self.flush()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _device_events(fn, calls: int, before=None) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    return [(ev.name, (ev.device_time if hasattr(ev, "device_time") else ev.cuda_time) / 1e3)
            for ev in prof.events()
            if ev.device_type is not None and "cuda" in str(ev.device_type).lower()]


def profiled_kernels(fn, calls: int, flush=None) -> list[tuple[str, float]]:
    """(kernel name, ms) of every CUDA kernel that `calls` calls of fn launch, from torch.profiler
    (after one unprofiled warm-up call). With `flush` (Timer.flush): called before each call, as
    the end-to-end timing does, so the kernels start with a cold L2 like it; its own kernels are
    left out (by name: a name fn launches too is refused rather than miscounted)."""
    fn()
    torch.cuda.synchronize()
    if flush is None:
        return _device_events(fn, calls)
    flush_names = {name for name, _ in _device_events(flush, 1)}
    clash = flush_names & {name for name, _ in _device_events(fn, 1)}
    if clash:
        raise RuntimeError(f"the L2 flush launches kernels the timed call launches too: {clash}")
    return [(name, ms) for name, ms in _device_events(fn, calls, before=flush)
            if name not in flush_names]


def kernel_breakdown(fn, names, flush, calls: int = 5) -> tuple[float, float]:
    """(forward kernel ms: the median over `calls` profiled calls, pre-pass ms: the mean per call
    of the other kernels' summed times), the L2 flushed before each call."""
    fwd, pre = [], []
    for name, ms in profiled_kernels(fn, calls, flush):
        if any(k in name for k in names):
            fwd.append(ms)
        else:  # everything else fp4attn launches is the quantization pre-pass
            pre.append(ms)
    fwd_ms = statistics.median(fwd) if fwd else float("nan")
    pre_ms = sum(pre) / calls if pre else float("nan")
    return fwd_ms, pre_ms


def prepass_bytes(prec: str, q, k, causal: bool) -> int:
    """Bytes the pre-pass moves, each tensor counted once (Q, K and V of k's shape). FP4: Q, K, V
    read, K^ and V^ written as the FP16 values the workspace holds. INT8 (heuristics.h, the
    int8 plan): Q and K read, their codes written (a byte each); V read and a 16-bit copy written
    unless the sm90 kernel reads the caller's V itself (16-bit V, head dim 256 or at most 2K keys
    at head dim 64 / 4K at 128, twice that causal), when the pre-pass does not touch V."""
    e, nq, nk = q.element_size(), q.numel(), k.numel()
    if prec == "fp4":
        return (nq + 2 * nk) * e + 2 * nk * 2
    dp = 64 if q.shape[-1] <= 64 else 128 if q.shape[-1] <= 128 else 256
    short_keys = (2048 if dp == 64 else 4096) * (2 if causal else 1)
    sm90 = fp4attn._ops.attention_kernel(q.device.index or 0, q.shape[-1], "int8") == "sm90"
    v_in_place = sm90 and e == 2 and (dp == 256 or k.shape[-2] <= short_keys)
    return (nq + nk) * (e + 1) + (0 if v_in_place else nk * (e + 2))


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = timer.time(lambda: b.copy_(a), reps=10)
    del a, b
    return 2 * n / ms / 1e6


def int_list(text: str) -> list[int]:
    """"1024,4096" -> [1024, 4096] (comma-separated command-line lists)."""
    return [int(x) for x in text.split(",")]


def start_gpu_run() -> tuple[Timer, float, dict[str, str]]:
    """The timer, the device-to-device copy bandwidth (GB/s) and the printed result header of a
    GPU benchmark run."""
    timer = Timer()
    bw = copy_bandwidth(timer)
    head = announce(f"{gpu_description()}, device-to-device copy {bw:.0f} GB/s; host {cpu_name()}")
    return timer, bw, head


def sdpa_backend_fn(name, q, k, v, causal):
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}

    def fn():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

    return fn


def sage_fn(q, k, v, causal):
    """SageAttention's forward on the same inputs, or None where the package is missing."""
    try:
        from sageattention import sageattn
    except ImportError:
        return None
    return lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=causal)


def configs(args) -> list[tuple]:
    """(dtype, D, N, B, query heads, KV heads, causal) of every timed call."""
    if args.short:  # the short calls: one sequence, GQA 32/8, head dim 128
        return [(torch.bfloat16, 128, N, 1, 32, 8, causal)
                for N in (512, 1024, 2048) for causal in (True, False)]
    if args.quick:
        seqs, dims, causals, dtypes = [1024, 4096, 16384], [64, 128], [False, True], [torch.float16]
    else:  # head dim 256 for the 8-bit attention, whose Hopper forward serves it
        seqs = [1024, 2048, 4096, 8192, 16384, 32768]
        dims = [64, 128, 256] if args.precision == "int8" else [64, 128]
        causals, dtypes = [False, True], [torch.float16, torch.bfloat16]
    seqs = int_list(args.seqs) if args.seqs else seqs
    dims = int_list(args.dims) if args.dims else dims
    tokens = args.tokens or 16384
    return [(dtype, D, N, max(1, tokens // N), 2048 // D, 2048 // D, causal)
            for dtype in dtypes for D in dims for N in seqs for causal in causals]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sweep (~2 minutes)")
    ap.add_argument("--out", default=RESULTS, help="output folder (default: benchmarks/results)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="B*N per config (default 16384)")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths (overrides the sweep's)")
    ap.add_argument("--dims", default=None, help="comma-separated head dims (overrides the sweep's)")
    ap.add_argument("--short", action="store_true",
                    help="the short calls: B = 1, 32/8 heads, head dim 128, N = 512, 1K, 2K")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp4",
                    help="fp4 (SPEC) or int8 (SPEC_INT8) attention")
    args = ap.parse_args()
    if args.short and (args.quick or args.seqs or args.dims or args.tokens):
        ap.error("--short has its own shapes: it takes no --quick, --seqs, --dims or --tokens")
    prec = args.precision
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU")
        return 1
    os.makedirs(args.out, exist_ok=True)
    reps = args.reps or (10 if args.quick else 30)
    timer, bw, head = start_gpu_run()
    baselines = [] if args.no_baselines else ["flash", "cudnn", "efficient"]
    if baselines and sage_fn(None, None, None, False) is not None:
        baselines.append("sage")
    rows = []
    t_start = time.time()
    for dtype, D, N, B, H, Hkv, causal in configs(args):
        g = torch.Generator(device="cuda").manual_seed(N + D)
        q = torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
        row = {"dtype": str(dtype).replace("torch.", ""), "D": D, "N": N, "B": B, "H": H, "Hkv": Hkv,
               "causal": causal}

        def ours():
            return fp4attn.sdpa(q, k, v, is_causal=causal, enable_gqa=Hkv != H, precision=prec)

        ms = timer.time(ours, reps)  # and again after the baselines (below): clocks drift
        fwd_ms, pre_ms = kernel_breakdown(ours, FWD_KERNELS[prec], timer.flush)
        row[f"{prec}attn_ms"] = row[f"{prec}attn_tflops"] = float("nan")  # set below (column order)
        row[f"{prec}_kernel_ms"] = fwd_ms
        row[f"{prec}_kernel_tflops"] = flops / fwd_ms / 1e9
        row[f"{prec}_prepass_ms"] = pre_ms
        row["prepass_gbps"] = prepass_bytes(prec, q, k, causal) / pre_ms / 1e6
        row["prepass_frac_copy"] = row["prepass_gbps"] / bw
        for name in baselines:
            try:
                fn = sage_fn(q, k, v, causal) if name == "sage" else \
                    sdpa_backend_fn(name, q, k, v, causal)
                ms_b = timer.time(fn, reps)
                row[f"{name}_ms"] = ms_b
                row[f"{name}_tflops"] = flops / ms_b / 1e9
            except (RuntimeError, AssertionError, ValueError) as exc:  # unavailable here
                row[f"{name}_ms"] = row[f"{name}_tflops"] = float("nan")
                print(f"  {name} unavailable: {str(exc).splitlines()[0][:100]}")
        # end to end before and after the baselines: their mean, and how far apart they were
        # (within-configuration clock drift once put an end-to-end time below its kernel's)
        ms_after = timer.time(ours, reps)
        row[f"{prec}attn_ms"] = ms = (ms + ms_after) / 2
        row[f"{prec}attn_tflops"] = flops / ms / 1e9
        row[f"{prec}attn_spread"] = abs(ms - ms_after) * 2 / ms
        if ms < fwd_ms or row[f"{prec}attn_spread"] > 0.05:
            print(f"  inconsistent: end to end {ms:.3f} ms (before / after the baselines "
                  f"{2 * ms - ms_after:.3f} / {ms_after:.3f}), kernel {fwd_ms:.3f} ms: rerun this row")
        rows.append(row)
        fl = row.get("flash_tflops", float("nan"))
        cu = row.get("cudnn_tflops", float("nan"))
        sa = row.get("sage_tflops", float("nan"))
        print(f"{row['dtype']:>8} D={D:<3} N={N:<6} causal={int(causal)} "
              f"{prec}attn {row[f'{prec}attn_tflops']:6.1f} "
              f"kernel {row[f'{prec}_kernel_tflops']:6.1f} "
              f"prepass {pre_ms:6.3f} ms ({100 * row['prepass_frac_copy']:3.0f}% copy bw) | "
              f"flash {fl:6.1f} cudnn {cu:6.1f} sage {sa:6.1f} TFLOPS", flush=True)
        del q, k, v
    stem = "bench_attention_short" if args.short else "bench_attention"
    stem = stem if prec == "fp4" else f"{stem}_{prec}"
    path = os.path.join(args.out, f"{stem}.csv")
    write_csv(path, head, rows)
    print(f"\nwrote {path} ({time.time() - t_start:.0f} s)")
    plot(rows, os.path.join(args.out, f"{stem}.png"), head["hardware"], baselines, prec)
    table(rows, baselines, prec)
    return 0


def plot_tflops(rows, path, dev, series, title="", ylabel="TFLOPS"):
    """One panel per (dtype, D, causal) of TFLOPS against N, a line per (key, label) of series
    (rows hold f"{key}_tflops")."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    keys = sorted({(r["dtype"], r["D"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, (dt, D, causal) in zip(axes[0], keys):
        sel = [r for r in rows if (r["dtype"], r["D"], r["causal"]) == (dt, D, causal)]
        ns = [r["N"] for r in sel]
        for name, label in series:
            ax.plot(ns, [r[f"{name}_tflops"] for r in sel], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{title}{dt} D={D} causal={causal}")
        ax.set_xlabel("N")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(dev)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def plot(rows, path, dev, baselines, prec):
    plot_tflops(rows, path, dev, [(f"{prec}attn", f"fp4attn {prec} e2e"),
                                  (f"{prec}_kernel", f"fp4attn {prec} kernel")] +
                [(b, "SageAttention" if b == "sage" else f"sdpa {b}") for b in baselines])


def table(rows, baselines, prec):
    cols = [f"{prec}attn", f"{prec}_kernel"] + baselines
    head = "| dtype | D | N | causal | " + " | ".join(cols) + " | e2e/flash | e2e/cudnn | prepass % copy bw |"
    print("\nTFLOPS (median):\n")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        vals = " | ".join(f"{r[f'{c}_tflops']:.1f}" for c in cols)
        rf = r[f"{prec}attn_tflops"] / r["flash_tflops"] if "flash_tflops" in r else float("nan")
        rc = r[f"{prec}attn_tflops"] / r["cudnn_tflops"] if "cudnn_tflops" in r else float("nan")
        print(f"| {r['dtype']} | {r['D']} | {r['N']} | {int(r['causal'])} | {vals} | {rf:.2f} | {rc:.2f} | "
              f"{100 * r['prepass_frac_copy']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
