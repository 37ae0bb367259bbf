"""CPU FP4 attention: against fp4attn.reference (same numerics, rel_l1 < 2e-3) and against exact
attention (accuracy on structured inputs), over the shape/mask/dtype matrix of SPEC 4."""

import itertools
import math

import pytest
import torch

import fp4attn
from fp4attn import reference as R

TOL = 2e-3  # SPEC 5: only accumulation order and exp rounding differ from the reference


def make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, k_bias=0.0, scale=1.0):
    q = torch.randn(B, Hq, Nq, D) * scale
    k = (torch.randn(B, Hkv, Nk, D) + k_bias) * scale
    v = torch.randn(B, Hkv, Nk, D) * scale
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_against_reference(q, k, v, **kw):
    out, lse = fp4attn.sdpa(q, k, v, enable_gqa=True, return_lse=True, **kw)
    ref, ref_lse = R.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    m = R.metrics(out.float(), ref)
    tol = TOL if q.dtype == torch.float32 else 5e-3  # output rounding to fp16/bf16
    assert m["rel_l1"] < tol, m
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-3)
    return m


LENGTHS = [1, 17, 127, 333]
HEAD_DIMS = [32, 64, 80, 128, 256]


@pytest.mark.parametrize("nq,nk", [(n, n) for n in LENGTHS] + [(17, 333), (333, 127), (1, 333)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_and_causal(nq, nk, causal):
    check_against_reference(*make_qkv(1, 2, 2, nq, nk, 64), is_causal=causal)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(d, causal):
    check_against_reference(*make_qkv(1, 2, 1, 130, 200, d), is_causal=causal)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_gqa_mqa(hq, hkv):
    check_against_reference(*make_qkv(2, hq, hkv, 140, 150, 64), is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(dtype):
    check_against_reference(*make_qkv(1, 2, 2, 200, 200, 64, dtype=dtype))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("shape", ["full", "key_padding", "per_head", "2d"])
def test_masks(kind, shape):
    B, H, Nq, Nk = 2, 3, 150, 140
    q, k, v = make_qkv(B, H, H, Nq, Nk, 64)
    sizes = {"full": (B, H, Nq, Nk), "key_padding": (B, 1, 1, Nk), "per_head": (1, H, Nq, Nk),
             "2d": (Nq, Nk)}[shape]
    keep = torch.rand(sizes) > 0.3
    mask = keep if kind == "bool" else torch.where(keep, torch.randn(sizes), float("-inf"))
    check_against_reference(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_near_the_top_of_the_float_range(dtype):
    """|V| up to 2^120 (finite FP32 / BF16): the output stays finite and agrees with the
    reference (SPEC 4.5's product order; FP4MM(P^, V^) dV alone reaches 2^19 max|V| and
    overflowed from about 2^115)."""
    torch.manual_seed(3)
    q, k, _ = make_qkv(1, 2, 2, 150, 150, 64)
    v = torch.randn(1, 2, 150, 64).clamp(-1, 1) * 2.0**120
    check_against_reference(q.to(dtype), k.to(dtype), v.to(dtype))


def test_scale_argument_is_used():
    q, k, v = make_qkv(1, 2, 2, 100, 100, 64)
    m = check_against_reference(q, k, v, scale=0.37)
    a = fp4attn.sdpa(q, k, v, scale=0.37)
    b = fp4attn.sdpa(q, k, v)
    assert not torch.allclose(a, b)
    assert m["rel_l1"] < TOL


def test_fully_masked_rows_give_zero():
    q, k, v = make_qkv(1, 1, 1, 20, 30, 32)
    mask = torch.ones(20, 30, dtype=torch.bool)
    mask[3] = False
    out, lse = fp4attn.sdpa(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.isfinite(out).all() and (out[0, 0, 3] == 0).all()
    assert lse[0, 0, 3] == -math.inf and torch.isfinite(lse[0, 0, :3]).all()


@pytest.mark.parametrize("precision", ["fp4", "int8"])
def test_3d_and_5d_inputs(precision):
    """Leading dims other than [B, H] are folded into the batch and restored, out and lse alike."""
    q, k, v = make_qkv(1, 2, 2, 40, 50, 32)
    out4, lse4 = fp4attn.sdpa(q, k, v, return_lse=True, precision=precision)
    out3, lse3 = fp4attn.sdpa(q[0], k[0], v[0], return_lse=True, precision=precision)
    assert out3.shape == (2, 40, 32) and lse3.shape == (2, 40)
    assert torch.equal(out3, out4[0]) and torch.equal(lse3, lse4[0])
    assert torch.equal(fp4attn.sdpa(q[0], k[0], v[0], precision=precision), out4[0])
    q5, k5, v5 = (t.unsqueeze(0).expand(2, *t.shape) for t in (q, k, v))
    mask = torch.rand(2, 1, 2, 40, 50, generator=torch.Generator().manual_seed(3)) > 0.3
    out5, lse5 = fp4attn.sdpa(q5, k5, v5, attn_mask=mask, return_lse=True, precision=precision)
    assert out5.shape == (2, 1, 2, 40, 32) and lse5.shape == (2, 1, 2, 40)
    for i in range(2):
        want, want_lse = fp4attn.sdpa(q, k, v, attn_mask=mask[i], return_lse=True,
                                      precision=precision)
        assert torch.equal(out5[i], want) and torch.equal(lse5[i], want_lse)


def test_noncontiguous_bnhd_layout():
    # transformers/diffusers often hand [B, N, H, D] tensors transposed to [B, H, N, D]
    q = torch.randn(2, 90, 4, 64).transpose(1, 2)
    k = torch.randn(2, 70, 4, 64).transpose(1, 2)
    v = torch.randn(2, 70, 4, 64).transpose(1, 2)
    out = fp4attn.sdpa(q, k, v)
    torch.testing.assert_close(out, fp4attn.sdpa(q.contiguous(), k.contiguous(), v.contiguous()),
                               rtol=0, atol=0)


def test_inputs_not_mutated():
    q, k, v = make_qkv(1, 2, 2, 130, 130, 64, k_bias=5.0)
    mask = torch.randn(130, 130)
    copies = [t.clone() for t in (q, k, v, mask)]
    fp4attn.sdpa(q, k, v, attn_mask=mask)
    for t, c in zip((q, k, v, mask), copies):
        assert torch.equal(t, c)


# ---- accuracy against exact attention on structured inputs (report the metrics) -------------

def accuracy(q, k, v, **kw):
    out = fp4attn.sdpa(q, k, v, **kw)
    return R.metrics(out.float(), R.exact_attention(q, k, v, **kw))


def test_accuracy_key_bias_is_smoothed_away():
    torch.manual_seed(1)
    base = accuracy(*make_qkv(1, 4, 4, 512, 512, 64))
    biased = accuracy(*make_qkv(1, 4, 4, 512, 512, 64, k_bias=20.0))
    print(f"\nunbiased K: {base}\nK + 20 channel bias: {biased}")
    assert base["cos"] > 0.97
    assert biased["cos"] > base["cos"] - 0.005  # same accuracy: smoothing removes the bias


def test_accuracy_independent_of_input_scale():
    torch.manual_seed(2)
    q, k, v = make_qkv(1, 4, 4, 256, 256, 64)
    unit = accuracy(q, k, v)
    # scale Q and K by 1e-3 and compensate in `scale`, and V by 1e-3: same attention map
    small = fp4attn.sdpa(q * 1e-3, k * 1e-3, v * 1e-3, scale=1e6 / 8.0)
    ref_small = R.exact_attention(q * 1e-3, k * 1e-3, v * 1e-3, scale=1e6 / 8.0)
    small_m = R.metrics(small, ref_small)
    print(f"\nunit scale: {unit}\n1e-3 scale: {small_m}")
    assert abs(small_m["cos"] - unit["cos"]) < 1e-3
    assert small_m["rel_l1"] < unit["rel_l1"] * 1.05


def test_accuracy_peaked_attention():
    # A realistic, peaked attention map (queries aligned with some keys) is far more accurate
    # than the Gaussian worst case.
    torch.manual_seed(3)
    k = torch.randn(1, 2, 512, 64)
    q = k[:, :, torch.randint(0, 512, (512,))] * 2 + 0.3 * torch.randn(1, 2, 512, 64)
    v = torch.randn(1, 2, 512, 64)
    m = accuracy(q, k, v, is_causal=False)
    print(f"\npeaked: {m}")
    assert m["cos"] > 0.995


@pytest.mark.parametrize("causal,masked", list(itertools.product([False, True], [False, True])))
def test_accuracy_vs_exact(causal, masked):
    q, k, v = make_qkv(1, 2, 2, 300, 300, 64)
    mask = (torch.rand(300, 300) > 0.2) if masked and not causal else None
    m = accuracy(q, k, v, attn_mask=mask, is_causal=causal)
    assert m["cos"] > 0.97, m


# ---- V smoothing (SPEC 4.3): V - vbar is quantized, vbar added back to every visible row ----


def _v_with_offset(B, Hkv, Nk, D, offset, seed):
    g = torch.Generator().manual_seed(seed)
    common = offset * torch.randn(B, Hkv, 1, D, generator=g)  # one offset per channel, all keys
    return torch.randn(B, Hkv, Nk, D, generator=g) + common


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2)])
def test_v_smoothing_removes_a_common_offset(hq, hkv):
    """A V whose channels share a large offset (10 std): the C backend's error against float64
    attention is a fraction of the unsmoothed SPEC's (the reference with smooth_v=False), and it
    agrees with the reference (which computes vbar over the KV head's G query heads)."""
    torch.manual_seed(40)
    q, k, _ = make_qkv(2, hq, hkv, 200, 300, 64, k_bias=0.5)
    v = _v_with_offset(2, hkv, 300, 64, 10.0, seed=41)
    exact = R.exact_attention(q, k, v, is_causal=True)
    out = fp4attn.sdpa(q, k, v, is_causal=True, enable_gqa=True)
    unsmoothed = R.attention(q, k, v, is_causal=True, smooth_v=False)
    err = R.metrics(out, exact)["rel_l1"]
    assert err < 0.25 * R.metrics(unsmoothed, exact)["rel_l1"], err
    assert R.metrics(out, R.attention(q, k, v, is_causal=True))["rel_l1"] < 1e-4


def test_v_smoothing_masked_rows_zero_lse_unchanged():
    """Rows that see no key stay exactly 0 (vbar is not added), the others get vbar; the LSE is
    the unsmoothed one (V smoothing does not touch the scores)."""
    torch.manual_seed(42)
    q, k, _ = make_qkv(1, 4, 2, 60, 90, 64)
    v = _v_with_offset(1, 2, 90, 64, 8.0, seed=43)
    mask = torch.rand(1, 4, 60, 90) > 0.4
    mask[:, :, 5] = False
    out, lse = fp4attn.sdpa(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    assert torch.all(lse[:, :, 5] == -math.inf)
    _, lse0 = R.attention(q, k, v, attn_mask=mask, return_lse=True, smooth_v=False)
    finite = torch.isfinite(lse0)
    torch.testing.assert_close(lse[finite], lse0[finite], rtol=1e-4, atol=1e-3)
    assert R.metrics(out, R.attention(q, k, v, attn_mask=mask))["rel_l1"] < 1e-4
    # causal, more queries than keys: rows past the keys see none (top-left aligned)
    q2, k2 = torch.randn(1, 2, 40, 64), torch.randn(1, 1, 24, 64)
    v2 = _v_with_offset(1, 1, 24, 64, 5.0, seed=44)
    o2 = fp4attn.sdpa(q2, k2, v2, attn_mask=torch.ones(40, 24, dtype=torch.bool).tril(-20),
                      enable_gqa=True)
    assert torch.equal(o2[:, :, :20], torch.zeros_like(o2[:, :, :20]))
    assert torch.isfinite(o2).all() and o2[:, :, 20:].abs().min() > 0


def test_v_smoothing_nonfinite_scores_fall_back():
    """Scores that overflow float32 (qm . K = inf) make vbar 0 in every channel (no smoothing):
    that head's output is what the unsmoothed SPEC gives (in float32 such keys overflow its
    attention too: NaN there either way), and the other heads keep their own vbar, bit for bit."""
    q = torch.cat([torch.full((1, 1, 16, 16), 1e30), torch.randn(1, 1, 16, 16)], dim=1)
    k = torch.cat([torch.full((1, 1, 32, 16), 1e30), torch.randn(1, 1, 32, 16)], dim=1)
    v = torch.randn(1, 2, 32, 16) + 3.0
    vbar = R.v_mean(q[:, :1].mean(2, keepdim=True), torch.tensor([16.0]), k[:, :1], v[:, :1], 16, 0.25)
    assert torch.equal(vbar, torch.zeros_like(vbar))
    out = fp4attn.sdpa(q, k, v)
    ref = R.attention(q[:, :1], k[:, :1], v[:, :1], smooth_v=False)
    assert torch.equal(torch.isnan(out[:, :1]), torch.isnan(ref))
    assert torch.equal(out[:, :1].nan_to_num(), ref.nan_to_num())
    ordinary = R.attention(q[:, 1:], k[:, 1:], v[:, 1:])  # smoothed, finite
    assert torch.isfinite(ordinary).all()
    torch.testing.assert_close(out[:, 1:], ordinary, rtol=0, atol=1e-5)
