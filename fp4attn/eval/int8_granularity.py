"""`python -m fp4attn.eval.int8_granularity`: does the 8-bit attention get more accurate with finer
Q and K scales? (issue 33, "Accuracy on models unlike SmolLM2")

SPEC_INT8 quantizes Q with one INT8 scale per 64 query rows and K (after smoothing) with one per
128 keys. On Hopper, a wgmma accumulator fragment spans 16 rows per warp and the key columns in
blocks the kernel chooses, so scales per 16 or 32 query rows and per 64 or 32 keys multiply rows
and columns of the same accumulator at no extra loads. This driver measures them with the pure
PyTorch reference (``fp4attn.reference_int8.attention_forward(..., q_block=, k_block=)``);
everything else of SPEC_INT8 (K smoothing, V per 128 keys and channel, 128-key online-softmax
steps, per-row unsigned 8-bit P) is unchanged.

For each model (``fp4attn.eval.models``; text: *Pride and Prejudice*, from the Debian package
``r-cran-janeaustenr``):

* per layer, on the Q/K/V captured on the first ``--tokens`` tokens (``report.capture``): cos of
  the INT8 output against exact float64 attention (``reference.exact_attention``); worst layer and
  the number of layers below SPEC_INT8's target 0.999;
* end to end, ``report.perplexity`` on the first ``--ppl-tokens`` tokens in non-overlapping
  windows: exact (FP32 SDPA), each granularity (every layer), BF16 SDPA for scale, and the spec's
  granularity through the compiled backend (``fp4attn.sdpa(precision="int8")``: it reproduces the
  report's numbers, and checks that the reference stands for the kernels).

Models: SmolLM2-135M (head dim 64, the report's model) and Gemma 3 270M (head dim 256, sliding
window on five of six layers, one KV head; ``<bos>`` before every window). Writes
``docs/results/int8_granularity.csv`` (one row per model and granularity) and
``int8_granularity_layers.csv`` (per layer) beside it, and prints the table.
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
from . import models as M
from . import report as RP

#: SPEC_INT8's granularity: (query rows per Q scale, keys per K scale).
SPEC = (R8.BQ, R8.BK)
#: The granularities of the study: the spec, then what Hopper's wgmma fragments give for free.
GRANULARITIES = [(64, 128), (32, 128), (16, 128), (64, 64), (64, 32), (32, 64), (32, 32),
                 (16, 64), (16, 32)]
#: Per-row Q and per-key K scales: a bound on what finer scales can give (not free: a scale per
#: accumulator row and column to load).
BOUND = (1, 1)
COS_TARGET = RP.INT8_COS_TARGET  # 0.999
MODELS = ("smollm2", "gemma3")
DEFAULT_CSV = Path("docs/results/int8_granularity.csv")


def _log(msg: str) -> None:
    print(f"[int8-granularity] {msg}", file=sys.stderr, flush=True)


def parse_granularities(text: str) -> list[tuple[int, int]]:
    """``"64x128,16x32"`` -> [(64, 128), (16, 32)]."""
    out = []
    for part in text.split(","):
        q, k = part.strip().lower().split("x")
        out.append((int(q), int(k)))
    return out


def label(g: tuple[int, int]) -> str:
    q, k = g
    extra = " (SPEC_INT8)" if g == SPEC else " (bound: per row / per key)" if g == BOUND else ""
    return f"Q/{q} K/{k}{extra}"


def load_model(name: str):
    """(model, tokenizer, title, bos_id): bos_id is put before every window and capture (Gemma
    expects it); None for SmolLM2, as in the report."""
    if name == "smollm2":
        model, tok = M.load_smollm2(verbose=True)
        return model, tok, "SmolLM2-135M-Instruct", None
    if name == "gemma3":
        model, tok = M.load_gemma3(verbose=True)
        return model, tok, "Gemma 3 270M", tok.bos_token_id
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def text_ids(tok, book: str, bos_id: int | None) -> torch.Tensor:
    """The book's tokens; without the tokenizer's own <bos> when bos_id is given (it is added
    per window)."""
    text = M.austen_text(book)
    if bos_id is None:
        return tok(text, return_tensors="pt").input_ids[0]  # as report_smollm2
    return tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]


def _hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix of size n (a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def outlier_fix(name: str, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two exact rewrites of Q K^T that spread K's channel outliers before INT8 (a diagnostic, not
    SPEC_INT8): ``hadamard``, Q H and K H with H an orthonormal Hadamard matrix over the head dim
    (H H^T = I); ``migrate``, channel c of Q divided and of K multiplied by
    sqrt(amax_c |Q| / amax_c |K - kbar|), one factor per channel and KV head from the whole
    sequence (SmoothQuant's migration). Both leave Q K^T, the smoothing and V unchanged."""
    q32, k32 = q.float(), k.float()
    if name == "hadamard":
        h = _hadamard(q.shape[-1])
        return q32 @ h, k32 @ h
    if name == "migrate":
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        qa = q32.abs().amax(dim=2).reshape(B, Hkv, Hq // Hkv, D).amax(dim=2)[:, :, None]
        ka = (k32 - k32.mean(dim=2, keepdim=True)).abs().amax(dim=2, keepdim=True)
        f = torch.where((qa > 0) & (ka > 0), (qa / ka).sqrt(), torch.ones_like(qa))
        return q32 / f.repeat_interleave(Hq // Hkv, dim=1), k32 * f
    raise ValueError(f"unknown outlier fix {name!r}")


OUTLIER_FIXES = ("hadamard", "migrate")


def layer_study(calls: list[RP.AttnCall], grans: list[tuple[int, int]], *,
                backend_check: bool, outlier_fixes: bool = False) -> list[dict]:
    """Per layer and granularity: cos / rel_l1 of the INT8 reference against exact float64
    attention; with ``backend_check``, the compiled backend's INT8 (spec granularity) too; with
    ``outlier_fixes``, the spec's granularity after each ``outlier_fix``."""
    rows = []
    for call in calls:
        t0 = time.perf_counter()
        exact = R.exact_attention(call.q, call.k, call.v, call.attn_mask, call.is_causal,
                                  call.scale, enable_gqa=True)
        runs = [(f"q{q}k{k}", q, k) for q, k in grans]
        if backend_check:
            runs.append(("backend", *SPEC))
        if outlier_fixes and (call.q.shape[-1] & (call.q.shape[-1] - 1)) == 0:
            runs += [(f, *SPEC) for f in OUTLIER_FIXES]
        for key, q, k in runs:
            if key in OUTLIER_FIXES:
                qf, kf = outlier_fix(key, call.q, call.k)
                out, _ = R8.attention_forward(qf, kf, call.v, call.attn_mask, call.is_causal,
                                              call.scale)
            elif key == "backend":
                try:
                    out = RP.run_method("int8", call, device="cpu", backend="fp4attn")
                except Exception as exc:  # noqa: BLE001  (no compiled backend: no check)
                    _log(f"layer {call.layer}: compiled INT8 backend failed: {exc}")
                    continue
            else:
                out, _ = R8.attention_forward(call.q, call.k, call.v, call.attn_mask,
                                              call.is_causal, call.scale, q_block=q, k_block=k)
            met = R.metrics(out, exact)
            rows.append({"layer": call.layer, "run": key, "q_block": q, "k_block": k,
                         "cos": met["cos"], "rel_l1": met["rel_l1"]})
        cos = ", ".join(f"{r['run']} {r['cos']:.5f}" for r in rows if r["layer"] == call.layer)
        _log(f"layer {call.layer:2d} ({time.perf_counter() - t0:4.1f}s): {cos}")
    return rows


def _summarise_layers(rows: list[dict], key: str) -> dict:
    sel = [r for r in rows if r["run"] == key]
    if not sel:
        return {}
    worst = min(sel, key=lambda r: r["cos"])
    return {"worst_cos": worst["cos"], "worst_layer": worst["layer"],
            "layers_below": sum(not r["cos"] >= COS_TARGET for r in sel), "layers": len(sel),
            "mean_cos": sum(r["cos"] for r in sel) / len(sel),
            "mean_rel_l1": sum(r["rel_l1"] for r in sel) / len(sel)}


def capture_layers(name: str, args):
    """The study's common start: model ``name`` loaded, its token ids of ``args.book``, the
    perplexity token count for it (``args.gemma3_ppl_tokens`` for Gemma where given), and the
    SDPA calls of one forward over the first ``args.tokens`` tokens (``<bos>`` first where the
    model expects it). Returns (model, tok, title, bos_id, ids, ppl_tokens, calls)."""
    model, tok, title, bos_id = load_model(name)
    ids = text_ids(tok, args.book, bos_id)
    ppl_tokens = args.ppl_tokens if name == "smollm2" else (args.gemma3_ppl_tokens or
                                                             args.ppl_tokens)
    need = max(args.tokens, ppl_tokens)
    if ids.numel() < need:
        raise ValueError(f"{args.book} has only {ids.numel()} tokens for {name}, {need} requested")
    cap = ids[: args.tokens] if bos_id is None else torch.cat(
        [ids.new_tensor([bos_id]), ids[: args.tokens - 1]])
    with torch.no_grad(), RP.capture(model) as calls:
        model(cap.unsqueeze(0), use_cache=False)
    _log(f"{name}: captured {len(calls)} layers on {cap.numel()} tokens; {calls[0].describe()}")
    return model, tok, title, bos_id, ids, ppl_tokens, calls


def _backend_works() -> bool:
    try:
        import fp4attn

        q = torch.randn(1, 1, 8, 64)
        fp4attn.sdpa(q, q, q, precision="int8", strict=True)
        return True
    except Exception as exc:  # noqa: BLE001
        _log(f"compiled INT8 backend unavailable ({type(exc).__name__}: {exc}): no backend check")
        return False


def study_model(name: str, args, grans: list[tuple[int, int]]) -> tuple[list[dict], list[dict]]:
    """Summary rows (one per granularity, plus exact / BF16 / backend) and per-layer rows."""
    t0 = time.perf_counter()
    model, tok, title, bos_id, ids, ppl_tokens, calls = capture_layers(name, args)
    head_dim = calls[0].q.shape[-1]
    layer_rows = layer_study(calls, grans, backend_check=args.backend_check,
                             outlier_fixes=args.outlier_fixes)
    del calls
    for r in layer_rows:
        r["model"] = name

    e2e: dict[str, dict] = {}
    if ppl_tokens > 1:
        modes = ["exact"] + (["int8"] if args.backend_check else []) + (
            ["bf16"] if args.bf16 else []) + [RP.int8_granularity_mode(q, k) for q, k in grans]
        e2e = RP.perplexity(model, ids[:ppl_tokens], window=args.window, modes=modes,
                            backend="fp4attn", bos_id=bos_id)
    base = {"model": name, "title": title, "head_dim": head_dim,
            "layer_tokens": args.tokens, "ppl_tokens": ppl_tokens, "window": args.window}
    out = []

    def row(key: str, q, k, lab: str, mode: str | None) -> dict:
        d = e2e.get(mode, {}) if mode else {}
        r = {**base, "run": key, "q_block": q, "k_block": k, "label": lab,
             "ppl": d.get("ppl", math.nan), "ppl_exact": e2e.get("exact", {}).get("ppl", math.nan),
             "delta_pct": 100 * d["rel_change"] if d else math.nan,
             "kl": d.get("kl", math.nan), "top1": d.get("top1_agree", math.nan)}
        r.update({k2: _summarise_layers(layer_rows, key).get(k2, math.nan)
                  for k2 in ("worst_cos", "worst_layer", "layers_below", "layers", "mean_cos",
                             "mean_rel_l1")})
        return r

    if e2e:
        out.append(row("exact", "", "", "exact (FP32 SDPA)", "exact"))
    if e2e and args.bf16:
        out.append(row("bf16", "", "", "BF16 SDPA (for scale)", "bf16"))
    if args.backend_check:
        out.append(row("backend", *SPEC, f"Q/{SPEC[0]} K/{SPEC[1]}, compiled backend", "int8"))
    for q, k in grans:
        out.append(row(f"q{q}k{k}", q, k, label((q, k)), RP.int8_granularity_mode(q, k)))
    if args.outlier_fixes:
        names = {"hadamard": "Hadamard-rotated head dim", "migrate": "channel migration"}
        out += [row(f, *SPEC, f"Q/{SPEC[0]} K/{SPEC[1]}, {names[f]} (per layer only)", None)
                for f in OUTLIER_FIXES if any(r["run"] == f for r in layer_rows)]
    _log(f"{name}: done in {time.perf_counter() - t0:.0f}s")
    return out, layer_rows


def _fmt(x, spec: str) -> str:
    """format(x, spec) with "-" for a missing value; a trailing "%" in spec is a literal."""
    if x == "" or x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    pct = spec.endswith("%")
    return format(x, spec[:-1] if pct else spec) + ("%" if pct else "")


def format_table(rows: list[dict]) -> str:
    """Markdown table: granularity x model."""
    head = ["model (head dim)", "Q rows / K keys per scale", "perplexity", "change", "KL per token",
            "top-1 = exact", "worst layer cos", f"layers < {COS_TARGET}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        worst = "-" if isinstance(r["worst_cos"], float) and math.isnan(r["worst_cos"]) else (
            f"{r['worst_cos']:.5f} (layer {r['worst_layer']})")
        below = ("-" if isinstance(r["layers_below"], float)
                 else f"{r['layers_below']} / {r['layers']}")
        lines.append("| " + " | ".join([
            f"{r['title']} ({r['head_dim']})", r["label"], _fmt(r["ppl"], ".3f"),
            "" if r["run"] == "exact" else _fmt(r["delta_pct"], "+.2f") + "%",
            "" if r["run"] == "exact" else _fmt(r["kl"], ".5f"),
            "" if r["run"] == "exact" else _fmt(100 * r["top1"], ".2f") + "%", worst, below])
            + " |")
    return "\n".join(lines)


SUMMARY_FIELDS = ["model", "head_dim", "run", "q_block", "k_block", "label", "ppl", "ppl_exact",
                  "delta_pct", "kl", "top1", "worst_cos", "worst_layer", "layers_below", "layers",
                  "mean_cos", "mean_rel_l1", "ppl_tokens", "window", "layer_tokens"]
LAYER_FIELDS = ["model", "layer", "run", "q_block", "k_block", "cos", "rel_l1"]


def _write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in r.items()})


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fp4attn.eval.int8_granularity",
        description="INT8 attention (SPEC_INT8) at finer Q / K scale granularities: per-layer "
                    "cos against exact attention and perplexity, on SmolLM2-135M and Gemma 3 "
                    "270M (offline packaged models, Pride and Prejudice).")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, from {', '.join(MODELS)} (default both)")
    ap.add_argument("--granularities", type=parse_granularities, default=GRANULARITIES,
                    help="QROWSxKKEYS list, e.g. 64x128,16x32 (default: 64, 32, 16 rows x "
                         "128, 64, 32 keys)")
    ap.add_argument("--no-bound", action="store_true",
                    help=f"leave out the per-row / per-key bound {BOUND[0]}x{BOUND[1]}")
    ap.add_argument("--tokens", type=int, default=1024,
                    help="tokens whose Q/K/V are captured for the per-layer cos (default 1024)")
    ap.add_argument("--ppl-tokens", type=int, default=4096,
                    help="perplexity tokens, 0 to skip (default 4096, as the report)")
    ap.add_argument("--gemma3-ppl-tokens", type=int, default=0,
                    help="perplexity tokens for Gemma 3 (default: --ppl-tokens)")
    ap.add_argument("--window", type=int, default=1024, help="perplexity window (default 1024)")
    ap.add_argument("--book", default="prideprejudice", choices=list(M.BOOKS))
    ap.add_argument("--no-backend-check", dest="backend_check", action="store_false",
                    help="do not run the compiled INT8 backend at the spec's granularity")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false",
                    help="do not measure BF16 SDPA for scale")
    ap.add_argument("--outlier-fixes", action="store_true",
                    help="also measure, per layer at the spec's granularity, two exact rewrites "
                         "of QK^T that spread K's channel outliers (Hadamard rotation of the "
                         "head dim, SmoothQuant-style channel migration): a diagnostic")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV,
                    help=f"summary CSV (default {DEFAULT_CSV}); the per-layer CSV goes beside it "
                         "with _layers added to the name")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad:
        print(f"error: unknown model(s) {bad}; choose from {MODELS}", file=sys.stderr)
        return 2
    grans = list(dict.fromkeys(args.granularities + ([] if args.no_bound else [BOUND])))
    if args.backend_check:
        args.backend_check = _backend_works()
    t0 = time.perf_counter()
    rows: list[dict] = []
    layer_rows: list[dict] = []
    try:
        for name in names:
            r, lr = study_model(name, args, grans)
            rows += r
            layer_rows += lr
    except M.MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _write_csv(args.csv, SUMMARY_FIELDS, rows)
    layers_csv = args.csv.with_name(args.csv.stem + "_layers" + args.csv.suffix)
    _write_csv(layers_csv, LAYER_FIELDS, layer_rows)
    print(format_table(rows))
    _log(f"done in {time.perf_counter() - t0:.0f}s; wrote {args.csv} and {layers_csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
