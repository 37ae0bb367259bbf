"""fp4attn.calibrate (this module: fp4attn.calibration): the cheapest per-layer precision policy
that keeps a model within an accuracy budget.

    policy = fp4attn.calibrate(model, batches, budget=0.01, device_kind="blackwell")

1. Reference: one forward per batch with torch's SDPA (the model as loaded), recording every
   attention call's q/k/v (fp4attn.eval.report.capture): the exact metric and each call site's
   attention FLOPs (visible query-key pairs x heads x head dim x 4).
2. Per site and candidate precision, the attention error on the captured q/k/v against exact
   float64 attention (cos, rel_l1): the per-layer table.
3. Sensitivity, what orders the sites: the attention error of step 2 (1 - cos, the default), or
   (sensitivity="model") the model metric with one site in the cheapest candidate precision and
   every other site exact (KL(exact || policy) per token for causal LMs, 1 - mean embedding cos
   for encoders), scaled for the dearer candidates by their attention error relative to it.
4. Order: each site's precisions on the lower convex hull of (cost, sensitivity) give its
   upgrade moves (cheaper to dearer); all moves sorted by sensitivity removed per unit of cost
   added, largest first. Assignment m = every site at its cheapest candidate, then the first m
   moves applied: m = 0 is the cheapest policy, the last m the most accurate.
5. Search: the smallest m whose metric, measured by running the model with the policy applied
   through fp4attn.patch(policy=..., model=...), is within budget (bisection over m: the
   sensitivities only order the moves, the measured metric decides). For causal LMs both the
   perplexity increase and exp(KL) - 1 must be: a perplexity change on a few thousand tokens
   swings by tenths of a percent with the text's luck, which the KL does not see, and a
   policy picked where that luck is good does not hold on other text. The result is a
   measured point, never an estimate.

"bf16" is the reference (torch SDPA in the input dtype), so its sensitivity is 0 and any
precision that costs more than it is never a candidate (FP4 on Hopper). Deterministic for fixed
input: every tie is broken by site index.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from .patch import is_patched, patched
from .policy import PRECISIONS, Policy

#: Cost of each precision per unit of attention work, by device: only the order matters to the
#: search, the ratios weigh it against the sites' FLOPs (FP4 tensor cores run at twice the INT8
#: and four times the BF16 rate on Blackwell; Hopper has no FP4 MMA, fp4attn dequantizes there).
DEVICE_COSTS = {
    "blackwell": {"fp4": 1.0, "int8": 2.0, "bf16": 4.0},
    "hopper": {"int8": 1.0, "bf16": 2.0, "fp4": 3.0},
}
METRICS = ("perplexity", "embedding_cos")
SENSITIVITIES = ("attention", "model")


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def cost_table(device_kind) -> dict[str, float]:
    """``device_kind`` ("blackwell", "hopper" or {precision: cost}) as a checked cost table."""
    if isinstance(device_kind, str):
        if device_kind not in DEVICE_COSTS:
            raise ValueError(f"device_kind must be one of {list(DEVICE_COSTS)} or a cost table "
                             f"{{precision: cost}}, got {device_kind!r}")
        return dict(DEVICE_COSTS[device_kind])
    if not isinstance(device_kind, dict) or not device_kind:
        raise TypeError("device_kind must be a device name or a non-empty dict {precision: cost}, "
                        f"got {device_kind!r}")
    out = {}
    for p, c in device_kind.items():
        if p not in PRECISIONS:
            raise ValueError(f"device_kind: precision must be one of {list(PRECISIONS)}, got {p!r}")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0 or math.isinf(c):
            raise ValueError(f"device_kind[{p!r}] must be a positive finite cost, got {c!r}")
        out[p] = float(c)
    if len(set(out.values())) != len(out):
        raise ValueError(f"device_kind: costs must differ (they order the precisions), got {out}")
    return out


def candidates(costs: dict[str, float]) -> list[str]:
    """The precisions worth choosing, cheapest first: those dearer than bf16, which is exact
    here, never are."""
    top = costs.get("bf16", math.inf)
    return sorted((p for p, c in costs.items() if c <= top), key=costs.get)


# ---------------------------------------------------------------------------------------------
# Running the model
# ---------------------------------------------------------------------------------------------


def _inputs(batch) -> dict:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    if isinstance(batch, dict) or hasattr(batch, "keys"):  # a dict or a tokenizer's BatchEncoding
        return dict(batch)
    raise TypeError(f"batches must hold input-id tensors or dicts of model inputs, got "
                    f"{type(batch).__name__}")


def _forward(model, batch: dict):
    dev = next(model.parameters()).device
    with torch.no_grad():
        return model(**{k: v.to(dev) if isinstance(v, torch.Tensor) else v
                        for k, v in batch.items()})


def _log_probs(out, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs of the next token [T, V], targets [T], valid [T]) of one causal-LM batch."""
    ids = batch["input_ids"]
    if getattr(out, "logits", None) is None:
        raise ValueError(f'metric="perplexity" needs a causal LM (outputs with logits); this model '
                         f'returns {type(out).__name__}: use metric="embedding_cos" for encoders')
    lp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1).cpu()
    tgt = ids[:, 1:]
    valid = torch.ones_like(tgt, dtype=torch.bool)
    if batch.get("attention_mask") is not None:  # padding: neither a target nor a context end
        m = batch["attention_mask"].bool()
        valid = m[:, 1:] & m[:, :-1]
    return lp.flatten(0, 1), tgt.flatten(), valid.flatten()


def _embedding(out, batch: dict) -> torch.Tensor:
    """Mean over the real tokens of the last hidden state, L2-normalised, float64."""
    if getattr(out, "last_hidden_state", None) is None:
        raise ValueError(f'metric="embedding_cos" needs an encoder (outputs with last_hidden_state); '
                         f'this model returns {type(out).__name__}: use metric="perplexity" for '
                         "causal LMs")
    h = out.last_hidden_state.double().cpu()
    m = batch.get("attention_mask")
    m = torch.ones(h.shape[:2], dtype=torch.double) if m is None else m.double().cpu()
    e = (h * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1e-9)
    return torch.nn.functional.normalize(e, dim=-1)


#: Tokens of the exact next-token distribution kept per position for the KL (the rest is one
#: bucket: a lower bound of the full KL, tight when the kept tokens hold almost all the mass).
KL_TOP = 256


def _kl_sum(lp: torch.Tensor, top_idx: torch.Tensor, top_lp: torch.Tensor) -> float:
    """sum over positions of KL(exact || lp) on the exact top-KL_TOP tokens and the tail bucket."""
    q = lp.gather(-1, top_idx)
    p = top_lp.exp()
    tail_p = (1.0 - p.sum(-1)).clamp(min=1e-12)
    tail_q = (1.0 - q.exp().sum(-1)).clamp(min=1e-12)
    # p = 0 (a -inf exact logit) adds nothing: 0 * (-inf - -inf) would be NaN
    kl = torch.where(p > 0, p * (top_lp - q), 0.0).sum(-1) + tail_p * (tail_p.log() - tail_q.log())
    return max(float(kl.double().sum()), 0.0)  # float32 rounding can take a KL near 0 below it


class _Metric:
    """The model metric over the calibration batches, against the exact model's."""

    def __init__(self, model, batches: list[dict], kind: str):
        self.model, self.batches, self.kind = model, batches, kind

    def reference(self, out, batch: dict):
        """What a batch's exact forward leaves for later comparisons: its embeddings, or its
        NLL, token count and top-KL_TOP next-token log-probs."""
        if self.kind == "embedding_cos":
            return _embedding(out, batch)
        lp, tgt, valid = _log_probs(out, batch)
        lp = lp[valid]
        top_lp, top_idx = lp.topk(min(KL_TOP, lp.shape[-1]), dim=-1)
        return {"nll": -lp.gather(-1, tgt[valid, None]).sum().item(), "n": int(valid.sum()),
                "top_idx": top_idx, "top_lp": top_lp}

    def compare(self, out, batch: dict, ref) -> tuple[float, float]:
        """(nll sum, KL sum) for causal LMs, (sum of cos, count) for encoders."""
        if self.kind == "embedding_cos":
            e = _embedding(out, batch)
            return float((e * ref).sum(-1).sum()), float(e.shape[0])
        lp, tgt, valid = _log_probs(out, batch)
        lp = lp[valid]
        nll = -lp.gather(-1, tgt[valid, None]).sum().item()
        return nll, _kl_sum(lp, ref["top_idx"], ref["top_lp"])

    def measure(self, policy: Policy, refs: list) -> dict:
        """The model metric with ``policy`` applied through fp4attn.patch: {"value": perplexity,
        "kl": KL per token} or {"value": mean embedding cos against exact}."""
        a = b = 0.0
        with patched(policy=policy, model=self.model):
            for batch, ref in zip(self.batches, refs):
                x, y = self.compare(_forward(self.model, batch), batch, ref)
                a, b = a + x, b + y
        if self.kind == "embedding_cos":
            return {"value": a / b}
        n = sum(r["n"] for r in refs)
        return {"value": math.exp(a / n), "kl": b / n}

    def losses(self, m: dict, exact: float) -> dict:
        """What the budget bounds: the measured relative perplexity increase and the one the KL
        implies (exp(KL) - 1: its expectation over text the model predicts well, free of the
        luck of which tokens the text holds); or 1 - mean cos."""
        if self.kind == "embedding_cos":
            return {"loss": 1.0 - m["value"]}
        return {"loss": m["value"] / exact - 1.0, "kl_loss": math.expm1(m["kl"])}


def _site_flops(call) -> float:
    """Attention FLOPs of one captured call: 4 x head dim per visible (query, key) pair and
    query head (QK^T and PV, a multiply-add each)."""
    B, Hq, Nq, D = call.q.shape
    Nk = call.k.shape[2]
    m = call.attn_mask
    if m is not None:
        visible = (m if m.dtype == torch.bool else m > -math.inf)
        pairs = float(visible.sum()) * (B * Hq * Nq * Nk) / visible.numel()
    elif call.is_causal:  # top-left aligned, as torch SDPA
        pairs = B * Hq * sum(min(i + 1, Nk) for i in range(Nq))
    else:
        pairs = B * Hq * Nq * Nk
    return 4.0 * D * pairs


def _attention_errors(calls, cands: list[str], device) -> dict[int, dict[str, dict]]:
    """Per site and non-reference candidate: cos and rel_l1 against exact float64 attention."""
    from . import reference as R
    from .eval.report import run_method

    method = {"fp4": "fp4attn", "int8": "int8"}
    out: dict[int, dict[str, dict]] = {}
    for call in calls:
        ref = R.exact_attention(call.q, call.k, call.v, call.attn_mask, call.is_causal,
                                call.scale, enable_gqa=True)
        rows = call.row_mask
        sel = (lambda o: o) if rows is None else (lambda o: o.transpose(1, 2)[rows])
        for p in cands:
            if p == "bf16":
                continue
            o = run_method(method[p], call, device=str(device), backend="fp4attn")
            out.setdefault(call.layer, {})[p] = R.metrics(sel(o), sel(ref))
    return out


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------


def upgrade_moves(sens: dict[int, dict[str, float]], flops: list[float],
                  costs: dict[str, float], cands: list[str]) -> list[tuple[int, str]]:
    """The calibration order: (site, precision it moves to), most sensitivity removed per unit
    of cost first. Per site, only precisions on the lower convex hull of (cost, sensitivity)
    appear, so a site's moves are in cost order and each removes less per cost than the last."""
    moves = []
    for site in range(len(flops)):
        pts = [(costs[p] * flops[site], sens[site][p], p) for p in cands]
        hull = [pts[0]]
        for pt in pts[1:]:
            if pt[1] >= hull[-1][1]:
                continue  # dearer and no more accurate: never worth it
            while len(hull) >= 2:  # drop a middle point above the chord: not on the hull
                (c0, s0, _), (c1, s1, _) = hull[-2], hull[-1]
                if (s0 - s1) * (pt[0] - c0) <= (s0 - pt[1]) * (c1 - c0):
                    hull.pop()
                else:
                    break
            hull.append(pt)
        for (c0, s0, _), (c1, s1, p) in zip(hull, hull[1:]):
            moves.append(((s0 - s1) / max(c1 - c0, 1e-30), site, costs[p], p))
    moves.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(site, p) for _, site, _, p in moves]


def assignment(n_sites: int, cheapest: str, moves: list[tuple[int, str]], m: int) -> list[str]:
    """Assignment m of the order: ``cheapest`` everywhere, then the first m moves."""
    out = [cheapest] * n_sites
    for site, p in moves[:m]:
        out[site] = p
    return out


def smallest_passing(passes, n: int) -> int | None:
    """The smallest m in [0, n] with ``passes(m)`` along an upgrade order of n moves (passing from
    some m on), by bisection: m = 0 probed first, then, if it fails, m = n (the most accurate end;
    None if it fails too), then the middle of what is left."""
    if passes(0):
        return 0
    lo, hi = 0, n
    if not passes(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi


def ladder(policy: Policy) -> list[Policy]:
    """Every assignment of a calibrated policy's order, m = 0 (cheapest) to the last (most
    accurate): the curve the calibration searched along."""
    cal = policy.meta.get("calibration")
    if not cal:
        raise ValueError("ladder needs a policy made by fp4attn.calibrate (meta['calibration'])")
    moves = [tuple(m) for m in cal["order"]]
    n = policy.num_layers
    return [Policy(assignment(n, cal["cheapest"], moves, m)) for m in range(len(moves) + 1)]


def calibrate(model, batches, budget: float = 0.01, device_kind="blackwell", *,
              metric: str = "auto", sensitivity: str = "attention",
              verbose: bool = True) -> Policy:
    """The cheapest per-layer Policy (by ``device_kind``'s cost order) whose model metric on
    ``batches`` stays within ``budget``, measured.

    model: a transformers model (or any nn.Module whose attention calls
        torch.nn.functional.scaled_dot_product_attention; transformers: attn_implementation
        "sdpa"), in eval mode.
    batches: input-id tensors [B, N] or dicts of model inputs (a tokenizer's output); the same
        sequence length within a batch, padding marked by attention_mask.
    budget: for metric "perplexity" (causal LMs: the output has logits), the largest relative
        perplexity increase over exact attention (0.01 = +1 %); for "embedding_cos" (encoders:
        the output has last_hidden_state, mean-pooled over real tokens), the largest drop of the
        mean cosine to the exact embeddings (0.001 = mean cos >= 0.999).
    device_kind: "blackwell" (fp4 < int8 < bf16), "hopper" (int8 < bf16 < fp4) or a cost table
        {precision: cost per unit of attention work}; precisions left out are not used.
    metric: "auto" (from the model's output), "perplexity" or "embedding_cos".
    sensitivity: what orders the layers: "attention", each site's attention error on the
        captured inputs (1 - cos; no extra forwards), or "model", the model metric with that
        site alone in the cheapest candidate precision (KL per token, or 1 - mean cos; one
        forward per site and batch: slower, and it sees how much each layer's error matters
        downstream), the dearer candidates' in proportion to their attention error.

    Prints the per-layer table (stdout) and progress (stderr, ``verbose``). The policy's
    ``meta["calibration"]`` holds the measurements, the order and the probed points.
    """
    t0 = time.perf_counter()
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or \
            not 0 <= budget < math.inf:
        raise ValueError(f"budget must be a finite number >= 0, got {budget!r}")
    costs = cost_table(device_kind)
    cands = candidates(costs)
    if sensitivity not in SENSITIVITIES:
        raise ValueError(f"sensitivity must be one of {list(SENSITIVITIES)}, got {sensitivity!r}")
    if metric not in ("auto",) + METRICS:
        raise ValueError(f"metric must be 'auto' or one of {list(METRICS)}, got {metric!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("model must be in eval mode (model.eval()): dropout would make the "
                         "calibration random")
    impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if impl != "sdpa":
        raise ValueError(f'model has attn_implementation="{impl}": load it with "sdpa" to '
                         "calibrate (its attention calls are captured there); apply the policy "
                         "afterwards with fp4attn.patch or register(policy)")
    if is_patched():
        raise RuntimeError("calibrate: fp4attn.patch() is active; unpatch first (exact "
                           "attention is the calibration's reference)")
    if isinstance(batches, (torch.Tensor, dict)):
        raise TypeError("batches must be a list (or iterable) of batches, got a single "
                        f"{type(batches).__name__}: wrap it in a list")
    batches = [_inputs(b) for b in batches]
    if not batches:
        raise ValueError("batches must hold at least one batch")
    from .eval.report import capture  # the report's recorder of SDPA calls

    # 1. reference pass, with the attention inputs recorded
    device = next(model.parameters()).device
    refs, calls_by_batch = [], []
    metric_kind = None
    for batch in batches:
        with capture(model) as calls:
            out = _forward(model, batch)
        if metric_kind is None:
            metric_kind = metric if metric != "auto" else (
                "perplexity" if getattr(out, "logits", None) is not None else
                "embedding_cos" if getattr(out, "last_hidden_state", None) is not None else None)
            if metric_kind is None:
                raise ValueError("metric='auto': the model's output has neither logits nor "
                                 "last_hidden_state; pass metric=")
            meter = _Metric(model, batches, metric_kind)
        refs.append(meter.reference(out, batch))
        mask = batch.get("attention_mask")
        for c in calls:
            if mask is not None and c.q.shape[2] == mask.shape[1]:
                c.row_mask = mask.bool().cpu()  # padding query rows: outside the metrics
        calls_by_batch.append(calls)
        del out
    n_sites = len(calls_by_batch[0])
    if n_sites == 0 or any(len(c) != n_sites for c in calls_by_batch):
        raise ValueError("the model must call torch SDPA the same number of times (> 0) in "
                         f"every batch's forward, got {[len(c) for c in calls_by_batch]}")
    if metric_kind == "perplexity":
        tokens = sum(r["n"] for r in refs)
        exact = math.exp(sum(r["nll"] for r in refs) / tokens)
    else:
        exact, tokens = 1.0, sum(r.shape[0] for r in refs)
    _log(verbose, f"{n_sites} attention sites, {len(batches)} batches, {tokens} "
         f"{'tokens' if metric_kind == 'perplexity' else 'embeddings'}; exact "
         f"{metric_kind} {exact:.4f} ({time.perf_counter() - t0:.0f}s)")

    # 2. per-layer attention error and FLOPs on the captured inputs
    flops = [0.0] * n_sites
    err: dict[int, dict[str, list[dict]]] = {}
    for calls in calls_by_batch:
        for c in calls:
            flops[c.layer] += _site_flops(c)
        for site, d in _attention_errors(calls, cands, device).items():
            for p, met in d.items():
                err.setdefault(site, {}).setdefault(p, []).append(met)
    del calls_by_batch
    _log(verbose, f"per-layer attention errors measured ({time.perf_counter() - t0:.0f}s)")

    # 3. sensitivity of the model to each site's precision
    probe = [p for p in cands if p != "bf16"]
    if not probe:  # bf16 alone: nothing to order
        sens = {s: {p: 0.0 for p in cands} for s in range(n_sites)}
    elif sensitivity == "attention":  # the captured attention error, 1 - cos (free)
        sens = {s: {p: (1.0 - min(m["cos"] for m in err[s][p]) if p in probe else 0.0)
                    for p in cands} for s in range(n_sites)}
    else:  # the model metric with one site in the cheapest candidate, exact elsewhere
        first = probe[0]
        acc = [0.0] * n_sites
        for batch, ref in zip(batches, refs):
            for s in range(n_sites):
                with patched(policy=Policy({s: first}, "bf16", num_layers=n_sites), model=model):
                    out = _forward(model, batch)
                x, y = meter.compare(out, batch, ref)
                acc[s] += y if metric_kind == "perplexity" else y - x  # KL, or sum(1 - cos)
            _log(verbose, f"sensitivities: batch done ({time.perf_counter() - t0:.0f}s)")
        # dearer candidates: the same downstream effect per unit of attention error (1 - cos)
        sens = {}
        for s in range(n_sites):
            e0 = max(1.0 - min(m["cos"] for m in err[s][first]), 1e-12)
            sens[s] = {p: (0.0 if p not in probe else acc[s] / tokens * (
                1.0 - min(m["cos"] for m in err[s][p])) / e0) for p in cands}

    # 4. the order, 5. the measured search along it
    moves = upgrade_moves(sens, flops, costs, cands)
    probes: dict[int, dict] = {}

    def passes(m: int) -> bool:
        pol = Policy(assignment(n_sites, cands[0], moves, m))
        got = meter.measure(pol, refs)
        los = meter.losses(got, exact)
        probes[m] = {"m": m, "code": pol.code(), **got, **los,
                     "fp4_share": pol.fp4_share(flops),
                     "cost": sum(costs[p] * f for p, f in zip(pol.as_list(), flops))}
        ok = all(math.isfinite(v) and v <= budget for v in los.values())  # NaN or inf: fails
        _log(verbose, f"probe m={m}/{len(moves)}: {pol.code()}, {metric_kind} "
             f"{got['value']:.5f}, " + ", ".join(f"{k} {v:+.5f}" for k, v in los.items())
             + f" (budget {budget}: {'pass' if ok else 'fail'}) ({time.perf_counter() - t0:.0f}s)")
        return ok

    hi = smallest_passing(passes, len(moves))
    if hi is None:
        raise ValueError(
            f"budget {budget} cannot be met with the precisions of device_kind ({costs}): the "
            f"most accurate assignment measures {probes[len(moves)]}")
    chosen = assignment(n_sites, cands[0], moves, hi)
    total = sum(flops)
    layers = []
    for s in range(n_sites):
        row = {"site": s, "flops_share": flops[s] / total, "precision": chosen[s]}
        for p, mets in err.get(s, {}).items():
            row[f"cos_{p}"] = min(m["cos"] for m in mets)
            row[f"rel_l1_{p}"] = sum(m["rel_l1"] for m in mets) / len(mets)
        for p in probe:
            row[f"sens_{p}"] = sens[s][p]
        layers.append(row)
    cal = {"metric": metric_kind, "budget": budget, "sensitivity": sensitivity, "exact": exact,
           "tokens": tokens,
           "batches": len(batches), "measured": probes[hi]["value"], "loss": probes[hi]["loss"],
           "kl": probes[hi].get("kl"), "kl_loss": probes[hi].get("kl_loss"),
           "fp4_share": probes[hi]["fp4_share"],
           "device_kind": device_kind if isinstance(device_kind, str) else "custom",
           "costs": costs, "cheapest": cands[0], "order": [list(m) for m in moves], "m": hi,
           "flops": flops, "layers": layers, "probes": [probes[k] for k in sorted(probes)],
           "seconds": round(time.perf_counter() - t0, 1)}
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    policy = Policy(chosen, meta={"model": str(name), "calibration": cal})
    print(format_table(policy))
    return policy


def format_table(policy: Policy) -> str:
    """The per-layer table and the summary of a calibrated policy."""
    cal = policy.meta["calibration"]
    probe = [p for p in ("fp4", "int8") if f"sens_{p}" in cal["layers"][0]
             and (cal["sensitivity"] == "model" or f"cos_{p}" not in cal["layers"][0])]
    cosp = [p for p in ("fp4", "int8") if f"cos_{p}" in cal["layers"][0]]
    sens_name = ("attn 1-cos" if cal["sensitivity"] == "attention" else
                 "KL/token" if cal["metric"] == "perplexity" else "emb 1-cos")
    head = (["layer", "FLOPs %"] + [f"cos {p}" for p in cosp]
            + [f"{sens_name} {p}" for p in probe] + ["precision"])
    lines = ["  ".join(f"{h:>12}" for h in head)]
    for r in cal["layers"]:
        cells = [str(r["site"]), f"{100 * r['flops_share']:.2f}"]
        cells += [f"{r[f'cos_{p}']:.5f}" for p in cosp]
        cells += [f"{r[f'sens_{p}']:.3e}" for p in probe]
        cells.append(r["precision"])
        lines.append("  ".join(f"{c:>12}" for c in cells))
    counts = {p: policy.as_list().count(p) for p in PRECISIONS}
    what = (f"perplexity {cal['measured']:.4f} vs exact {cal['exact']:.4f} "
            f"({100 * cal['loss']:+.3f} %; KL {cal['kl']:.5f} per token, exp(KL) - 1 = "
            f"{100 * cal['kl_loss']:+.3f} %; budget +{100 * cal['budget']:.3f} %)"
            if cal["metric"] == "perplexity" else
            f"mean embedding cos {cal['measured']:.6f} (budget >= {1 - cal['budget']:.6f})")
    lines.append(
        f"policy ({cal['device_kind']}: {cal['costs']}): "
        + ", ".join(f"{n} {p}" for p, n in counts.items() if n)
        + f"; {100 * cal['fp4_share']:.1f} % of attention FLOPs in FP4; measured {what} on "
        f"{cal['tokens']} {'tokens' if cal['metric'] == 'perplexity' else 'sequences'}; "
        f"{cal['seconds']:.0f} s")
    return "\n".join(lines)
