"""SPEC_INT8 2.2 and 2.4-2.5's P.V in the reference (fp4attn.reference_int8): the spec's 16-bit
P.V (pv="16bit") and the FP8 P.V it replaced (pv="fp8", a study variant now) against an
independent float64 evaluation of each definition and against exact attention, masks and hidden
rows; V as two e4m3 terms (psi_e4m3_pair) against a float64 model; the FP8 study variants; and
pv="int8" as the INT8 P.V before them, bit for bit. CPU only, small sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp4attn.reference as R
import fp4attn.reference_int8 as R8
from fp4attn.eval import report as RP


def _inputs(Nq=150, Nk=300, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, Nq, D, generator=g)
    k = torch.randn(2, 2, Nk, D, generator=g) + 0.5  # a key mean to smooth; GQA 4 / 2
    v = torch.randn(2, 2, Nk, D, generator=g)
    return q, k, v


def _e4m3_model(x: np.ndarray) -> np.ndarray:
    """Round float32 values (|x| <= 448) to e4m3 with fp4attn.reference's bit-level encoder (not
    torch's float8 cast, which the reference uses), sign restored."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    mag = R.e4m3_decode(R.e4m3_encode_sat(t))
    return torch.where(t < 0, -mag, mag).numpy()


def _pair_model(x: np.ndarray):
    """psi_e4m3_pair of one group (float32 array) in numpy float32 (IEEE, correctly rounded) and
    float64: (y, V~, y - V~ exact in float64, R, sV)."""
    x = x.astype(np.float32)
    amax = np.abs(x).max()
    with np.errstate(divide="ignore", over="ignore"):
        r = np.float32(448.0) / amax
    if np.isinf(r):
        z = np.zeros_like(x)
        return z, z, z.astype(np.float64), z, np.float32(0.0)
    sv = amax / np.float32(448.0)
    y = x * r
    hi = _e4m3_model(np.clip(y, -448.0, 448.0))
    d = y.astype(np.float64) - hi.astype(np.float64)
    return y, hi, d, _e4m3_model(d.astype(np.float32)), sv


def test_v_pair_against_a_float64_model():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, 8, generator=g) * torch.logspace(-3, 3, 8)  # channel scales 1e-3..1e3
    x[0, :128, 0] = 0.0  # a zero group
    x[0, 128:, 1] = 1e-39 * torch.sign(x[0, 128:, 1])  # amax < 448 / FLT_MAX: r = inf, flushed
    x[1, :128, 2] *= torch.logspace(-9, 0, 128)  # values down to e4m3's subnormals (2^-9 of 448)
    x[2, :128, 3] = torch.rand(128, generator=g) * 400  # amax 448: r = 1, y = x, with ties
    x[2, :6, 3] = torch.tensor([448.0, 1.0625, 304.0, -3 * 2.0**-11, 2.0**-10, 447.0])
    x[2, :128, 4] = 0.6 + 1e-4 * torch.arange(128.0)  # y in [256, 448]: |y - V~| up to 16
    xb = R8._blocks(x[:, None], 128)  # [3, 1, 2, 128, 8]: one group per (row, block, channel)
    hi, lo, sv = R8.psi_e4m3_pair(xb, (3,))
    assert hi.shape == lo.shape == xb.shape and sv.shape == (3, 1, 2, 1, 8)
    assert torch.equal(hi, R8._e4m3(hi)) and torch.equal(lo, R8._e4m3(lo))
    worst = 0.0
    for b in range(3):
        for blk in range(2):
            for c in range(8):
                y, mhi, d, mlo, msv = _pair_model(xb[b, 0, blk, :, c].numpy())
                assert np.array_equal(hi[b, 0, blk, :, c].numpy(), mhi), (b, blk, c)
                assert np.array_equal(lo[b, 0, blk, :, c].numpy(), mlo), (b, blk, c)
                assert sv[b, 0, blk, 0, c].item() == msv
                assert np.array_equal(d, (y - mhi).astype(np.float64))  # y - V~ exact in FP32
                assert np.abs(d).max() <= 16.0 and np.abs(mlo).max() <= 16.0
                deq = (mhi.astype(np.float64) + mlo) * np.float64(msv)
                assert np.array_equal(mhi + mlo, mhi.astype(np.float64) + mlo)  # exact in FP32
                xs = xb[b, 0, blk, :, c].double().numpy()
                if msv == 0:  # flushed: |x| < 448 / FLT_MAX, or 0
                    assert not deq.any() and np.abs(xs).max() < 448 / 3.4e38
                    continue
                # |y - (V~ + R)| = |d - e4m3(d)| <= 2^-4 |d| + 2^-10, |d| <= 2^-4 |y| + 2^-10;
                # y sV = x (1 + 3 FP32 roundings)
                err = np.abs(deq - xs)
                bound = (2.0**-8 * 1.07 * np.abs(xs) + 2.0**-9 * msv) + 2.0**-21 * np.abs(xs)
                assert (err <= bound).all(), (b, blk, c)
                worst = max(worst, float((err / (np.abs(xs).max() + 1e-300)).max()))
    assert hi[0, 0, 0, :, 0].abs().max() == 0 and sv[0, 0, 0, 0, 0] == 0  # the zero group
    assert (hi[0, 0, 1, :, 1] == 0).all() and (lo[0, 0, 1, :, 1] == 0).all()
    assert sv[0, 0, 1, 0, 1] == 0
    assert ((hi.abs().amax(dim=3, keepdim=True) == 448.0) | (sv == 0)).all()
    assert 2.0**-12 < worst < 2.0**-9  # of the group's amax (one e4m3 term: 2^-4.8, INT8 2^-8)
    assert hi[2, 0, 0, :6, 3].tolist() == [448.0, 1.0, 320.0, -2.0**-9, 0.0, 448.0]  # to even
    # NaN propagates through its group only
    xn = xb.clone()
    xn[1, 0, 0, 3, 5] = math.nan
    hn, ln, sn = R8.psi_e4m3_pair(xn, (3,))
    assert hn[1, 0, 0, :, 5].isnan().all() and sn[1, 0, 0, 0, 5].isnan()
    assert torch.equal(hn[1, 0, 1], hi[1, 0, 1]) and torch.equal(ln[0], lo[0])
    # lo_scale (pv="fp8-r16"): the residual rounded at 16x, nearer y where R is subnormal
    h16, l16, s16 = R8.psi_e4m3_pair(xb, (3,), 16.0)
    assert torch.equal(h16, hi) and torch.equal(s16, sv)
    assert torch.equal(16 * l16, R8._e4m3(16 * l16))
    y = xb * torch.where(sv == 0, 0.0, R8._div_rn(448.0, xb.abs().amax(dim=3, keepdim=True)))
    sub = (y - hi).abs() < 2.0**-6  # R subnormal in e4m3
    assert sub.sum() > 50 and torch.equal((y - h16 - l16)[~sub], (y - hi - lo)[~sub])
    assert (y - h16 - l16)[sub].abs().sum() < 0.5 * (y - hi - lo)[sub].abs().sum()


def _forward_model(q, k, v, attn_mask=None, is_causal=False, pv="16bit", scale=None):
    """SPEC_INT8 2.4-2.5 evaluated independently of attention_forward's loop: the reference's
    scores (SPEC_INT8 2.3, shared), W in float32 as the definition writes it, O and l summed in
    float64. pv="16bit" (the spec): V16 and P16 = W in FP16 for FP16 inputs, else BF16 (FP32
    inputs rounded); "fp8": V~ and R from _pair_model, P~ by fp4attn.reference's e4m3 encoder;
    "p-e4m3" (no spec, the regression to catch): V16 with P~ = e4m3(W)."""
    B, Hq, Nq, D = q.shape
    Nk, G = k.shape[2], q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    q32, k32, v32 = q.float(), k.float(), v.float()
    ops = R8._Quantized(q32, k32, v32, G)
    allowed, additive = R8._mask_bias(attn_mask, is_causal, (B, Hq, Nq, Nk), q.device)
    t16 = torch.float16 if v.dtype == torch.float16 else torch.bfloat16
    vh = np.zeros((B, k.shape[1], Nk, D))
    svs = np.ones((B, k.shape[1], -(-Nk // 128), D))
    if pv in ("16bit", "p-e4m3"):
        vh = v.to(t16).double().numpy()
    else:
        for b in range(B):
            for h in range(k.shape[1]):
                for j in range(0, Nk, 128):
                    for c in range(D):
                        _, hi, _, lo, sv = _pair_model(v32[b, h, j:j + 128, c].numpy())
                        vh[b, h, j:j + 128, c] = hi.astype(np.float64) + lo
                        svs[b, h, j // 128, c] = sv
    vh = torch.from_numpy(vh).repeat_interleave(G, 1)
    svs = torch.from_numpy(svs).repeat_interleave(G, 1)
    m = torch.full((B, Hq, Nq), -math.inf)
    o = torch.zeros(B, Hq, Nq, D, dtype=torch.float64)
    l = torch.zeros(B, Hq, Nq, dtype=torch.float64)
    for j in range(-(-Nk // 128)):
        j0, j1 = j * 128, min(j * 128 + 128, Nk)
        s = ops.scores(j, scale, allowed, additive)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp((m - m_new).double()).nan_to_num(0.0)  # -inf - -inf: no key yet
        w = 448.0 * torch.exp(s - m_new.nan_to_num(0.0, neginf=0.0)[..., None])  # float32
        p = (w.to(t16) if pv == "16bit" else R.e4m3_decode(R.e4m3_encode_sat(w))).double()
        o = alpha[..., None] * o + (p @ vh[:, :, j0:j1]) * svs[:, :, j, None]
        l = alpha * l + w.double().sum(dim=-1)
        m = m_new
    seen = l > 0
    out = torch.where(seen[..., None], o / l.clamp(min=1e-300)[..., None], 0.0)
    shift = R8._lse_shift(q32, ops.kbar, G, scale).double()
    lse = torch.where(seen, m.double() + torch.log(l) - math.log(448.0) + shift, -math.inf)
    return out, lse


@pytest.mark.parametrize("pv, dtype", [("16bit", torch.float32), ("16bit", torch.bfloat16),
                                       ("16bit", torch.float16), ("fp8", torch.float32)])
@pytest.mark.parametrize("case", ["plain", "causal", "mask"])
def test_forward_is_the_definition_and_near_exact(case, pv, dtype):
    """Against the independent float64 evaluation: SPEC_INT8 4's kernel tolerances, with room
    to spare (only FP32 rounding separates them). For the 16-bit P.V, P alone rounded to e4m3
    (V16 kept) is >100x further off the definition. Against exact attention: cos >= 0.999 (this
    case's INT8 QK^T and 16- or 8-bit P give ~0.9998), and the lse within SPEC_INT8 4's 1e-3 of
    exact softmax on the same (INT8) scores (l sums the unquantized W). Causal: row 0 sees one
    key; the mask: partially hidden rows, a row with no visible key (0 and -inf), and rows that
    see only the first or only the last key step."""
    q, k, v = (t.to(dtype) for t in _inputs(Nq=100, Nk=300, seed=1))
    kw = {"is_causal": case == "causal"}
    if case == "mask":
        g = torch.Generator().manual_seed(2)
        kw["attn_mask"] = mask = torch.rand(2, 1, 100, 300, generator=g) > 0.5
        mask[:, :, 5] = False  # no visible key
        mask[:, :, 9, 128:] = False  # step 0 only
        mask[:, :, 11, :256] = False  # step 2 only
    out, lse = R8.attention_forward(q, k, v, **kw, pv=pv)
    want, want_lse = _forward_model(q, k, v, **kw, pv=pv)
    hidden = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), hidden) and (lse[hidden] == -math.inf).all()
    assert hidden.any() == (case == "mask") and (out[hidden] == 0).all()
    assert R.metrics(out, want.float())["rel_l1"] < 2e-6  # SPEC_INT8 4: 2e-3
    assert (lse.double() - want_lse)[~hidden].abs().max() < 1e-5  # SPEC_INT8 4: 1e-3
    if pv == "16bit":  # P rounded to e4m3 (the FP8 P.V's P) would be far off the definition
        p8 = _forward_model(q, k, v, **kw, pv="p-e4m3")[0]
        assert R.metrics(p8, want)["rel_l1"] > 100 * R.metrics(out, want.float())["rel_l1"]
        assert R.metrics(p8, want)["rel_l1"] > 100 * 2e-6
    q, k, v = q.float(), k.float(), v.float()
    exact = R.exact_attention(q, k, v, kw.get("attn_mask"), kw["is_causal"], enable_gqa=True)
    assert R.metrics(out, exact)["cos"] > 0.999
    ops = R8._Quantized(q, k, v, 2)
    allowed, additive = R8._mask_bias(kw.get("attn_mask"), kw["is_causal"], (2, 4, 100, 300),
                                      q.device)
    s = torch.cat([ops.scores(j, 1 / 8, allowed, additive) for j in range(3)], dim=-1)
    lse_s = torch.logsumexp(s.double(), dim=-1) + R8._lse_shift(q, ops.kbar, 2, 1 / 8).double()
    assert (lse.double() - lse_s)[~hidden].abs().max() < 1e-3


@pytest.mark.parametrize("pv", ["16bit", "fp8"])
def test_hidden_rows_and_steps(pv):
    """Rows with no visible key give 0 and -inf (boolean and additive masks, also fully hidden
    heads); rows hidden for whole key steps (row 9 after step 0, row 11 before step 2, every row
    after step 0 when causal) add nothing there; no NaN anywhere; the model agrees on every
    visible row."""
    q, k, v = _inputs(Nq=70, Nk=300, seed=3)
    mask = torch.rand(2, 4, 70, 300, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[:, :, 7] = False  # a hidden row
    mask[1, 2] = False  # a hidden head
    mask[:, :, 9, 128:] = False  # row 9 sees only step 0
    mask[:, :, 11, :256] = False  # row 11 sees only step 2
    bias = torch.where(mask, 0.0, -math.inf)
    for kw in ({"attn_mask": mask}, {"attn_mask": bias}, {"attn_mask": mask, "is_causal": True}):
        out, lse = R8.attention_forward(q, k, v, **kw, pv=pv)
        assert not out.isnan().any() and not lse.isnan().any()
        hidden = ~mask.any(dim=-1)
        if kw.get("is_causal"):
            hidden = hidden | ~(mask & torch.ones(70, 300, dtype=torch.bool).tril()).any(dim=-1)
        assert hidden[:, :, 7].all() and hidden[1, 2].all()
        assert (out[hidden] == 0).all() and (lse[hidden] == -math.inf).all()
        assert torch.isfinite(lse[~hidden]).all()
        want, want_lse = _forward_model(q, k, v, **kw, pv=pv)
        assert (out - want.float()).abs().max() < 1e-5
        assert (lse[~hidden].double() - want_lse[~hidden]).abs().max() < 1e-5


def _int8_model(q, k, v, attn_mask=None, is_causal=False):
    """SPEC_INT8 2.4-2.5 as they were before the FP8 and 16-bit P.V (INT8 V^, P^ = rne(255 exp(S - t))
    per step, the per-step factor exp(t - m_new) / 255), written out in float32 in the old
    spec's order, on the reference's INT8 operands."""
    B, Hq, Nq, D = q.shape
    Nk, G = k.shape[2], q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(D)
    ops = R8._Quantized(q, k, v, G, pv="int8")
    allowed, additive = R8._mask_bias(attn_mask, is_causal, (B, Hq, Nq, Nk), q.device)
    vc, sv = R8.psi(R8._blocks(v, 128), (3,))
    vc = R8._per_q_head(vc.reshape(B, k.shape[1], -1, D)[:, :, :Nk], G)
    sv = R8._per_q_head(sv[..., 0, :], G)  # [B, Hq, nb, D]
    m = torch.full((B, Hq, Nq), -math.inf)
    o = torch.zeros(B, Hq, Nq, D)
    l = torch.zeros(B, Hq, Nq)
    for j in range(-(-Nk // 128)):
        j0, j1 = j * 128, min(j * 128 + 128, Nk)
        s = ops.scores(j, scale, allowed, additive)
        t = s.amax(dim=-1)
        m_new = torch.maximum(m, t)
        alpha = torch.where(m == -math.inf, 0.0, torch.exp(m - m_new))
        beta = torch.where(t == -math.inf, 0.0, torch.exp(t - m_new))
        e = torch.exp(s - torch.where(t == -math.inf, 0.0, t)[..., None])
        pc = torch.round(255.0 * e)
        l = alpha * l + beta * e.sum(dim=-1)
        acc = (pc.double() @ vc[:, :, j0:j1].double()).float() * sv[:, :, j, None]
        o = alpha[..., None] * o + R8._div_rn(beta, 255.0)[..., None] * acc
        m = m_new
    seen = l > 0
    out = torch.where(seen[..., None], o / torch.where(seen, l, 1.0)[..., None], 0.0)
    lse = torch.where(seen, m + torch.log(l) + R8._lse_shift(q, ops.kbar, G, scale), -math.inf)
    return out, lse


def test_pv_int8_is_the_previous_spec_bit_for_bit():
    q, k, v = _inputs(seed=6)
    mask = torch.rand(2, 1, 150, 300, generator=torch.Generator().manual_seed(7)) > 0.3
    mask[:, :, 7] = False
    for kw in ({"is_causal": True}, {"attn_mask": mask}):
        got = R8.attention_forward(q, k, v, **kw, pv="int8")
        want = _int8_model(q, k, v, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        new = R8.attention_forward(q, k, v, **kw)
        assert not torch.equal(new[0], got[0])
        assert (new[1] - got[1]).nan_to_num(0.0).abs().max() < 1e-5  # l unquantized in both


def test_backward_does_not_depend_on_v_codes(monkeypatch):
    """attention_backward recomputes P in FP32 and uses 16-bit V for dP: V's codes, whichever
    pv made them, never enter it."""
    q, k, v = _inputs(Nq=70, Nk=200, seed=8)
    out, lse = R8.attention_forward(q, k, v, is_causal=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    want = R8.attention_backward(do, q, k, v, out, lse, is_causal=True)

    class _NoV(R8._Quantized):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.vc = self.sv = None  # any use raises

    monkeypatch.setattr(R8, "_Quantized", _NoV)
    got = R8.attention_backward(do, q, k, v, out, lse, is_causal=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_study_variants_and_options():
    """The default is the spec's 16-bit P.V; fp8-tile and fp8-r16 differ from fp8 but only
    slightly; p_max, v_block, p_exp and l_sum are refused without pv="int8"; bad values raise;
    report modes reach every pv."""
    q, k, v = _inputs(seed=10)
    default = R8.attention_forward(q, k, v, is_causal=True)
    assert all(torch.equal(a, b) for a, b in zip(default, R8.attention_forward(
        q, k, v, is_causal=True, pv="16bit")))
    spec = R8.attention_forward(q, k, v, is_causal=True, pv="fp8")
    assert not torch.equal(default[0], spec[0])
    for pv in ("fp8-tile", "fp8-r16"):
        out, lse = R8.attention_forward(q, k, v, is_causal=True, pv=pv)
        assert not torch.equal(out, spec[0]) and R.metrics(out, spec[0])["cos"] > 0.99999, pv
        assert (lse - spec[1]).abs().max() < 1e-5
    # fp8-tile: one step (no mask, 100 keys), O = (P~ (V~ + R) sV) / 448 / sum(E)
    q1, k1, v1 = _inputs(Nq=20, Nk=100)
    ops = R8._Quantized(q1, k1, v1, 2, pv="fp8")
    s = ops.scores(0, 1 / 8, None, None)
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    p = (448.0 * e).to(torch.float8_e4m3fn).double()
    want = (p @ ops.vc.double()) * ops.sv[:, :, 0, None].double() / 448.0 / e.sum(-1, keepdim=True)
    got = R8.attention_forward(q1, k1, v1, pv="fp8-tile")[0]
    assert torch.allclose(got, want.float(), rtol=1e-5, atol=1e-6)
    for bad in ({"p_max": "running"}, {"v_block": 0}, {"p_exp": "fp16"}, {"l_sum": "codes"}):
        for pv in ("16bit", "fp8"):
            with pytest.raises(ValueError, match='pv="int8" only'):
                R8.attention_forward(q, k, v, **bad, pv=pv)
        R8.attention_forward(q1, k1, v1, **bad, pv="int8")
    with pytest.raises(ValueError, match="pv"):
        R8.attention_forward(q, k, v, pv="fp8x2")
    for pv in ("16bit", "fp8", "int8", "fp8-tile", "fp8-r16"):
        mode = RP.int8_granularity_mode(64, 128, pv=pv)
        assert mode == "int8ref:q64k128" + ("" if pv == "16bit" else f":pv={pv}")
        RP.mode_label(mode)
        with RP.attention_mode(None, mode, "fp4attn"):
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.equal(got, R8.attention_forward(q, k, v, is_causal=True, pv=pv)[0]), pv
