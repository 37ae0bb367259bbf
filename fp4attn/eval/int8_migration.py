"""`python -m fp4attn.eval.int8_migration`: does a Q<->K channel migration bring the 8-bit attention
to its targets on models with K channel outliers? (issue 33, "Accuracy on models unlike SmolLM2";
docs/accuracy.md "INT8 channel migration")

The granularity study (``fp4attn.eval.int8_granularity``) found Gemma 3 270M (head dim 256) at
+0.69% perplexity with INT8 attention, 12 of 18 layers below cos 0.999, caused by channel
outliers of the smoothed K that no scale along rows or keys can separate. SmoothQuant's exact
rewrite moves them into Q: ``Q'_c = Q_c s_c``, ``Ks'_c = Ks_c / s_c``, ``Q' Ks'^T = Q Ks^T``, with
``s_c = max|Ks_c|^alpha / max|Q_c|^(1-alpha)`` per (batch, KV head) over the sequence
(``fp4attn.reference_int8.channel_migration``). This driver measures it in the pure-PyTorch
reference (``attention_forward(..., migrate=alpha, migrate_pow2=)``), alone and with Q/16 K/32
scales, with the exact and the power-of-two s_c, on two models and two texts:

* per layer, on the Q/K/V captured on the first ``--tokens`` tokens of each text: cos / rel_l1 of
  every variant against exact float64 attention, and K's and Q's channel-outlier ratio (largest
  per-channel amax over the median channel's, worst head) before and after the migration;
* end to end, perplexity, KL(exact || variant) per token and top-1 agreement on the first
  ``--ppl-tokens`` tokens in ``--window`` windows (Gemma: ``<bos>`` before every window), INT8 in
  every layer, for ``--ppl-variants``;
* the backward (``--backward-layers``): cos of dQ, dK, dV from ``reference_int8.attention_backward``
  against float64 autograd of exact attention, on captured Q/K/V (English) with a fixed random dO.

Texts: ``austen`` (*Pride and Prejudice*, as the report and the granularity study) and ``python``
(``models.python_source_text``: argparse.py, textwrap.py, json/decoder.py, json/encoder.py of the
running interpreter's standard library). Writes ``docs/results/int8_migration.csv`` (one row per
model, text and variant), ``int8_migration_layers.csv`` (per layer) and
``int8_migration_backward.csv`` beside it, and prints the tables.

The study led to SPEC_INT8 2.1b (alpha 0.5, power-of-two s: variant ``mig_pow2``, the reference's
default now); variant ``spec`` is the spec before it (``migrate=None``), and ``backend`` (per layer
and end to end) runs the compiled CPU backend, which implements 2.1b, instead of the reference.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch

from .. import reference as R
from .. import reference_int8 as R8
from . import int8_granularity as IG
from . import models as M
from . import report as RP

#: name -> (reference_int8.attention_forward keywords, label). "spec" is SPEC_INT8 as it was before
#: the channel-migration amendment (no migration; the name is kept for the stored CSVs);
#: "mig_pow2" is SPEC_INT8 2.1b, the reference's default now.
VARIANTS: dict[str, tuple[dict, str]] = {
    "spec": ({"migrate": None}, "SPEC_INT8 before migration (Q/64 K/128)"),
    "q16k32": ({"migrate": None, "q_block": 16, "k_block": 32}, "Q/16 K/32"),
    "mig": ({"migrate": 0.5, "migrate_pow2": False}, "migration a=0.5, exact s"),
    "mig_pow2": ({"migrate": 0.5, "migrate_pow2": True}, "migration a=0.5, power-of-two s"),
    "mig_q16k32": ({"migrate": 0.5, "migrate_pow2": False, "q_block": 16, "k_block": 32},
                   "migration a=0.5, exact s, Q/16 K/32"),
    "mig_pow2_q16k32": ({"migrate": 0.5, "migrate_pow2": True, "q_block": 16, "k_block": 32},
                        "migration a=0.5, power-of-two s, Q/16 K/32"),
    "mig0.3": ({"migrate": 0.3, "migrate_pow2": False}, "migration a=0.3, exact s"),
    "mig0.7": ({"migrate": 0.7, "migrate_pow2": False}, "migration a=0.7, exact s"),
    "mig0.3_pow2": ({"migrate": 0.3, "migrate_pow2": True}, "migration a=0.3, power-of-two s"),
    "mig0.7_pow2": ({"migrate": 0.7, "migrate_pow2": True}, "migration a=0.7, power-of-two s"),
}
#: Not a reference variant: the compiled CPU backend (torch.ops.fp4attn.int8_attention, the C
#: code), which implements SPEC_INT8 with the migration; per layer and end to end only.
BACKEND = "backend"
BACKEND_LABEL = "compiled CPU backend (SPEC_INT8 2.1b)"
DEFAULT_PPL_VARIANTS = ("spec", "mig", "mig_pow2", "mig_pow2_q16k32")
#: Variants whose backward is checked (the backward keeps SPEC_INT8's 64 / 128 blocks).
BACKWARD_VARIANTS = ("spec", "mig", "mig_pow2")
TEXTS = ("austen", "python")
COS_TARGET = RP.INT8_COS_TARGET  # 0.999
DEFAULT_CSV = Path("docs/results/int8_migration.csv")
#: Layers for the backward check: SmolLM2's two worst INT8 layers, and Gemma 3's worst
#: sliding-window layer and its global layers 5 and 11 (docs/accuracy.md "INT8 scale granularity").
DEFAULT_BACKWARD_LAYERS = "smollm2:19,25;gemma3:2,5,11"


def _log(msg: str) -> None:
    print(f"[int8-migration] {msg}", file=sys.stderr, flush=True)


def text_ids(tok, text: str, book: str, bos_id: int | None) -> torch.Tensor:
    """Token ids of ``text`` ("austen": the book; "python": the standard library sources); without
    the tokenizer's own <bos> when bos_id is given (it is added per window and capture)."""
    s = M.austen_text(book) if text == "austen" else M.python_source_text()
    if bos_id is None:
        return tok(s, return_tensors="pt").input_ids[0]
    return tok(s, add_special_tokens=False, return_tensors="pt").input_ids[0]


def _int8_sdpa(kw: dict | None):
    """swap_sdpa function: the INT8 reference with ``kw`` in every layer (None: the compiled CPU
    backend)."""
    def run(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        o = _int8_out(kw, q.cpu(), k.cpu(), v.cpu(),
                      None if attn_mask is None else attn_mask.cpu(), is_causal, scale)
        return o.to(q.device, q.dtype)
    return run


def _int8_out(kw: dict | None, q, k, v, attn_mask, is_causal, scale) -> torch.Tensor:
    """The INT8 output (float32) of the reference with ``kw``, or of the compiled CPU backend."""
    if kw is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return torch.ops.fp4attn.int8_attention(q, k, v, attn_mask, is_causal, scale)[0].float()
    return R8.attention_forward(q, k, v, attn_mask, is_causal, scale, **kw)[0]


def _kw(name: str) -> dict | None:
    return None if name == BACKEND else VARIANTS[name][0]


def perplexity(model, ids: torch.Tensor, *, window: int, variants: list[str],
               bos_id: int | None) -> dict[str, dict]:
    """As ``report.perplexity`` (non-overlapping windows, ``bos_id`` before each, never a
    target), for exact attention (the KL reference) and each INT8 reference variant."""
    modes = ["exact"] + [v for v in variants if v != "exact"]
    stats = {m: {"nll": 0.0, "n": 0, "agree": 0, "kl": 0.0} for m in modes}
    t0 = time.perf_counter()
    lead = 0 if bos_id is None else 1
    for s in range(0, ids.numel() - 1, window):
        chunk = ids[s : s + window].unsqueeze(0)
        if chunk.shape[1] < 2:
            break
        tgt = chunk[:, 1:]
        if bos_id is not None:
            chunk = torch.cat([chunk.new_full((1, 1), bos_id), chunk], dim=1)
        ref_lp = ref_p = None
        for mode in modes:
            if mode == "exact":
                with torch.no_grad():
                    logits = model(chunk, use_cache=False).logits
            else:
                with torch.no_grad(), RP.swap_sdpa(_int8_sdpa(_kw(mode)), model):
                    logits = model(chunk, use_cache=False).logits
            lp = torch.log_softmax(logits[:, lead:-1].float(), dim=-1)
            del logits
            st = stats[mode]
            st["nll"] += -lp.gather(-1, tgt.unsqueeze(-1)).sum().item()
            st["n"] += tgt.numel()
            if ref_lp is None:
                ref_lp, ref_p = lp, lp.exp()
            st["agree"] += (lp.argmax(-1) == ref_lp.argmax(-1)).sum().item()
            st["kl"] += (ref_p * (ref_lp - lp)).sum().item()
            del lp
        done = {m: math.exp(st["nll"] / st["n"]) for m, st in stats.items()}
        _log(f"perplexity: {min(s + window, ids.numel())}/{ids.numel()} tokens "
             f"({time.perf_counter() - t0:.0f}s): "
             + ", ".join(f"{m} {p:.4f} kl {stats[m]['kl'] / stats[m]['n']:.5f}"
                         for m, p in done.items()))
    base = math.exp(stats["exact"]["nll"] / max(stats["exact"]["n"], 1))
    out = {}
    for m, st in stats.items():
        ppl = math.exp(st["nll"] / max(st["n"], 1))
        out[m] = {"ppl": ppl, "rel_change": ppl / base - 1.0,
                  "top1_agree": st["agree"] / max(st["n"], 1), "kl": st["kl"] / max(st["n"], 1),
                  "tokens": st["n"]}
    return out


def channel_ratios(call: RP.AttnCall, alpha: float = 0.5) -> dict[str, float]:
    """Largest per-channel amax over the median channel's (worst (batch, head)) of the smoothed
    K and of Q, before and after the migration with ``alpha`` (exact s_c)."""
    q32, k32 = call.q.float(), call.k.float()
    B, Hq, _, D = q32.shape
    Hkv = k32.shape[1]
    Gq = Hq // Hkv
    kbar = k32.mean(dim=2, keepdim=True)
    ks = k32 - kbar
    s = R8.channel_migration(q32, k32, kbar, Gq, alpha, pow2=False)

    def ratio(x):  # [B, H, N, D] -> max over (B, H) of max_c amax_c / median_c amax_c
        a = x.abs().amax(dim=2)
        return (a.amax(dim=-1) / a.median(dim=-1).values).max().item()

    return {"k_ratio": ratio(ks), "q_ratio": ratio(q32),
            "k_ratio_mig": ratio(ks / s), "q_ratio_mig": ratio(q32 * s.repeat_interleave(Gq, 1))}


def layer_study(calls: list[RP.AttnCall], variants: list[str]) -> list[dict]:
    """Per layer and variant: cos / rel_l1 against exact float64 attention."""
    rows = []
    for call in calls:
        t0 = time.perf_counter()
        exact = R.exact_attention(call.q, call.k, call.v, call.attn_mask, call.is_causal,
                                  call.scale, enable_gqa=True)
        ratios = channel_ratios(call)
        for name in variants:
            out = _int8_out(_kw(name), call.q, call.k, call.v, call.attn_mask, call.is_causal,
                            call.scale)
            met = R.metrics(out, exact)
            rows.append({"layer": call.layer, "variant": name, "cos": met["cos"],
                         "rel_l1": met["rel_l1"], **ratios})
        cos = ", ".join(f"{r['variant']} {r['cos']:.5f}" for r in rows if r["layer"] == call.layer)
        _log(f"layer {call.layer:2d} ({time.perf_counter() - t0:4.1f}s, K channel ratio "
             f"{ratios['k_ratio']:.1f} -> {ratios['k_ratio_mig']:.1f}): {cos}")
    return rows


def backward_check(calls: list[RP.AttnCall], layers: list[int], variants: list[str],
                   seed: int = 0) -> list[dict]:
    """Per layer and variant: cos / rel_l1 of dQ, dK, dV (reference_int8.attention_backward with
    the variant's migration, SPEC_INT8's blocks) against float64 autograd of exact attention,
    dO ~ N(0, 1) fixed by ``seed`` (the same for every variant)."""
    rows = []
    for call in calls:
        if call.layer not in layers:
            continue
        t0 = time.perf_counter()
        q64, k64, v64 = (t.double().requires_grad_(True) for t in (call.q, call.k, call.v))
        o = R.exact_attention(q64, k64, v64, call.attn_mask, call.is_causal, call.scale, True)
        g = torch.Generator().manual_seed(seed + call.layer)
        do = torch.randn(o.shape, generator=g, dtype=torch.float64)
        ref = torch.autograd.grad(o, (q64, k64, v64), do)
        for name in variants:
            if name == BACKEND:
                raise ValueError(f"{BACKEND}: the backward check runs reference variants only")
            kw = VARIANTS[name][0]
            if "q_block" in kw:
                raise ValueError(f"{name}: the backward keeps SPEC_INT8's blocks (no q_block)")
            out, lse = R8.attention_forward(call.q, call.k, call.v, call.attn_mask,
                                            call.is_causal, call.scale, **kw)
            grads = R8.attention_backward(do.float(), call.q, call.k, call.v, out, lse,
                                          call.attn_mask, call.is_causal, call.scale, **kw)
            row = {"layer": call.layer, "variant": name}
            for gname, got, want in zip(("dq", "dk", "dv"), grads, ref):
                met = R.metrics(got, want)
                row[f"{gname}_cos"], row[f"{gname}_rel_l1"] = met["cos"], met["rel_l1"]
            rows.append(row)
            _log(f"backward layer {call.layer} {name}: dq {row['dq_cos']:.5f} dk "
                 f"{row['dk_cos']:.5f} dv {row['dv_cos']:.5f}")
        _log(f"backward layer {call.layer}: {time.perf_counter() - t0:.0f}s")
    return rows


def _summarise(layer_rows: list[dict], variant: str) -> dict:
    sel = [r for r in layer_rows if r["variant"] == variant]
    if not sel:
        return {}
    worst = min(sel, key=lambda r: r["cos"])
    return {"worst_cos": worst["cos"], "worst_layer": worst["layer"],
            "mean_cos": sum(r["cos"] for r in sel) / len(sel),
            "sum_1mcos": sum(1.0 - r["cos"] for r in sel),
            "layers_below": sum(not r["cos"] >= COS_TARGET for r in sel), "layers": len(sel)}


def study(name: str, text: str, args) -> tuple[list[dict], list[dict], list[dict]]:
    """Summary rows (exact + one per variant), per-layer rows and backward rows of one model on
    one text."""
    t0 = time.perf_counter()
    model, tok, title, bos_id = IG.load_model(name)
    ids = text_ids(tok, text, args.book, bos_id)
    need = max(args.tokens, args.ppl_tokens)
    if ids.numel() < need:
        raise ValueError(f"{text} has only {ids.numel()} tokens for {name}, {need} requested")
    layer_rows: list[dict] = []
    back_rows: list[dict] = []
    if args.variants:
        cap = ids[: args.tokens] if bos_id is None else torch.cat(
            [ids.new_tensor([bos_id]), ids[: args.tokens - 1]])
        with torch.no_grad(), RP.capture(model) as calls:
            model(cap.unsqueeze(0), use_cache=False)
        _log(f"{name} / {text}: captured {len(calls)} layers on {cap.numel()} tokens; "
             f"{calls[0].describe()}")
        layer_rows = layer_study(calls, args.variants)
        blayers = args.backward_layers.get(name, [])
        if blayers and text in args.backward_texts:
            back_rows = backward_check(calls, blayers, args.backward_variants)
        del calls
    e2e = {}
    if args.ppl_tokens > 1 and args.ppl_variants:
        e2e = perplexity(model, ids[: args.ppl_tokens], window=args.window,
                         variants=args.ppl_variants, bos_id=bos_id)
    base = {"model": name, "title": title, "text": text, "layer_tokens": args.tokens,
            "ppl_tokens": e2e.get("exact", {}).get("tokens", 0), "window": args.window}
    rows = []
    for v in (["exact"] if e2e else []) + list(dict.fromkeys(args.variants + args.ppl_variants)):
        d = e2e.get(v, {})
        rows.append({**base, "variant": v, "label": "exact (FP32 SDPA)" if v == "exact"
                     else VARIANTS[v][1] if v in VARIANTS else BACKEND_LABEL,
                     **{k: VARIANTS.get(v, ({},))[0].get(k, "")
                                             for k in ("migrate", "migrate_pow2", "q_block",
                                                       "k_block")},
                     "ppl": d.get("ppl", math.nan), "delta_pct": 100 * d["rel_change"] if d
                     else math.nan, "kl": d.get("kl", math.nan),
                     "top1": d.get("top1_agree", math.nan), **_summarise(layer_rows, v)})
    for r in layer_rows + back_rows:
        r.update(model=name, text=text)
    _log(f"{name} / {text}: done in {time.perf_counter() - t0:.0f}s")
    return rows, layer_rows, back_rows


def _fmt(x, spec: str) -> str:
    if x == "" or x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def format_table(rows: list[dict]) -> str:
    head = ["model", "text", "variant", "perplexity", "change", "KL per token", "top-1 = exact",
            "worst layer cos", "mean layer cos", f"layers < {COS_TARGET}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        ex = r["variant"] == "exact"
        worst = "-" if "worst_cos" not in r else f"{r['worst_cos']:.5f} ({r['worst_layer']})"
        lines.append("| " + " | ".join([
            r["title"], r["text"], r["label"], _fmt(r["ppl"], ".3f"),
            "" if ex else _fmt(r["delta_pct"], "+.2f") + "%", "" if ex else _fmt(r["kl"], ".5f"),
            "" if ex else _fmt(100 * r["top1"], ".2f") + "%", worst,
            _fmt(r.get("mean_cos", math.nan), ".5f"),
            f"{r['layers_below']} / {r['layers']}" if "layers" in r else "-"]) + " |")
    return "\n".join(lines)


SUMMARY_FIELDS = ["model", "text", "variant", "label", "migrate", "migrate_pow2", "q_block",
                  "k_block", "ppl", "delta_pct", "kl", "top1", "worst_cos", "worst_layer",
                  "mean_cos", "sum_1mcos", "layers_below", "layers", "ppl_tokens", "window",
                  "layer_tokens"]
LAYER_FIELDS = ["model", "text", "layer", "variant", "cos", "rel_l1", "k_ratio", "k_ratio_mig",
                "q_ratio", "q_ratio_mig"]
BACKWARD_FIELDS = ["model", "text", "layer", "variant", "dq_cos", "dk_cos", "dv_cos",
                   "dq_rel_l1", "dk_rel_l1", "dv_rel_l1"]


def _write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in r.items()})


def _variant_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS and v != BACKEND]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {bad}; choose from "
                                         f"{', '.join(VARIANTS)}, {BACKEND}")
    return names


def _backward_layers(text: str) -> dict[str, list[int]]:
    """``"smollm2:19,25;gemma3:2,5,11"`` -> {"smollm2": [19, 25], "gemma3": [2, 5, 11]}."""
    out = {}
    for part in text.split(";"):
        if part.strip():
            name, layers = part.split(":")
            out[name.strip()] = [int(x) for x in layers.split(",") if x.strip()]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fp4attn.eval.int8_migration",
        description="INT8 attention (SPEC_INT8) with a Q<->K channel migration: per-layer cos, "
                    "perplexity / KL and the backward's gradient cos, in the reference, on "
                    "SmolLM2-135M and Gemma 3 270M, English and Python source.")
    ap.add_argument("--models", default=",".join(IG.MODELS),
                    help=f"comma-separated, from {', '.join(IG.MODELS)} (default both)")
    ap.add_argument("--texts", default=",".join(TEXTS),
                    help=f"comma-separated, from {', '.join(TEXTS)} (default both)")
    ap.add_argument("--variants", type=_variant_list, default=list(VARIANTS),
                    help="variants of the per-layer study (default all: "
                         f"{', '.join(VARIANTS)}; also {BACKEND}); empty for none")
    ap.add_argument("--ppl-variants", type=_variant_list, default=list(DEFAULT_PPL_VARIANTS),
                    help="variants measured end to end (default "
                         f"{','.join(DEFAULT_PPL_VARIANTS)}); empty for none")
    ap.add_argument("--tokens", type=int, default=1024,
                    help="tokens whose Q/K/V are captured per text (default 1024)")
    ap.add_argument("--ppl-tokens", type=int, default=4096,
                    help="perplexity tokens per text, 0 to skip (default 4096: 4 windows)")
    ap.add_argument("--window", type=int, default=1024, help="perplexity window (default 1024)")
    ap.add_argument("--book", default="prideprejudice", choices=list(M.BOOKS))
    ap.add_argument("--backward-layers", type=_backward_layers,
                    default=_backward_layers(DEFAULT_BACKWARD_LAYERS),
                    help=f"MODEL:L,L;MODEL:L layers whose backward is checked (default "
                         f"{DEFAULT_BACKWARD_LAYERS}; empty for none)")
    ap.add_argument("--backward-texts", default="austen",
                    help="texts on which the backward is checked (default austen)")
    ap.add_argument("--backward-variants", type=_variant_list, default=list(BACKWARD_VARIANTS),
                    help=f"(default {','.join(BACKWARD_VARIANTS)})")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV,
                    help=f"summary CSV (default {DEFAULT_CSV}); _layers and _backward CSVs go "
                         "beside it")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    bad = [n for n in names if n not in IG.MODELS] + [t for t in texts if t not in TEXTS]
    if bad:
        print(f"error: unknown model(s) / text(s) {bad}", file=sys.stderr)
        return 2
    args.backward_texts = {t.strip() for t in args.backward_texts.split(",")}
    t0 = time.perf_counter()
    rows: list[dict] = []
    layer_rows: list[dict] = []
    back_rows: list[dict] = []
    layers_csv = args.csv.with_name(args.csv.stem + "_layers" + args.csv.suffix)
    back_csv = args.csv.with_name(args.csv.stem + "_backward" + args.csv.suffix)
    try:
        for name in names:
            for text in texts:
                r, lr, br = study(name, text, args)
                rows += r
                layer_rows += lr
                back_rows += br
                # after every (model, text): a long run leaves its finished part behind
                _write_csv(args.csv, SUMMARY_FIELDS, rows)
                if layer_rows:
                    _write_csv(layers_csv, LAYER_FIELDS, layer_rows)
                if back_rows:
                    _write_csv(back_csv, BACKWARD_FIELDS, back_rows)
    except M.MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    _log(f"done in {time.perf_counter() - t0:.0f}s; wrote {args.csv}"
         + (f", {layers_csv}" if layer_rows else "") + (f", {back_csv}" if back_rows else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
