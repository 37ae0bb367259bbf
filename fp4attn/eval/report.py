"""`python -m fp4attn report`: accuracy of FP4 attention on real models and real text.

Random Gaussian inputs are the worst case for FP4 attention; this report measures what users
care about. For each model (SmolLM2-135M-Instruct, all-MiniLM-L6-v2; see fp4attn.eval.models):

1. Capture: run the model once on real text (Jane Austen) with attn_implementation="sdpa" while
   torch.nn.functional.scaled_dot_product_attention is wrapped by a recorder, so every attention
   layer's real Q, K, V, mask, causal flag, scale and GQA flag are kept (the call order inside
   one forward is the layer index).
2. Per layer, against exact attention in float64 on the same inputs (SPEC.md 5: cos, rel_l1,
   rmse): fp4attn.sdpa (the real backend, strict mode so a silent fallback cannot pass as FP4),
   torch SDPA in FP16 and BF16, and the pure-torch reference of SPEC.md with ablations that show
   where the error comes from: no Q smoothing, no K smoothing, one-level P, no global scale, and
   each of Q, K, V, P quantized alone.
3. End to end: perplexity of the LLM over a few thousand tokens (windows, exact vs FP4 through
   fp4attn.patch(), plus BF16 attention for scale), with top-1 agreement and KL against exact;
   cosine similarity of MiniLM sentence embeddings, exact vs FP4.
   With a per-layer policy calibrated on another novel (fp4attn.calibrate, --cal-book; skip with
   --no-calibrate), side by side with FP4 and INT8 everywhere: perplexity, greedy agreement,
   each layer's precision and cos, the share of attention FLOPs in FP4, and the perplexity
   along the calibration's order (the curve against the FP4 share, <model>_policy_curve.png).
4. Writes report.md, <model>_layers.csv, <model>_layers.png (matplotlib, optional), e2e.csv and
   summary.json into --out, and checks the targets (per-layer cos >= 0.99 on the LLM,
   perplexity increase < 2%). If a target fails, the closing note names the layers, the
   quantity that dominates their error, and measures a per-layer fallback policy.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import models as M
from .. import reference as R
from .. import reference_int8 as R8

try:  # the function torch had before anyone (fp4attn.patch included) replaced it
    TORCH_SDPA = importlib.import_module("fp4attn.sdpa").ORIGINAL_SDPA
except (ImportError, AttributeError):  # pragma: no cover
    TORCH_SDPA = F.scaled_dot_product_attention

COS_TARGET = 0.99
PPL_TARGET = 0.02  # relative perplexity increase

# Per-layer methods: name -> (label, how). how: "fp4attn" | "int8" | torch dtype | reference flags.
_QUANT_ONLY = {"quantize_q": False, "quantize_k": False, "quantize_v": False, "quantize_p": False}
METHODS: dict[str, tuple[str, object]] = {
    "fp4attn": ("fp4attn (FP4)", "fp4attn"),
    "int8": ("fp4attn (INT8)", "int8"),
    "fp16": ("FP16 SDPA", torch.float16),
    "bf16": ("BF16 SDPA", torch.bfloat16),
    "ref": ("reference (SPEC)", {}),
    "no_smooth_q": ("no Q smoothing", {"smooth_q": False}),
    "no_smooth_k": ("no K smoothing", {"smooth_k": False}),
    "one_level_p": ("one-level P", {"two_level_p": False}),
    "no_global_scale": ("no global scale", {"global_scale": False}),
    "only_q": ("Q quantized only", {**_QUANT_ONLY, "quantize_q": True}),
    "only_k": ("K quantized only", {**_QUANT_ONLY, "quantize_k": True}),
    "only_v": ("V quantized only", {**_QUANT_ONLY, "quantize_v": True}),
    "only_p": ("P quantized only", {**_QUANT_ONLY, "quantize_p": True}),
    "fp4_qk": ("FP4 QK^T only (P.V exact)", {"quantize_p": False, "quantize_v": False}),
    "fp4_pv": ("FP4 P.V only (QK^T exact)", {"quantize_q": False, "quantize_k": False}),
    # Changes to the FP4 numerics that are not SPEC (fp4attn.eval.fp4_variants): V smoothing by
    # V's key mean, its first key or its mean-query-weighted mean, l summed from the quantized
    # P^; and their effect on V or P quantized alone.
    "smooth_v": ("V smoothing (key mean)", {"smooth_v": "mean"}),
    "smooth_v_first": ("V smoothing (first key)", {"smooth_v": "first"}),
    "smooth_v_weighted": ("V smoothing (mean-query weighted)", {"smooth_v": "weighted"}),
    "quantized_rowsum": ("l from quantized P", {"quantized_rowsum": True}),
    "smooth_v_weighted_rowsum": ("V smoothing (mean-query weighted) + l from quantized P",
                                 {"smooth_v": "weighted", "quantized_rowsum": True}),
    "only_v_smooth_v": ("V quantized only, smoothed (key mean)",
                        {**_QUANT_ONLY, "quantize_v": True, "smooth_v": "mean"}),
    "only_v_smooth_v_first": ("V quantized only, smoothed (first key)",
                              {**_QUANT_ONLY, "quantize_v": True, "smooth_v": "first"}),
    "only_v_smooth_v_weighted": ("V quantized only, smoothed (mean-query weighted)",
                                 {**_QUANT_ONLY, "quantize_v": True, "smooth_v": "weighted"}),
    "only_p_smooth_v": ("P quantized only, V smoothed (key mean)",
                        {**_QUANT_ONLY, "quantize_p": True, "smooth_v": "mean"}),
    "only_p_rowsum": ("P quantized only, l from quantized P",
                      {**_QUANT_ONLY, "quantize_p": True, "quantized_rowsum": True}),
    # Exact rewrites of Q.K^T / P.V before NVFP4 (not SPEC; fp4attn.eval.fp4_variants,
    # docs/accuracy.md "Channel migration and Hadamard rotation for FP4")
    "migrate_qk": ("Q/K channel migration (s from smoothed Q)", {"migrate_qk": True}),
    "migrate_qk_raw": ("Q/K channel migration (s from raw Q)", {"migrate_qk": "raw"}),
    "rotate_qk16": ("Hadamard 16 on Q, K", {"rotate_qk": 16}),
    "rotate_qk32": ("Hadamard 32 on Q, K", {"rotate_qk": 32}),
    "rotate_qk64": ("Hadamard 64 on Q, K", {"rotate_qk": 64}),
    "rotate_qk": ("Hadamard D on Q, K", {"rotate_qk": True}),
    "migrate_rotate_qk": ("migration + Hadamard D on Q, K",
                          {"migrate_qk": True, "rotate_qk": True}),
    "rotate_qk_v": ("Hadamard D on Q, K and V", {"rotate_qk": True, "rotate_v": True}),
    "rotate_v": ("Hadamard D on V", {"rotate_v": True}),
    "fp4_qk_rotate_qk": ("FP4 QK^T only, Hadamard D on Q, K",
                         {"quantize_p": False, "quantize_v": False, "rotate_qk": True}),
    "fp4_qk_migrate_qk": ("FP4 QK^T only, channel migration",
                          {"quantize_p": False, "quantize_v": False, "migrate_qk": True}),
    "fp4_pv_rotate_v": ("FP4 P.V only, Hadamard D on V",
                        {"quantize_q": False, "quantize_k": False, "rotate_v": True}),
    # Hadamard rotation along the keys for P.V (not SPEC; docs/accuracy.md "Hadamard rotation
    # along the keys for FP4 P.V"): (P H)(H V) / n, blocks of n keys inside the 128-key tile
    **{f"rotate_pv{n}": (f"Hadamard {n} keys on P, V", {"rotate_pv": n}) for n in (16, 32, 128)},
    **{f"migrate_rotate_qk_pv{n}": (f"migration + Hadamard D on Q, K; Hadamard {n} keys on P, V",
                                    {"migrate_qk": True, "rotate_qk": True, "rotate_pv": n})
       for n in (16, 32, 128)},
    **{f"fp4_pv_rotate_pv{n}": (f"FP4 P.V only, Hadamard {n} keys on P, V",
                                {"quantize_q": False, "quantize_k": False, "rotate_pv": n})
       for n in (16, 128)},
}
MAIN_METHODS = ("fp4attn", "int8", "fp16", "bf16")
INT8_COS_TARGET = 0.999  # SPEC_INT8's accuracy targets: every layer, and end to end
INT8_PPL_TARGET = 0.003
ABLATIONS = ("ref", "no_smooth_q", "no_smooth_k", "one_level_p", "no_global_scale")
SINGLE = ("only_q", "only_k", "only_v", "only_p")
HALVES = ("fp4_qk", "fp4_pv")  # what an 8-bit P.V or an 8-bit QK^T path would leave


def _log(msg: str) -> None:
    print(f"[report] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Hooking torch SDPA: capture, and per-layer attention policies
# ---------------------------------------------------------------------------------------------


@dataclass
class AttnCall:
    """One recorded SDPA call: everything needed to recompute it."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    row_mask: torch.Tensor | None = None  # [B, Nq] True for real (non-padding) query rows

    def describe(self) -> str:
        m = "none" if self.attn_mask is None else f"{self.attn_mask.dtype} {tuple(self.attn_mask.shape)}"
        return (f"q {tuple(self.q.shape)} k {tuple(self.k.shape)} {self.q.dtype}, mask {m}, "
                f"causal={self.is_causal}, gqa={self.enable_gqa}, scale={self.scale}")


@contextlib.contextmanager
def swap_sdpa(fn, model=None):
    """Replace torch.nn.functional.scaled_dot_product_attention by ``fn(layer, q, k, v, **kw)``.

    ``layer`` is the call's index within the current forward pass of ``model`` (a forward
    pre-hook resets the counter), which for transformers decoders and encoders is the layer
    index. Restores the previous function on exit.
    """
    state = {"n": 0}
    prev = F.scaled_dot_product_attention

    def wrapper(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        i = state["n"]
        state["n"] += 1
        return fn(i, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    handle = None
    if model is not None:
        handle = model.register_forward_pre_hook(lambda *_: state.__setitem__("n", 0))
    F.scaled_dot_product_attention = wrapper
    try:
        yield state
    finally:
        F.scaled_dot_product_attention = prev
        if handle is not None:
            handle.remove()


@contextlib.contextmanager
def capture(model, layers: set[int] | None = None):
    """Record the inputs of every SDPA call of one forward pass (list of AttnCall)."""
    calls: list[AttnCall] = []

    def rec(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        if layers is None or i in layers:
            calls.append(AttnCall(
                i, q.detach().cpu().clone(), k.detach().cpu().clone(), v.detach().cpu().clone(),
                None if attn_mask is None else attn_mask.detach().cpu().clone(),
                bool(is_causal), scale, bool(enable_gqa)))
        return TORCH_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    with swap_sdpa(rec, model):
        yield calls


def _torch_sdpa_in(dtype):
    def run(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        m = attn_mask.to(dtype) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
        o = TORCH_SDPA(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=m, dropout_p=dropout_p,
                       is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return o.to(q.dtype)
    return run


def _fp4_fn(backend: str):
    if backend == "reference":
        def run(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
            dev = q.device
            o = R.attention(q.cpu(), k.cpu(), v.cpu(),
                            None if attn_mask is None else attn_mask.cpu(), is_causal, scale)
            return o.to(dev, q.dtype)
        return run
    import fp4attn

    def run(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return fp4attn.sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return run


def _int8_fn(backend: str, **granularity):
    """INT8 attention (SPEC_INT8) for swap_sdpa; ``granularity`` (``q_block``, ``k_block``) goes
    to the reference, the only backend that has it."""
    def run(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        if backend == "reference":
            o, _ = R8.attention_forward(q.cpu(), k.cpu(), v.cpu(),
                                        None if attn_mask is None else attn_mask.cpu(), is_causal,
                                        scale, **granularity)
            return o.to(q.device, q.dtype)
        import fp4attn

        return fp4attn.sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, precision="int8", strict=True)
    return run


#: Tokens of each perplexity window that "prefill" the FP4 KV cache (exact attention, and the
#: cache's K mean); every later position decodes from the cache.
CACHE_PREFILL = 128


def _layer_windows(model) -> list[int | None]:
    """Per attention layer, its sliding window (None: full attention), from the config's
    ``layer_types`` (models without it: all full)."""
    text = model.config.get_text_config(decoder=True) if model is not None else None
    types = getattr(text, "layer_types", None) if text is not None else None
    if not types:
        return []
    return [text.sliding_window if t == "sliding_attention" else None for t in types]


def _fp4cache_fn(model=None):
    """SDPA on one causal window as generation with an FP4 KV cache computes it (SPEC 6): the
    first CACHE_PREFILL positions by exact attention (the prefill), every later position by
    fp4attn.decode on the cache, in steps of MAX_DECODE_QUERIES positions (append them, decode
    them): each query sees the stored rows of every older key and its own residual keys exact,
    as in token-by-token generation (a query's result does not depend on the step's size). A
    sliding-window layer of ``model`` (its config's ``layer_types``; the mask transformers passes
    must be the plain window pattern) runs a windowed cache and windowed decodes, as FP4Cache
    does."""
    import fp4attn
    from fp4attn.integrations.transformers import _window_mask, attended
    from fp4attn.kv_cache import MAX_DECODE_QUERIES

    windows = _layer_windows(model)

    def run(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        B, Hq, N, D = q.shape
        window = windows[i] if i < len(windows) else None
        if window is not None and window >= N:
            window = None  # the window covers the whole sequence: plain causal
        if attn_mask is not None:
            plain = _window_mask(N, N, window, q.device)
            if not bool((attended(attn_mask)[..., :N] == plain).all()):
                raise ValueError(f"fp4cache mode: layer {i}'s mask is not the plain causal "
                                 f"{'' if window is None else f'window-{window} '}pattern")
        elif not is_causal or window is not None:
            raise ValueError(f"fp4cache mode: layer {i} expects a causal call "
                             f"{'' if window is None else f'with a window-{window} mask'}")
        P = min(CACHE_PREFILL, N)
        pre_mask = None if window is None else _window_mask(P, P, window, q.device)
        out = TORCH_SDPA(q[:, :, :P], k[:, :, :P], v[:, :, :P], attn_mask=pre_mask,
                         is_causal=pre_mask is None, scale=scale, enable_gqa=enable_gqa)
        if P == N:
            return out
        cache = fp4attn.FP4KVCache(B, k.shape[1], D, dtype=k.dtype, device=k.device,
                                   max_tokens=N, window=window)
        cache.append(k[:, :, :P].contiguous(), v[:, :, :P].contiguous())
        outs = [out]
        for t in range(P, N, MAX_DECODE_QUERIES):
            u = min(t + MAX_DECODE_QUERIES, N)
            cache.append(k[:, :, t:u].contiguous(), v[:, :, t:u].contiguous())
            outs.append(fp4attn.decode(q[:, :, t:u].contiguous(), cache, scale=scale,
                                       window=window))
        return torch.cat(outs, dim=2)

    return run


def generation_agreement(model, tok, prompts: list[str], *, new_tokens: int,
                         policy_modes: tuple[str, ...] = (),
                         modes: tuple[str, ...] | None = None) -> dict[str, dict]:
    """Greedy generation from each prompt with exact attention and a default cache, then with
    the FP4 KV cache (exact prefill, decode through it: the cache's own effect), with FP4
    attention and a default cache, and with both (the default HF use of FP4Cache): tokens until
    the first divergence from the exact continuation (``new_tokens`` when none). Each of
    ``policy_modes`` (``policy_mode``) runs too, with transformers' default cache. ``modes``: only
    these of "fp4cache", "fp4", "fp4+fp4cache" (None: all; "exact" always runs)."""
    from transformers import AttentionInterface

    from ..integrations import transformers as hf

    hf.register()

    def exact_prefill(module, query, key, value, attention_mask, scaling=None, **kw):
        out, key, value = hf.fp4cache_step(query, key, value, attention_mask, scaling)
        if out is not None:  # a decode step: the decode kernel on the FP4 cache
            return out, None
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        o = TORCH_SDPA(query, key, value, attn_mask=attention_mask, scale=scaling,
                       is_causal=attention_mask is None and query.shape[2] > 1,
                       enable_gqa=key.shape[1] != query.shape[1])
        return o.transpose(1, 2).contiguous(), None

    AttentionInterface.register("fp4attn-report-exact-prefill", exact_prefill)
    hf.register_cache_reader("fp4attn-report-exact-prefill")
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register("fp4attn-report-exact-prefill", sdpa_mask)
    setups = {"exact": ("sdpa", False), "fp4cache": ("fp4attn-report-exact-prefill", True),
              "fp4": ("fp4attn", False), "fp4+fp4cache": ("fp4attn", True),
              **{m: ("sdpa", False) for m in policy_modes}}
    if modes is not None:
        unknown = set(modes) - set(setups)
        if unknown:
            raise ValueError(f"modes: unknown {sorted(unknown)}; choose from {list(setups)}")
        setups = {m: s for m, s in setups.items() if m == "exact" or m in modes}
    before = model.config._attn_implementation
    runs: dict[str, list[list[int]]] = {m: [] for m in setups}
    try:
        for text in prompts:
            ids = tok(text, return_tensors="pt").input_ids.to(next(model.parameters()).device)
            for mode, (impl, fp4_cache) in setups.items():
                model.config._attn_implementation = impl
                kw = {"past_key_values": hf.FP4Cache(config=model.config)} if fp4_cache else {}
                scope = attention_mode(model, mode, "fp4attn") if mode in policy_modes else \
                    contextlib.nullcontext()
                with torch.no_grad(), scope:
                    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                         do_sample=False, **kw)
                runs[mode].append(out[0, ids.shape[1]:].tolist())
    finally:
        model.config._attn_implementation = before
    res = {}
    for mode in setups:
        if mode == "exact":
            continue
        same = []
        for a, b in zip(runs[mode], runs["exact"]):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            same.append(n)
        res[mode] = {"mean_tokens": sum(same) / len(same), "min_tokens": min(same),
                     "all_tokens": sum(n == new_tokens for n in same), "prompts": len(same),
                     "per_prompt": same}
    return res


def policy_sdpa(fp4_layers: set[int] | None, backend: str, fallback_dtype=None):
    """SDPA function for swap_sdpa: FP4 on ``fp4_layers`` (None = all), torch SDPA (in
    ``fallback_dtype``, default the input dtype) everywhere else."""
    fp4 = _fp4_fn(backend)
    other = _torch_sdpa_in(fallback_dtype) if fallback_dtype is not None else (
        lambda i, q, k, v, **kw: TORCH_SDPA(q, k, v, **kw))

    def run(i, q, k, v, **kw):
        return (fp4 if fp4_layers is None or i in fp4_layers else other)(i, q, k, v, **kw)
    return run


def fallback_mode(layers) -> str:
    """Mode name for "FP4 everywhere except ``layers`` (BF16 SDPA there)"."""
    return "fallback:" + ",".join(str(i) for i in sorted(layers))


GEN_LABELS = {
    "fp4cache": "exact attention, FP4 KV cache (FP4Cache)",
    "fp4": "fp4attn FP4 attention, default cache",
    "fp4+fp4cache": "fp4attn FP4 attention, FP4 KV cache",
}


def int8_granularity_mode(q_block: int, k_block: int, p_max: str = "tile", v_block: int = 128,
                          p_exp: str = "fp32", l_sum: str = "e", pv: str = "16bit") -> str:
    """Mode name for the INT8 reference with Q scales per ``q_block`` rows and K scales per
    ``k_block`` keys (SPEC_INT8: 64 and 128; see fp4attn.eval.int8_granularity), and optionally
    another P.V (``pv``: ``"fp8"``, SPEC_INT8 before its 16-bit P.V, with its study variants
    ``"fp8-tile"`` and ``"fp8-r16"``, or ``"int8"``, before the FP8 P.V) and, with
    ``pv="int8"``, P coded against the running
    maximum (``p_max="running"``), V scales per ``v_block`` keys (0: the whole sequence), P's
    exponentials in FP16 (``p_exp``) or l from P's codes (``l_sum``); see
    reference_int8.attention_forward."""
    return (f"int8ref:q{q_block}k{k_block}" + (f":p={p_max}" if p_max != "tile" else "")
            + (f":v={v_block}" if v_block != 128 else "")
            + (f":e={p_exp}" if p_exp != "fp32" else "")
            + (f":l={l_sum}" if l_sum != "e" else "")
            + (f":pv={pv}" if pv != "16bit" else ""))


def _parse_int8_granularity(mode: str) -> dict:
    head, *opts = mode.split(":")[1:]
    q, k = head[1:].split("k")
    kw = {"q_block": int(q), "k_block": int(k)}
    for opt in opts:
        name, value = opt.split("=", 1)
        if name == "p":
            kw["p_max"] = value
        elif name == "v":
            kw["v_block"] = int(value)
        elif name == "e":
            kw["p_exp"] = value
        elif name == "l":
            kw["l_sum"] = value
        elif name == "pv":
            kw["pv"] = value
        else:
            raise ValueError(f"unknown INT8 reference option {opt!r} in mode {mode!r}")
    return kw


def mode_label(mode: str) -> str:
    if mode.startswith("int8ref:"):
        g = _parse_int8_granularity(mode)
        extra = ("" if g.get("p_max", "tile") == "tile" else ", P against the running max") + (
            "" if g.get("v_block", 128) == 128 else
            f", V per {g['v_block'] or 'all'} keys") + (
            "" if g.get("p_exp", "fp32") == "fp32" else f", P's exponentials in {g['p_exp']}") + (
            "" if g.get("l_sum", "e") == "e" else ", l from P's codes") + (
            {"16bit": "", "fp8": ", FP8 P.V (SPEC_INT8 before the 16-bit P.V)",
             "int8": ", INT8 P.V (SPEC_INT8 before FP8 P.V)",
             "fp8-tile": ", FP8 P.V, P~ against the step max",
             "fp8-r16": ", FP8 P.V, V's residual scaled by 16"}[g.get("pv", "16bit")])
        return f"INT8 reference, Q per {g['q_block']} rows, K per {g['k_block']} keys{extra}"
    if mode.startswith("variant:"):
        return f"{METHODS[mode.split(':', 1)[1]][0]}, every layer (reference)"
    if mode.startswith("policy:"):
        return policy_label(mode.split(":", 1)[1])
    if mode.startswith("fallback:"):
        layers = mode.split(":", 1)[1]
        n = len(layers.split(",")) if layers else 0
        return f"fp4attn, {n} layer{'s' * (n != 1)} on BF16 ({layers})"
    return {"exact": "exact (FP32 SDPA)", "fp4": "fp4attn (FP4)", "int8": "fp4attn (INT8)",
            "bf16": "BF16 SDPA", "fp16": "FP16 SDPA",
            "fp4cache": f"exact attention, FP4 KV cache (prefill {CACHE_PREFILL}, then decode)"}.get(mode, mode)


def policy_mode(policy) -> str:
    """Mode name for an fp4attn.Policy (applied with fp4attn.patched(policy=..., model=...))."""
    return "policy:" + policy.code()


def policy_label(code: str) -> str:
    n = {c: code.count(c) for c in "48b"}
    return (f"policy {n['4']} FP4 / {n['8']} INT8 / {n['b']} exact layers ({code}; "
            "4 fp4, 8 int8, b torch SDPA in the model's dtype: FP32 here)")


@contextlib.contextmanager
def attention_mode(model, mode: str, backend: str):
    """exact | fp4 | int8 | bf16 | fp16 | fallback:<layers> (FP4 except those layers, BF16
    there) | policy:<code> (fp4attn.Policy.from_code)."""
    if mode == "exact":
        yield
    elif mode == "int8":
        with swap_sdpa(_int8_fn(backend), model):
            yield
    elif mode.startswith("int8ref:"):  # the INT8 reference at another scale granularity
        with swap_sdpa(_int8_fn("reference", **_parse_int8_granularity(mode)), model):
            yield
    elif mode == "fp4" and backend == "fp4attn":
        import fp4attn

        with fp4attn.patched():  # the user-facing path
            yield
    elif mode == "fp4":
        with swap_sdpa(policy_sdpa(None, backend), model):
            yield
    elif mode in ("bf16", "fp16"):
        dt = torch.bfloat16 if mode == "bf16" else torch.float16
        with swap_sdpa(_torch_sdpa_in(dt), model):
            yield
    elif mode.startswith("variant:"):  # a reference ablation in every layer
        flags = METHODS[mode.split(":", 1)[1]][1]

        def run(i, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
            o = R.attention(q.cpu(), k.cpu(), v.cpu(),
                            None if attn_mask is None else attn_mask.cpu(), is_causal, scale,
                            **flags)
            return o.to(q.device, q.dtype)

        with swap_sdpa(run, model):
            yield
    elif mode == "fp4cache":
        with swap_sdpa(_fp4cache_fn(model), model):
            yield
    elif mode.startswith("policy:"):  # a per-layer fp4attn.Policy, by its code, the user's path
        import fp4attn

        with fp4attn.patched(policy=fp4attn.Policy.from_code(mode.split(":", 1)[1]), model=model):
            yield
    elif mode.startswith("fallback:"):
        spec = mode.split(":", 1)[1]
        keep = {int(x) for x in spec.split(",")} if spec else set()
        fp4_layers = set(range(_num_layers(model))) - keep
        with swap_sdpa(policy_sdpa(fp4_layers, backend, torch.bfloat16), model):
            yield
    else:
        raise ValueError(f"unknown attention mode {mode!r}")


def _num_layers(model) -> int:
    return int(model.config.num_hidden_layers)


# ---------------------------------------------------------------------------------------------
# Per-layer evaluation
# ---------------------------------------------------------------------------------------------


def _select_rows(o: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
    return o if row_mask is None else o.transpose(1, 2)[row_mask]  # [real rows, H, D]


def run_method(name: str, call: AttnCall, *, device: str, backend: str) -> torch.Tensor:
    """Output of one method on a recorded call, float32 on the CPU."""
    how = METHODS[name][1]
    q, k, v, m = call.q, call.k, call.v, call.attn_mask
    if how == "fp4attn" and backend == "reference":
        how = {}
    if how == "int8":
        o = _int8_fn(backend)(call.layer, q.to(device), k.to(device), v.to(device),
                              attn_mask=None if m is None else m.to(device), dropout_p=0.0,
                              is_causal=call.is_causal, scale=call.scale,
                              enable_gqa=call.enable_gqa)
        return o.float().cpu()
    if how == "fp4attn":
        import fp4attn

        d = torch.device(device)
        o = fp4attn.sdpa(q.to(d), k.to(d), v.to(d), attn_mask=None if m is None else m.to(d),
                         is_causal=call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa,
                         strict=True)
        return o.float().cpu()
    if isinstance(how, torch.dtype):
        d = torch.device(device)
        mm = None if m is None else (m.to(d, how) if m.is_floating_point() else m.to(d))
        o = TORCH_SDPA(q.to(d, how), k.to(d, how), v.to(d, how), attn_mask=mm,
                       is_causal=call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa)
        return o.float().cpu()
    # reference.attention computes with repeated-by-index KV heads itself (GQA)
    return R.attention(q, k, v, m, call.is_causal, call.scale, **how)


def subset(call: AttnCall, max_tokens: int) -> AttnCall:
    """A smaller, self-contained part of a recorded call for the (slow, pure-PyTorch) ablations:
    the first ``max_tokens`` tokens of a causal call without mask (a causal prefix is exactly
    the attention of those tokens), else the first batch items holding about ``max_tokens``
    query rows."""
    B, _, Nq, _ = call.q.shape
    if max_tokens <= 0 or B * Nq <= max_tokens:
        return call
    if call.is_causal and call.attn_mask is None and call.q.shape[2] == call.k.shape[2]:
        n = max_tokens
        return AttnCall(call.layer, call.q[:, :, :n], call.k[:, :, :n], call.v[:, :, :n], None,
                        True, call.scale, call.enable_gqa,
                        None if call.row_mask is None else call.row_mask[:, :n])
    b = max(1, max_tokens // Nq)
    m = call.attn_mask
    if m is not None and m.shape[0] == B:
        m = m[:b]
    return AttnCall(call.layer, call.q[:b], call.k[:b], call.v[:b], m, call.is_causal,
                    call.scale, call.enable_gqa,
                    None if call.row_mask is None else call.row_mask[:b])


def evaluate_layers(calls: list[AttnCall], methods: list[str], *, device: str, backend: str,
                    model_name: str, ablation_tokens: int = 0) -> list[dict]:
    """Per layer and method: metrics against exact float64 attention. The reference ablations
    (every method but fp4attn / fp16 / bf16) see ``subset(call, ablation_tokens)``."""
    rows = []
    for full in calls:
        t0 = time.perf_counter()
        small = subset(full, ablation_tokens)
        refs = {}
        parts = []
        for name in methods:
            call = full if name in MAIN_METHODS else small
            if id(call) not in refs:
                ref = R.exact_attention(call.q, call.k, call.v, call.attn_mask, call.is_causal,
                                        call.scale, enable_gqa=True)
                refs[id(call)] = _select_rows(ref, call.row_mask)
            ref_sel = refs[id(call)]
            t = time.perf_counter()
            try:
                out = run_method(name, call, device=device, backend=backend)
                met = R.metrics(_select_rows(out, call.row_mask), ref_sel)
                err = ""
            except Exception as exc:  # noqa: BLE001  (the report goes on; the row says what failed)
                met = {"cos": math.nan, "rel_l1": math.nan, "rmse": math.nan}
                err = f"{type(exc).__name__}: {exc}"
                _log(f"{model_name} layer {call.layer} {name}: {err}")
            rows.append({"model": model_name, "layer": call.layer, "method": name,
                             "label": METHODS[name][0], "cos": met["cos"], "rel_l1": met["rel_l1"],
                             "rmse": met["rmse"], "seconds": round(time.perf_counter() - t, 4),
                             "query_rows": int(call.q.shape[0] * call.q.shape[2]), "error": err})
            parts.append(f"{name} {met['cos']:.5f}")
        _log(f"{model_name} layer {full.layer:2d} ({time.perf_counter() - t0:5.1f}s): "
             + ", ".join(parts[:4]))
    return rows


def _by_layer(rows: list[dict]) -> dict[int, dict[str, dict]]:
    out: dict[int, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["layer"], {})[r["method"]] = r
    return out


def dominant_quantity(layer_rows: dict[str, dict]) -> str:
    """Which of Q, K, V, P alone gives the largest error (rel_l1) in this layer."""
    cand = [(layer_rows[m]["rel_l1"], m[-1].upper()) for m in SINGLE if m in layer_rows
            and not math.isnan(layer_rows[m]["rel_l1"])]
    return max(cand)[1] if cand else "-"


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


def perplexity(model, ids: torch.Tensor, *, window: int, modes: list[str],
               backend: str, bos_id: int | None = None) -> dict[str, dict]:
    """Perplexity over non-overlapping windows of ``ids`` for each attention mode, plus top-1
    agreement and mean KL(exact || mode) of the next-token distributions. ``bos_id``: a token
    put before every window (models such as Gemma expect ``<bos>``), never a target."""
    if "fp4cache" in modes and window <= CACHE_PREFILL:
        raise ValueError(f"the fp4cache mode needs windows longer than its {CACHE_PREFILL}-token "
                         f"prefill (window={window}: nothing would decode from the cache)")
    dev = next(model.parameters()).device
    stats = {m: {"nll": 0.0, "n": 0, "agree": 0, "kl": 0.0} for m in modes}
    t0 = time.perf_counter()
    lead = 0 if bos_id is None else 1
    for s in range(0, ids.numel() - 1, window):
        chunk = ids[s : s + window].unsqueeze(0).to(dev)
        if chunk.shape[1] < 2:
            break
        tgt = chunk[:, 1:]
        if bos_id is not None:
            chunk = torch.cat([chunk.new_full((1, 1), bos_id), chunk], dim=1)
        ref_lp = None
        for mode in modes:
            with torch.no_grad(), attention_mode(model, mode, backend):
                logits = model(chunk, use_cache=False).logits[:, lead:-1].float()
            lp = torch.log_softmax(logits, dim=-1)
            st = stats[mode]
            st["nll"] += -lp.gather(-1, tgt.unsqueeze(-1)).sum().item()
            st["n"] += tgt.numel()
            if ref_lp is None:
                ref_lp = lp  # modes[0] is the reference (exact)
            st["agree"] += (lp.argmax(-1) == ref_lp.argmax(-1)).sum().item()
            st["kl"] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
        _log(f"perplexity: {min(s + window, ids.numel())}/{ids.numel()} tokens "
             f"({time.perf_counter() - t0:.0f}s)")
    out = {}
    base = math.exp(stats[modes[0]]["nll"] / max(stats[modes[0]]["n"], 1))
    for m, st in stats.items():
        ppl = math.exp(st["nll"] / max(st["n"], 1))
        out[m] = {"ppl": ppl, "rel_change": ppl / base - 1.0, "top1_agree": st["agree"] / max(st["n"], 1),
                      "kl": st["kl"] / max(st["n"], 1), "tokens": st["n"]}
    return out


def embedding_similarity(model, tok, sentences: list[str], *, modes: list[str], backend: str,
                         batch_size: int) -> dict[str, dict]:
    embs = {}
    for mode in modes:
        with attention_mode(model, mode, backend):
            embs[mode] = M.minilm_embed(model, tok, sentences, batch_size=batch_size).double()
    ref = embs[modes[0]]
    ref_nn = _nearest(ref)
    out = {}
    for mode, e in embs.items():
        c = (e * ref).sum(-1) / (e.norm(dim=-1) * ref.norm(dim=-1))
        out[mode] = {"mean_cos": c.mean().item(), "min_cos": c.min().item(),
                         "nn_agree": (_nearest(e) == ref_nn).double().mean().item(),
                         "sentences": len(sentences)}
    return out


def _nearest(e: torch.Tensor) -> torch.Tensor:
    sim = e @ e.T
    sim.fill_diagonal_(-math.inf)
    return sim.argmax(-1)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _parse_layers(spec: str, n: int) -> list[int]:
    if spec in ("all", ""):
        return list(range(n))
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if "-" in part[1:]:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        else:
            out.add(int(part))
    bad = [i for i in out if not -n <= i < n]
    if bad:
        raise ValueError(f"--layers: {bad} out of range for a model with {n} layers")
    return sorted(i % n for i in out)


@dataclass
class ModelResult:
    name: str
    title: str
    info: str
    rows: list[dict] = field(default_factory=list)
    e2e: dict = field(default_factory=dict)
    e2e_kind: str = ""
    policies: list[dict] = field(default_factory=list)
    generation: dict = field(default_factory=dict)
    policy: object = None  # the calibrated fp4attn.Policy (report --calibrate)
    curve: list[dict] = field(default_factory=list)  # perplexity along its calibration order
    n_layers: int = 0
    seconds: float = 0.0


def _methods(args) -> list[str]:
    ms = list(MAIN_METHODS)
    if not args.no_ablations:
        ms += list(ABLATIONS) + list(SINGLE) + list(HALVES)
    if args.backend == "reference":
        ms = [m for m in ms if m != "ref"]  # identical to the fp4attn column then
    return ms


def report_smollm2(args) -> ModelResult:
    t0 = time.perf_counter()
    model, tok = M.load_smollm2(verbose=True)
    model = model.to(args.device)
    n_layers = _num_layers(model)
    layers = _parse_layers(args.layers, n_layers)
    text = M.austen_text(args.book)
    ids = tok(text, return_tensors="pt").input_ids[0]
    need = max(args.tokens, args.ppl_tokens)
    if ids.numel() < need:
        raise ValueError(f"{args.book} has only {ids.numel()} tokens, {need} requested")
    cap_ids = ids[: args.tokens].unsqueeze(0).to(args.device)
    with torch.no_grad(), capture(model, set(layers)) as calls:
        model(cap_ids, use_cache=False)
    _log(f"smollm2: captured {len(calls)} layers on {args.tokens} tokens; {calls[0].describe()}")
    res = ModelResult(
        "smollm2", "SmolLM2-135M-Instruct (GGUF Q4_1 weights dequantized to FP32)",
        f"Llama, {n_layers} layers, {model.config.num_attention_heads} query / "
        f"{model.config.num_key_value_heads} KV heads, head dim {calls[0].q.shape[-1]}; "
        f"captured on the first {args.tokens} tokens of {args.book} (causal)")
    res.n_layers = n_layers
    res.rows = evaluate_layers(calls, _methods(args), device=args.device, backend=args.backend,
                               model_name="smollm2", ablation_tokens=args.ablation_tokens)
    del calls
    pmodes = []
    if args.calibrate and not args.no_e2e:
        res.policy = calibrate_llm(model, tok, args)
        pmodes = [policy_mode(res.policy)]
    if args.ppl_tokens <= 1 and not args.no_e2e and (args.gen_prompts > 0 or args.curve_points > 0):
        print("[report] --ppl-tokens 0: no perplexity, and so no greedy agreement, fallback "
              "policies or calibration curve (they run with it)", file=sys.stderr)
    if args.ppl_tokens > 1 and not args.no_e2e:
        ppl_ids = ids[: args.ppl_tokens]
        res.e2e = perplexity(model, ppl_ids, window=args.window,
                             modes=["exact", "fp4", "int8", "bf16", "fp4cache", *pmodes],
                             backend=args.backend)
        res.e2e_kind = (f"perplexity on the first {args.ppl_tokens} tokens of {args.book}, "
                        f"non-overlapping windows of {args.window} (FP4 KV cache: the first "
                        f"{CACHE_PREFILL} positions of a window prefill it, the others decode "
                        "from it)")
        if args.gen_prompts > 0:
            paras = [p for p in M.austen_paragraphs(args.book) if len(p) > 400][: args.gen_prompts]
            prompts = [tok.decode(tok(p).input_ids[:64], skip_special_tokens=True) for p in paras]
            res.generation = generation_agreement(model, tok, prompts, new_tokens=args.gen_tokens,
                                                  policy_modes=tuple(pmodes))
        res.policies = fallback_policies(model, ppl_ids, res, args)
        if res.policy is not None and args.curve_points > 0:
            res.curve = policy_curve(model, ids[: args.curve_tokens], res.policy, args)
    res.seconds = time.perf_counter() - t0
    return res


def calibrate_llm(model, tok, args):
    """fp4attn.calibrate on --cal-seqs x --cal-len tokens of --cal-book (two sequences per
    batch), the report's book being the held-out text."""
    from .. import calibration as CAL
    from .policy_study import calibration_batches

    cal_ids = tok(M.austen_text(args.cal_book), return_tensors="pt").input_ids[0]
    batches = calibration_batches(cal_ids, args.cal_seqs, args.cal_len, None)
    policy = CAL.calibrate(model, batches, budget=args.budget, device_kind=args.device_kind)
    policy.meta["calibration_text"] = f"{args.cal_seqs} x {args.cal_len} tokens of {args.cal_book}"
    return policy


def policy_curve(model, ids, policy, args) -> list[dict]:
    """Perplexity on ``ids`` at --curve-points assignments of the policy's calibration order
    (all FP4 ... all BF16; calibration.ladder) and at the calibrated one."""
    from .. import calibration as CAL

    cal = policy.meta["calibration"]
    steps = CAL.ladder(policy)
    n = args.curve_points
    picks = sorted({round(i * (len(steps) - 1) / max(n - 1, 1)) for i in range(n)} | {cal["m"]})
    modes = list(dict.fromkeys(["exact"] + [policy_mode(steps[m]) for m in picks]))
    res = perplexity(model, ids, window=args.window, modes=modes, backend=args.backend)
    return [{"m": m, "code": steps[m].code(), "fp4_share": steps[m].fp4_share(cal["flops"]),
             "calibrated": m == cal["m"], **res[policy_mode(steps[m])]} for m in picks]


def fp4_share(mode: str, policy) -> float | None:
    """Share of the attention FLOPs a mode computes in FP4 (FLOPs per layer from the policy's
    calibration), None where it does not apply (the FP4 KV cache)."""
    if mode == "fp4" or mode.startswith("variant:"):
        return 1.0
    if mode.startswith("policy:") and policy is not None:
        from ..policy import Policy

        flops = policy.meta["calibration"]["flops"]
        return Policy.from_code(mode.split(":", 1)[1]).fp4_share(flops)
    if mode.startswith("fallback:") and policy is not None:
        flops = policy.meta["calibration"]["flops"]
        keep = {int(x) for x in mode.split(":", 1)[1].split(",") if x}
        return sum(f for i, f in enumerate(flops) if i not in keep) / sum(flops)
    if mode in ("exact", "int8", "bf16", "fp16") or mode.startswith("int8ref:"):
        return 0.0
    return None


def report_captured(args) -> ModelResult:
    """Per-layer report on attention inputs captured elsewhere (scripts/crosscheck_captured.py
    capture): the way to run the report on a machine the model weights cannot reach."""
    t0 = time.perf_counter()
    data = torch.load(args.captured)
    calls = [AttnCall(c["layer"], c["q"], c["k"], c["v"], c["attn_mask"], c["is_causal"],
                      c["scale"], c["enable_gqa"]) for c in data["calls"]]
    res = ModelResult(
        "smollm2", f"{data['model']} (captured activations)",
        f"{len(calls)} layers captured on {data['tokens']} tokens, read from {args.captured}; "
        f"{calls[0].describe()}; no end-to-end numbers (the model is not loaded)")
    res.n_layers = max(c.layer for c in calls) + 1
    res.rows = evaluate_layers(calls, _methods(args), device=args.device, backend=args.backend,
                               model_name="smollm2", ablation_tokens=args.ablation_tokens)
    res.seconds = time.perf_counter() - t0
    return res


def fallback_policies(model, ids, res: ModelResult, args) -> list[dict]:
    """If a target fails, measure per-layer fallback policies (BF16 SDPA on some layers, FP4
    on the rest): the layers below the cosine target, and the smallest top-k of layers ranked
    by cosine (ladder ``--policy-ladder``) that meets the perplexity target."""
    by = _by_layer(res.rows)
    ranked = sorted((l for l in by if "fp4attn" in by[l]), key=lambda l: by[l]["fp4attn"]["cos"])
    failing = sorted(l for l in ranked if not by[l]["fp4attn"]["cos"] >= COS_TARGET)
    ppl_fails = res.e2e["fp4"]["rel_change"] >= PPL_TARGET
    if args.no_policy or not (failing or ppl_fails) or not ranked:
        return []
    out = []

    def measure(layers: list[int], rule: str) -> dict:
        mode = fallback_mode(layers)
        _log(f"policy {rule}: {len(layers)} layers on BF16")
        d = perplexity(model, ids, window=args.window, modes=["exact", mode],
                       backend=args.backend)[mode]
        res.e2e[mode] = d
        item = dict(rule=rule, layers=sorted(layers), mode=mode, **d)
        out.append(item)
        return item

    for m in HALVES:  # what an 8-bit P.V (resp. QK^T) path would leave, end to end
        mode = f"variant:{m}"
        _log(f"variant {m} in every layer (reference implementation)")
        res.e2e[mode] = perplexity(model, ids, window=args.window, modes=["exact", mode],
                                   backend=args.backend)[mode]
    if failing and len(failing) < _num_layers(model):
        measure(failing, f"layers with cos < {COS_TARGET}")
    for k in args.policy_ladder:
        if k >= len(ranked) or (failing and k >= len(failing)):
            break
        item = measure(ranked[:k], f"the {k} layers with the lowest cos")
        if item["rel_change"] < PPL_TARGET:
            break
    return out


def report_minilm(args) -> ModelResult:
    t0 = time.perf_counter()
    model, tok = M.load_minilm()
    model = model.to(args.device)
    n_layers = _num_layers(model)
    layers = _parse_layers(args.minilm_layers, n_layers)
    sentences = M.austen_sentences("emma", args.sentences)
    paras = [p for p in M.austen_paragraphs("persuasion") if len(p) > 400][: args.paragraphs]
    enc = tok(paras, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad(), capture(model, set(layers)) as calls:
        model(**enc.to(args.device))
    real = enc["attention_mask"].bool().cpu()
    for c in calls:
        c.row_mask = real
    _log(f"minilm: captured {len(calls)} layers; {calls[0].describe()}")
    res = ModelResult(
        "minilm", "all-MiniLM-L6-v2 (BERT encoder)",
        f"BERT, {n_layers} layers, {model.config.num_attention_heads} heads, head dim "
        f"{calls[0].q.shape[-1]}; captured on {len(paras)} paragraphs of persuasion "
        f"(<= 256 tokens, {int(real.sum())} real tokens, padding rows excluded from metrics)")
    res.rows = evaluate_layers(calls, _methods(args), device=args.device, backend=args.backend,
                               model_name="minilm", ablation_tokens=2 * args.ablation_tokens)
    pmodes = []
    if args.calibrate and not args.no_e2e:
        from .. import calibration as CAL

        res.policy = CAL.calibrate(model, [enc], budget=args.minilm_budget,
                                   device_kind=args.device_kind)
        res.policy.meta["calibration_text"] = f"{len(paras)} paragraphs of persuasion"
        pmodes = [policy_mode(res.policy)]
    if not args.no_e2e and args.sentences > 1:
        res.e2e = embedding_similarity(model, tok, sentences,
                                       modes=["exact", "fp4", "int8", "bf16", *pmodes],
                                       backend=args.backend, batch_size=32)
        res.e2e_kind = f"sentence embeddings of {len(sentences)} sentences of emma (mean pooling)"
    res.seconds = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _f(x, spec=".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _layer_tables(res: ModelResult, check_cos: bool) -> str:
    by = _by_layer(res.rows)
    have = {m for r in by.values() for m in r}
    main = [m for m in MAIN_METHODS if m in have]
    head = ["layer"]
    for m in main:
        head += [f"{METHODS[m][0]} cos", "rel_l1", "rmse"]
    if any(m in have for m in SINGLE):
        head.append("dominant")
    if check_cos:
        head.append(f"cos >= {COS_TARGET}")
    body = []
    for layer, r in sorted(by.items()):
        row = [str(layer)]
        for m in main:
            row += [_f(r[m]["cos"], ".5f"), _f(r[m]["rel_l1"]), _f(r[m]["rmse"])]
        if any(m in have for m in SINGLE):
            row.append(dominant_quantity(r))
        if check_cos:
            c = r.get("fp4attn", {}).get("cos", math.nan)
            row.append("yes" if c >= COS_TARGET else "**NO**")
        body.append(row)
    out = [_md_table(head, body)]
    abl = [m for m in ABLATIONS + SINGLE + HALVES if m in have]
    if abl:
        n = next(iter(by.values()))[abl[0]]["query_rows"]
        out.append(f"\nAblations (reference implementation of SPEC.md on {n} query rows), "
                   "rel_l1 against exact; the last columns give the cosine of the full SPEC and "
                   "of each half kept in FP4 alone:\n")
        cos_cols = [m for m in ("ref",) + HALVES if m in have]
        head = ["layer"] + [METHODS[m][0] for m in abl] + [f"cos {METHODS[m][0]}" for m in cos_cols]
        body = [[str(layer)] + [_f(r[m]["rel_l1"]) for m in abl]
                + [_f(r[m]["cos"], ".4f") for m in cos_cols] for layer, r in sorted(by.items())]
        out.append(_md_table(head, body))
    return "\n".join(out)


def _summary(res: ModelResult) -> dict:
    fp4 = [r for r in res.rows if r["method"] == "fp4attn"]
    s: dict = {"model": res.name, "layers": len(fp4), "seconds": round(res.seconds, 1)}
    if fp4:
        worst = min(fp4, key=lambda r: (r["cos"] if not math.isnan(r["cos"]) else -1))
        s.update(worst_layer=worst["layer"], worst_cos=worst["cos"],
                 worst_rel_l1=max(r["rel_l1"] for r in fp4),
                 mean_cos=sum(r["cos"] for r in fp4) / len(fp4),
                 failing_layers=[r["layer"] for r in fp4 if not r["cos"] >= COS_TARGET])
        for m in ("int8", "fp16", "bf16"):
            mr = [r for r in res.rows if r["method"] == m]
            if mr:
                s[f"{m}_worst_cos"] = min(r["cos"] for r in mr)
        i8 = [r for r in res.rows if r["method"] == "int8"]
        if i8:
            s["int8_failing_layers"] = [r["layer"] for r in i8 if not r["cos"] >= INT8_COS_TARGET]
    if res.e2e:
        s["e2e"] = res.e2e
    if res.policies:
        s["policies"] = res.policies
    if res.generation:
        s["generation"] = res.generation
    if res.policy is not None:
        s["calibrated_policy"] = res.policy.to_dict()
        s["policy_curve"] = res.curve
    return s


def _ablation_effects(by: dict[int, dict[str, dict]]) -> dict[str, float]:
    """Mean over layers of rel_l1(ablation) / rel_l1(reference)."""
    out = {}
    for m in ABLATIONS[1:] + SINGLE:
        ratios = [r[m]["rel_l1"] / r["ref"]["rel_l1"] for r in by.values()
                  if m in r and "ref" in r and r["ref"]["rel_l1"] > 0]
        if ratios:
            out[m] = sum(ratios) / len(ratios)
    return out


def _worst_cos(by: dict[int, dict[str, dict]], method: str) -> tuple[float, int]:
    """Worst cosine of a method over layers, and how many layers miss the target."""
    cs = [r[method]["cos"] for r in by.values()]
    return min(cs), sum(not c >= COS_TARGET for c in cs)


def _closing_note(results: list[ModelResult], args) -> str:
    lines = []
    for res in results:
        if res.name != "smollm2":
            continue
        s = _summary(res)
        by = _by_layer(res.rows)
        failing = s.get("failing_layers", [])
        ppl = res.e2e.get("fp4", {}).get("rel_change") if res.e2e else None
        ppl_ok = ppl is None or ppl < PPL_TARGET
        if "worst_cos" in s:
            lines.append(
                f"- **Per-layer cosine** (fp4attn vs exact, {args.tokens} tokens) on "
                f"{s['layers']} layers: worst {s['worst_cos']:.5f} (layer {s['worst_layer']}), "
                f"mean {s['mean_cos']:.5f}; target >= {COS_TARGET}: "
                + ("**met**." if not failing else
                   f"**not met** on {len(failing)} layers: {failing}."))
            bf = s.get("bf16_worst_cos")
            if bf is not None:
                lines.append(f"  For scale: BF16 SDPA's worst layer has cos {bf:.6f}.")
        if ppl is not None:
            lines.append(f"- **Perplexity** change with FP4 attention in every layer: "
                         f"{100 * ppl:+.2f}% (target < {100 * PPL_TARGET:.0f}%): "
                         + ("**met**." if ppl_ok else "**not met**.") +
                         f" BF16 SDPA: {100 * res.e2e['bf16']['rel_change']:+.2f}%.")
        if "int8_worst_cos" in s or "int8" in (res.e2e or {}):
            parts = []
            if "int8_worst_cos" in s:
                bad = s["int8_failing_layers"]
                parts.append(f"per-layer worst cos {s['int8_worst_cos']:.5f} (target >= "
                             f"{INT8_COS_TARGET}: " + ("**met**" if not bad else
                                                       f"**not met** on layers {bad}") + ")")
            if "int8" in (res.e2e or {}):
                p8 = res.e2e["int8"]["rel_change"]
                parts.append(f"perplexity {100 * p8:+.2f}% (target < {100 * INT8_PPL_TARGET:.1f}%: "
                             + ("**met**" if p8 < INT8_PPL_TARGET else "**not met**") + ")")
            lines.append("- **8-bit attention** (SPEC_INT8) in every layer: " + "; ".join(parts) + ".")
        eff = _ablation_effects(by)
        if eff:
            dom = {l: dominant_quantity(r) for l, r in by.items()}
            counts: dict[str, int] = {}
            for d in dom.values():
                counts[d] = counts.get(d, 0) + 1
            order = sorted(counts.items(), key=lambda kv: -kv[1])
            single = ", ".join(f"{q} {eff['only_' + q.lower()]:.2f}" for q in "QKVP"
                               if "only_" + q.lower() in eff)
            lines.append(
                f"- **Where the error comes from** (reference ablations on "
                f"{args.ablation_tokens or args.tokens} tokens; ratios are mean "
                "rel_l1(variant) / rel_l1(full SPEC)): the quantity whose quantization alone "
                "gives the largest error is " + ", ".join(f"{q} in {n} layer{'s' * (n != 1)}"
                                                         for q, n in order) +
                f"; quantizing only one operand: {single}. Removing a design element: " +
                ", ".join(f"{METHODS[m][0]} {eff[m]:.2f}x" for m in ABLATIONS[1:] if m in eff)
                + " (above 1 means the element helps).")
            halves = [m for m in ("ref",) + HALVES if all(m in r for r in by.values())]
            if len(halves) == 3:
                (c0, n0), (c1, n1), (c2, n2) = (_worst_cos(by, m) for m in halves)
                lines.append(
                    f"- On the same {args.ablation_tokens or args.tokens} tokens, full FP4 has "
                    f"worst cos {c0:.4f} ({n0} layers below {COS_TARGET}); keeping only QK^T in "
                    f"FP4 (P.V exact, the limit of an 8-bit P.V) gives {c1:.4f} ({n1} below); "
                    f"keeping only P.V in FP4 (QK^T exact) gives {c2:.4f} ({n2} below)." + "".join(
                        f" End to end, {mode_label('variant:' + m)}: perplexity "
                        f"{100 * res.e2e['variant:' + m]['rel_change']:+.2f}%, KL "
                        f"{res.e2e['variant:' + m]['kl']:.3g}."
                        for m in HALVES if "variant:" + m in res.e2e))
            if failing:
                lines.append("- Failing layers (dominant quantity, cos): " + ", ".join(
                    f"{l} ({dom.get(l, '-')}, {by[l]['fp4attn']['cos']:.4f})" for l in failing)
                    + ".")
        if not failing and ppl_ok:
            lines.append("- No fallback needed on this model: FP4 attention meets both targets.")
            continue
        for p in res.policies:
            ok = p["rel_change"] < PPL_TARGET
            lines.append(f"- Measured policy, {p['rule']} on BF16 SDPA ({len(p['layers'])} of "
                         f"{_n_model_layers(res)} layers: {p['layers']}): perplexity "
                         f"{100 * p['rel_change']:+.2f}% ({'meets' if ok else 'misses'} the "
                         f"target), top-1 agreement {100 * p['top1_agree']:.1f}%.")
        best = min((p for p in res.policies if p["rel_change"] < PPL_TARGET),
                   key=lambda p: len(p["layers"]), default=None)
        lines.append(
            "- **Where FP4 misses: a per-layer precision policy** (`fp4attn.calibrate`, "
            "`fp4attn.Policy`, docs/policy.md): each layer runs FP4, the 8-bit attention "
            "(`precision=\"int8\"`, rows above) or torch's SDPA, the cheapest mix within a "
            "budget, measured; the calibrated policy's rows are above where the report ran it.")
        qk = res.e2e.get("variant:fp4_qk")
        if qk is not None:
            still = sorted(l for l, r in by.items() if "fp4_qk" in r
                           and not r["fp4_qk"]["cos"] >= COS_TARGET)
            lines.append(
                f"  - Option A, 8-bit P.V in every layer (FP4 kept for QK^T): its limit, P.V "
                f"exact, measures {100 * qk['rel_change']:+.2f}% perplexity "
                f"({'within' if qk['rel_change'] < PPL_TARGET else 'outside'} the target); "
                + (f"the {len(still)} layers still below {COS_TARGET} with it ({still}) also "
                   "need 8-bit QK^T or BF16." if still else
                   f"every analysed layer reaches cos >= {COS_TARGET} with it."))
        if failing or best:
            lines.append(
                "  - Option B, BF16 (upper bound of 8-bit) on whole layers: "
                + (f"the per-layer target needs the {len(failing)} layers below {COS_TARGET}"
                   + (f" ({100 * next(p['rel_change'] for p in res.policies if p['layers'] == failing):+.2f}%)"
                      if any(p["layers"] == failing for p in res.policies) else "")
                   + "; " if failing else "")
                + (f"the perplexity target alone is met with {len(best['layers'])} layers "
                   f"({best['rule']}: {100 * best['rel_change']:+.2f}%)." if best else
                   "no measured top-k policy met the perplexity target."))
        lines.append(
            "  - On a few thousand tokens perplexity differences of a few tenths of a point are "
            "noise (FP4's codes flip on tiny input differences, so changes elsewhere move it); "
            "KL and top-1 agreement are the steadier measures. BF16 and exact P.V / QK^T are "
            "upper bounds for the 8-bit paths.")
    return "\n".join(lines)


def _n_model_layers(res: ModelResult) -> int:
    return res.n_layers or len(_by_layer(res.rows))


def write_outputs(results: list[ModelResult], args, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    for res in results:
        with open(out / f"{res.name}_layers.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=["model", "layer", "method", "label", "cos",
                                               "rel_l1", "rmse", "seconds", "query_rows",
                                               "error"])
            w.writeheader()
            for r in res.rows:
                w.writerow({**r, **{k: (f"{r[k]:.8g}" if isinstance(r[k], float) else r[k])
                                    for k in ("cos", "rel_l1", "rmse")}})
    with open(out / "e2e.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["model", "mode", "metric", "value"])
        for res in results:
            for mode, d in res.e2e.items():
                for k, v in d.items():
                    w.writerow([res.name, mode, k, f"{v:.8g}" if isinstance(v, float) else v])
    plots = {res.name: plot_layers(res, out / f"{res.name}_layers.png") for res in results}

    md = ["# fp4attn accuracy report", ""]
    md.append(f"Command: `python -m fp4attn report {' '.join(args.argv)}`".rstrip() + "  ")
    md.append(f"Attention backend under test: {_backend_desc(args)}; device {args.device}; "
              f"torch {torch.__version__}. Every number compares against exact attention in "
              "float64 on the same captured Q/K/V (cos, rel_l1 = sum|o-ref|/sum|ref|, rmse).")
    for res in results:
        md += ["", f"## {res.title}", "", res.info + f" ({res.seconds:.0f} s).", ""]
        if plots.get(res.name):
            md += [f"![{res.name} per-layer error]({plots[res.name].name})", ""]
        md.append(_layer_tables(res, check_cos=res.name == "smollm2"))
        if res.e2e:
            md += ["", f"End to end: {res.e2e_kind}.", ""]
            if res.name == "smollm2":
                body = [[mode_label(m), _share(m, res.policy), f"{d['ppl']:.4f}",
                         f"{100 * d['rel_change']:+.3f}%", f"{100 * d['top1_agree']:.2f}%",
                         _f(d["kl"])] for m, d in res.e2e.items()]
                md.append(_md_table(["attention", "FP4 FLOPs", "perplexity", "change",
                                     "top-1 = exact", "KL(exact||x) per token"], body))
            if res.generation:
                g = next(iter(res.generation.values()))
                md += ["", f"Greedy generation, {g['prompts']} prompts of {args.book} (their "
                       f"first 64 tokens), {args.gen_tokens} new tokens: tokens until the first "
                       "divergence from exact attention with transformers' default cache.", ""]
                body = [[GEN_LABELS.get(m) or mode_label(m), f"{d['mean_tokens']:.1f}", str(d["min_tokens"]),
                         f"{d['all_tokens']} / {d['prompts']}"] for m, d in res.generation.items()]
                md.append(_md_table(["attention and cache", "mean tokens", "min",
                                     "prompts with no divergence"], body))
            else:
                body = [[mode_label(m), _share(m, res.policy), f"{d['mean_cos']:.6f}",
                         f"{d['min_cos']:.6f}", f"{100 * d['nn_agree']:.1f}%"]
                        for m, d in res.e2e.items()]
                md.append(_md_table(["attention", "FP4 FLOPs", "mean cos vs exact", "min cos",
                                     "nearest neighbour = exact"], body))
        if res.policy is not None:
            md += ["", _policy_section(res, args, out)]
    note = _closing_note(results, args)
    if note:
        md += ["", "## Targets and closing note", "", note]
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    summ = {"command": ["python", "-m", "fp4attn", "report", *args.argv],
                "backend": _backend_desc(args), "device": args.device,
                "models": {r.name: _summary(r) for r in results}}
    (out / "summary.json").write_text(json.dumps(summ, indent=1, default=float) + "\n")
    return text


def _share(mode: str, policy) -> str:
    x = fp4_share(mode, policy)
    return "" if x is None else f"{100 * x:.0f}%"


def _policy_section(res: ModelResult, args, out: Path) -> str:
    """The calibrated policy: what it is, per layer, and the curve along its order."""
    pol = res.policy
    cal = pol.meta["calibration"]
    lines = [f"Calibrated policy (`fp4attn.calibrate`, {cal['device_kind']} cost order, on "
             f"{pol.meta['calibration_text']}, {cal['seconds']:.0f} s): `{pol.code()}` (layer 0 "
             f"first; 4 fp4, 8 int8, b torch SDPA in the input dtype), "
             f"{100 * cal['fp4_share']:.1f}% of attention FLOPs in FP4; measured there: "
             + (f"perplexity {100 * cal['loss']:+.3f}% (budget +{100 * cal['budget']:.2f}%)"
                if cal["metric"] == "perplexity" else
                f"mean embedding cos {cal['measured']:.6f} (budget >= {1 - cal['budget']:.4f})")
             + ". Per layer, its precision and that precision's cos against exact "
             "(the report's captured calls):", ""]
    by = _by_layer(res.rows)
    method = {"fp4": "fp4attn", "int8": "int8"}
    body = []
    for layer, p in enumerate(pol.as_list()):
        r = by.get(layer, {}).get(method.get(p, ""), {})
        body.append([str(layer), p, _f(r.get("cos"), ".5f") if p in method else "exact"])
    lines.append(_md_table(["layer", "calibrated", "cos"], body))
    if res.curve:
        png = plot_curve(res, out / f"{res.name}_policy_curve.png")
        lines += ["", f"Perplexity along the calibration order ({res.curve[0]['tokens']} tokens "
                  f"of {args.book}; m moves from all FP4 towards all exact, b: torch SDPA in the "
                  "model's dtype):", ""]
        lines.append(_md_table(["m", "policy", "FP4 FLOPs", "change", "KL"], [
            [f"{c['m']}{' (calibrated)' if c['calibrated'] else ''}", f"`{c['code']}`",
             f"{100 * c['fp4_share']:.1f}%", f"{100 * c['rel_change']:+.2f}%", _f(c["kl"])]
            for c in res.curve]))
        if png:
            lines += ["", f"![perplexity vs FP4 share]({png.name})"]
    return "\n".join(lines)


def plot_curve(res: ModelResult, path: Path) -> Path | None:
    """Perplexity change against the share of attention FLOPs in FP4, along the order."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot([100 * c["fp4_share"] for c in res.curve], [100 * c["rel_change"] for c in res.curve],
            marker="o", ms=3, label="calibration order")
    for c in res.curve:
        if c["calibrated"]:
            ax.plot(100 * c["fp4_share"], 100 * c["rel_change"], "*", ms=14, mec="k",
                    label="calibrated policy")
    ax.axhline(100 * res.policy.meta["calibration"]["budget"], color="k", ls="--", lw=0.8,
               label="budget")
    ax.set_xlabel("share of attention FLOPs in FP4 (%)")
    ax.set_ylabel("perplexity change (%)")
    ax.set_title(f"{res.title.split(' (')[0]}: perplexity vs FP4 share")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _backend_desc(args) -> str:
    if args.backend == "reference":
        return "fp4attn.reference.attention (pure PyTorch, SPEC.md numerics)"
    try:
        import fp4attn

        info = fp4attn.build_info() if hasattr(fp4attn, "build_info") else {}
        return f"fp4attn.sdpa (compiled backend, build {info})" if info else "fp4attn.sdpa"
    except Exception:  # noqa: BLE001  # pragma: no cover
        return "fp4attn.sdpa"


def plot_layers(res: ModelResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    by = _by_layer(res.rows)
    layers = sorted(by)
    have = {m for r in by.values() for m in r}
    abl = [m for m in ABLATIONS + SINGLE + HALVES if m in have]
    fig, axes = plt.subplots(2 if abl else 1, 1, figsize=(9, 8 if abl else 3.8), squeeze=False)
    ax = axes[0][0]
    styles = {"fp4attn": {"color": "C3", "lw": 2.2, "marker": "o", "ms": 3},
              "int8": {"color": "C1", "lw": 1.8, "marker": "s", "ms": 3},
              "fp16": {"color": "C0", "lw": 1.2, "marker": ".", "ms": 3},
              "bf16": {"color": "C2", "lw": 1.2, "marker": ".", "ms": 3}}
    for m in MAIN_METHODS:
        if m in have:
            ys = [max(1 - by[l][m]["cos"], 1e-12) for l in layers]
            ax.semilogy(layers, ys, label=METHODS[m][0], **styles[m])
    if res.name == "smollm2":
        ax.axhline(1 - COS_TARGET, color="k", ls="--", lw=0.8, label=f"cos = {COS_TARGET}")
    ax.set_ylabel("1 - cos (vs exact)")
    ax.set_title(f"{res.title}: per-layer attention error")
    ax.legend(fontsize=8, ncol=4)
    ax.grid(alpha=0.3, which="both")
    if abl:
        ax2 = axes[1][0]
        for j, m in enumerate(abl):
            ys = [by[l][m]["rel_l1"] for l in layers]
            ls = "--" if m in SINGLE else ":" if m in HALVES else "-"
            ax2.semilogy(layers, ys, ls=ls, lw=1.2, marker=".", ms=3, color=f"C{j % 10}",
                         label=METHODS[m][0])
        ax2.set_ylabel("rel_l1 (vs exact)")
        ax2.set_title("where the error comes from (reference ablations)")
        ax2.set_xlabel("layer")
        ax2.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        ax2.grid(alpha=0.3, which="both")
    axes[0][0].set_xlabel("layer")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fp4attn report",
        description="Accuracy of FP4 attention on real models with real text (offline): "
                    "per-layer error against exact attention with ablations, LLM perplexity, "
                    "sentence-embedding similarity. Writes report.md, CSV and PNG into --out.")
    ap.add_argument("--model", choices=["smollm2", "minilm", "all"], default="all")
    ap.add_argument("--tokens", type=int, default=1024,
                    help="LLM tokens of real text whose Q/K/V are captured (default 1024)")
    ap.add_argument("--layers", default="all",
                    help="LLM layers to analyse: all, or e.g. 0-3,15,29 (default all)")
    ap.add_argument("--ppl-tokens", type=int, default=4096,
                    help="tokens for the perplexity comparison, 0 to skip (default 4096)")
    ap.add_argument("--window", type=int, default=1024, help="perplexity window (default 1024)")
    ap.add_argument("--book", default="prideprejudice", choices=list(M.BOOKS),
                    help="Austen novel for the LLM (default prideprejudice)")
    ap.add_argument("--minilm-layers", default="all", help="MiniLM layers to analyse")
    ap.add_argument("--paragraphs", type=int, default=8,
                    help="MiniLM capture batch: paragraphs of persuasion (default 8)")
    ap.add_argument("--sentences", type=int, default=128,
                    help="MiniLM sentences for the embedding comparison (default 128)")
    ap.add_argument("--ablation-tokens", type=int, default=0,
                    help="query tokens the (pure-PyTorch, slower) reference ablations see: the "
                         "causal prefix of the LLM capture; MiniLM gets twice as many "
                         "(whole paragraphs); 0 = all captured tokens (default)")
    ap.add_argument("--no-ablations", action="store_true", help="skip the reference ablations")
    ap.add_argument("--no-e2e", action="store_true", help="skip perplexity / embeddings")
    ap.add_argument("--gen-prompts", type=int, default=10,
                    help="prompts for the greedy-generation agreement (0: skip; default 10)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    ap.add_argument("--no-policy", action="store_true",
                    help="do not measure per-layer fallback policies when a target fails")
    ap.add_argument("--policy-ladder", type=lambda t: [int(x) for x in t.split(",") if x],
                    default=[16],
                    help="top-k sizes tried for the fallback policy, smallest first, stopping "
                         "at the first that meets the perplexity target (default 16)")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="skip the calibrated per-layer policy (fp4attn.calibrate) and its curve")
    ap.add_argument("--budget", type=float, default=0.01,
                    help="calibration budget: relative perplexity increase (default 0.01)")
    ap.add_argument("--minilm-budget", type=float, default=0.001,
                    help="MiniLM calibration budget: 1 - mean embedding cos (default 0.001)")
    ap.add_argument("--device-kind", default="blackwell", choices=["blackwell", "hopper"],
                    help="cost order of the calibration (default blackwell: fp4 < int8 < bf16)")
    ap.add_argument("--cal-book", default="emma", choices=list(M.BOOKS),
                    help="novel the LLM is calibrated on (default emma; --book is held out)")
    ap.add_argument("--cal-seqs", type=int, default=4, help="calibration sequences (default 4)")
    ap.add_argument("--cal-len", type=int, default=512, help="their tokens (default 512)")
    ap.add_argument("--curve-points", type=int, default=6,
                    help="assignments of the calibration order measured for the perplexity vs "
                         "FP4-share curve, 0 to skip (default 6)")
    ap.add_argument("--curve-tokens", type=int, default=1024,
                    help="tokens of --book for the curve (default 1024)")
    ap.add_argument("--backend", choices=["fp4attn", "reference"], default="fp4attn",
                    help="FP4 attention under test: the compiled fp4attn.sdpa (default) or the "
                         "pure-PyTorch reference")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--captured", type=Path, default=None,
                    help="report on Q/K/V captured by scripts/crosscheck_captured.py instead of "
                         "loading a model (for machines without the model packages)")
    ap.add_argument("--out", type=Path, default=Path("fp4attn-report"),
                    help="output folder (default ./fp4attn-report)")
    ap.add_argument("--check", action="store_true",
                    help="exit with status 1 if a target (LLM per-layer cos, perplexity) fails")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    names = ["smollm2", "minilm"] if args.model == "all" else [args.model]
    results = []
    t0 = time.perf_counter()
    try:
        if args.captured is not None:
            results.append(report_captured(args))
        for n in names if args.captured is None else []:
            results.append(report_smollm2(args) if n == "smollm2" else report_minilm(args))
    except M.MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = write_outputs(results, args, args.out)
    print(text)
    _log(f"done in {time.perf_counter() - t0:.0f}s; wrote {args.out}/report.md")
    if args.check:
        for r in results:
            s = _summary(r)
            if r.name == "smollm2" and (s.get("failing_layers") or (
                    r.e2e and r.e2e["fp4"]["rel_change"] >= PPL_TARGET)):
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
