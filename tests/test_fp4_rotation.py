"""Exact rewrites of the FP4 reference's Q.K^T and P.V before NVFP4 (not SPEC; docs/accuracy.md
"Channel migration and Hadamard rotation for FP4"): ``migrate_qk`` (SPEC_INT8 2.1b's power-of-two
channel migration on the FP4 operands), ``rotate_qk`` (the same block-diagonal Sylvester-Hadamard
H on Q and K along the head dim), ``rotate_v`` (H on V, the output rotated back) and
``rotate_pv`` (H along the keys: (P H)(H V) / n, P H quantized signed).

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
    dict(rotate_pv=16),
    dict(rotate_pv=True),
    dict(migrate_qk=True, rotate_qk=32, rotate_v=True, rotate_pv=32),
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
                               rotate_v=0, rotate_pv=0, **kw)
    assert torch.equal(base, off) and torch.equal(lse, lse_off)
    for opt in OPTIONS:  # and every option changes the quantized result
        assert not torch.equal(base, R.attention(q, k, v, **kw, **opt)), opt


def test_default_is_the_compiled_spec():
    """The default reference is still SPEC 4 as the C backend computes it (where it is built)."""
    fp4attn = pytest.importorskip("fp4attn")
    q, k, v = _qkv(B=1, Nq=96, Nk=96)
    got = fp4attn.sdpa(q, k, v, is_causal=True, enable_gqa=True, strict=True)  # the C backend
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


# ---------------------------------------------------------------------------------------------
# rotate_pv: P.V = (P H)(H V) / n, H along the keys
# ---------------------------------------------------------------------------------------------


def _pv_dense(q, k, v, n, **kw):
    """The test's own (P H)(H V) / n: exact float64 softmax P of the scaled scores, V - nothing
    smoothed, H the dense block-diagonal Sylvester matrix built by concatenation (not the
    reference's butterfly), keys zero-padded to a multiple of n."""
    G = q.shape[1] // k.shape[1]
    Nk = k.shape[2]
    nkp = -(-Nk // n) * n
    s = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
    if kw.get("is_causal"):
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.nn.functional.pad(torch.softmax(s, dim=-1), (0, nkp - Nk))
    vv = torch.nn.functional.pad(v.double().repeat_interleave(G, 1), (0, 0, 0, nkp - Nk))
    H = torch.block_diag(*[_hadamard(n).double()] * (nkp // n))
    return (p @ H) @ (H @ vv) / n


@pytest.mark.parametrize("n", [16, 32, 64, 128])
def test_rotate_pv_is_an_identity_in_exact_arithmetic(n):
    """The rewrite itself, on its own: (P H)(H V) / n with a dense H equals exact attention for
    every block size (Nk = 200: the last tile's 72 keys padded to whole blocks), while the same
    product without the 1/n, or with H over the keys misaligned by one key (another matrix, not
    orthogonal to itself), is far off: the identity holds because H H = n I."""
    q, k, v = _qkv(B=1, Nq=150, Nk=200)
    exact = R.exact_attention(q, k, v, is_causal=True)
    assert torch.allclose(_pv_dense(q, k, v, n, is_causal=True), exact, rtol=0, atol=1e-10)
    assert not torch.allclose(n * _pv_dense(q, k, v, n, is_causal=True), exact, atol=1e-3)
    shifted = torch.roll(torch.block_diag(*[_hadamard(n)] * 2), 1, dims=0).double()
    assert not torch.allclose(shifted @ shifted / n, torch.eye(2 * n, dtype=torch.float64))


@pytest.mark.parametrize("n", [16, 32, 64, 128, True])
@pytest.mark.parametrize("case", ["causal", "mask", "no_smooth_v", "int8", "rowsum",
                                  "one_level", "block_kv64"])
def test_rotate_pv_exact_without_quantization(n, case):
    """Every quantization off: rotate_pv = n is the SPEC's attention to float32 rounding (LSE
    bit for bit: l sums the unrotated exponentials), also with qk="int8" (fp4pv's P.V, its scores
    quantized alike with and without), l from P^ (un-rotated), one-level P and 64-key tiles; and
    within float32 rounding of exact attention. Nk = 200: the last tile is padded."""
    q, k, v = _qkv()
    kw = dict(attn_mask=_mask(150, 200)) if case == "mask" else dict(is_causal=True)
    flags = dict(NO_QUANT)
    if case == "no_smooth_v":
        flags["smooth_v"] = False
    elif case == "int8":
        flags = dict(qk="int8", quantize_v=False, quantize_p=False)
    elif case == "rowsum":
        flags["quantized_rowsum"] = True
    elif case == "one_level":
        flags["two_level_p"] = False
    elif case == "block_kv64":
        flags["block_kv"] = 64
        if n == 128:  # a block of 128 keys does not fit a 64-key tile
            with pytest.raises(ValueError, match="rotate_pv"):
                R.attention(q, k, v, rotate_pv=n, **flags, **kw)
            return
    base, lse = R.attention(q, k, v, return_lse=True, **flags, **kw)
    out, lse2 = R.attention(q, k, v, return_lse=True, rotate_pv=n, **flags, **kw)
    assert torch.allclose(out, base, rtol=0, atol=2e-6), (out - base).abs().max()
    if case == "rowsum":  # l from the un-rotated P: the same sums up to float32 rounding
        assert torch.allclose(lse, lse2, rtol=0, atol=2e-6)
    else:
        assert torch.equal(lse, lse2)
    if case != "int8":
        exact = R.exact_attention(q, k, v, **kw)
        assert torch.allclose(out.double(), exact, rtol=0, atol=5e-6)


def _one_hot_pv(n, seed=4):
    """Inputs whose P and V quantize exactly with and without the key rotation of block n: 256
    keys (two tiles), key j one-hot on channel j mod 128 times 200, each query one-hot on a
    random channel, so each row has exactly one key per tile with score 200 and e = 1, the rest
    e = exp(-200) = 0: P = 2688 e and its rotation (+-1 on one block of n, c = 2688) are +-2688
    and 0. V is +-1 everywhere, each channel's n tokens of a block a signed Hadamard row, so V
    (all magnitudes 1) and H V (+-n on one token per block) quantize exactly too."""
    g = torch.Generator().manual_seed(seed)
    N, D, Dv = 256, 128, 16
    k = torch.zeros(1, 1, N, D)
    k[0, 0, torch.arange(N), torch.arange(N) % D] = 200.0
    q = torch.zeros(1, 2, 96, D)
    chans = torch.randint(0, D, (2, 96), generator=g)
    q[0, torch.arange(2)[:, None], torch.arange(96), chans] = 1.0
    rows = torch.randint(0, n, (N // n, Dv), generator=g)
    signs = torch.where(torch.rand(N // n, Dv, generator=g) < 0.5, -1.0, 1.0)
    Hn = _hadamard(n)
    v = (Hn[rows].transpose(1, 2) * signs[:, None, :]).reshape(1, 1, N, Dv)  # [block, n, Dv]
    return q, k, v


@pytest.mark.parametrize("n", [16, 32, 64, 128])
def test_rotate_pv_on_exactly_quantized_operands(n):
    """P and V quantized (Q and K not: the scores are then 200 or 0 up to float32 rounding):
    with and without rotate_pv every FP4 operand is exact, so both outputs are exact attention
    to float32 rounding; with a V that is not Hadamard-structured the rotation moves the output
    by far more than that."""
    q, k, v = _one_hot_pv(n)
    kw = dict(scale=1.0, smooth_v=False, quantize_q=False, quantize_k=False)
    exact = R.exact_attention(q, k, v, scale=1.0)
    base = R.attention(q, k, v, **kw)
    out = R.attention(q, k, v, rotate_pv=n, **kw)
    assert torch.allclose(base.double(), exact, rtol=0, atol=1e-6)
    assert torch.allclose(out.double(), exact, rtol=0, atol=1e-6), (out - exact).abs().max()
    g = torch.Generator().manual_seed(9)
    v2 = torch.randn(v.shape, generator=g)
    base2, out2 = R.attention(q, k, v2, **kw), R.attention(q, k, v2, rotate_pv=n, **kw)
    assert (out2 - base2).abs().max() > 1e-3


def test_rotate_pv_deterministic_and_close_to_exact():
    """Quantized (every operand FP4), random inputs with a key channel outlier and a V token
    outlier: the same bits twice, and for every block size the output stays within the SPEC's
    error class (cos >= 0.99, 1 - cos at most twice the SPEC's); every block size gives another
    result."""
    q, k, v = _qkv()
    v[:, :, 17] *= 20.0  # a token outlier of V
    kw = dict(attn_mask=_mask(150, 200))
    exact = R.exact_attention(q, k, v, **kw)
    spec = 1 - R.metrics(R.attention(q, k, v, **kw), exact)["cos"]
    outs = []
    for n in (16, 32, 64, 128):
        a, lse_a = R.attention(q, k, v, rotate_pv=n, return_lse=True, **kw)
        b, lse_b = R.attention(q, k, v, rotate_pv=n, return_lse=True, **kw)
        assert torch.equal(a, b) and torch.equal(lse_a, lse_b)
        err = 1 - R.metrics(a, exact)["cos"]
        assert err < 0.01 and err < 2 * spec, (n, err, spec)
        outs.append(a)
    assert all(not torch.equal(x, y) for i, x in enumerate(outs) for y in outs[i + 1:])


def test_rotate_pv_bad_options():
    q, k, v = _qkv(B=1, Nq=32, Nk=32)
    for bad in (dict(rotate_pv=8), dict(rotate_pv=24), dict(rotate_pv=256), dict(rotate_pv=-16),
                dict(rotate_pv=16.5), dict(rotate_pv="16"), dict(rotate_pv=64, block_kv=32),
                dict(rotate_pv=32, block_kv=48)):
        with pytest.raises(ValueError, match="rotate_pv"):
            R.attention(q, k, v, **bad)
    # True is the largest power of two dividing block_kv: 16 for 48-key tiles
    a = R.attention(q, k, v, rotate_pv=True, block_kv=48)
    assert torch.equal(a, R.attention(q, k, v, rotate_pv=16, block_kv=48))


def test_driver_pv_variants():
    for name in FV.PV_ROTATION_VARIANTS:
        assert name in FV.VARIANTS and name in RP.METHODS and name in FV.LABELS
    q, k, v = _qkv(B=1, Nq=64, Nk=64)
    call = RP.AttnCall(0, q, k, v, None, True, None, True, None)
    for name, opt in (("rotate_pv32", dict(rotate_pv=32)),
                      ("migrate_rotate_qk_pv128", dict(migrate_qk=True, rotate_qk=True,
                                                       rotate_pv=128)),
                      ("fp4_pv_rotate_pv16", dict(rotate_pv=16, quantize_q=False,
                                                  quantize_k=False))):
        got = RP.run_method(name, call, device="cpu", backend="reference")
        assert torch.equal(got, R.attention(q, k, v, None, True, None, **opt))


@pytest.mark.parametrize("n", [16, 128])
def test_rotate_pv_quantizes_the_rotated_v(n):
    """V quantized alone (P exact), no V smoothing: rotate_pv = n is attention of the V whose
    rotation was NVFP4-quantized along the tokens and rotated back, H V -> fake_quantize ->
    H (.) / n, with the test's own dense H (keys zero-padded to a multiple of n) -- and that V is
    not the unrotated V's quantization."""
    q, k, v = _qkv()
    v[:, :, 17] *= 20.0
    Nk = v.shape[2]
    nkp = -(-Nk // n) * n
    H = torch.block_diag(*[_hadamard(n)] * (nkp // n))
    vr = H @ torch.nn.functional.pad(v, (0, 0, 0, nkp - Nk))  # [B, Hkv, nkp, Dv]
    deq = R.fake_quantize(vr.transpose(-1, -2)).transpose(-1, -2)  # along the tokens
    v_back = ((H.double() @ deq.double()) / n).float()[:, :, :Nk]
    kw = dict(is_causal=True, smooth_v=False)
    only_v = dict(NO_QUANT, quantize_v=True)
    out = R.attention(q, k, v, rotate_pv=n, **only_v, **kw)
    want = R.attention(q, k, v_back, **NO_QUANT, **kw)
    assert torch.allclose(out, want, rtol=0, atol=2e-5), (out - want).abs().max()
    base = R.attention(q, k, v, **only_v, **kw)
    assert (out - base).abs().max() > 100 * 2e-5
