"""Real-model activations across machines: capture on one, check on another.

Model weights do not travel to the GPU machine, but Q/K/V do. `capture` runs SmolLM2-135M on
real Austen text (CPU, offline packages) and saves the attention inputs of some layers;
`check` recomputes them with fp4attn on every available backend (CPU, CUDA) and prints, per
layer, each backend's error against exact float64 attention and the agreement between backends
(which SPEC.md bounds by rel_l1 < 2e-3).

    python scripts/crosscheck_captured.py capture --out .captured/smollm2.pt
    python scripts/crosscheck_captured.py check .captured/smollm2.pt
"""

from __future__ import annotations

import argparse
import sys

import torch


def capture(args) -> int:
    from fp4attn.eval import models as M
    from fp4attn.eval.report import capture as capture_calls

    model, tok = M.load_smollm2()
    ids = tok(M.austen_text("prideprejudice"), return_tensors="pt").input_ids[:, : args.tokens]
    layers = {int(x) for x in args.layers.split(",")}
    with torch.no_grad(), capture_calls(model, layers) as calls:
        model(ids, use_cache=False)
    saved = [{"layer": c.layer, "q": c.q.half(), "k": c.k.half(), "v": c.v.half(),
              "is_causal": c.is_causal, "scale": c.scale, "enable_gqa": c.enable_gqa,
              "attn_mask": c.attn_mask} for c in calls]
    torch.save({"model": "SmolLM2-135M-Instruct", "tokens": args.tokens, "calls": saved}, args.out)
    print(f"saved {len(saved)} layers of {args.tokens} tokens to {args.out}")
    return 0


def check(args) -> int:
    import fp4attn
    from fp4attn import reference as R

    data = torch.load(args.file)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"{data['model']}, {data['tokens']} tokens, backends {devices}, fp16 inputs")
    print("| layer | " + " | ".join(f"{d} cos | {d} rel_l1" for d in devices)
          + (" | cpu vs cuda rel_l1 |" if len(devices) > 1 else " |"))
    print("|---" * (1 + 2 * len(devices) + (len(devices) > 1)) + "|")
    worst_cos, worst_agree = 1.0, 0.0
    for c in data["calls"]:
        kw = dict(attn_mask=c["attn_mask"], is_causal=c["is_causal"], scale=c["scale"])
        exact = R.exact_attention(c["q"], c["k"], c["v"], **kw)
        outs, cells = {}, []
        for d in devices:
            t = {k: (v.to(d) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            outs[d] = fp4attn.sdpa(c["q"].to(d), c["k"].to(d), c["v"].to(d),
                                   enable_gqa=c["enable_gqa"], **t).float().cpu()
            m = R.metrics(outs[d], exact)
            worst_cos = min(worst_cos, m["cos"])
            cells += [f"{m['cos']:.5f}", f"{m['rel_l1']:.4f}"]
        if len(devices) > 1:
            agree = R.metrics(outs["cuda"], outs["cpu"])["rel_l1"]
            worst_agree = max(worst_agree, agree)
            cells.append(f"{agree:.2e}")
        print(f"| {c['layer']} | " + " | ".join(cells) + " |")
    print(f"worst per-layer cos {worst_cos:.5f}"
          + (f"; worst CPU-vs-CUDA rel_l1 {worst_agree:.2e} (SPEC bound 2e-3)" if len(devices) > 1 else ""))
    return 0 if worst_agree < 2e-3 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--out", default=".captured/smollm2.pt")
    c.add_argument("--tokens", type=int, default=1024)
    c.add_argument("--layers", default="0,3,7,12,18,20,23,29")
    k = sub.add_parser("check")
    k.add_argument("file")
    args = ap.parse_args()
    return capture(args) if args.cmd == "capture" else check(args)


if __name__ == "__main__":
    sys.exit(main())
