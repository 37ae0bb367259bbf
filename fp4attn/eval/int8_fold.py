"""`python -m fp4attn.eval.int8_fold`: the 8-bit forward's P.V in 16 bits, FP8 and INT8 (issue 33;
docs/accuracy.md "P and V in FP8", "P.V in 16 bits").

SPEC_INT8 2.2 and 2.4 multiply P.V in 16 bits: P16 = 448 exp(S - m_new) against the running row
maximum rounded to V16's type, V16 = V as the backward's dP sees it. This driver measures the
spec against the FP8 P.V it replaced (``pv="fp8"``: V as two e4m3 terms per 128 keys and channel,
P~ = e4m3(W)), the INT8 P.V before that (``pv="int8"``) and two study variants of the FP8 P.V
(``"fp8-tile"``: P~ against each step's row maximum; ``"fp8-r16"``: V's residual scaled into
e4m3's normal range), with the pure-PyTorch
reference (``reference_int8.attention_forward(..., pv=)``), on the models and text of
``int8_granularity``: per layer, cos against exact float64 attention on the Q/K/V captured on the
first ``--tokens`` tokens; end to end, perplexity and KL with the variant in every layer. Writes
``docs/results/int8_fold_pv.csv`` and ``int8_fold_pv_layers.csv``. The reference's other study
options of the INT8 P.V (``p_max=``, ``v_block=``, ``p_exp=``, ``l_sum=``) were measured by this
driver before the amendment (docs/accuracy.md "P and V scales across key steps").
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from .. import reference as R
from .. import reference_int8 as R8
from . import int8_granularity as G
from . import report as RP


#: (label, pv): the spec first.
VARIANTS = [
    ("SPEC_INT8 (16-bit P.V: P16 against the running max, V16)", "16bit"),
    ("FP8 P.V (SPEC_INT8 before: P~ against the running max, V as two e4m3 terms)", "fp8"),
    ("INT8 P.V (SPEC_INT8 before: P per step max, INT8 V)", "int8"),
    ("FP8 P.V, P~ against each step's max", "fp8-tile"),
    ("FP8 P.V, V's residual scaled by 16", "fp8-r16"),
]
DEFAULT_CSV = Path("docs/results/int8_fold_pv.csv")


def _log(msg: str) -> None:
    print(f"[int8-fold] {msg}", file=sys.stderr, flush=True)


def layer_rows(calls, variants) -> list[dict]:
    rows = []
    for call in calls:
        exact = R.exact_attention(call.q, call.k, call.v, call.attn_mask, call.is_causal,
                                  call.scale, enable_gqa=True)
        for label, pv in variants:
            out, _ = R8.attention_forward(call.q, call.k, call.v, call.attn_mask, call.is_causal,
                                          call.scale, pv=pv)
            met = R.metrics(out, exact)
            rows.append({"layer": call.layer, "variant": label, "cos": met["cos"],
                         "rel_l1": met["rel_l1"]})
        _log(f"layer {call.layer}: " + ", ".join(f"{r['cos']:.5f}" for r in rows[-len(variants):]))
    return rows


def study(name: str, args) -> tuple[list[dict], list[dict]]:
    t0 = time.perf_counter()
    model, _, title, bos_id, ids, ppl_tokens, calls = G.capture_layers(name, args)
    per_layer = layer_rows(calls, VARIANTS)
    del calls
    modes = {label: RP.int8_granularity_mode(R8.BQ, R8.BK, pv=pv) for label, pv in VARIANTS}
    e2e = (RP.perplexity(model, ids[:ppl_tokens], window=args.window,
                         modes=["exact", *modes.values()], backend="reference", bos_id=bos_id)
           if ppl_tokens > 1 else {})
    summary = []
    for label, pv in VARIANTS:
        sel = [r for r in per_layer if r["variant"] == label]
        d = e2e.get(modes[label], {})
        summary.append({
            "model": name, "title": title, "variant": label, "pv": pv,
            "worst_cos": min(r["cos"] for r in sel),
            "layers_below_0.999": sum(not r["cos"] >= RP.INT8_COS_TARGET for r in sel),
            "layers": len(sel), "mean_cos": sum(r["cos"] for r in sel) / len(sel),
            "ppl": d.get("ppl", math.nan), "ppl_exact": e2e.get("exact", {}).get("ppl", math.nan),
            "delta_pct": 100 * d["rel_change"] if d else math.nan, "kl": d.get("kl", math.nan),
            "ppl_tokens": ppl_tokens, "layer_tokens": args.tokens})
    for r in per_layer:
        r["model"] = name
    _log(f"{name}: done in {time.perf_counter() - t0:.0f}s")
    return summary, per_layer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens captured for the layers")
    ap.add_argument("--ppl-tokens", type=int, default=2048, help="0: per-layer only")
    ap.add_argument("--gemma3-ppl-tokens", type=int, default=0)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--book", default="prideprejudice")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    summary, layers = [], []
    for name in args.models.split(","):
        s, lay = study(name, args)
        summary += s
        layers += lay
    print("| model | variant | worst layer cos | layers < 0.999 | mean cos | perplexity | KL |")
    print("|---|---|---|---|---|---|---|")
    for r in summary:
        print(f"| {r['model']} | {r['variant']} | {r['worst_cos']:.5f} | {r['layers_below_0.999']} "
              f"/ {r['layers']} | {r['mean_cos']:.5f} | {r['delta_pct']:+.2f}% | {r['kl']:.4g} |")
    G._write_csv(args.csv, list(summary[0]), summary)
    G._write_csv(args.csv.with_name(args.csv.stem + "_layers.csv"), list(layers[0]), layers)
    _log(f"wrote {args.csv} and its _layers.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
