"""`python -m fp4attn.eval.fp4_variants`: cheap changes to the FP4 numerics (issue 35 item 1,
"Improve FP4 itself first: V smoothing"; docs/accuracy.md "V smoothing for FP4").

The accuracy study found V's quantization the largest single error source of the FP4 attention
(docs/accuracy.md "Where the error comes from"). This driver measures, with the pure-PyTorch
reference (``fp4attn.reference.attention``), changes that are not SPEC:

* ``smooth_v``: V smoothing as in SageAttention2: V's per-channel mean over the keys (per batch
  and KV head, float32) is subtracted before V is quantized and added back exactly after the
  normalisation (softmax rows sum to one);
* ``smooth_v_first``: the same with V's first key row instead of the mean (in causal LMs the
  first key is usually the attention sink, whose V then quantizes to exactly 0);
* ``smooth_v_weighted``: the same with ``softmax(scale * qm . K^T) V``, ``qm`` = Q's mean over
  the rows (and the KV head's query heads): V averaged where the mean query attends, sinks
  included;
* ``quantized_rowsum``: the softmax denominator ``l`` summed from the quantized P^ (first level
  undone) instead of the unquantized exponentials, so that ``O / l`` weights V^'s rows with the
  weights the FP4MM actually used; ``smooth_v_weighted_rowsum``: weighted V smoothing and this;

against the SPEC (``ref``) and, per layer, the compiled backend (which must match ``ref``).
``ROTATION_VARIANTS`` are exact rewrites of Q.K^T / P.V before NVFP4 (docs/accuracy.md "Channel
migration and Hadamard rotation for FP4"): SPEC_INT8's power-of-two channel migration on the
smoothed Q and K (``migrate_qk``; ``_raw``: s from the unsmoothed Q), a Sylvester-Hadamard
rotation of Q and K along the head dim (``rotate_qk16`` / ``32`` / ``64``, ``rotate_qk`` = D),
both (``migrate_rotate_qk``), V's rotation (``rotate_v``, ``rotate_qk_v``) and the one-product
halves (``fp4_qk*``, ``fp4_pv*``). ``PV_ROTATION_VARIANTS`` rotate P and V along the keys
(``rotate_pv16`` / ``32`` / ``128``: ``reference.attention(rotate_pv=n)``, alone and after
``migrate_rotate_qk``; docs/accuracy.md "Hadamard rotation along the keys for FP4 P.V").
``--calibrate VARIANT`` instead computes the calibrated FP4
share with VARIANT as the FP4 precision through ``fp4attn.eval.fp4pv``'s calibration machinery
(``calibrate_variant``).
Diagnostics per layer (``--no-diagnostics`` drops them): V quantized alone without smoothing,
with the key mean, the first key and the weighted mean; P quantized alone as specified / with V
smoothed (key mean) / with ``l`` from P^. Per layer also: V's offset (RMS of its key mean over
its RMS) and the attention mass on key 0 (exact attention, mean over heads and rows).

For each model (``fp4attn.eval.models``, text: *Pride and Prejudice*; the capture, the model
loaders, ``<bos>`` handling and the CSV writer are those of ``fp4attn.eval.int8_granularity``,
the per-layer evaluation and the perplexity those of ``fp4attn.eval.report``):

* per layer, on the Q/K/V captured on the first ``--tokens`` tokens: cos / rel_l1 of the output
  against exact float64 attention; worst layer, layers below the report's target 0.99, summed
  ``1 - cos`` (also relative to the SPEC), and how many layers get better / worse than the SPEC;
  plus the in-sample bound of choosing, per layer, the best of no / key-mean / first-key V
  smoothing (``best_v_per_layer``, a per-layer policy calibrated on the same tokens);
* end to end, ``report.perplexity`` on the first ``--ppl-tokens`` tokens in non-overlapping
  windows: exact (FP32 SDPA) and each of ``--ppl-variants`` in every layer (KL(exact || x),
  top-1 agreement).

About 11 minutes on 2 CPU cores with the defaults (1024 captured tokens, 4096 perplexity tokens
in 1024-token windows for both models).

Writes ``docs/results/fp4_variants.csv`` (one row per model and variant) and
``fp4_variants_layers.csv`` (per layer and method) beside it, and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch

from .. import calibration as C
from .. import reference as R
from . import fp4pv as FP
from . import int8_granularity as IG
from . import models as M
from . import report as RP
from .int8_granularity import _fmt, _write_csv, capture_layers

#: Variants (report.METHODS names); ``ref`` = the SPEC, the baseline of "vs SPEC", always run.
DEFAULT_VARIANTS = ("ref", "smooth_v", "smooth_v_first", "smooth_v_weighted", "quantized_rowsum",
                    "smooth_v_weighted_rowsum")
#: Exact rewrites of Q.K^T / P.V before NVFP4 (docs/accuracy.md "Channel migration and Hadamard
#: rotation for FP4"): channel migration, Hadamard rotations of Q and K (blocks of 16, 32, 64,
#: D) and of V; the ``fp4_*`` ones quantize one product only (the other exact).
ROTATION_VARIANTS = ("migrate_qk", "migrate_qk_raw", "rotate_qk16", "rotate_qk32", "rotate_qk64",
                     "rotate_qk", "migrate_rotate_qk", "rotate_v", "rotate_qk_v", "fp4_qk",
                     "fp4_qk_rotate_qk", "fp4_qk_migrate_qk", "fp4_pv", "fp4_pv_rotate_v")
#: P.V rotated along the keys, (P H)(H V) / n with H of blocks of n keys (16, 32, 128) inside the
#: 128-key tile (docs/accuracy.md "Hadamard rotation along the keys for FP4 P.V"), alone, after
#: migration + Hadamard D on Q, K, and with QK^T exact (``fp4_pv_rotate_pv*``).
PV_ROTATION_VARIANTS = ("rotate_pv16", "rotate_pv32", "rotate_pv128", "migrate_rotate_qk_pv16",
                        "migrate_rotate_qk_pv32", "migrate_rotate_qk_pv128", "fp4_pv_rotate_pv16",
                        "fp4_pv_rotate_pv128")
VARIANTS = DEFAULT_VARIANTS + ROTATION_VARIANTS + PV_ROTATION_VARIANTS
DEFAULT_PPL_VARIANTS = ("ref", "smooth_v", "smooth_v_first", "smooth_v_weighted",
                        "smooth_v_weighted_rowsum")
#: Per-layer diagnostics: one operand quantized alone, with and without the change.
DIAGNOSTICS = ("only_v", "only_v_smooth_v", "only_v_smooth_v_first", "only_v_smooth_v_weighted")
P_DIAGNOSTICS = ("only_p", "only_p_smooth_v", "only_p_rowsum")
#: The V-smoothing choices among which ``best_v_per_layer`` picks per layer.
V_CHOICES = ("ref", "smooth_v", "smooth_v_first")
LABELS = {"ref": "SPEC (reference)", "smooth_v": "V smoothing, key mean",
          "smooth_v_first": "V smoothing, first key",
          "smooth_v_weighted": "V smoothing, mean-query weighted",
          "quantized_rowsum": "l from quantized P",
          "smooth_v_weighted_rowsum": "V smoothing, weighted + l from quantized P",
          "best_v_per_layer": "best of the three per layer (in-sample, per layer only)",
          "fp4attn": "SPEC, compiled backend (per layer only)",
          **{v: RP.METHODS[v][0] for v in ROTATION_VARIANTS + PV_ROTATION_VARIANTS}}
COS_TARGET = RP.COS_TARGET  # 0.99
MODELS = ("smollm2", "gemma3")
DEFAULT_CSV = Path("docs/results/fp4_variants.csv")


def _log(msg: str) -> None:
    print(f"[fp4-variants] {msg}", file=sys.stderr, flush=True)


def v_offset(call: RP.AttnCall) -> float:
    """How much of V is its per-channel mean: RMS over (batch, head, channel) of the key mean
    ``vbar`` divided by the RMS of V (0: centred channels; 1: V constant over the keys)."""
    v = call.v.double()
    vbar = v.mean(dim=2)
    rms_v = v.pow(2).mean().sqrt().item()
    return vbar.pow(2).mean().sqrt().item() / rms_v if rms_v > 0 else 0.0


def key0_mass(call: RP.AttnCall) -> float:
    """Mean attention probability on key 0 (exact attention, over heads and query rows): exact
    attention of a V that is 1 on key 0 and 0 elsewhere."""
    v = torch.zeros(*call.k.shape[:3], 1, dtype=torch.float64)
    v[:, :, 0] = 1.0
    p0 = R.exact_attention(call.q, call.k, v, call.attn_mask, call.is_causal, call.scale,
                           enable_gqa=True)
    return p0.mean().item()


def best_per_layer(layer_rows: list[dict], choices=V_CHOICES) -> list[dict]:
    """Rows of the method ``best_v_per_layer``: per layer the highest cos among ``choices``."""
    out = []
    for layer in sorted({r["layer"] for r in layer_rows}):
        cand = [r for r in layer_rows if r["layer"] == layer and r["method"] in choices]
        if len(cand) == len(choices):
            best = max(cand, key=lambda r: r["cos"])
            out.append({**best, "method": "best_v_per_layer", "choice": best["method"],
                        "seconds": 0.0})
    return out


def summarise(layer_rows: list[dict], method: str, base: str = "ref") -> dict:
    """Worst layer, layers below 0.99, summed 1 - cos (and relative to ``base``), and the number
    of layers whose cos is higher / lower than ``base``'s."""
    sel = {r["layer"]: r for r in layer_rows if r["method"] == method}
    if not sel:
        return {}
    ref = {r["layer"]: r for r in layer_rows if r["method"] == base}
    worst = min(sel.values(), key=lambda r: r["cos"])
    err = sum(1.0 - r["cos"] for r in sel.values())
    ref_err = sum(1.0 - r["cos"] for r in ref.values()) if ref else math.nan
    return {"worst_cos": worst["cos"], "worst_layer": worst["layer"],
            "layers_below": sum(not r["cos"] >= COS_TARGET for r in sel.values()),
            "layers": len(sel), "mean_cos": sum(r["cos"] for r in sel.values()) / len(sel),
            "sum_err": err, "sum_err_vs_ref": err / ref_err if ref_err else math.nan,
            "layers_better": sum(sel[i]["cos"] > ref[i]["cos"] for i in sel if i in ref),
            "layers_worse": sum(sel[i]["cos"] < ref[i]["cos"] for i in sel if i in ref)}


def _backend_works() -> bool:
    try:
        import fp4attn

        q = torch.randn(1, 1, 32, 64)
        fp4attn.sdpa(q, q, q, strict=True)
        return True
    except Exception as exc:  # noqa: BLE001
        _log(f"compiled FP4 backend unavailable ({type(exc).__name__}: {exc}): no backend check")
        return False


def study_model(name: str, args) -> tuple[list[dict], list[dict]]:
    """Summary rows (exact, then one per variant, then the backend) and per-layer rows."""
    t0 = time.perf_counter()
    model, tok, title, bos_id, ids, ppl_tokens, calls = capture_layers(name, args)
    window = args.window if name == "smollm2" else (args.gemma3_window or args.window)
    head_dim = calls[0].q.shape[-1]
    methods = list(args.variants) + (["fp4attn"] if args.backend_check else []) + (
        list(DIAGNOSTICS) + list(P_DIAGNOSTICS) if args.diagnostics else [])
    t1 = time.perf_counter()
    layer_rows = RP.evaluate_layers(calls, methods, device="cpu", backend="fp4attn",
                                    model_name=name)
    layer_rows += best_per_layer(layer_rows)
    stats = {c.layer: {"v_offset": v_offset(c), "key0_mass": key0_mass(c)} for c in calls}
    for r in layer_rows:
        r.update(stats[r["layer"]])
    layer_s = time.perf_counter() - t1
    del calls

    e2e: dict[str, dict] = {}
    ppl_s = 0.0
    if ppl_tokens > 1:
        t1 = time.perf_counter()
        e2e = RP.perplexity(model, ids[:ppl_tokens], window=window,
                            modes=["exact"] + [f"variant:{v}" for v in args.ppl_variants],
                            backend="reference", bos_id=bos_id)
        ppl_s = time.perf_counter() - t1
    base = {"model": name, "title": title, "head_dim": head_dim,
            "layer_tokens": args.tokens, "ppl_tokens": ppl_tokens, "window": window}
    rows = []

    def row(method: str, mode: str | None) -> dict:
        d = e2e.get(mode, {}) if mode else {}
        r = {**base, "method": method, "label": LABELS.get(method, method),
             "ppl": d.get("ppl", math.nan),
             "ppl_exact": e2e.get("exact", {}).get("ppl", math.nan),
             "delta_pct": 100 * d["rel_change"] if d else math.nan,
             "kl": d.get("kl", math.nan), "top1": d.get("top1_agree", math.nan)}
        s = summarise(layer_rows, method) if method != "exact" else {}
        for k in ("worst_cos", "worst_layer", "layers_below", "layers", "mean_cos", "sum_err",
                  "sum_err_vs_ref", "layers_better", "layers_worse"):
            r[k] = s.get(k, math.nan)
        return r

    if e2e:
        rows.append(row("exact", "exact"))
    rows += [row(v, f"variant:{v}") for v in args.variants]
    rows += [row(v, f"variant:{v}") for v in args.ppl_variants if v not in args.variants]
    if any(r["method"] == "best_v_per_layer" for r in layer_rows):
        rows.append(row("best_v_per_layer", None))
    if args.backend_check:
        rows.append(row("fp4attn", None))
    _log(f"{name}: per layer {layer_s:.0f}s, perplexity {ppl_s:.0f}s, all "
         f"{time.perf_counter() - t0:.0f}s")
    return rows, layer_rows


def calibrate_variant(name: str, args) -> list[dict]:
    """The calibrated FP4 share at ``--budget`` with ``--calibrate``'s variant as the FP4
    precision (cost 1, all of its FLOPs FP4), by the fp4pv study's machinery
    (``fp4attn.eval.fp4pv``: ``fp4attn.calibrate``'s steps, per-layer attention error as the
    sensitivity, bisection on the perplexity increase and exp(KL) - 1), candidates variant / int8
    / bf16 (Blackwell order); with ``--cal-baseline`` also fp4 (SPEC, compiled) / int8 / bf16 on
    the same batches. Then, held out on ``--heldout-seqs`` sequences of ``--book``: the variant
    everywhere, the chosen policies and the variant order's last point with >= 60 % FP4 FLOPs.
    Rows in fp4pv's CSV layout (kinds cal_layer, cal_point, probe, chosen, curve)."""
    t0 = time.perf_counter()
    var = args.calibrate
    FP.register_precision(var, RP.METHODS[var][1], cost=1.0, fp4_fraction=1.0, char="r")
    model, tok, title, bos_id = IG.load_model(name)
    base = {"model": name, "title": title}
    cal_ids = IG.text_ids(tok, args.cal_book, bos_id)
    meter, refs, exact, flops, calls_by_batch = FP.prepare(
        model, FP._batches(cal_ids, args.cal_seqs, args.cal_len, bos_id))
    n = len(flops)
    base["head_dim"] = calls_by_batch[0][0].q.shape[-1]
    precs = [var, "fp4", "int8"] if args.cal_baseline else [var, "int8"]
    err: dict[int, dict[str, list]] = {}
    for calls in calls_by_batch:
        for c in calls:
            for p, met in FP.layer_metrics(c, precs).items():
                err.setdefault(c.layer, {}).setdefault(p, []).append(met)
    del calls_by_batch
    _log(f"{name} calibration: per-layer errors ({time.perf_counter() - t0:.0f}s)")
    sens = {s: {**{p: 1.0 - min(m["cos"] for m in err[s][p]) for p in precs}, "bf16": 0.0}
            for s in range(n)}
    tokens = sum(r["n"] for r in refs)
    cal = {"text": args.cal_book, "tokens": tokens, "ppl_exact": exact, "budget": args.budget}
    rows = []
    got = meter.measure([var] * n, refs)
    los = meter.losses(got, exact)
    rows.append({**base, **cal, "kind": "cal_point", "method": f"all {var}",
                 "code": FP.code([var] * n), "fp4_share": 1.0, "ppl": got["value"],
                 "rel_change": los["loss"], "kl": got["kl"], "kl_loss": los["kl_loss"]})
    _log(f"{name} calibration text, {var} everywhere: ppl {100 * los['loss']:+.3f}%, exp(KL)-1 "
         f"{100 * los['kl_loss']:+.3f}%")
    searches = {var: FP.search(meter, refs, exact, flops, sens, [var, "int8", "bf16"],
                               args.budget, f"{name} {var}", t0)}
    if args.cal_baseline:
        searches["fp4"] = FP.search(meter, refs, exact, flops, sens, ["fp4", "int8", "bf16"],
                                    args.budget, f"{name} fp4 (SPEC)", t0)
    for p, srch in searches.items():
        what = f"{p}/int8/bf16"
        for m in sorted(srch["probes"]):
            pr = srch["probes"][m]
            rows.append({**base, **cal, "kind": "chosen" if m == srch["m"] else "probe",
                         "method": what, "m": m, "moves": len(srch["moves"]), "code": pr["code"],
                         "fp4_share": pr["fp4_share"], "ppl": pr["value"],
                         "rel_change": pr["loss"], "kl": pr["kl"], "kl_loss": pr["kl_loss"]})
    for s in range(n):
        for p in precs:
            mets = err[s][p]
            rows.append({**base, "kind": "cal_layer", "text": args.cal_book, "tokens": tokens,
                         "layer": s, "method": p, "label": LABELS.get(p, p),
                         "cos": min(m["cos"] for m in mets),
                         "rel_l1": sum(m["rel_l1"] for m in mets) / len(mets),
                         "flops_share": flops[s] / sum(flops),
                         "chosen": searches[var]["chosen"][s],
                         "chosen_base": searches["fp4"]["chosen"][s] if args.cal_baseline else ""})
    if args.heldout_seqs:
        srch = searches[var]
        at60 = [m for m in range(len(srch["moves"]) + 1)
                if FP.fp4_share(C.assignment(n, var, srch["moves"], m), flops) >= 0.6]
        assigns = [(f"all {var}", [var] * n), (f"chosen {var}/int8/bf16", srch["chosen"])]
        if at60:
            assigns.append((f"{var} order m={max(at60)} (>= 60 %)",
                            C.assignment(n, var, srch["moves"], max(at60))))
        if args.cal_baseline:
            assigns.append(("chosen fp4/int8/bf16", searches["fp4"]["chosen"]))
        ids = IG.text_ids(tok, args.book, bos_id)
        for r in FP.heldout_curve(model, FP._batches(ids, args.heldout_seqs, args.cal_len, bos_id),
                                  assigns, flops):
            rows.append({**base, "kind": "curve", "text": args.book, "budget": args.budget,
                         "tokens": args.heldout_seqs * args.cal_len, "method": r["label"],
                         **{k: v for k, v in r.items() if k != "label"}})
    _log(f"{name} calibration done ({time.perf_counter() - t0:.0f}s)")
    return rows


def write_calibration_csv(path: Path, rows: list[dict], command: str, variant: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        fh.write(f"# command: {command}\n")
        fh.write(f"# codes: one character per layer, layer 0 first: r {variant} (reference), 4 fp4 "
                 "(SPEC, compiled), 8 int8, b bf16; fp4_share: r and 4 count as FP4\n")
        w = csv.DictWriter(fh, fieldnames=FP.FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in r.items()})


def format_table(rows: list[dict]) -> str:
    """Markdown table: variant x model."""
    head = ["model (head dim)", "FP4 numerics", "perplexity", "change", "KL per token",
            "top-1 = exact", "worst layer cos", f"layers < {COS_TARGET}", "sum(1 - cos)",
            "vs SPEC", "layers better / worse"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        ex = r["method"] == "exact"
        has_layers = not (isinstance(r["worst_cos"], float) and math.isnan(r["worst_cos"]))
        worst = f"{r['worst_cos']:.5f} ({r['worst_layer']})" if has_layers else "-"
        below = f"{r['layers_below']} / {r['layers']}" if has_layers else "-"
        bw = (f"{r['layers_better']} / {r['layers_worse']}"
              if has_layers and r["method"] != "ref" else "-")
        lines.append("| " + " | ".join([
            f"{r['title']} ({r['head_dim']})", r["label"], _fmt(r["ppl"], ".3f"),
            "" if ex else _fmt(r["delta_pct"], "+.2f%"),
            "" if ex else _fmt(r["kl"], ".5f"),
            "" if ex else _fmt(100 * r["top1"], ".2f%"), worst, below,
            _fmt(r["sum_err"], ".4f"), _fmt(r["sum_err_vs_ref"], ".3f"), bw]) + " |")
    return "\n".join(lines)


def _label(method: str) -> str:
    return RP.METHODS[method][0] if method in RP.METHODS else LABELS.get(method, method)


def format_layers(layer_rows: list[dict], model: str, methods: list[str]) -> str:
    """Per-layer cos table of one model (bold below 0.99)."""
    by = {}
    for r in layer_rows:
        if r["model"] == model:
            by.setdefault(r["layer"], {})[r["method"]] = r
    have = [m for m in methods if any(m in d for d in by.values())]
    head = ["layer", "key-0 mass", "V offset"] + [f"{_label(m)} cos" for m in have]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for layer in sorted(by):
        d = by[layer]
        first = next(iter(d.values()))
        cells = [str(layer), f"{first['key0_mass']:.2f}", f"{first['v_offset']:.2f}"]
        for m in have:
            c = d[m]["cos"] if m in d else math.nan
            s = _fmt(c, ".5f")
            s = f"**{s}**" if c < COS_TARGET else s
            if m == "best_v_per_layer" and m in d:
                s += f" ({d[m]['choice']})"
            cells.append(s)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SUMMARY_FIELDS = ["model", "head_dim", "method", "label", "ppl", "ppl_exact", "delta_pct", "kl",
                  "top1", "worst_cos", "worst_layer", "layers_below", "layers", "mean_cos",
                  "sum_err", "sum_err_vs_ref", "layers_better", "layers_worse", "ppl_tokens",
                  "window", "layer_tokens"]
LAYER_FIELDS = ["model", "layer", "method", "choice", "cos", "rel_l1", "rmse", "key0_mass",
                "v_offset", "seconds"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fp4attn.eval.fp4_variants",
        description="FP4 attention with V smoothing and other cheap numerics changes (not "
                    "SPEC): per-layer cos against exact attention and perplexity, on "
                    "SmolLM2-135M and Gemma 3 270M (offline packaged models, Pride and "
                    "Prejudice), with the pure-PyTorch reference.")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, from {', '.join(MODELS)} (default both)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"per layer: comma-separated, from {', '.join(VARIANTS)} (default "
                         f"{','.join(DEFAULT_VARIANTS)}; ref, the baseline, is always added)")
    ap.add_argument("--ppl-variants", default=",".join(DEFAULT_PPL_VARIANTS),
                    help="end to end, every layer: comma-separated, same names (default "
                         f"{','.join(DEFAULT_PPL_VARIANTS)})")
    ap.add_argument("--tokens", type=int, default=1024,
                    help="tokens whose Q/K/V are captured for the per-layer cos (default 1024)")
    ap.add_argument("--ppl-tokens", type=int, default=4096,
                    help="perplexity tokens, 0 to skip (default 4096, as the report)")
    ap.add_argument("--gemma3-ppl-tokens", type=int, default=0,
                    help="perplexity tokens for Gemma 3 (default: --ppl-tokens)")
    ap.add_argument("--window", type=int, default=1024, help="perplexity window (default 1024)")
    ap.add_argument("--gemma3-window", type=int, default=0,
                    help="perplexity window for Gemma 3 (default: --window)")
    ap.add_argument("--book", default="prideprejudice", choices=list(M.BOOKS))
    ap.add_argument("--no-backend-check", dest="backend_check", action="store_false",
                    help="do not run the compiled FP4 backend per layer")
    ap.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                    help="leave out the per-layer single-operand diagnostics")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV,
                    help=f"summary CSV (default {DEFAULT_CSV}); the per-layer CSV goes beside it "
                         "with _layers added to the name")
    ap.add_argument("--layer-table", action="store_true",
                    help="also print each model's per-layer cos table")
    cal = ap.add_argument_group(
        "calibration", "--calibrate VARIANT: instead of the per-layer / perplexity study, the "
        "calibrated FP4 share with VARIANT as the FP4 precision (fp4attn.eval.fp4pv's "
        "machinery); writes --csv with _calibration added to the name")
    cal.add_argument("--calibrate", default="", metavar="VARIANT",
                     help=f"one of {', '.join(ROTATION_VARIANTS + PV_ROTATION_VARIANTS)} "
                          "(default: no calibration)")
    cal.add_argument("--budget", type=float, default=0.01,
                     help="perplexity increase and exp(KL) - 1 allowed (default 0.01)")
    cal.add_argument("--cal-book", default="emma", choices=list(M.BOOKS))
    cal.add_argument("--cal-seqs", type=int, default=2, help="calibration sequences (default 2)")
    cal.add_argument("--cal-len", type=int, default=1024, help="their length (default 1024)")
    cal.add_argument("--cal-baseline", action="store_true",
                     help="also search fp4 (SPEC, compiled) / int8 / bf16 on the same batches")
    cal.add_argument("--heldout-seqs", type=int, default=2,
                     help="held-out sequences of --cal-len tokens of --book (default 2; 0: none)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    variants = list(dict.fromkeys(["ref"] + [v.strip() for v in args.variants.split(",")
                                             if v.strip()]))
    ppl_variants = [v.strip() for v in args.ppl_variants.split(",") if v.strip()]
    bad = [n for n in names if n not in MODELS] + [
        v for v in variants + ppl_variants if v not in VARIANTS]
    if bad:
        print(f"error: unknown model(s) / variant(s) {bad}; models {MODELS}, variants "
              f"{VARIANTS}", file=sys.stderr)
        return 2
    args.variants, args.ppl_variants = variants, ppl_variants
    if args.calibrate:
        if args.calibrate not in ROTATION_VARIANTS + PV_ROTATION_VARIANTS:
            print(f"error: --calibrate: choose from {ROTATION_VARIANTS + PV_ROTATION_VARIANTS}",
                  file=sys.stderr)
            return 2
        cal_csv = args.csv.with_name(args.csv.stem + "_calibration" + args.csv.suffix)
        command = "python -m fp4attn.eval.fp4_variants " + " ".join(
            sys.argv[1:] if argv is None else argv)
        rows = []
        try:
            for name in names:
                rows += calibrate_variant(name, args)
                write_calibration_csv(cal_csv, rows, command, args.calibrate)
        except M.MissingResourceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(FP.summary(rows))
        _log(f"wrote {cal_csv}")
        return 0
    if args.backend_check:
        args.backend_check = _backend_works()
    t0 = time.perf_counter()
    rows: list[dict] = []
    layer_rows: list[dict] = []
    try:
        for name in names:
            r, lr = study_model(name, args)
            rows += r
            layer_rows += lr
    except M.MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _write_csv(args.csv, SUMMARY_FIELDS, rows)
    layers_csv = args.csv.with_name(args.csv.stem + "_layers" + args.csv.suffix)
    _write_csv(layers_csv, LAYER_FIELDS, layer_rows)
    print(format_table(rows))
    if args.layer_table:
        for name in names:
            print(f"\n{name}:\n" + format_layers(
                layer_rows, name, list(variants) + ["best_v_per_layer", "fp4attn"]
                + list(DIAGNOSTICS) + list(P_DIAGNOSTICS)))
    _log(f"done in {time.perf_counter() - t0:.0f}s; wrote {args.csv} and {layers_csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
