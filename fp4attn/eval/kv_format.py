"""`python -m fp4attn.eval.kv_format`: which key format makes the KV cache meet +1% perplexity at
>= 3.2x less memory than FP16? (issue 34 items 1 and 6)

A pure-PyTorch emulation of generation with a quantized KV cache, in one forward pass per window:
the first ``CACHE_PREFILL`` positions of each window attend exactly (the prefill), every later
position attends to the dequantized keys and values of all positions up to itself, as
``fp4attn.decode`` on a cache holding them computes it (rows are quantized independently, so one
pass gives what token-by-token decoding gives). Attention itself is exact (float32). V is NVFP4
per row (SPEC 2 with the row as its slice) in every variant; the key formats:

* ``nvfp4``: SPEC 6 before issue 34: NVFP4 rows of ``K - kmean``, kmean over the first append;
* ``fp8``: E4M3 per row with an FP32 row scale (a bound, 2.46x); ``exact K``: keys unquantized
  (V's share of the error);
* ``int5``: 5-bit integer codes -15..15 of the row (optionally Hadamard-rotated over the head
  dim: ``rot``), one E4M3 scale per 64 values chosen among the 7 codes nearest to amax / 15 by
  the smallest squared error (``search``; ``nosearch``: amax / 15 rounded), a power-of-two row
  scale; ``mean``: K minus its mean over the first append (of ``first`` tokens), ``nomean``: K as
  it is; ``sink``: token 0's key row kept exact (16 bits); ``chan``: before the rotation, channel
  c of K - kmean divided by d_c = sqrt(max |K - kmean| of channel c over the first append) (at
  least 1/64 of the largest d), decode multiplying the query by d (exact in real arithmetic: the
  keys stand for d (H K5 / n) + kmean); ``recentW``: as ``chan``, with each query row's last W
  keys and values (itself included) kept exact, as a 16-bit window of the newest tokens would.

Measures perplexity and KL(exact || variant) of the next-token distributions over the first
``--tokens`` tokens of *Pride and Prejudice* in windows of 1024, on SmolLM2-135M (head dim 64)
and Gemma 3 270M (head dim 256, MQA, sliding-window layers, ``<bos>`` per window), and writes
``docs/results/kv_format.csv``.
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
from . import int8_granularity as IG
from . import report as RP

CACHE_PREFILL = RP.CACHE_PREFILL  # 128
DEFAULT_CSV = Path("docs/results/kv_format.csv")


def _log(msg: str) -> None:
    print(f"[kv-format] {msg}", file=sys.stderr, flush=True)


def _hadamard(n: int) -> torch.Tensor:
    """Unnormalised Sylvester-Hadamard matrix (entries +-1) of size n, a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotation_size(dp: int) -> int:
    """The largest power of two dividing dp (the rotation is block-diagonal in blocks of it)."""
    return dp & -dp


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., Dp] times the block-diagonal unnormalised Hadamard matrix (H = H^T, H H = n I)."""
    dp = x.shape[-1]
    n = rotation_size(dp)
    h = _hadamard(n).to(x)
    return (x.reshape(*x.shape[:-1], dp // n, n) @ h).reshape(x.shape)


def int5_rows(x: torch.Tensor, *, rot: bool, search: int, crit: str = "l2", block: int = 64) -> torch.Tensor:
    """Dequantized 5-bit rows of x [..., D] (float32), see the module doc."""
    D = x.shape[-1]
    dp = -(-D // 16) * 16
    x = torch.nn.functional.pad(x.float(), (0, dp - D))
    if rot:
        x = rotate(x)
    amax = x.abs().amax(dim=-1, keepdim=True)
    e = torch.ceil(torch.log2(torch.clamp(amax / (15 * 448), min=2.0 ** -126)))
    r = torch.exp2(e)
    y = x / r
    pad = -dp % block
    yb = torch.nn.functional.pad(y, (0, pad)).reshape(*y.shape[:-1], -1, block)
    bmax = yb.abs().amax(dim=-1)
    c0 = R.e4m3_encode_sat(bmax / 15).to(torch.int32)
    best_err, best_q = None, None
    for off in range(-search, search + 1):
        c = torch.clamp(c0 + off, 1, 126)
        s = R.e4m3_decode(c.to(torch.uint8))[..., None]
        q = torch.clamp(torch.round(yb / s), -15, 15) * s
        err = ((yb - q) ** 2 if crit == "l2" else (yb - q).abs()).sum(-1)
        if best_err is None:
            best_err, best_q = err, q
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_q = torch.where(better[..., None], q, best_q)
    best_q = torch.where((bmax == 0)[..., None], torch.zeros_like(best_q), best_q)
    out = best_q.reshape(*y.shape[:-1], -1)[..., :dp] * r
    if rot:
        out = rotate(out) / rotation_size(dp)
    return out[..., :D]


def channel_scales(x: torch.Tensor) -> torch.Tensor:
    """d [..., 1, D] of the ``chan`` variants from x = K - kmean [..., first, D] (module doc)."""
    d = torch.sqrt(x.float().abs().amax(dim=-2, keepdim=True))
    return torch.maximum(d, d.amax(dim=-1, keepdim=True) / 64).clamp(min=2.0 ** -64)


def nvfp4_rows(x: torch.Tensor) -> torch.Tensor:
    """SPEC 2 phi with every row its own slice, dequantized (float32)."""
    codes, scales, dec = R.quantize(x.float()[..., None, :])
    return R.dequantize(codes, scales, dec, x.shape[-1])[..., 0, :]


def nvfp4_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``nvfp4_rows(x)`` as its factors: E2M1 values [..., D], E4M3 block scales [..., D/16] and
    the row's FP32 dec [...] (value * scale * dec is the dequantized row)."""
    D = x.shape[-1]
    codes, scales, dec = R.quantize(x.float()[..., None, :])
    vals = R.e2m1_decode(R._unpack(codes))[..., 0, :D]
    return vals, R.e4m3_decode(scales)[..., 0, :], dec


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return (x / s).to(torch.float8_e4m3fn).float() * s


#: variant name -> (key format, keyword arguments, mean, sink)
VARIANTS = {
    "exact K": ("exact", {}, False, False),  # V's share of the error alone
    "nvfp4 mean": ("nvfp4", {}, True, False),
    "nvfp4 mean sink": ("nvfp4", {}, True, True),
    "fp8 mean": ("fp8", {}, True, False),
    "int5 mean sink (no rotation)": ("int5", {"rot": False, "search": 3}, True, True),
    "int5 rot mean sink nosearch": ("int5", {"rot": True, "search": 0}, True, True),
    "int5 rot mean sink": ("int5", {"rot": True, "search": 3}, True, True),
    "int5 rot mean sink l1": ("int5", {"rot": True, "search": 3, "crit": "l1"}, True, True),
    "int5 rot mean": ("int5", {"rot": True, "search": 3}, True, False),
    "int5 rot mean b32": ("int5", {"rot": True, "search": 3, "block": 32}, True, False),
    "int5 rot mean chan": ("int5", {"rot": True, "search": 3, "chan": True}, True, False),
    "int5 rot mean chan sink": ("int5", {"rot": True, "search": 3, "chan": True}, True, True),
    "int5 rot mean chan recent16": ("int5", {"rot": True, "search": 3, "chan": True, "recent": 16}, True, False),
    "int5 rot mean chan recent64": ("int5", {"rot": True, "search": 3, "chan": True, "recent": 64}, True, False),
    # the implemented format with the decode's P.V on FP8 tensor cores: V's E2M1 codes as E4M3
    # operands, V's block scale and dec folded into P, rounded to E4M3 per (key, 16 channels)
    "int5 rot mean chan recent16 p-e4m3": ("int5", {"rot": True, "search": 3, "chan": True, "recent": 16,
                                                    "p_e4m3": True}, True, False),
    "int5 rot nomean sink": ("int5", {"rot": True, "search": 3}, False, True),
    "int5 rot nomean": ("int5", {"rot": True, "search": 3}, False, False),
}


def quantized_kv(k: torch.Tensor, v: torch.Tensor, variant: str, first: int):
    fmt, kw, mean, sink = VARIANTS[variant]
    k32 = k.float()
    kmean = k32[:, :, :first].mean(dim=2, keepdim=True) if mean else torch.zeros_like(k32[:, :, :1])
    x = k32 - kmean
    kw = dict(kw)
    kw.pop("recent", None)  # cache_sdpa's business
    kw.pop("p_e4m3", None)
    d = channel_scales(x[:, :, :first]) if kw.pop("chan", False) else torch.ones_like(kmean)
    kq = {"nvfp4": nvfp4_rows, "fp8": fp8_rows, "exact": lambda t: t}.get(
        fmt, lambda t: int5_rows(t, **kw))(x / d) * d + kmean
    if sink:
        kq[:, :, 0] = k32[:, :, 0]
    return kq, nvfp4_rows(v)


def _pv_e4m3(p: torch.Tensor, vparts) -> torch.Tensor:
    """p [B, H, Nq, Nk] times the NVFP4 values as an FP8 tensor-core decode would take them: per
    16 channels, the E2M1 values against P * (dec / max dec) * scale rounded to E4M3 (RNE, at
    most 448 since P <= 1), times max dec in FP32. The max is over all keys of the (batch, head):
    the smallest P of any running maximum, so the most underflow."""
    vals, scales, dec = vparts  # [B, H, Nk, D], [B, H, Nk, D/16], [B, H, Nk]
    top = dec.amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    g = (dec / top)[..., None] * scales  # [B, H, Nk, D/16], at most 448
    w = (p[..., None] * g[:, :, None]).to(torch.float8_e4m3fn).float()  # [B, H, Nq, Nk, D/16]
    D = vals.shape[-1]
    vals = torch.nn.functional.pad(vals, (0, 16 * scales.shape[-1] - D))  # whole 16-value blocks
    out = torch.einsum("bhqkc,bhkcd->bhqcd", w, vals.reshape(*vals.shape[:-1], -1, 16))
    return out.reshape(*out.shape[:-2], -1)[..., :D] * top[..., None]


def _recent_exact(q, k, v, kq, vq, mask, scale, first_row: int, recent: int, vparts=None) -> torch.Tensor:
    """Attention of query rows first_row.. (float32) where each row's last ``recent`` visible keys
    (key j with j > row - recent) use the exact k, v and older ones the dequantized kq, vq. mask:
    the rows' boolean or additive mask (None: all keys visible). vparts: V's NVFP4 factors
    (nvfp4_parts) for the older keys' P.V on FP8 tensor cores (_pv_e4m3), else exact."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v, kq, vq = (t.repeat_interleave(rep, dim=1) for t in (k, v, kq, vq))
        if vparts is not None:
            vparts = tuple(t.repeat_interleave(rep, dim=1) for t in vparts)
    rows = torch.arange(first_row, first_row + q.shape[2], device=q.device).view(-1, 1)
    near = torch.arange(k.shape[2], device=q.device).view(1, -1) > rows - recent
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.where(near, q @ k.transpose(-1, -2), q @ kq.transpose(-1, -2)) * sc
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1)
    far = (p * ~near) @ vq if vparts is None else _pv_e4m3(p * ~near, vparts)
    return (p * near) @ v + far


def cache_sdpa(variant: str, first: int):
    """SDPA as generation on the emulated cache computes it (see the module doc)."""

    def run(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        N = q.shape[2]
        P = min(CACHE_PREFILL, N)
        exact = RP.TORCH_SDPA(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa)
        if P == N:
            return exact
        kq, vq = quantized_kv(k, v, variant, min(first, k.shape[2]))
        mask = attn_mask[..., P:, :] if attn_mask is not None else None
        if mask is None and is_causal:  # rows P.. of a causal square: a bottom-right pattern
            mask = torch.ones(N - P, N, dtype=torch.bool, device=q.device).tril(P)
        recent = VARIANTS[variant][1].get("recent", 0)
        vparts = nvfp4_parts(v) if VARIANTS[variant][1].get("p_e4m3") else None
        if vparts is not None and not recent:
            raise ValueError(f"{variant}: p_e4m3 is modelled with a recent window only")
        if recent:
            rest = _recent_exact(q[:, :, P:].float(), k.float(), v.float(), kq, vq, mask, scale, P, recent,
                                 vparts)
        else:
            rest = RP.TORCH_SDPA(q[:, :, P:].float(), kq, vq, attn_mask=mask, scale=scale,
                                 enable_gqa=enable_gqa)
        return torch.cat([exact[:, :, :P], rest.to(q.dtype)], dim=2)

    return run


def measure(model, ids: torch.Tensor, runs: list[tuple[str, int]], *, window: int,
            bos_id: int | None) -> dict[tuple[str, int], dict]:
    """Perplexity and mean KL(exact || run) for each (variant, first-append length)."""
    stats = {r: {"nll": 0.0, "n": 0, "kl": 0.0} for r in [("exact", 0), *runs]}
    lead = 0 if bos_id is None else 1
    t0 = time.perf_counter()
    for s in range(0, ids.numel() - 1, window):
        chunk = ids[s: s + window].unsqueeze(0)
        if chunk.shape[1] < 2:
            break
        tgt = chunk[:, 1:]
        if bos_id is not None:
            chunk = torch.cat([chunk.new_full((1, 1), bos_id), chunk], dim=1)
        ref = None
        for run in stats:
            with torch.no_grad():
                if run[0] == "exact":
                    logits = model(chunk, use_cache=False).logits
                else:
                    with RP.swap_sdpa(cache_sdpa(*run), model):
                        logits = model(chunk, use_cache=False).logits
            lp = torch.log_softmax(logits[:, lead:-1].float(), dim=-1)
            st = stats[run]
            st["nll"] += -lp.gather(-1, tgt.unsqueeze(-1)).sum().item()
            st["n"] += tgt.numel()
            ref = lp if ref is None else ref
            st["kl"] += (ref.exp() * (ref - lp)).sum().item()
        _log(f"{min(s + window, ids.numel())}/{ids.numel()} tokens ({time.perf_counter() - t0:.0f}s)")
    base = math.exp(stats[("exact", 0)]["nll"] / stats[("exact", 0)]["n"])
    return {r: {"ppl": math.exp(st["nll"] / st["n"]), "rel_change": math.exp(st["nll"] / st["n"]) / base - 1,
                "kl": st["kl"] / st["n"], "tokens": st["n"]} for r, st in stats.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4attn.eval.kv_format", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    ap.add_argument("--first", default="128", help="first-append lengths, comma-separated")
    ap.add_argument("--first-variants", default="", help="variants also run with every --first")
    ap.add_argument("--csv", default=str(DEFAULT_CSV), help='"" writes nothing')
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--implementation", action="store_true",
                    help="instead of the emulation: the cache as implemented (FP4KVCache and "
                         "fp4attn.decode, report.perplexity's fp4cache mode), perplexity and KL, "
                         "and greedy agreement (report.generation_agreement, --gen-prompts)")
    ap.add_argument("--gen-prompts", type=int, default=10)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--gen-modes", default="fp4cache",
                    help='--implementation: generation_agreement modes besides exact ("fp4cache", '
                         '"fp4", "fp4+fp4cache"), comma-separated')
    ap.add_argument("--no-perplexity", action="store_true",
                    help="--implementation: greedy agreement only")
    args = ap.parse_args(argv)
    if not args.implementation and (args.no_perplexity or args.gen_modes != "fp4cache"):
        raise SystemExit("--no-perplexity and --gen-modes apply to --implementation only")
    if args.implementation:
        return implementation(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    firsts = [int(x) for x in args.first.split(",")]
    fv = [v for v in args.first_variants.split(",") if v]
    for v in variants + fv:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {list(VARIANTS)}")
    rows = []
    for name in args.models.split(","):
        model, tok, title, bos = IG.load_model(name)
        ids = IG.text_ids(tok, "prideprejudice", bos)[: args.tokens]
        runs = [(v, CACHE_PREFILL) for v in variants]
        runs += [(v, f) for v in fv for f in firsts if (v, f) not in runs]
        res = measure(model, ids, runs, window=args.window, bos_id=bos)
        for (v, f), r in res.items():
            rows.append({"model": title, "tokens": r["tokens"], "variant": v, "first_append": f,
                         "ppl": f"{r['ppl']:.4f}", "rel_change": f"{100 * r['rel_change']:+.2f}%",
                         "kl": f"{r['kl']:.5f}"})
            print(f"{title:22s} {v:34s} first={f:4d} ppl {r['ppl']:.3f} ({100 * r['rel_change']:+.2f}%) "
                  f"KL {r['kl']:.5f}", flush=True)
        del model
    if args.csv:  # "" writes nothing
        args.csv = Path(args.csv)
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        new = not args.csv.exists()
        with args.csv.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
    return 0


def implementation(args) -> int:
    """The implemented cache (C backend on the CPU) through the report's own modes."""
    from . import models as M

    for name in args.models.split(","):
        model, tok, title, bos = IG.load_model(name)
        ids = IG.text_ids(tok, "prideprejudice", bos)[: args.tokens]
        if not args.no_perplexity:
            res = RP.perplexity(model, ids, window=args.window, modes=["exact", "fp4cache"],
                                backend="fp4attn", bos_id=bos)
            r = res["fp4cache"]
            print(f"{title}: FP4KVCache as implemented, {r['tokens']} tokens: ppl {r['ppl']:.3f} "
                  f"({100 * r['rel_change']:+.2f}%), KL {r['kl']:.5f} (exact {res['exact']['ppl']:.3f})",
                  flush=True)
        if args.gen_prompts > 0:
            paras = [p for p in M.austen_paragraphs("prideprejudice") if len(p) > 400][: args.gen_prompts]
            prompts = [tok.decode(tok(p).input_ids[:64], skip_special_tokens=True) for p in paras]
            gen = RP.generation_agreement(model, tok, prompts, new_tokens=args.gen_tokens,
                                          modes=tuple(m for m in args.gen_modes.split(",") if m))
            for mode, g in gen.items():
                print(f"{title}: greedy, {mode}: {g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
