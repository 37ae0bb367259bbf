"""`python -m fp4attn.eval.int8_fold`: can the 8-bit forward accumulate P^ V^ in int32 across key
steps? (issue 33, forward speed)

SPEC_INT8 2.4 codes each 128-key step's P against that step's row maximum and scales V per 128
keys and channel, so the Hopper kernel folds its int32 P^ V^ accumulator into FP32 after every
step (per thread and step at head dim 128: 64 output columns x convert, multiply, add, about a
fifth of the consumer's instructions). Coding P against the running row maximum (as FP8
FlashAttention does) and scaling V over more keys would let the int32 sum run until the row
maximum grows or V's scale block ends. It also measures P's exponentials taken in FP16 (two per
``ex2.approx.f16x2``) and l summed from P's codes (``p_exp=``, ``l_sum=``), which would cut the
consumer's per-score instructions instead, and P.V in FP8 e4m3 (``pv="fp8"``, as SageAttention2
does: FP8 wgmma accumulates in FP32 across steps, and FP32 -> e4m3 is one conversion per pair).
This driver measures what each costs in accuracy with the pure-PyTorch reference
(``reference_int8.attention_forward(..., p_max=, v_block=, p_exp=, l_sum=, pv=)``), on the
models and text of ``int8_granularity``: per layer, cos against exact float64 attention on the
Q/K/V captured on the first ``--tokens`` tokens; end to end, perplexity and KL with the variant in
every layer. Writes ``docs/results/int8_fold.csv`` and ``int8_fold_layers.csv``.
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


def _variant(label: str, p_max: str = "tile", v_block: int = 128, p_exp: str = "fp32",
             l_sum: str = "e", pv: str = "int8") -> tuple:
    """A study variant: the spec's options except those named."""
    return label, p_max, v_block, p_exp, l_sum, pv


#: (label, p_max, v_block, p_exp, l_sum, pv): the spec first.
VARIANTS = [
    _variant("SPEC_INT8 (P per step max, V per 128 keys)"),
    _variant("P against the running max", p_max="running"),
    _variant("V per 512 keys", v_block=512),
    _variant("V per channel over the sequence", v_block=0),
    _variant("running max, V per 512 keys", p_max="running", v_block=512),
    _variant("running max, V over the sequence", p_max="running", v_block=0),
    _variant("P's exponentials in FP16 (ex2.f16x2)", p_exp="fp16"),
    _variant("the same, error at PTX's bound 2^-9.9", p_exp="fp16-noisy"),
    _variant("FP16 exponentials, l from P's codes", p_exp="fp16", l_sum="codes"),
    _variant("P and V in FP8 e4m3, V per 128 keys and channel", pv="fp8"),
    _variant("P and V in FP8 e4m3, V per channel over the sequence", v_block=0, pv="fp8"),
    _variant("FP8 e4m3, P against the running max, V over the sequence", p_max="running",
             v_block=0, pv="fp8"),
    _variant("FP8 e4m3, V as two e4m3 terms, V per 128 keys and channel", pv="fp8x2"),
    _variant("FP8 e4m3, V as two e4m3 terms, P against the running max, V over the sequence",
             p_max="running", v_block=0, pv="fp8x2"),
]
DEFAULT_CSV = Path("docs/results/int8_fold.csv")


def _log(msg: str) -> None:
    print(f"[int8-fold] {msg}", file=sys.stderr, flush=True)


def layer_rows(calls, variants) -> list[dict]:
    rows = []
    for call in calls:
        exact = R.exact_attention(call.q, call.k, call.v, call.attn_mask, call.is_causal,
                                  call.scale, enable_gqa=True)
        for label, p_max, v_block, p_exp, l_sum, pv in variants:
            out, _ = R8.attention_forward(call.q, call.k, call.v, call.attn_mask, call.is_causal,
                                          call.scale, p_max=p_max, v_block=v_block, p_exp=p_exp,
                                          l_sum=l_sum, pv=pv)
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
    modes = {label: RP.int8_granularity_mode(R8.BQ, R8.BK, *options) for label, *options in VARIANTS}
    e2e = (RP.perplexity(model, ids[:ppl_tokens], window=args.window,
                         modes=["exact", *modes.values()], backend="reference", bos_id=bos_id)
           if ppl_tokens > 1 else {})
    summary = []
    for label, p_max, v_block, p_exp, l_sum, pv in VARIANTS:
        sel = [r for r in per_layer if r["variant"] == label]
        d = e2e.get(modes[label], {})
        summary.append({
            "model": name, "title": title, "variant": label, "p_max": p_max, "v_block": v_block,
            "p_exp": p_exp, "l_sum": l_sum, "pv": pv,
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
