"""The INT8 reference's Q<->K channel migration (SPEC_INT8 2.1b; issue 33, docs/accuracy.md "INT8
channel migration"): on by default (alpha 0.5, power-of-two s), ``migrate=None`` bit-identical to
the spec before the amendment, exact in real arithmetic (and in floating point with power-of-two
factors), what its docstring says it computes (edge cases included), and it fixes K's channel
outliers in the forward and the backward. CPU, small sizes (one op test also on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

import fp4attn.reference_int8 as R8
from fp4attn.eval import int8_migration as IM
from fp4attn.reference import exact_attention, metrics
from test_int8_granularity import _SpecQuantized


def _inputs(Nq=150, Nk=300, D=64, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, Nq, D, generator=g)
    k = torch.randn(2, 2, Nk, D, generator=g) + 0.5  # a key mean to smooth; GQA 4 / 2
    v = torch.randn(2, 2, Nk, D, generator=g)
    if outliers:  # K channel outliers (Gemma 3-like), one milder Q outlier channel
        k[..., 3] *= 20.0
        k[..., 17] *= 12.0
        q[..., 9] *= 6.0
    return q, k, v


def _s(q, k, **kw):
    return R8.channel_migration(q, k, k.mean(dim=2, keepdim=True), q.shape[1] // k.shape[1], **kw)


@pytest.mark.parametrize("case", ["causal", "mask_fp16"])
def test_migrate_none_is_the_spec_before_the_amendment(monkeypatch, case):
    q, k, v = _inputs(outliers=True)
    kw = dict(is_causal=case == "causal")
    if case == "mask_fp16":
        q, k, v = (t.half() for t in (q, k, v))
        kw["attn_mask"] = torch.rand(2, 1, q.shape[2], k.shape[2],
                                     generator=torch.Generator().manual_seed(3)) > 0.3
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q.dtype)
    off = R8.attention_forward(q, k, v, **kw, migrate=None)
    off_g = R8.attention_backward(do, q, k, v, off[0].to(q.dtype), off[1], **kw, migrate=None)

    def boom(*a, **k):
        raise AssertionError("channel_migration called with migrate=None")

    with monkeypatch.context() as mp:
        mp.setattr(R8, "channel_migration", boom)
        mp.setattr(R8, "_Quantized", _SpecQuantized)  # the code before the granularity options
        old = R8.attention_forward(q, k, v, **kw, migrate=None)
        old_g = R8.attention_backward(do, q, k, v, old[0].to(q.dtype), old[1], **kw, migrate=None)
    for a, b in zip(off + off_g, old + old_g):
        assert torch.equal(a, b)
    # the default is the spec's migration: alpha 0.5, power-of-two s, and it changes the result
    new = R8.attention_forward(q, k, v, **kw)
    explicit = R8.attention_forward(q, k, v, **kw, migrate=0.5, migrate_pow2=True)
    assert all(torch.equal(a, b) for a, b in zip(new, explicit))
    assert not torch.equal(new[0], off[0])
    new_g = R8.attention_backward(do, q, k, v, new[0].to(q.dtype), new[1], **kw)
    explicit_g = R8.attention_backward(do, q, k, v, new[0].to(q.dtype), new[1], **kw,
                                       migrate=0.5, migrate_pow2=True)
    assert all(torch.equal(a, b) for a, b in zip(new_g, explicit_g))


def test_migration_factors_are_as_documented():
    q, k, _ = _inputs(outliers=True)
    kbar = k.mean(dim=2, keepdim=True)
    ks = k - kbar
    ka = ks.abs().amax(dim=2, keepdim=True)  # the one-pass max / min form is the same number
    qa = q.abs().amax(dim=2).reshape(2, 2, 2, -1).amax(dim=2)[:, :, None]
    s = _s(q, k, pow2=False)
    assert s.shape == (2, 2, 1, 64) and s.dtype == torch.float32
    assert torch.equal(s, torch.sqrt(R8._div_rn(ka, qa)))
    # after migrating, Q's and K's channel maxima are both sqrt(qa ka) (up to FP32 rounding)
    qa2 = (q * s.repeat_interleave(2, 1)).abs().amax(dim=2).reshape(2, 2, 2, -1).amax(dim=2)
    ka2 = (ks / s).abs().amax(dim=2)
    assert torch.allclose(qa2, ka2, rtol=1e-6)
    assert (ka2.amax(-1) / ka2.median(-1).values).max() < 0.5 * (ka.amax(-1) / ka.median(
        -1).values).max()
    # power of two: 2^ceil(E / 2), E = floor(log2(ka / qa)); within sqrt(2) of the exact s
    p = _s(q, k)  # the default: SPEC_INT8 2.1b
    m, e = torch.frexp(p)
    assert torch.all(m == 0.5)
    want = torch.ceil(torch.floor(torch.log2(R8._div_rn(ka, qa).double())) / 2)
    assert torch.equal(e.double() - 1, want)
    r = (p / s).double()
    assert torch.all(r >= 2 ** -0.5 - 1e-6) and torch.all(r <= 2 ** 0.5 + 1e-6)
    # general alpha: ka^alpha / qa^(1 - alpha); alpha = 0.5 through the general formula agrees
    for a in (0.3, 0.7):
        want = ka.double() ** a / qa.double() ** (1 - a)
        assert torch.allclose(_s(q, k, alpha=a, pow2=False).double(), want, rtol=1e-6)
    assert torch.allclose(_s(q, k, alpha=0.5000001, pow2=False).double(), s.double(), rtol=1e-5)
    # a zero query channel keeps s = 1; a constant key channel (zero after smoothing) gets 2^-63
    q2, k2 = q.clone(), k.clone()
    q2[:, :, :, 5] = 0.0
    k2[0, 1, :, 6] = 2.5
    for pow2 in (False, True):
        s2 = _s(q2, k2, pow2=pow2)
        assert torch.all(s2[..., 5] == 1.0) and torch.all(s2[0, 1, :, 6] == 2.0 ** -63)
        assert torch.isfinite(s2).all()
    q2[:, :, :, 7] = 1e-40  # ka / qa overflows FP32: power-of-two s = 1, exact s = inf -> 1
    q2[:, :, :, 8] = 1e38  # ka / qa is subnormal: power-of-two s = 1
    k2[:, :, :, 8] *= 1e-3
    for pow2 in (False, True):
        s2 = _s(q2, k2, pow2=pow2)
        assert torch.all(s2[..., 7] == 1.0) and torch.isfinite(s2).all() and (s2 > 0).all()
    assert torch.all(_s(q2, k2, pow2=True)[..., 8] == 1.0)


def _s_scalar(qa: float, ka: float) -> float:
    """SPEC_INT8 2.1b's s for one channel, in Python floats."""
    tiny, fmax = 2.0 ** -126, float(torch.finfo(torch.float32).max)
    if ka == 0.0 and tiny <= qa <= fmax:
        return 2.0 ** -63
    if not (tiny <= qa <= fmax and tiny <= ka <= fmax):
        return 1.0
    r = torch.tensor(ka / qa, dtype=torch.float32).item()  # FP32 division, correctly rounded
    if not tiny <= r <= fmax:
        return 1.0
    return 2.0 ** math.ceil((math.frexp(r)[1] - 1) / 2)


def test_power_of_two_factors_at_the_edges():
    """s = 2^-63 where ka = 0 < qa (normal); 1 where qa, ka or ka / qa is otherwise zero,
    subnormal, inf or NaN; else 2^ceil(E / 2), and Q' = Q s and Ks' = Ks / s are finite and exact
    for every finite input, FP32's extremes included (qa s < 2^128: no overflow). Where s = 2^-63
    Ks' is 0 and Q' may round (its products are 0 whatever it is)."""
    fmax = float(torch.finfo(torch.float32).max)
    mags = [0.0, 1e-45, 1e-39, 2.0 ** -126, 3e-30, 1e-3, 0.75, 1.0, 2.0, 3.0, 1e20, 2.0 ** 127,
            fmax, math.inf, math.nan]
    pairs = [(a, b) for a in mags for b in mags]
    D = len(pairs)
    q = torch.tensor([[a for a, _ in pairs], [-a for a, _ in pairs]], dtype=torch.float32)
    k = torch.tensor([[b for _, b in pairs], [-b for _, b in pairs]], dtype=torch.float32)
    q, k = q[None, None], k[None, None]  # one head, two rows: qa = |a|, kbar 0 (or NaN), ka = |b|
    s = _s(q, k)[0, 0, 0]
    for c, (a, b) in enumerate(pairs):
        kbar = k[0, 0, :, c].mean().item()
        want = _s_scalar(a, b) if kbar == 0.0 else 1.0  # kbar NaN where b is inf or NaN
        assert s[c].item() == want, (a, b)
    finite = torch.isfinite(q).all(dim=2) & torch.isfinite(k).all(dim=2)
    qs, ks = q * s, k / s
    assert torch.isfinite(qs[finite.expand_as(q)]).all()
    assert torch.isfinite(ks[finite.expand_as(k)]).all()
    keys_zero = torch.tensor([b == 0.0 and 2.0 ** -126 <= a <= fmax for a, b in pairs]).expand_as(k)
    assert torch.all(s[keys_zero[0, 0, 0]] == 2.0 ** -63) and torch.all(ks[keys_zero] == 0)
    normal = (q.abs() >= 2.0 ** -126) & (q.abs() <= fmax) & ~keys_zero
    assert torch.equal((qs / s)[normal], q[normal])
    nk = (k.abs() >= 2.0 ** -126) & (k.abs() <= fmax) & ((k / s).abs() >= 2.0 ** -126)
    assert torch.equal((ks * s)[nk], k[nk])
    # a NaN anywhere in a channel of one query head of the group: s = 1 for that channel only
    q3, k3 = _inputs(outliers=True)[:2]
    q3[1, 2, 7, 9] = math.nan  # batch 1, query head 2 -> KV head 1
    s3 = _s(q3, k3)
    assert s3[1, 1, 0, 9].item() == 1.0 and s3[0, 1, 0, 9].item() != 1.0
    assert torch.equal(s3[1, 1, 0, :9], _s(*_inputs(outliers=True)[:2])[1, 1, 0, :9])


def test_migration_is_exact_without_quantization():
    q, k, _ = _inputs(outliers=True)
    kbar = k.mean(dim=2, keepdim=True)
    for pow2 in (False, True):
        s = _s(q, k, pow2=pow2).double()
        q64, ks64 = q.double(), (k - kbar).double()
        want = q64 @ R8._per_q_head(ks64, 2).transpose(-1, -2)
        got = (q64 * s.repeat_interleave(2, 1)) @ R8._per_q_head(ks64 / s, 2).transpose(-1, -2)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    # power-of-two factors are exact in FP32 too: scaling and unscaling gives the input back
    p = _s(q, k, pow2=True)
    ks = k - kbar
    assert torch.equal((q * p.repeat_interleave(2, 1)) / p.repeat_interleave(2, 1), q)
    assert torch.equal((ks / p) * p, ks)


def test_unit_factors_change_nothing():
    """Q's channel maxima made equal to the smoothed K's: every power-of-two s is 1 and the
    migrated forward and backward are the spec's, bit for bit (the plumbing adds no rounding)."""
    q, k, v = _inputs(outliers=True)
    ka = (k - k.mean(dim=2, keepdim=True)).abs().amax(dim=2, keepdim=True)
    qa = q.abs().amax(dim=2, keepdim=True)
    q = q / qa * R8._per_q_head(ka, 2)
    assert torch.all(_s(q, k) == 1.0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    kw = dict(is_causal=True)
    spec = R8.attention_forward(q, k, v, **kw, migrate=None)
    mig = R8.attention_forward(q, k, v, **kw)
    assert all(torch.equal(a, b) for a, b in zip(spec, mig))
    g_spec = R8.attention_backward(do, q, k, v, *spec, **kw, migrate=None)
    g_mig = R8.attention_backward(do, q, k, v, *mig, **kw)
    assert all(torch.equal(a, b) for a, b in zip(g_spec, g_mig))


@pytest.mark.parametrize("kw", [dict(migrate=0.5, migrate_pow2=False), dict(),
                                dict(migrate=0.5, migrate_pow2=False, q_block=16, k_block=32)])
def test_migration_fixes_channel_outliers_forward(kw):
    q, k, v = _inputs(outliers=True)
    exact = exact_attention(q, k, v, is_causal=True, enable_gqa=True)
    out_s, lse_s = R8.attention_forward(q, k, v, is_causal=True, migrate=None)
    out_m, lse_m = R8.attention_forward(q, k, v, is_causal=True, **kw)
    err_s = 1 - metrics(out_s, exact)["cos"]
    err_m = 1 - metrics(out_m, exact)["cos"]
    assert err_s > 1e-3  # the spec misses its target on these inputs
    assert err_m < 0.4 * err_s and err_m < 1e-3
    # the lse is still that of the true scores (the shift scale * q . kbar unmigrated), closer
    s = (q.double() @ R8._per_q_head(k, 2).double().transpose(-1, -2)) / 8.0
    lse = torch.logsumexp(s.masked_fill(torch.ones(150, 300, dtype=torch.bool).triu(1),
                                        float("-inf")), -1)
    lerr_s, lerr_m = ((x.double() - lse).abs() for x in (lse_s, lse_m))
    assert lerr_m.max() < 0.5 and lerr_m.mean() < 0.6 * lerr_s.mean()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_constant_key_channel_does_not_set_the_query_scale(dtype, device):
    """A key channel constant over the sequence (exactly 0 after smoothing; in bf16 a channel of
    small spread rounds to one) adds nothing to a score, yet with s = 1 its large query channel
    set every 64-row Q^ scale: rel_l1 0.58-0.62 against exact attention. s = 2^-63 drops it from
    the codes: as accurate as without the channel (SPEC_INT8 2.1b; the C and CUDA backends)."""
    import fp4attn

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(3))
    q[..., 0] = 100 * torch.randn(1, 2, 256, generator=g)
    k[..., 0] = 2.5 if dtype == torch.float32 else 5 + 1e-3 * torch.randn(1, 2, 256, generator=g)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    exact = exact_attention(q.double(), k.double(), v.double())
    out = fp4attn.sdpa(*(t.to(device) for t in (q, k, v)), precision="int8").double().cpu()
    assert ((out - exact).abs().sum() / exact.abs().sum()).item() < 0.03


def test_migration_backward_matches_autograd():
    q, k, v = _inputs(Nq=130, Nk=200, outliers=True)
    mask = torch.rand(2, 1, 130, 200, generator=torch.Generator().manual_seed(2)) > 0.2
    mask[:, :, 3] = False  # a row that sees no key
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    o = exact_attention(q64, k64, v64, mask, enable_gqa=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref = torch.autograd.grad(o, (q64, k64, v64), do)
    res = {}
    for name, kw in [("spec", dict(migrate=None)), ("mig", dict(migrate=0.5, migrate_pow2=False)),
                     ("pow2", {})]:
        out, lse = R8.attention_forward(q, k, v, mask, **kw)
        grads = R8.attention_backward(do.float(), q, k, v, out, lse, mask, **kw)
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.all(grads[0][:, :, 3] == 0)
        res[name] = [1 - metrics(g, r)["cos"] for g, r in zip(grads, ref)]
    for name in ("mig", "pow2"):
        dq, dk, dv = res[name]
        assert dq < 0.5 * res["spec"][0] and dk < 0.5 * res["spec"][1]
        assert max(dq, dk, dv) < 3e-3


def test_migration_rejects_bad_options():
    q, k, v = _inputs(Nq=8, Nk=8)
    with pytest.raises(ValueError, match="alpha"):
        R8.attention_forward(q, k, v, migrate=1.5)
    with pytest.raises(ValueError, match="migrate_pow2"):
        R8.attention_forward(q, k, v, migrate=None, migrate_pow2=True)
    with pytest.raises(ValueError, match="migrate_pow2"):
        R8.attention_backward(q, q, k, v, q, q[..., 0], migrate=None, migrate_pow2=False)


def test_driver_plumbing():
    assert IM._backward_layers("smollm2:19,25;gemma3:2") == {"smollm2": [19, 25], "gemma3": [2]}
    assert IM._backward_layers("") == {}
    assert IM._variant_list("spec, mig_pow2") == ["spec", "mig_pow2"]
    assert IM._variant_list("") == []
    with pytest.raises(Exception, match="unknown variant"):
        IM._variant_list("nope")
    for name, (kw, _) in IM.VARIANTS.items():  # every variant is a valid keyword set
        q, k, v = _inputs(Nq=20, Nk=20, outliers=True)
        out, _ = R8.attention_forward(q, k, v, is_causal=True, **kw)
        assert torch.isfinite(out).all(), name
    q, k, v = _inputs(Nq=40, Nk=40, outliers=True)
    with torch.no_grad():
        got = IM._int8_sdpa(IM.VARIANTS["mig_pow2"][0])(
            0, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=None,
            enable_gqa=True)
    want, _ = R8.attention_forward(q, k, v, is_causal=True, migrate=0.5, migrate_pow2=True)
    assert torch.equal(got, want)
    assert IM._variant_list("spec,backend") == ["spec", "backend"]
    with torch.no_grad():  # the compiled CPU backend: the same spec, up to FP32 summation order
        got = IM._int8_sdpa(None)(0, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True,
                                  scale=None, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5)
