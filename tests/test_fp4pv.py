"""The "fp4pv" study precision (``reference.attention_fp4pv`` = ``attention(..., qk="int8")``):
QK^T as SPEC_INT8 2.1-2.3 computes it, P.V as SPEC 4.3 and 4.5-4.6 (docs/accuracy.md "fp4pv").

Checked against independent compositions: its scores are SPEC_INT8's dequantized scores (built
here from ``psi`` and ``channel_migration``, with P and V left unquantized, exact softmax in
float64); its P.V path is the FP4 reference's on the same scores (inputs whose INT8 codes are
exact, so that both paths see bit-identical scores); and it is neither precision in full.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp4attn import reference as R
from fp4attn import reference_int8 as R8


def _qkv(B=1, Hq=4, Hkv=2, Nq=200, Nk=200, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g) + 0.5
    k[..., 3] *= 8.0  # a channel outlier, so that the migration does something
    v = torch.randn(B, Hkv, Nk, D, generator=g) + 2.0
    return q, k, v


def _int8_scores(q, k, scale):
    """SPEC_INT8 2.1-2.3 written out: K smoothed, channels migrated, Q' per 64 rows and Ks' per
    128 keys through psi, S = float(Q^ K^T) * ((sQ sK) * scale): float32 [B, Hq, Nq, Nk]."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kbar = k.mean(dim=2, keepdim=True)
    s = R8.channel_migration(q, k, kbar, G)
    qm = q * s.repeat_interleave(G, dim=1)
    ks = (k - kbar) / s
    S = torch.empty(B, Hq, Nq, Nk)
    for i0 in range(0, Nq, 64):
        qc, sq = R8.psi(qm[:, :, i0:i0 + 64], (2, 3))  # [B, Hq, rows, D], [B, Hq, 1, 1]
        for j0 in range(0, Nk, 128):
            kc, sk = R8.psi(ks[:, :, j0:j0 + 128], (2, 3))
            kc, sk = kc.repeat_interleave(G, dim=1), sk.repeat_interleave(G, dim=1)
            acc = (qc.double() @ kc.double().transpose(-1, -2)).float()
            S[:, :, i0:i0 + 64, j0:j0 + 128] = acc * ((sq * sk) * scale)
    return S


@pytest.mark.parametrize("causal", [False, True])
def test_scores_are_int8_dequantized_scores(causal):
    """With P and V unquantized and no V smoothing, fp4pv is softmax(S_int8) V."""
    q, k, v = _qkv(Nq=200, Nk=200)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = R.attention(q, k, v, is_causal=causal, qk="int8", quantize_p=False, quantize_v=False,
                      smooth_v=False)
    S = _int8_scores(q, k, scale).double()
    if causal:
        S = S.masked_fill(~torch.ones(200, 200, dtype=torch.bool).tril(), -math.inf)
    want = torch.softmax(S, dim=-1) @ v.double().repeat_interleave(2, dim=1)
    assert (out.double() - want).abs().max().item() < 2e-5
    # and they are not the FP4 scores: the same path with FP4 QK^T is far from it
    fp4 = R.attention(q, k, v, is_causal=causal, quantize_p=False, quantize_v=False,
                      smooth_v=False)
    assert (fp4.double() - want).abs().max().item() > 1e-3


def _exact_int8_inputs(seed=1, D=64):
    """Integer Q and K whose SPEC_INT8 codes are the values themselves (every 64-row Q block,
    128-key K block and channel has amax 127, kbar = 0 exactly: K's rows come in +- pairs, so
    the migration factors are 1 and every scale 1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-126, 127, (1, 4, 256, D), generator=g).float()
    q[:, :, ::64] = 127.0
    a = torch.randint(-126, 127, (1, 2, 128, D), generator=g).float()
    a[:, :, 0] = 127.0
    k = torch.cat([a, -a], dim=2)
    v = torch.randn(1, 2, 256, D, generator=g) + 1.5
    return q, k, v


@pytest.mark.parametrize("mask", [None, "causal", "padding"])
def test_pv_path_is_the_fp4_reference_on_the_same_scores(mask):
    """On inputs whose INT8 quantization is exact, the INT8 scores are exactly scale * Q K^T,
    which the FP4 reference computes bit for bit with Q/K smoothing and quantization off: from
    there both run SPEC 4.3 / 4.5-4.6 (vbar from the same Q and K), so outputs and LSE agree."""
    q, k, v = _exact_int8_inputs()
    scale = 2.0 ** -14  # a power of two: scale * (integer product) is exact in float32
    kw = {}
    if mask == "causal":
        kw["is_causal"] = True
    elif mask == "padding":
        m = torch.ones(1, 1, 256, 256, dtype=torch.bool)
        m[..., 230:] = False
        kw["attn_mask"] = m
    # the premise: SPEC_INT8's scores are the exact integer products
    S8 = _int8_scores(q, k, scale)
    exact = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)) * scale
    assert torch.equal(S8.double(), exact)
    out, lse = R.attention_fp4pv(q, k, v, scale=scale, return_lse=True, **kw)
    ref, ref_lse = R.attention(q, k, v, scale=scale, smooth_q=False, smooth_k=False,
                               quantize_q=False, quantize_k=False, return_lse=True, **kw)
    assert torch.equal(out, ref)
    assert torch.equal(lse, ref_lse)


def test_neither_full_precision():
    """fp4pv differs from FP4 and from INT8 attention, and sits between them against exact."""
    q, k, v = _qkv(Nq=256, Nk=256, seed=2)
    ex = R.exact_attention(q, k, v, is_causal=True)
    pv = R.attention_fp4pv(q, k, v, is_causal=True)
    fp4 = R.attention(q, k, v, is_causal=True)
    int8, _ = R8.attention_forward(q, k, v, is_causal=True)
    assert not torch.equal(pv, fp4) and not torch.equal(pv, int8)
    c = {n: R.metrics(o, ex)["cos"] for n, o in (("pv", pv), ("fp4", fp4), ("int8", int8))}
    assert c["fp4"] < c["pv"] < c["int8"], c
    # its P.V half is FP4's: far from INT8 attention, not a rounding away from it (here 2.8x
    # INT8's own error with FP8 P.V, 3.5x with INT8 P.V)
    assert R.metrics(pv, int8)["rel_l1"] > 2.5 * R.metrics(int8, ex)["rel_l1"]


def test_lse_is_the_int8_lse():
    """Same scores and the same unquantized row sums exp(S - t) as SPEC_INT8's INT8 P.V
    (pv="int8"): the same LSE, bit for bit (V and P quantization do not enter it); within FP32
    rounding of the spec's (its l sums 448 exp(S - m_new)); near the true LSE."""
    q, k, v = _qkv(Nq=130, Nk=300, seed=3)
    _, lse = R.attention_fp4pv(q, k, v, return_lse=True)
    assert torch.equal(lse, R8.attention_forward(q, k, v, pv="int8")[1])
    assert (lse - R8.attention_forward(q, k, v)[1]).abs().max() < 1e-5
    s = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)) / 8.0
    assert (lse.double() - torch.logsumexp(s, dim=-1)).abs().max().item() < 0.2


def test_validation():
    q, k, v = _qkv(Nq=16, Nk=16)
    with pytest.raises(ValueError, match="qk must be"):
        R.attention(q, k, v, qk="fp8")
    with pytest.raises(ValueError, match="block_kv=128"):
        R.attention(q, k, v, qk="int8", block_kv=64)


def test_study_site_attention_is_attention_fp4pv():
    """The calibration study's fp4pv call site (``fp4pv.attention_fn``) computes
    ``reference.attention_fp4pv`` and returns the input's dtype."""
    from fp4attn.eval import fp4pv as FP

    q, k, v = _qkv(Nq=64, Nk=96)
    got = FP.attention_fn("fp4pv")(q, k, v, None, 0.0, True, None, True)
    assert got.dtype == q.dtype
    assert torch.equal(got, R.attention_fp4pv(q, k, v, is_causal=True).to(q.dtype))
