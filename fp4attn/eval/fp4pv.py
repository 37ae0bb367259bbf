"""`python -m fp4attn.eval.fp4pv`: "fp4pv", a per-product precision, measured (issue 35's 60 %
FP4 target; docs/accuracy.md "fp4pv").

fp4pv computes QK^T in 8 bits exactly as SPEC_INT8 2.1-2.3 does (K smoothing, channel migration,
Q^ per 64 rows, K^ per 128 keys) and P.V in FP4 exactly as SPEC 4.3 / 4.5-4.6 do (V smoothing
with the masked vbar, two-level P, NVFP4 V^): ``reference.attention_fp4pv``. Half of a layer's
attention FLOPs (the P.V product) are then FP4. No backend computes it: the reference does, on
the CPU, and this study is the only place it runs in a model.

Per causal LM (SmolLM2-135M, Gemma 3 270M; loaders and ``<bos>`` handling of
``fp4attn.eval.int8_granularity``):

1. per layer, on the Q/K/V captured on the first ``--tokens`` tokens of ``--book``: cos / rel_l1
   against exact float64 attention of FP4 (compiled backend, SPEC), INT8 (compiled backend,
   SPEC_INT8), fp4pv (reference) and the FP4 P.V half alone (QK^T exact, the report's
   ``fp4_pv``: the limit fp4pv's 8-bit scores approach);
2. end to end, ``report.perplexity`` on the first ``--ppl-tokens`` tokens of ``--book`` in
   windows of ``--window``: exact, FP4, INT8 and fp4pv in every layer (KL, top-1 agreement);
3. calibration with fp4pv among the candidates: ``calibrate_study``, the steps of
   ``fp4attn.calibrate`` (capture, per-layer attention error as the sensitivity, the convex-hull
   order of ``calibration.upgrade_moves``, bisection on the measured perplexity increase *and*
   exp(KL) - 1 against ``--budget``) with the Blackwell costs fp4 1 < fp4pv 1.5 < int8 2 < bf16 4
   (fp4pv: half FP4, half INT8 work) and fp4pv counted as 50 % FP4 FLOPs; on ``--cal-seqs``
   sequences of ``--cal-len`` tokens of ``--cal-book`` (as ``policy_study``); the same search
   without fp4pv (fp4 / int8 / bf16, ``fp4attn.calibrate``'s candidates) on the same batches for
   the baseline;
   Also fp4pv in every layer on the calibration text (row kind ``cal_point``).
4. the curve: perplexity change and exp(KL) - 1 of ``--curve-points`` assignments along each
   order, of fp4pv everywhere and of both chosen policies on ``--curve-seqs`` x ``--cal-len``
   tokens of ``--book`` (held out), against their FP4 FLOP share.

Mixed policies run per call site: fp4 and int8 through ``fp4attn.sdpa`` (compiled backend,
strict), bf16 torch SDPA, fp4pv ``reference.attention_fp4pv``.

Writes one CSV (``--csv``, headed by the command) with rows of kind ``layer``, ``e2e``,
``cal_layer`` (the calibration text's per-layer cos and both chosen precisions), ``cal_point``,
``probe``, ``chosen`` and ``curve``, and prints a summary.
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
from . import int8_granularity as IG
from . import models as M
from . import report as RP

MODELS = ("smollm2", "gemma3")
#: The study's precisions, cheapest first on Blackwell, their cost per unit of attention work
#: and the share of their FLOPs in FP4 (fp4pv: the P.V half).
COSTS = {"fp4": 1.0, "fp4pv": 1.5, "int8": 2.0, "bf16": 4.0}
FP4_FRACTION = {"fp4": 1.0, "fp4pv": 0.5, "int8": 0.0, "bf16": 0.0}
CODE = {"fp4": "4", "fp4pv": "p", "int8": "8", "bf16": "b"}
LAYER_METHODS = ("fp4", "int8", "fp4pv", "fp4_pv_exact_qk")
LABELS = {"fp4": "FP4 (SPEC, compiled)", "int8": "INT8 (SPEC_INT8, compiled)",
          "fp4pv": "fp4pv: INT8 QK^T, FP4 P.V (reference)",
          "fp4_pv_exact_qk": "FP4 P.V only, QK^T exact (reference)"}
DEFAULT_CSV = Path("docs/results/fp4pv.csv")
#: The precisions computed by the reference (name -> ``reference.attention`` keywords): fp4pv
#: (``reference.attention_fp4pv``), and the variants other studies calibrate with this machinery
#: (``register_precision``).
REFERENCE_PRECISIONS: dict[str, dict] = {"fp4pv": {"qk": "int8"}}
_STUDY_PRECISIONS = frozenset(COSTS)


def register_precision(name: str, flags: dict, *, cost: float, fp4_fraction: float,
                       char: str) -> None:
    """Make ``reference.attention(..., **flags)`` a precision of this module (``attention_fn``,
    ``search``, ``code``, ``fp4_share``) with the given cost, FP4 share of its FLOPs and code
    character (used by ``fp4attn.eval.fp4_variants --calibrate``)."""
    if name in _STUDY_PRECISIONS:
        raise ValueError(f"{name!r} is a precision of the fp4pv study already")
    if char in CODE.values() and CODE.get(name) != char:
        raise ValueError(f"code character {char!r} is taken")
    REFERENCE_PRECISIONS[name] = dict(flags)
    COSTS[name], FP4_FRACTION[name], CODE[name] = cost, fp4_fraction, char


def _log(msg: str) -> None:
    print(f"[fp4pv] {msg}", file=sys.stderr, flush=True)


def code(precisions: list[str]) -> str:
    """One character per site: 4 fp4, p fp4pv, 8 int8, b bf16."""
    return "".join(CODE[p] for p in precisions)


def fp4_share(precisions: list[str], flops: list[float]) -> float:
    return sum(FP4_FRACTION[p] * f for p, f in zip(precisions, flops)) / sum(flops)


def attention_fn(precision: str):
    """One site's attention, torch SDPA's contract, in ``precision``."""
    if precision in REFERENCE_PRECISIONS:
        flags = REFERENCE_PRECISIONS[precision]

        def run(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
            o = R.attention(q.cpu(), k.cpu(), v.cpu(),
                            None if attn_mask is None else attn_mask.cpu(), is_causal, scale,
                            **flags)
            return o.to(q.device, q.dtype)
        return run
    if precision == "bf16":
        def run(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
            return RP.TORCH_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                 is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return run
    if precision in ("fp4", "int8"):
        import fp4attn

        def run(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
            return fp4attn.sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                precision=precision, strict=True)
        return run
    raise ValueError(f"precision must be one of {list(COSTS)}, got {precision!r}")


def site_sdpa(precisions: list[str]):
    """An SDPA function for ``report.swap_sdpa``: call site i in ``precisions[i]``."""
    fns = {p: attention_fn(p) for p in set(precisions)}

    def run(i, q, k, v, **kw):
        if i >= len(precisions):
            raise ValueError(f"call site {i} is past the {len(precisions)} sites of the policy")
        return fns[precisions[i]](q, k, v, **kw)
    return run


class _Meter(C._Metric):
    """calibration's metric (perplexity and top-256 KL against the exact forward), measured
    with a per-site precision list applied through swap_sdpa."""

    def measure(self, precisions: list[str], refs: list) -> dict:
        a = b = 0.0
        with RP.swap_sdpa(site_sdpa(precisions), self.model):
            for batch, ref in zip(self.batches, refs):
                x, y = self.compare(C._forward(self.model, batch), batch, ref)
                a, b = a + x, b + y
        n = sum(r["n"] for r in refs)
        return {"value": math.exp(a / n), "kl": b / n}


def layer_metrics(call: RP.AttnCall, methods=LAYER_METHODS) -> dict[str, dict]:
    """cos / rel_l1 / rmse against exact float64 attention of each method on one captured call
    (padding query rows left out)."""
    ref = RP._select_rows(R.exact_attention(call.q, call.k, call.v, call.attn_mask,
                                            call.is_causal, call.scale, enable_gqa=True),
                          call.row_mask)
    out = {}
    for m in methods:
        if m == "fp4_pv_exact_qk":
            o = RP.run_method("fp4_pv", call, device="cpu", backend="fp4attn")
        else:
            o = attention_fn(m)(call.q, call.k, call.v, call.attn_mask, 0.0, call.is_causal,
                                call.scale, call.enable_gqa).float()
        out[m] = R.metrics(RP._select_rows(o, call.row_mask), ref)
    return out


def prepare(model, batches: list[dict]):
    """The exact pass of calibrate (step 1): the meter, its references, the exact perplexity,
    per-site FLOPs and the captured calls of every batch."""
    meter = _Meter(model, batches, "perplexity")
    refs, calls_by_batch = [], []
    for batch in batches:
        with RP.capture(model) as calls:
            out = C._forward(model, batch)
        refs.append(meter.reference(out, batch))
        calls_by_batch.append(calls)
    n_sites = len(calls_by_batch[0])
    flops = [0.0] * n_sites
    for calls in calls_by_batch:
        for c in calls:
            flops[c.layer] += C._site_flops(c)
    exact = math.exp(sum(r["nll"] for r in refs) / sum(r["n"] for r in refs))
    return meter, refs, exact, flops, calls_by_batch


def search(meter, refs, exact, flops, sens, cands, budget, label, t0) -> dict:
    """calibrate's steps 4-5 for the candidate list ``cands`` (cost order): the order and the
    bisection for the smallest m whose perplexity increase and exp(KL) - 1 are both within
    ``budget``. Returns the moves, the probes and the chosen m."""
    n = len(flops)
    costs = {p: COSTS[p] for p in cands}
    moves = C.upgrade_moves(sens, flops, costs, cands)
    probes: dict[int, dict] = {}

    def passes(m: int) -> bool:
        pol = C.assignment(n, cands[0], moves, m)
        got = meter.measure(pol, refs)
        los = meter.losses(got, exact)
        probes[m] = {"m": m, "code": code(pol), "fp4_share": fp4_share(pol, flops), **got, **los,
                     "pass": max(los.values()) <= budget}
        _log(f"{label} probe m={m}/{len(moves)}: {code(pol)}, FP4 share "
             f"{100 * probes[m]['fp4_share']:.1f}%, ppl {100 * los['loss']:+.3f}%, exp(KL)-1 "
             f"{100 * los['kl_loss']:+.3f}% ({'pass' if probes[m]['pass'] else 'fail'}) "
             f"({time.perf_counter() - t0:.0f}s)")
        return probes[m]["pass"]

    hi = C.smallest_passing(passes, len(moves))
    if hi is None:
        raise ValueError(f"{label}: the most accurate assignment fails: {probes[len(moves)]}")
    return {"moves": moves, "probes": probes, "m": hi, "cands": cands,
            "chosen": C.assignment(n, cands[0], moves, hi)}


def calibrate_study(model, batches: list[dict], budget: float, t0: float) -> dict:
    """The calibration with and without fp4pv on the same batches and per-layer errors."""
    meter, refs, exact, flops, calls_by_batch = prepare(model, batches)
    n = len(flops)
    _log(f"calibration: {n} sites, exact perplexity {exact:.4f} ({time.perf_counter() - t0:.0f}s)")
    err: dict[int, dict[str, list]] = {}
    for calls in calls_by_batch:
        for c in calls:
            for p, met in layer_metrics(c, ("fp4", "fp4pv", "int8")).items():
                err.setdefault(c.layer, {}).setdefault(p, []).append(met)
    del calls_by_batch
    _log(f"calibration: per-layer errors ({time.perf_counter() - t0:.0f}s)")
    # step 3, sensitivity "attention": 1 - the worst cos over the batches; bf16 exact
    sens = {s: {p: (1.0 - min(m["cos"] for m in err[s][p]) if p != "bf16" else 0.0)
                for p in COSTS} for s in range(n)}
    got = meter.measure(["fp4pv"] * n, refs)  # fp4pv in every layer, on the calibration text
    every = {"code": code(["fp4pv"] * n), "fp4_share": 0.5, **got, **meter.losses(got, exact)}
    _log(f"calibration text, fp4pv everywhere: ppl {100 * every['loss']:+.3f}%, exp(KL)-1 "
         f"{100 * every['kl_loss']:+.3f}% ({time.perf_counter() - t0:.0f}s)")
    with_pv = search(meter, refs, exact, flops, sens, ["fp4", "fp4pv", "int8", "bf16"], budget,
                     "with fp4pv", t0)
    base = search(meter, refs, exact, flops, sens, ["fp4", "int8", "bf16"], budget,
                  "without fp4pv", t0)
    return {"exact": exact, "flops": flops, "err": err, "sens": sens, "with_pv": with_pv,
            "base": base, "every": every, "tokens": sum(r["n"] for r in refs)}


def heldout_curve(model, batches: list[dict], assignments: list[tuple[str, list[str]]],
                  flops: list[float]) -> list[dict]:
    """Perplexity change and exp(KL) - 1 of each (label, precisions) on held-out batches."""
    meter, refs, exact, _, calls = prepare(model, batches)
    del calls
    rows = []
    for label, pol in assignments:
        got = meter.measure(pol, refs)
        los = meter.losses(got, exact)
        rows.append({"label": label, "code": code(pol), "fp4_share": fp4_share(pol, flops),
                     "ppl": got["value"], "ppl_exact": exact, "rel_change": los["loss"],
                     "kl": got["kl"], "kl_loss": los["kl_loss"]})
        _log(f"held out {label}: {code(pol)} FP4 {100 * rows[-1]['fp4_share']:.1f}%, ppl "
             f"{100 * los['loss']:+.3f}%, exp(KL)-1 {100 * los['kl_loss']:+.3f}%")
    return rows


def _batches(ids: torch.Tensor, seqs: int, length: int, bos_id, skip: int = 0) -> list[dict]:
    from .policy_study import calibration_batches

    return [{"input_ids": b} for b in calibration_batches(ids[skip:], seqs, length, bos_id)]


def study_model(name: str, args) -> list[dict]:
    t0 = time.perf_counter()
    rows: list[dict] = []
    model, tok, title, bos_id = IG.load_model(name)
    base = {"model": name, "title": title}
    ids = IG.text_ids(tok, args.book, bos_id)

    if args.tokens:  # 1. per layer
        cap = ids[: args.tokens] if bos_id is None else torch.cat(
            [ids.new_tensor([bos_id]), ids[: args.tokens - 1]])
        with torch.no_grad(), RP.capture(model) as calls:
            model(cap.unsqueeze(0), use_cache=False)
        for c in calls:
            met = layer_metrics(c)
            for m, d in met.items():
                rows.append({**base, "kind": "layer", "text": args.book, "tokens": args.tokens,
                             "layer": c.layer, "method": m, "label": LABELS[m], **d})
            _log(f"{name} layer {c.layer}: " + ", ".join(f"{m} {d['cos']:.5f}"
                                                         for m, d in met.items()))
        head_dim = calls[0].q.shape[-1]
        del calls
        base["head_dim"] = head_dim
        for r in rows:
            r["head_dim"] = head_dim

    if args.ppl_tokens:  # 2. end to end, every layer
        RP.METHODS.setdefault("fp4pv", (LABELS["fp4pv"], {"qk": "int8"}))
        modes = ["exact"] + [m for m in args.e2e_modes.split(",") if m and m != "exact"]
        res = RP.perplexity(model, ids[: args.ppl_tokens], window=args.window, modes=modes,
                            backend="fp4attn", bos_id=bos_id)
        for mode, d in res.items():
            m = mode.split(":")[-1]
            rows.append({**base, "kind": "e2e", "text": args.book, "tokens": d["tokens"],
                         "method": m, "label": LABELS.get(m, RP.mode_label(mode)),
                         "fp4_share": {"fp4": 1.0, "fp4pv": 0.5, "fp4_pv": 0.5,
                                       "fp4_qk": 0.5}.get(m, 0.0),
                         "ppl": d["ppl"], "rel_change": d["rel_change"], "kl": d["kl"],
                         "top1_agree": d["top1_agree"]})
        _log(f"{name} e2e: " + ", ".join(f"{m} {100 * d['rel_change']:+.2f}% KL {d['kl']:.5f}"
                                         for m, d in res.items()))

    if args.cal_seqs:  # 3. calibration with and without fp4pv
        cal_ids = IG.text_ids(tok, args.cal_book, bos_id)
        cal = calibrate_study(model, _batches(cal_ids, args.cal_seqs, args.cal_len, bos_id),
                              args.budget, t0)
        flops = cal["flops"]
        for s in range(len(flops)):
            for p in ("fp4", "fp4pv", "int8"):
                mets = cal["err"][s][p]
                rows.append({**base, "kind": "cal_layer", "text": args.cal_book,
                             "tokens": cal["tokens"], "layer": s, "method": p,
                             "label": LABELS[p], "cos": min(m["cos"] for m in mets),
                             "rel_l1": sum(m["rel_l1"] for m in mets) / len(mets),
                             "flops_share": flops[s] / sum(flops),
                             "chosen": cal["with_pv"]["chosen"][s],
                             "chosen_base": cal["base"]["chosen"][s]})
        ev = cal["every"]
        rows.append({**base, "kind": "cal_point", "text": args.cal_book, "tokens": cal["tokens"],
                     "method": "all fp4pv", "code": ev["code"], "fp4_share": ev["fp4_share"],
                     "ppl": ev["value"], "ppl_exact": cal["exact"], "rel_change": ev["loss"],
                     "kl": ev["kl"], "kl_loss": ev["kl_loss"], "budget": args.budget})
        for key, what in (("with_pv", "fp4/fp4pv/int8/bf16"), ("base", "fp4/int8/bf16")):
            srch = cal[key]
            for m in sorted(srch["probes"]):
                p = srch["probes"][m]
                rows.append({**base, "kind": "chosen" if m == srch["m"] else "probe",
                             "text": args.cal_book, "tokens": cal["tokens"], "method": what,
                             "m": m, "moves": len(srch["moves"]), "code": p["code"],
                             "fp4_share": p["fp4_share"], "ppl": p["value"],
                             "ppl_exact": cal["exact"], "rel_change": p["loss"], "kl": p["kl"],
                             "kl_loss": p["kl_loss"], "budget": args.budget})
        # 4. the curve on held-out text along both orders, plus both chosen policies
        if args.curve_seqs:
            n = len(flops)
            assigns = []
            for key, what in (("with_pv", "fp4pv order"), ("base", "fp4/int8 order")):
                srch = cal[key]
                nm = len(srch["moves"])
                picks = sorted({round(i * nm / max(args.curve_points - 1, 1))
                                for i in range(args.curve_points)})
                assigns += [(f"{what} m={m}", C.assignment(n, "fp4", srch["moves"], m))
                            for m in picks]
            assigns += [("all fp4pv", ["fp4pv"] * n),
                        ("chosen with fp4pv", cal["with_pv"]["chosen"]),
                        ("chosen without fp4pv", cal["base"]["chosen"])]
            seen, uniq = set(), []
            for lab, pol in assigns:
                if tuple(pol) not in seen:
                    seen.add(tuple(pol))
                    uniq.append((lab, pol))
            cur = heldout_curve(model, _batches(ids, args.curve_seqs, args.cal_len, bos_id),
                                uniq, flops)
            for r in cur:
                rows.append({**base, "kind": "curve", "text": args.book,
                             "tokens": args.curve_seqs * args.cal_len, "method": r["label"],
                             **{k: v for k, v in r.items() if k != "label"}})
    _log(f"{name} done ({time.perf_counter() - t0:.0f}s)")
    return rows


FIELDS = ["model", "title", "head_dim", "kind", "text", "tokens", "layer", "method", "label",
          "cos", "rel_l1", "rmse", "flops_share", "chosen", "chosen_base", "m", "moves", "code",
          "fp4_share", "ppl", "ppl_exact", "rel_change", "kl", "kl_loss", "top1_agree", "budget"]


def write_csv(path: Path, rows: list[dict], command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        fh.write(f"# command: {command}\n")
        fh.write("# codes: one character per layer, layer 0 first: 4 fp4, p fp4pv (INT8 QK^T, "
                 "FP4 P.V), 8 int8, b bf16; fp4_share counts fp4pv as half FP4\n")
        w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in r.items()})


def summary(rows: list[dict]) -> str:
    lines = []
    for name in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == name]
        lay = [r for r in rs if r["kind"] == "layer"]
        for m in LAYER_METHODS:
            cs = [r["cos"] for r in lay if r["method"] == m]
            if cs:
                w = min((r for r in lay if r["method"] == m), key=lambda r: r["cos"])
                lines.append(f"{name} per layer {m}: worst cos {w['cos']:.5f} (layer "
                             f"{w['layer']}), mean {sum(cs) / len(cs):.5f}, sum(1-cos) "
                             f"{sum(1 - c for c in cs):.4f}, below 0.99: "
                             f"{sum(c < 0.99 for c in cs)}, below 0.999: "
                             f"{sum(c < 0.999 for c in cs)}")
        for r in rs:
            if r["kind"] == "e2e":
                lines.append(f"{name} e2e {r['method']}: ppl {r['ppl']:.4f} "
                             f"({100 * r['rel_change']:+.3f}%), KL {r['kl']:.5f}, top-1 "
                             f"{100 * r['top1_agree']:.2f}%")
            elif r["kind"] in ("chosen", "probe", "curve", "cal_point"):
                lines.append(f"{name} {r['kind']} {r['method']} {r.get('m', '')}: {r['code']} FP4 "
                             f"{100 * r['fp4_share']:.1f}%, ppl {100 * r['rel_change']:+.3f}%, "
                             f"exp(KL)-1 {100 * r['kl_loss']:+.3f}%")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fp4attn.eval.fp4pv",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--book", default="prideprejudice", choices=list(M.BOOKS))
    ap.add_argument("--tokens", type=int, default=1024,
                    help="captured tokens for the per-layer cos (0: skip)")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="end to end (0: skip)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--e2e-modes", default="fp4,int8,variant:fp4pv",
                    help="report.perplexity modes besides exact (default fp4,int8,variant:fp4pv; "
                         "variant:fp4_qk / variant:fp4_pv: one product in FP4, the other exact)")
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--cal-book", default="emma", choices=list(M.BOOKS))
    ap.add_argument("--cal-seqs", type=int, default=4, help="calibration sequences (0: skip)")
    ap.add_argument("--cal-len", type=int, default=512)
    ap.add_argument("--curve-seqs", type=int, default=4,
                    help="held-out sequences of --cal-len tokens of --book for the curve (0: skip)")
    ap.add_argument("--curve-points", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if any(n not in MODELS for n in names):
        print(f"error: --models: choose from {MODELS}", file=sys.stderr)
        return 2
    command = "python -m fp4attn.eval.fp4pv " + " ".join(argv)
    rows: list[dict] = []
    try:
        for n in names:
            rows += study_model(n, args)
            write_csv(args.csv, rows, command)  # after each model: a long run keeps what it has
    except M.MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
