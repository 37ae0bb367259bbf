"""`python -m fp4attn demo`: FP4 attention on a few realistic input distributions, on the best
available backend, with its error against exact attention next to FP16 SDPA's, and timings."""

from __future__ import annotations

import argparse
import time

import torch

from . import reference
from .sdpa import ORIGINAL_SDPA, sdpa


def _inputs(kind: str, B: int, H: int, N: int, D: int, device, gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cpu").to(device)

    if kind == "gaussian (worst case)":
        return randn(B, H, N, D), randn(B, H, N, D), randn(B, H, N, D), False
    if kind == "llm-like (K channel outliers, causal)":
        # LLM keys carry a large per-channel offset and a few outlier channels; queries are
        # moderately aligned with past keys, which makes the map peaked.
        bias = randn(1, H, 1, D) * 4
        bias[..., : D // 16] *= 6
        k = randn(B, H, N, D) + bias
        q = 0.6 * k[:, :, torch.randint(0, N, (N,), generator=gen)] + randn(B, H, N, D)
        return q, k, randn(B, H, N, D), True
    if kind == "retrieval (peaked)":
        k = randn(B, H, N, D)
        q = 2.0 * k[:, :, torch.randint(0, N, (N,), generator=gen)] + 0.3 * randn(B, H, N, D)
        return q, k, randn(B, H, N, D), False
    if kind == "diffusion-like (tiny magnitudes)":
        scale = 1e-3  # K and V tiny; Q large enough that the scores are of order one
        k, v = (randn(B, H, N, D) + 1.0) * scale, randn(B, H, N, D) * scale
        return randn(B, H, N, D) / scale, k, v, False  # score std ~ sqrt(2)
    raise ValueError(kind)


KINDS = ["gaussian (worst case)", "llm-like (K channel outliers, causal)", "retrieval (peaked)",
         "diffusion-like (tiny magnitudes)"]


def _time(fn, device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run(device: str | None = None, B=1, H=8, N=1024, D=64, repeats=3, seed=0) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for kind in KINDS:
        q, k, v, causal = _inputs(kind, B, H, N, D, dev, gen)
        q16, k16, v16 = (t.half() for t in (q, k, v))
        exact = reference.exact_attention(q16.double().cpu(), k16.double().cpu(),
                                          v16.double().cpu(), is_causal=causal)  # of FP16 inputs
        fp4 = sdpa(q16, k16, v16, is_causal=causal, strict=True)  # no fallback shown as fp4attn
        fp16 = ORIGINAL_SDPA(q16, k16, v16, is_causal=causal)
        row = {"inputs": kind, "shape": f"{B}x{H}x{N}x{D}", "causal": causal}
        for name, out in (("fp4attn", fp4), ("fp16_sdpa", fp16)):
            m = reference.metrics(out.float().cpu(), exact)
            row.update({f"{name}_{key}": val for key, val in m.items()})
        t_dtype = torch.float16 if dev.type == "cuda" else torch.float32
        qt, kt, vt = (t.to(t_dtype) for t in (q, k, v))
        row["fp4attn_ms"] = 1e3 * _time(lambda: sdpa(qt, kt, vt, is_causal=causal, strict=True),
                                        dev, repeats)
        row["torch_sdpa_ms"] = 1e3 * _time(
            lambda: ORIGINAL_SDPA(qt, kt, vt, is_causal=causal), dev, repeats)
        row["timing_dtype"] = str(t_dtype).replace("torch.", "")
        rows.append(row)
    return rows


def format_table(rows: list[dict], device: str) -> str:
    head = ("| inputs | fp4attn cos | fp4attn rel_l1 | fp4attn rmse | FP16 SDPA cos | "
            "FP16 SDPA rel_l1 | FP16 SDPA rmse | fp4attn ms | torch SDPA ms |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['inputs']} | {r['fp4attn_cos']:.5f} | {r['fp4attn_rel_l1']:.4f} | "
            f"{r['fp4attn_rmse']:.2e} | {r['fp16_sdpa_cos']:.6f} | {r['fp16_sdpa_rel_l1']:.5f} | "
            f"{r['fp16_sdpa_rmse']:.2e} | {r['fp4attn_ms']:.1f} | {r['torch_sdpa_ms']:.1f} |")
    r0 = rows[0]
    lines.append(f"\nshape [B, H, N, D] = {r0['shape']}, device {device}; errors against exact "
                 f"float64 attention (FP16 inputs); timings median of runs, {r0['timing_dtype']} "
                 "inputs, fp4attn including quantization.")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4attn demo", description=__doc__)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--seq", type=int, default=1024, help="sequence length N")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    for name in ("seq", "heads", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.head_dim <= 256:
        ap.error(f"--head-dim must be in [1, 256] (fp4attn's head dims), got {args.head_dim}")
    if args.device not in (None, "cpu", "cuda"):
        ap.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no CUDA GPU")
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"fp4attn demo on {dev} (torch {torch.__version__})")
    rows = run(dev, 1, args.heads, args.seq, args.head_dim, args.repeats)
    print(format_table(rows, dev))
    return 0
