"""`python -m fp4attn.eval.policy_study`: calibrated per-layer policies (fp4attn.calibrate) on
real models, checked on text they were not calibrated on (issue 35).

Per causal LM (SmolLM2-135M, Gemma 3 270M; ``int8_granularity.load_model``):

1. calibrate on ``--cal-seqs`` sequences of ``--cal-len`` tokens of one Austen novel
   (``--cal-book``, default emma), two sequences per batch, with ``--budget`` and
   ``--device-kind``; the policy goes to ``policy_<model>.json``;
2. on another novel (``--book``, default prideprejudice, its first ``--ppl-tokens`` tokens in
   windows of ``--window``; ``report.perplexity``): exact, FP4 everywhere, INT8 everywhere and
   the calibrated policy side by side (perplexity, top-1 agreement, KL), with each one's share of
   the attention FLOPs in FP4 (the FLOPs per layer are the calibration's);
3. transfer: the same on Python source (``models.python_source_text``: standard library
   modules), a text of another kind than the one calibrated on;
4. greedy generation from ``--gen-prompts`` paragraphs of ``--book`` (first 64 tokens),
   ``--gen-tokens`` new tokens: tokens until the first divergence from exact attention;
5. the curve: perplexity on ``--book`` along the calibration's order (``calibration.ladder``: all
   FP4, then layer by layer to INT8, then to BF16), at ``--curve-points`` assignments and the
   calibrated one; plotted against the FP4 share.

MiniLM (all-MiniLM-L6-v2): calibrated on ``report``'s capture batch (paragraphs of persuasion,
metric embedding cos, ``--minilm-budget``), checked on sentences of emma
(``report.embedding_similarity``).

Writes policy_<model>.json, policy_study.csv (one row per model, text and attention),
policy_curve.csv, policy_layers.csv, policy_curve.png and policy_study.md into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

from .. import calibration as C
from ..policy import Policy
from . import int8_granularity as IG
from . import models as M
from . import report as RP

CAUSAL = ("smollm2", "gemma3")
TITLES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M",
          "minilm": "all-MiniLM-L6-v2"}


def _log(msg: str) -> None:
    print(f"[policy-study] {msg}", file=sys.stderr, flush=True)


def text_ids(tok, text: str, bos_id: int | None) -> torch.Tensor:
    """Token ids of ``text``; without the tokenizer's own <bos> when ``bos_id`` is given (it is
    put before every sequence)."""
    if bos_id is None:
        return tok(text, return_tensors="pt").input_ids[0]
    return tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]


def calibration_batches(ids: torch.Tensor, seqs: int, length: int, bos_id: int | None,
                        per_batch: int = 2) -> list[torch.Tensor]:
    """``seqs`` consecutive sequences of ``length`` tokens (``<bos>`` first where given), batched
    ``per_batch`` at a time."""
    body = length - (bos_id is not None)
    if ids.numel() < seqs * body:
        raise ValueError(f"calibration text has {ids.numel()} tokens, {seqs * body} needed")
    rows = [ids[i * body:(i + 1) * body] for i in range(seqs)]
    if bos_id is not None:
        rows = [torch.cat([r.new_tensor([bos_id]), r]) for r in rows]
    return [torch.stack(rows[i:i + per_batch]) for i in range(0, seqs, per_batch)]


def fp4_share(mode: str, flops: list[float]) -> float:
    if mode == "fp4":
        return 1.0
    if mode.startswith("policy:"):
        return Policy.from_code(mode.split(":", 1)[1]).fp4_share(flops)
    return 0.0


def greedy_agreement(model, tok, prompts: list[str], modes: list[str], new_tokens: int,
                     bos_id: int | None) -> dict[str, dict]:
    """Tokens of greedy generation until the first divergence from modes[0] (exact)."""
    runs: dict[str, list[list[int]]] = {m: [] for m in modes}
    for text in prompts:
        ids = text_ids(tok, text, bos_id)[:64]
        if bos_id is not None:
            ids = torch.cat([ids.new_tensor([bos_id]), ids])
        for mode in modes:
            with torch.no_grad(), RP.attention_mode(model, mode, "fp4attn"):
                out = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]),
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False)
            runs[mode].append(out[0, ids.numel():].tolist())
    res = {}
    for mode in modes[1:]:
        same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(runs[mode], runs[modes[0]])]
        res[mode] = {"mean_tokens": sum(same) / len(same), "min_tokens": min(same),
                     "per_prompt": same}
    return res


def study_causal(name: str, args) -> dict:
    t0 = time.perf_counter()
    model, tok, title, bos_id = IG.load_model(name)
    cal_ids = text_ids(tok, M.austen_text(args.cal_book), bos_id)
    batches = calibration_batches(cal_ids, args.cal_seqs, args.cal_len, bos_id)
    policy = C.calibrate(model, batches, budget=args.budget, device_kind=args.device_kind,
                         sensitivity=args.sensitivity)
    policy.meta["calibration_text"] = (f"{args.cal_seqs} x {args.cal_len} tokens of "
                                       f"{args.cal_book}")
    policy.save(args.out / f"policy_{name}.json")
    cal = policy.meta["calibration"]
    flops = cal["flops"]
    pmode = RP.policy_mode(policy)
    modes = ["exact", "fp4", "int8", pmode]
    rows = []
    texts = {args.book: M.austen_text(args.book), "python": M.python_source_text()}
    for label, text in texts.items():
        ids = text_ids(tok, text, bos_id)[: args.ppl_tokens]
        res = RP.perplexity(model, ids, window=args.window, modes=modes, backend="fp4attn",
                            bos_id=bos_id)
        for mode, d in res.items():
            rows.append({"model": name, "text": label, "attention": mode,
                         "label": RP.mode_label(mode), "fp4_share": fp4_share(mode, flops), **d})
        _log(f"{name} on {label}: " + ", ".join(
            f"{m.split(':')[0]} {100 * d['rel_change']:+.2f}%" for m, d in res.items()))
    gen = {}
    if args.gen_prompts:
        paras = [p for p in M.austen_paragraphs(args.book) if len(p) > 400][: args.gen_prompts]
        gen = greedy_agreement(model, tok, paras, modes, args.gen_tokens, bos_id)
        for r in rows:
            if r["text"] == args.book and r["attention"] in gen:
                r["gen_mean_tokens"] = gen[r["attention"]]["mean_tokens"]
                r["gen_min_tokens"] = gen[r["attention"]]["min_tokens"]
    curve = []
    steps = C.ladder(policy)
    picks = sorted({round(i * (len(steps) - 1) / max(args.curve_points - 1, 1))
                    for i in range(args.curve_points)} | {cal["m"]})
    ids = text_ids(tok, texts[args.book], bos_id)[: args.curve_tokens]
    cmodes = ["exact"] + [RP.policy_mode(steps[m]) for m in picks]
    res = RP.perplexity(model, ids, window=args.window, modes=list(dict.fromkeys(cmodes)),
                        backend="fp4attn", bos_id=bos_id)
    for m in picks:
        d = res[RP.policy_mode(steps[m])]
        curve.append({"model": name, "m": m, "code": steps[m].code(),
                      "fp4_share": steps[m].fp4_share(flops), "calibrated": m == cal["m"],
                      "text": args.book, "tokens": d["tokens"], "ppl": d["ppl"],
                      "rel_change": d["rel_change"], "kl": d["kl"],
                      "top1_agree": d["top1_agree"]})
    return {"name": name, "title": title, "policy": policy, "rows": rows, "curve": curve,
            "gen": gen, "seconds": time.perf_counter() - t0}


def study_minilm(args) -> dict:
    t0 = time.perf_counter()
    model, tok = M.load_minilm()
    paras = [p for p in M.austen_paragraphs("persuasion") if len(p) > 400][: args.paragraphs]
    enc = tok(paras, padding=True, truncation=True, max_length=256, return_tensors="pt")
    policy = C.calibrate(model, [enc], budget=args.minilm_budget, device_kind=args.device_kind,
                         sensitivity=args.sensitivity)
    policy.meta["calibration_text"] = f"{len(paras)} paragraphs of persuasion"
    policy.save(args.out / "policy_minilm.json")
    flops = policy.meta["calibration"]["flops"]
    sentences = M.austen_sentences("emma", args.sentences)
    modes = ["exact", "fp4", "int8", RP.policy_mode(policy)]
    res = RP.embedding_similarity(model, tok, sentences, modes=modes, backend="fp4attn",
                                  batch_size=32)
    rows = [{"model": "minilm", "text": f"{args.sentences} sentences of emma", "attention": m,
             "label": RP.mode_label(m), "fp4_share": fp4_share(m, flops), **d}
            for m, d in res.items()]
    return {"name": "minilm", "title": TITLES["minilm"], "policy": policy, "rows": rows,
            "curve": [], "gen": {}, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _pct(x) -> str:
    return "" if x is None or x == "" else f"{100 * x:+.2f}%"


def markdown(results: list[dict], args) -> str:
    md = ["# Calibrated per-layer precision policies", "",
          f"Command: `python -m fp4attn.eval.policy_study {' '.join(args.argv)}`".rstrip(), "",
          f"Cost order `{args.device_kind}` ({C.cost_table(args.device_kind)}), perplexity budget "
          f"+{100 * args.budget:.2f}%, MiniLM budget mean cos >= {1 - args.minilm_budget:.4f}, "
          f"layer order by sensitivity `{args.sensitivity}`. \"bf16\" is torch SDPA in the "
          "input dtype (float32 here): exact.", ""]
    for r in results:
        cal = r["policy"].meta["calibration"]
        md += [f"## {r['title']}", "",
               f"Calibrated on {r['policy'].meta['calibration_text']} in {cal['seconds']:.0f} s: "
               f"`{r['policy'].code()}` (4 fp4, 8 int8, b bf16; layer 0 first), "
               f"{100 * cal['fp4_share']:.1f}% of attention FLOPs in FP4, measured there "
               + (f"{100 * cal['loss']:+.3f}% perplexity" if cal["metric"] == "perplexity" else
                  f"mean cos {cal['measured']:.6f}") + ".", ""]
        if r["name"] == "minilm":
            md.append(RP._md_table(
                ["attention", "FP4 FLOPs", "mean cos", "min cos", "nearest neighbour = exact"],
                [[x["label"], f"{100 * x['fp4_share']:.0f}%", f"{x['mean_cos']:.6f}",
                  f"{x['min_cos']:.6f}", f"{100 * x['nn_agree']:.1f}%"] for x in r["rows"]]))
        else:
            md.append(RP._md_table(
                ["text", "attention", "FP4 FLOPs", "perplexity", "change", "top-1 = exact",
                 "KL", "greedy tokens (mean / min)"],
                [[x["text"], x["label"], f"{100 * x['fp4_share']:.0f}%", f"{x['ppl']:.4f}",
                  _pct(x["rel_change"]), f"{100 * x['top1_agree']:.2f}%", f"{x['kl']:.4f}",
                  (f"{x['gen_mean_tokens']:.1f} / {x['gen_min_tokens']}"
                   if "gen_mean_tokens" in x else "")] for x in r["rows"]]))
            md += ["", f"Perplexity on {args.ppl_tokens} tokens per text, windows of "
                   f"{args.window}; greedy: {args.gen_prompts} prompts of {args.book}, "
                   f"{args.gen_tokens} new tokens.", ""]
            if r["curve"]:
                md += ["Curve along the calibration's order (`m` moves from all FP4), "
                       f"{r['curve'][0]['tokens']} tokens of {args.book}:", ""]
                md.append(RP._md_table(
                    ["m", "policy", "FP4 FLOPs", "perplexity change", "KL"],
                    [[str(c["m"]) + (" (calibrated)" if c["calibrated"] else ""),
                      f"`{c['code']}`", f"{100 * c['fp4_share']:.1f}%",
                      _pct(c["rel_change"]), f"{c['kl']:.4f}"] for c in r["curve"]]))
        md += ["", "Per layer (calibration text): attention cos against exact float64, the "
               "chosen precision:", ""]
        md.append(RP._md_table(
            ["layer", "FLOPs", "cos fp4", "cos int8", "precision"],
            [[str(x["site"]), f"{100 * x['flops_share']:.1f}%", f"{x.get('cos_fp4', 0):.5f}",
              f"{x.get('cos_int8', 0):.5f}", x["precision"]] for x in cal["layers"]]))
        md.append("")
    return "\n".join(md) + "\n"


def plot_curves(results: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib is not installed: no plot")
        return None
    with_curve = [r for r in results if r["curve"]]
    if not with_curve:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for j, r in enumerate(with_curve):
        xs = [100 * c["fp4_share"] for c in r["curve"]]
        ys = [100 * c["rel_change"] for c in r["curve"]]
        ax.plot(xs, ys, marker="o", ms=3, color=f"C{j}", label=r["title"])
        for c in r["curve"]:
            if c["calibrated"]:
                ax.plot(100 * c["fp4_share"], 100 * c["rel_change"], marker="*", ms=14,
                        color=f"C{j}", mec="k")
    ax.axhline(100 * with_curve[0]["policy"].meta["calibration"]["budget"], color="k", ls="--",
               lw=0.8, label="budget")
    ax.set_xlabel("share of attention FLOPs in FP4 (%)")
    ax.set_ylabel("perplexity change vs exact (%)")
    ax.set_title("Along the calibration order (star: calibrated policy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_outputs(results: list[dict], args) -> str:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    keys = ["model", "text", "attention", "label", "fp4_share", "ppl", "rel_change", "top1_agree",
            "kl", "tokens", "gen_mean_tokens", "gen_min_tokens", "mean_cos", "min_cos",
            "nn_agree", "sentences"]
    with open(out / f"policy_study{args.tag}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerows(r["rows"])
    with open(out / f"policy_curve{args.tag}.csv", "w", newline="") as fh:
        keys = ["model", "m", "code", "fp4_share", "calibrated", "text", "tokens", "ppl",
                "rel_change", "kl", "top1_agree"]
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in results:
            w.writerows(r["curve"])
    with open(out / f"policy_layers{args.tag}.csv", "w", newline="") as fh:
        keys = ["model", "site", "flops_share", "cos_fp4", "cos_int8", "rel_l1_fp4",
                "rel_l1_int8", "sens_fp4", "sens_int8", "precision"]
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in results:
            layers = r["policy"].meta["calibration"]["layers"]
            w.writerows({"model": r["name"], **x} for x in layers)
    text = markdown(results, args)
    png = plot_curves(results, out / f"policy_curve{args.tag}.png")
    if png:
        text += f"\n![perplexity vs FP4 share]({png.name})\n"
    (out / f"policy_study{args.tag}.md").write_text(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fp4attn.eval.policy_study",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,minilm",
                    help="comma-separated: smollm2, gemma3, minilm (default smollm2,minilm)")
    ap.add_argument("--budget", type=float, default=0.01,
                    help="perplexity budget, relative (default 0.01)")
    ap.add_argument("--minilm-budget", type=float, default=0.001,
                    help="MiniLM budget: 1 - mean embedding cos (default 0.001)")
    ap.add_argument("--device-kind", default="blackwell", choices=list(C.DEVICE_COSTS))
    ap.add_argument("--sensitivity", default="attention", choices=list(C.SENSITIVITIES))
    ap.add_argument("--cal-book", default="emma", choices=list(M.BOOKS))
    ap.add_argument("--cal-seqs", type=int, default=4, help="calibration sequences (default 4)")
    ap.add_argument("--cal-len", type=int, default=512, help="their length (default 512)")
    ap.add_argument("--book", default="prideprejudice", choices=list(M.BOOKS))
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--curve-points", type=int, default=6,
                    help="assignments of the order measured for the curve (default 6)")
    ap.add_argument("--curve-tokens", type=int, default=1024)
    ap.add_argument("--gen-prompts", type=int, default=5)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--paragraphs", type=int, default=8, help="MiniLM calibration paragraphs")
    ap.add_argument("--sentences", type=int, default=128, help="MiniLM test sentences")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--tag", default="", help="suffix of the csv / md / png names (default none)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    bad = [n for n in names if n not in CAUSAL + ("minilm",)]
    if bad:
        print(f"error: --models: unknown {bad}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for n in names:
            results.append(study_minilm(args) if n == "minilm" else study_causal(n, args))
            _log(f"{n} done in {results[-1]['seconds']:.0f}s")
            write_outputs(results, args)  # after each model: a long run keeps what it has
    except M.MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(write_outputs(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
