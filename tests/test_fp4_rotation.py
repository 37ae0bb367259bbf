"""Exact rewrites of the FP4 reference's Q.K^T and P.V before NVFP4 (not SPEC; docs/accuracy.md
"Channel migration and Hadamard rotation for FP4"): ``migrate_qk`` (SPEC_INT8 2.1b's power-of-two
channel migration on the FP4 operands), ``rotate_qk`` (the same block-diagonal Sylvester-Hadamard
H on Q and K along the head dim) and ``rotate_v`` (H on V, the output rotated back).

Checked: off by default (explicit False gives the same bits as the default call, and the default
is still the SPEC as the compiled backend computes it); exact in real arithmetic (every
quantization off: the migration bit for bit, the rotations to float32 rounding, LSE included,
with GQA, masks, causal, a head dim that is not a multiple of 16); with quantization on, the
migration quantizes exactly ``Q s`` and ``K / s`` (``attention`` of the pre-scaled inputs), and
the rotations change nothing on inputs whose rotated operands quantize exactly; on a key channel
outlier both lower the QK^T error. CPU only, small sizes."""

from __future__ import annotations

import pytest
import torch

from fp4attn import reference as R
from fp4attn import reference_int8 as R8
from fp4attn.eval import fp4_variants as FV
from fp4attn.eval import report as RP

NO_QUANT = dict(quantize_q=False, quantize_k=False, quantize_v=False, quantize_p=False)
OPTIONS = (
    dict(migrate_qk=True),
    dict(migrate_qk="raw"),
    dict(rotate_qk=16),
    dict(rotate_qk=True),
    dict(rotate_v=True),
    dict(rotate_v=16),
    dict(migrate_qk=True, rotate_qk=32, rotate_v=True),
)


def _qkv(B=2, Hq=4, Hkv=2, Nq=150, Nk=200, D=64, Dv=None, seed=0, outlier=8.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g) + 0.5
    k[..., 3] *= outlier  # a key channel outlier: what migration and rotation are for
    v = torch.randn(B, Hkv, Nk, Dv or D, generator=g) + 1.0
    return q, k, v


def _mask(Nq, Nk, seed=3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, 1, Nq, Nk, generator=g) > 0.3
    mask[:, :, 7] = False  # a row that sees no key
    return mask


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@pytest.mark.parametrize("case", ["causal", "mask"])
def test_off_by_default(case):
    q, k, v = _qkv()
    kw = dict(is_causal=True) if case == "causal" else dict(attn_mask=_mask(150, 200))
    base, lse = R.attention(q, k, v, return_lse=True, **kw)
    off, lse_off = R.attention(q, k, v, return_lse=True, migrate_qk=False, rotate_qk=False,
                               rotate_v=0, **kw)
    assert torch.equal(base, off) and torch.equal(lse, lse_off)
    for opt in OPTIONS:  # and every option changes the quantized result
        assert not torch.equal(base, R.attention(q, k, v, **kw, **opt)), opt


def test_default_is_the_compiled_spec():
    """The default reference is still SPEC 4 as the C backend computes it (where it is built)."""
    fp4attn = pytest.importorskip("fp4attn")
    q, k, v = _qkv(B=1, Nq=96, Nk=96)
    try:
        got = fp4attn.sdpa(q, k, v, is_causal=True, enable_gqa=True, strict=True)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no compiled FP4 backend: {exc}")
    ref = R.attention(q, k, v, is_causal=True)
    assert torch.allclose(got.float(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("opt", OPTIONS, ids=str)
@pytest.mark.parametrize("case", ["causal", "mask", "odd_dims"])
def test_exact_without_quantization(opt, case):
    if case == "odd_dims":  # head dims padded to 48 / 32: blocks of 16 divide both
        q, k, v = _qkv(D=40, Dv=24)
        kw = dict(is_causal=True)
        opt = {**opt, **({"rotate_qk": 16} if opt.get("rotate_qk") == 32 else {})}
    else:
        q, k, v = _qkv()
        kw = dict(is_causal=True) if case == "causal" else dict(attn_mask=_mask(150, 200))
    base, lse = R.attention(q, k, v, return_lse=True, **NO_QUANT, **kw)
    out, lse2 = R.attention(q, k, v, return_lse=True, **NO_QUANT, **kw, **opt)
    assert out.shape == base.shape
    if set(opt) == {"migrate_qk"}:  # power-of-two s: the products are the same numbers
        assert torch.equal(out, base) and torch.equal(lse, lse2)
    else:  # the rotated scores differ by float32 rounding, and so do m and l
        assert torch.allclose(out, base, rtol=0, atol=2e-6), (out - base).abs().max()
        assert torch.allclose(lse, lse2, rtol=0, atol=2e-5), (lse - lse2).abs().max()
        if "rotate_qk" not in opt:  # V's rotation leaves the scores alone
            assert torch.equal(lse, lse2)
    exact = R.exact_attention(q, k, v, attn_mask=kw.get("attn_mask"),
                              is_causal=kw.get("is_causal", False))
    assert torch.allclose(out.double(), exact, rtol=0, atol=5e-6)


@pytest.mark.parametrize("smooth", [True, False])
def test_migration_quantizes_q_s_and_k_over_s(smooth):
    """With every quantization on, migrate_qk="raw" is attention of Q s and K / s, bit for bit
    (s from the raw Q, a power of two per (batch, KV head, channel)): the FP4 operands are
    exactly the migrated ones and nothing else moves (Q and K smoothing, the qbar . K
    correction, vbar and the LSE commute with a power-of-two scaling)."""
    q, k, v = _qkv()
    q[..., 5] += 6.0  # a query channel offset: Q smoothing removes it, raw Q's maximum keeps it
    G = q.shape[1] // k.shape[1]
    kbar = k.mean(dim=2, keepdim=True) if smooth else torch.zeros_like(k[:, :, :1])
    s = R8.channel_migration(q, k, kbar, G)
    assert torch.all(torch.frexp(s).mantissa == 0.5)  # powers of two
    assert (s != 1).any()
    kw = dict(is_causal=True, return_lse=True, smooth_k=smooth, smooth_q=smooth)
    out, lse = R.attention(q, k, v, migrate_qk="raw", **kw)
    pre, lse_pre = R.attention(q * s.repeat_interleave(G, dim=1), k / s, v, **kw)
    assert torch.equal(out, pre)
    assert torch.allclose(lse, lse_pre, rtol=0, atol=1e-5)  # qs . kbar: the same products, summed
    # the smoothed Q's maximum picks another s for channel 5, so "smoothed" is another result
    if smooth:
        assert not torch.equal(out, R.attention(q, k, v, migrate_qk=True, **kw)[0])
    else:  # without Q smoothing the quantized Q is the raw Q: the same s
        assert torch.equal(out, R.attention(q, k, v, migrate_qk=True, **kw)[0])


@pytest.mark.parametrize("n", [16, 64])
def test_rotate_qk_on_exactly_quantized_operands(n):
    """Q rows that are +-Hadamard rows (block n) rotate to one-hot rows n e_i, K rows the same
    to e_j: both quantize exactly with or without the rotation, so the quantized scores are
    exact either way and the outputs agree (P and V quantized alike)."""
    D, N = 64, 128
    g = torch.Generator().manual_seed(1)
    H = torch.block_diag(*[_hadamard(n)] * (D // n))
    pick = lambda rows: H[torch.randint(0, D, (rows,), generator=g)] * torch.where(  # noqa: E731
        torch.rand(rows, 1, generator=g) < 0.5, -1.0, 1.0)
    q = pick(2 * N).reshape(1, 2, N, D)
    k = pick(N).reshape(1, 1, N, D)
    v = torch.randn(1, 1, N, D, generator=g)
    kw = dict(is_causal=True, smooth_q=False, smooth_k=False)
    base = R.attention(q, k, v, **kw)
    out = R.attention(q, k, v, rotate_qk=n, **kw)
    assert torch.equal(out, base)
    # ... and the scores are exact: the same as with Q and K unquantized
    assert torch.equal(base, R.attention(q, k, v, quantize_q=False, quantize_k=False, **kw))


def test_rotate_v_on_exactly_quantized_values():
    """V rows that are one-hot (token j: e_{j mod 16}) quantize exactly, and so do their
    rotations (rows of H: +-1): rotating V changes the output only by float32 rounding."""
    D, N = 32, 96
    v = torch.zeros(1, 1, N, D)
    v[0, 0, torch.arange(N), torch.arange(N) % 16] = 1.0
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, N, D, generator=g), torch.randn(1, 1, N, D, generator=g)
    kw = dict(is_causal=True, smooth_v=False)
    base = R.attention(q, k, v, **kw)
    for n in (16, True):
        out = R.attention(q, k, v, rotate_v=n, **kw)
        assert torch.allclose(out, base, rtol=0, atol=1e-6), (n, (out - base).abs().max())
    assert not torch.equal(base, R.attention(q, k, v * 1.1 + 0.3, **kw))  # not vacuous


def _qk_errors(q, k, v):
    exact = R.exact_attention(q, k, v, is_causal=True)
    qk_only = dict(quantize_v=False, quantize_p=False, is_causal=True)
    return {name: 1 - R.metrics(R.attention(q, k, v, **qk_only, **opt), exact)["cos"]
            for name, opt in (("spec", {}), ("mig", dict(migrate_qk=True)),
                              ("rot", dict(rotate_qk=True)))}


def test_migration_lowers_the_qk_error_on_a_channel_outlier():
    """Only Q and K quantized (P.V exact): keys with a 12x channel outlier (every key). The
    migration cuts the error (1 - cos against exact attention) to well below the SPEC's; the
    rotation D does not help there (it spreads the channel over every 16-value block of every
    key, where the SPEC confines it to one)."""
    err = _qk_errors(*_qkv(outlier=12.0))
    assert err["mig"] < 0.5 * err["spec"], err
    assert err["rot"] > 0.8 * err["spec"], err


def test_rotation_lowers_the_qk_error_on_sparse_outliers():
    """Only Q and K quantized: one large value at a random channel of each key row (a spike, not
    a channel, 30 times the others' RMS). The rotation D spreads each spike over the row and
    lowers the error by about a fifth (0.0094 against 0.0121: NVFP4's 16-value blocks already
    confine a spike to its block); the migration, with no channel standing out, does not."""
    q, k, v = _qkv(outlier=1.0)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, k.shape[-1], (*k.shape[:-1], 1), generator=g)
    k = k.scatter_add(-1, idx, 30.0 * torch.ones(*k.shape[:-1], 1))
    err = _qk_errors(q, k, v)
    assert err["rot"] < 0.85 * err["spec"], err
    assert err["mig"] > 0.9 * err["spec"], err


def test_bad_options():
    q, k, v = _qkv(B=1, Nq=32, Nk=32)
    for bad in (dict(rotate_qk=3), dict(rotate_qk=128), dict(rotate_v=1), dict(rotate_v=24),
                dict(migrate_qk="median")):
        with pytest.raises(ValueError):
            R.attention(q, k, v, **bad)
    q, k, v = _qkv(B=1, Nq=128, Nk=128)
    with pytest.raises(ValueError, match="qk='int8'"):
        R.attention(q, k, v, qk="int8", rotate_qk=True)


def test_driver_variants():
    assert FV.DEFAULT_VARIANTS == ("ref", "smooth_v", "smooth_v_first", "smooth_v_weighted",
                                   "quantized_rowsum", "smooth_v_weighted_rowsum")
    for name in FV.ROTATION_VARIANTS:
        assert name in FV.VARIANTS and name in RP.METHODS and name in FV.LABELS
    q, k, v = _qkv(B=1, Nq=64, Nk=64)
    call = RP.AttnCall(0, q, k, v, None, True, None, True, None)
    for name, opt in (("rotate_qk", dict(rotate_qk=True)),
                      ("migrate_rotate_qk", dict(migrate_qk=True, rotate_qk=True)),
                      ("fp4_qk_rotate_qk", dict(rotate_qk=True, quantize_p=False,
                                                quantize_v=False))):
        got = RP.run_method(name, call, device="cpu", backend="reference")
        assert torch.equal(got, R.attention(q, k, v, None, True, None, **opt))


def test_registered_reference_precision(monkeypatch):
    """``fp4pv.register_precision``: a variant becomes a precision of the fp4pv study's
    calibration machinery (what ``fp4_variants --calibrate`` uses): its attention is the
    reference with the variant's keywords, cost / FP4 share / code character as given."""
    from fp4attn.eval import fp4pv as FP

    for name in ("COSTS", "FP4_FRACTION", "CODE", "REFERENCE_PRECISIONS"):
        monkeypatch.setattr(FP, name, dict(getattr(FP, name)))
    FP.register_precision("rotate_qk", RP.METHODS["rotate_qk"][1], cost=1.0, fp4_fraction=1.0,
                          char="r")
    q, k, v = _qkv(B=1, Nq=64, Nk=64)
    got = FP.attention_fn("rotate_qk")(q, k, v, None, 0.0, True, None, True)
    assert torch.equal(got, R.attention(q, k, v, is_causal=True, rotate_qk=True))
    assert FP.code(["rotate_qk", "int8", "bf16"]) == "r8b"
    assert FP.fp4_share(["rotate_qk", "int8"], [1.0, 3.0]) == 0.25
    with pytest.raises(ValueError, match="taken"):
        FP.register_precision("other", {}, cost=1.0, fp4_fraction=1.0, char="8")
    with pytest.raises(ValueError, match="already"):
        FP.register_precision("fp4pv", {}, cost=1.0, fp4_fraction=1.0, char="z")
