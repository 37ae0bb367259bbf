"""The FP4 reference's V smoothing variants and options (issue 35 item 1; docs/accuracy.md "V
smoothing for FP4"): ``smooth_v`` (SPEC 4.3's mean-query weighted vbar by default; off, V's key
mean or its first key for the study) and ``quantized_rowsum`` (l summed from the quantized P^, not
SPEC). The default is the weighted form, V smoothing is exact where it must be (no quantization;
a V whose smoothed values are 0), masked rows stay 0 and the LSE is unchanged; and the study's
plumbing (report modes, fp4attn.eval.fp4_variants helpers) works. CPU only, small sizes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fp4attn import reference as R
from fp4attn.eval import fp4_variants as FV
from fp4attn.eval import report as RP

NO_QUANT = dict(quantize_q=False, quantize_k=False, quantize_v=False, quantize_p=False)
SMOOTHINGS = (True, "mean", "first", "weighted")


def _inputs(Nq=150, Nk=200, D=64, dtype=torch.float32, seed=0, v_offset=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, Nq, D, generator=g)
    k = torch.randn(2, 2, Nk, D, generator=g) + 0.5  # GQA 4 / 2, a key mean to smooth
    v = torch.randn(2, 2, Nk, D, generator=g) + v_offset * torch.randn(2, 2, 1, D, generator=g)
    return [t.to(dtype) for t in (q, k, v)]


def _mask(Nq, Nk, seed=3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, 1, Nq, Nk, generator=g) > 0.3
    mask[:, :, 7] = False  # a row that sees no key
    return mask


@pytest.mark.parametrize("case", ["causal", "mask_fp16", "one_level_p"])
def test_default_is_weighted_v_smoothing(case):
    dtype = torch.float16 if case == "mask_fp16" else torch.float32
    q, k, v = _inputs(dtype=dtype)
    kw = dict(attn_mask=_mask(q.shape[2], k.shape[2]) if case == "mask_fp16" else None,
              is_causal=case != "mask_fp16", two_level_p=case != "one_level_p", return_lse=True)
    base = R.attention(q, k, v, **kw)
    explicit = R.attention(q, k, v, **kw, smooth_v="weighted", quantized_rowsum=False)
    for a, b in zip(base, explicit):
        assert torch.equal(a, b)
    assert not torch.equal(base[0], R.attention(q, k, v, **kw, smooth_v=False)[0])


@pytest.mark.parametrize("smooth", SMOOTHINGS)
@pytest.mark.parametrize("rowsum", [False, True])
def test_exact_without_quantization(smooth, rowsum):
    """softmax(S) (V - vbar) + vbar = softmax(S) V: with no quantization, V smoothing (and the
    row sum of the unquantized P) is exact attention up to float32 rounding."""
    q, k, v = _inputs(v_offset=5.0)
    exact = R.exact_attention(q, k, v, is_causal=True)
    plain = R.attention(q, k, v, is_causal=True, **NO_QUANT)
    out = R.attention(q, k, v, is_causal=True, **NO_QUANT, smooth_v=smooth,
                      quantized_rowsum=rowsum)
    assert (out - exact).abs().max() < 1e-5
    assert (out - plain).abs().max() < 1e-5


@pytest.mark.parametrize("smooth", ["mean", "first", "weighted"])
def test_smoothed_v_of_zeros_is_exact_through_fp4(smooth):
    """V whose rows are all one vector c: V - vbar = 0 exactly (c dyadic, 64 keys, so its mean is
    exact), the FP4 P.V adds 0 and the output is c exactly in every visible row, where the SPEC's
    FP4 V^ is off by its rounding of c. (The weighted vbar is c times a float32 sum of softmax
    weights, so there V - vbar is only nearly 0.)"""
    q, k, _ = _inputs(Nq=70, Nk=64)
    g = torch.Generator().manual_seed(5)
    c = torch.randint(-40, 41, (2, 2, 1, 64), generator=g).float() / 8.0 + 0.1  # not FP4-exact
    c = (c * 1024).round() / 1024  # dyadic: the mean of 64 copies is exact in float32
    v = c.expand(2, 2, 64, 64).contiguous()
    want = c.repeat_interleave(2, dim=1).expand(2, 4, 70, 64)
    out = R.attention(q, k, v, is_causal=True, smooth_v=smooth)
    if smooth == "weighted":
        assert (out - want).abs().max() < 1e-5
    else:
        assert torch.equal(out, want)
    unsmoothed = R.attention(q, k, v, is_causal=True, smooth_v=False)
    assert (unsmoothed - want).abs().max() > 1e-3


@pytest.mark.parametrize("smooth", SMOOTHINGS)
def test_masked_rows_zero_and_lse_unchanged(smooth):
    q, k, v = _inputs(v_offset=3.0)
    mask = _mask(q.shape[2], k.shape[2])
    out, lse = R.attention(q, k, v, mask, return_lse=True, smooth_v=smooth)
    _, lse0 = R.attention(q, k, v, mask, return_lse=True, smooth_v=False)
    assert torch.equal(out[:, :, 7], torch.zeros_like(out[:, :, 7]))
    assert torch.all(lse[:, :, 7] == -math.inf)
    assert torch.equal(lse, lse0)  # V smoothing does not touch the scores
    assert torch.isfinite(out).all()
    # causal with more queries than keys: rows past the keys see none (top-left aligned)
    q2 = torch.randn(1, 2, 40, 64)
    k2, v2 = torch.randn(1, 1, 24, 64), torch.randn(1, 1, 24, 64) + 2.0
    o2 = R.attention(q2, k2, v2, attn_mask=torch.ones(40, 24, dtype=torch.bool).tril(-20),
                     smooth_v=smooth)
    assert torch.equal(o2[:, :, :20], torch.zeros_like(o2[:, :, :20]))


def test_smoothing_removes_a_channel_offset():
    """Channels with a large offset (|mean| ~ 10 std) waste the FP4 V blocks' range; V smoothing
    quantizes only the variation."""
    q, k, v = _inputs(v_offset=10.0)
    exact = R.exact_attention(q, k, v, is_causal=True)
    cos = {s: R.metrics(R.attention(q, k, v, is_causal=True, smooth_v=s), exact)["cos"]
           for s in (False, "mean")}
    assert 1 - cos["mean"] < 0.5 * (1 - cos[False])


def test_quantized_rowsum_is_a_convex_combination():
    """With l summed from P^, O = sum P^ V / sum P^: a V of identical FP4-exact rows comes out
    unchanged up to float32 rounding, where the SPEC's l (unquantized P) scales it by
    sum P^ / sum P~."""
    q, k, _ = _inputs(Nq=100, Nk=256)
    v = torch.ones(2, 2, 256, 64)
    spec = R.attention(q, k, v, is_causal=True, smooth_v=False)  # smoothing would hide it
    out = R.attention(q, k, v, is_causal=True, smooth_v=False, quantized_rowsum=True)
    assert (out - 1).abs().max() < 1e-5
    assert (spec - 1).abs().max() > 1e-3
    for two_level in (True, False):  # without P quantized it is the SPEC's l, up to rounding
        a = R.attention(q, k, v, is_causal=True, quantize_p=False, two_level_p=two_level,
                        smooth_v=False)
        b = R.attention(q, k, v, is_causal=True, quantize_p=False, two_level_p=two_level,
                        smooth_v=False, quantized_rowsum=True)
        assert (a - b).abs().max() < 1e-5


def test_bad_smooth_v():
    q, k, v = _inputs(Nq=16, Nk=16)
    with pytest.raises(ValueError, match="smooth_v"):
        R.attention(q, k, v, smooth_v="median")


def test_report_variant_modes_and_helpers():
    q, k, v = _inputs(Nq=70, Nk=70)
    for name, flags in (("smooth_v", {"smooth_v": "mean"}),
                        ("smooth_v_first", {"smooth_v": "first"}),
                        ("smooth_v_weighted", {"smooth_v": "weighted"}),
                        ("quantized_rowsum", {"quantized_rowsum": True})):
        with RP.attention_mode(None, f"variant:{name}", "reference"):
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.equal(got, R.attention(q, k, v, is_causal=True, **flags))
    assert set(FV.VARIANTS + FV.DIAGNOSTICS + FV.P_DIAGNOSTICS) <= set(RP.METHODS)

    # key-0 mass: uniform scores (q = 0), causal: row i puts 1 / (i + 1) on key 0
    n = 32
    call = RP.AttnCall(0, torch.zeros(1, 2, n, 16), torch.randn(1, 1, n, 16),
                       torch.randn(1, 1, n, 16), None, True, None, True)
    want = sum(1 / (i + 1) for i in range(n)) / n
    assert math.isclose(FV.key0_mass(call), want, rel_tol=1e-9)
    call.v = torch.ones(1, 1, n, 16)
    assert math.isclose(FV.v_offset(call), 1.0)

    rows = [{"model": "m", "layer": i, "method": m, "cos": c, "rel_l1": 0.0}
            for i, cs in enumerate([(0.98, 0.985, 0.97), (0.995, 0.99, 0.999)])
            for m, c in zip(FV.V_CHOICES, cs)]
    best = FV.best_per_layer(rows)
    assert [(r["choice"], r["cos"]) for r in best] == [("smooth_v", 0.985),
                                                       ("smooth_v_first", 0.999)]
    s = FV.summarise(rows + best, "best_v_per_layer")
    assert s["worst_cos"] == 0.985 and s["layers_below"] == 1 and s["layers_better"] == 2
    assert math.isclose(s["sum_err_vs_ref"], (0.015 + 0.001) / (0.02 + 0.005))
