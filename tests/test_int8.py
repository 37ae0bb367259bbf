"""The 8-bit trainable attention (docs/SPEC_INT8.md): the quantizer bit for bit, forward and
backward against exact float64 attention and its autograd, the custom ops (opcheck, compile), and
the front end (precision="int8", patch, errors)."""

from __future__ import annotations

import math

import pytest
import torch

import fp4attn
import fp4attn.reference_int8 as R8
from fp4attn.reference import exact_attention

HAS_CUDA = torch.cuda.is_available()


def cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def grad_close(got, want) -> bool:
    """cos >= 0.99, or both (numerically) zero: with one visible key, exact dQ is 0."""
    if want.double().norm() < 1e-9:
        return got.abs().max().item() < 1e-5
    return cos(got, want) >= 0.99


def make(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64) + 0.5  # a key mean to smooth
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    return [t.to(dtype).to(device) for t in (q, k, v)]


# ------------------------------------------------------------------------------ psi (SPEC_INT8 1)


def psi_scalar(values: list[float]) -> tuple[list[float], float]:
    """SPEC_INT8 1 for one group, element by element with float32 rounding at every step."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    amax = max(abs(x) for x in values)
    r = f32(127.0 / amax) if amax else math.inf  # float64 division rounded once: correctly rounded
    if r == math.inf:
        return [0.0] * len(values), 0.0
    s = f32(amax / 127.0)
    codes = []
    for x in values:
        y = f32(x * r)
        codes.append(float(max(-127, min(127, round(y)))))  # Python round: ties to even
    return codes, s


def test_psi_is_bit_exact():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, 33, generator=g) * torch.logspace(-30, 30, 33)
    x[1] = 0.0  # an all-zero group: scale 0, codes 0
    x[3, 0] = 0.0
    x[3, 0, 5] = 1e-38  # too small to invert: flushed to zero, no NaN from 0 * inf
    x[2, :, :] = torch.arange(-16, 17, dtype=torch.float32) / 2  # ties at .5 with r = 127 / 8
    codes, scales = R8.psi(x, (2,))
    for i in range(5):
        for j in range(7):
            want_codes, want_s = psi_scalar(x[i, j].tolist())
            assert codes[i, j].tolist() == want_codes
            assert scales[i, j, 0].item() == want_s


def test_psi_rounds_ties_to_even_and_clamps():
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 126.5]])  # amax 127: r = 1
    codes, s = R8.psi(x, (1,))
    assert codes.tolist() == [[127.0, 2.0, 4.0, -2.0, -0.0, 0.0, 126.0]]
    assert s.item() == 1.0


# -------------------------------------------------------------- forward / backward vs float64


CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, mask
    (1, 2, 2, 100, 100, 64, False, None),
    (1, 4, 2, 200, 333, 64, True, None),  # GQA, Nq != Nk, causal top-left
    (2, 3, 1, 130, 70, 32, False, None),  # MQA
    (1, 2, 2, 257, 257, 128, True, None),
    (1, 2, 2, 90, 150, 48, False, "bool"),
    (1, 2, 2, 70, 129, 80, False, "additive"),
    (1, 2, 2, 1, 77, 16, False, None),  # one query
    (1, 2, 2, 50, 1, 8, True, None),  # one key
    (1, 2, 1, 65, 65, 1, True, None),  # head dim 1
    (1, 1, 1, 64, 200, 256, False, None),
    (1, 2, 2, 33, 140, 200, True, "bool"),
]


def make_mask(kind, Nq, Nk, seed=3):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        m = torch.rand(1, 1, Nq, Nk, generator=g) > 0.3
        m[..., 0, :] = False  # a row with no visible key
        return m
    if kind == "additive":
        return torch.randn(1, 2, Nq, Nk, generator=g) * 2
    return None


def exact_with_grads(q, k, v, mask, causal, grad_out):
    qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = exact_attention(qq, kk, vv, mask, causal)
    ref.backward(grad_out.double())
    return ref, qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_and_backward_against_float64(case):
    B, Hq, Hkv, Nq, Nk, D, causal, kind = case
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D)
    mask = make_mask(kind, Nq, Nk)
    out, lse = R8.attention_forward(q, k, v, mask, causal)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    dq, dk, dv = R8.attention_backward(grad_out, q, k, v, out, lse, mask, causal)
    ref, rq, rk, rv = exact_with_grads(q, k, v, mask, causal, grad_out)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    assert cos(out, ref) >= 0.999
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        assert grad_close(got, want)
    if kind == "bool":  # the row with no visible key: zero output and gradient, lse -inf
        assert out[..., 0, :].abs().max() == 0 and dq[..., 0, :].abs().max() == 0
        assert (lse[..., 0] == -math.inf).all()


@pytest.mark.parametrize("blocks", [(64, 128), (16, 32), (32, 64)])
def test_backward_score_scale_study_blocks(blocks):
    """attention_backward's q_block / k_block study (the scores' scale granularity in training):
    the spec's blocks passed explicitly give the spec's gradients; finer blocks (codes scaled
    before dQ's and dK's products) keep the gradients accurate and make dQ and dK no worse than
    the spec's."""
    B, Hq, Hkv, Nq, Nk, D, causal, kind = (1, 4, 2, 150, 300, 64, True, None)
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D, seed=4)
    qb, kb = blocks
    out, lse = R8.attention_forward(q, k, v, None, causal, q_block=qb, k_block=kb)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    got = R8.attention_backward(grad_out, q, k, v, out, lse, None, causal, q_block=qb, k_block=kb)
    ref = exact_with_grads(q, k, v, None, causal, grad_out)[1:]
    spec = R8.attention_backward(grad_out, q, k, v, *R8.attention_forward(q, k, v, None, causal),
                                 None, causal)
    for g, s, r in zip(got, spec, ref):
        assert torch.isfinite(g).all() and grad_close(g, r)
        if blocks == (64, 128):
            assert rel_l1(g, s) < 1e-6
    if blocks != (64, 128):
        for i in (0, 1):  # dQ, dK: finer score scales, closer to exact
            assert cos(got[i], ref[i]) >= cos(spec[i], ref[i]) - 1e-6
    with pytest.raises(ValueError, match="q_block"):
        R8.attention_backward(grad_out, q, k, v, out, lse, None, causal, q_block=0)


@pytest.mark.parametrize("knob, affected, factor", [("dv_product", (2,), 0.5),
                                                     ("ds_product", (0, 1), 1.0)])
def test_backward_product_studies(knob, affected, factor):
    """attention_backward's dv_product / ds_product: the 16-bit form of a product (the spec's) is
    closer to exact than its INT8 study form (dV by 2x or more; dQ and dK), the other gradients
    do not depend on it, the default is the spec, and an unknown form is refused."""
    B, Hq, Hkv, Nq, Nk, D, causal = (1, 4, 2, 150, 300, 64, True)
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D, dtype=torch.bfloat16, seed=9)
    out, lse = R8.attention_forward(q, k, v, None, causal)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(10)).bfloat16()
    g8, g16 = (R8.attention_backward(grad_out, q, k, v, out, lse, None, causal, **{knob: form})
               for form in ("int8", "16bit"))
    spec = R8.attention_backward(grad_out, q, k, v, out, lse, None, causal)
    ref = exact_with_grads(q, k, v, None, causal, grad_out)[1:]
    for i in range(3):
        assert torch.equal(spec[i], g16[i])
        if i in affected:
            assert 1 - cos(g16[i], ref[i]) < factor * (1 - cos(g8[i], ref[i]))
        else:
            assert torch.equal(g8[i], g16[i])
    with pytest.raises(ValueError, match=knob):
        R8.attention_backward(grad_out, q, k, v, out, lse, None, causal, **{knob: "fp8"})


def rel_l1(a, b) -> float:
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_backend_against_reference(case, dtype):
    """The C CPU backend (the ops' CPU kernel) against the reference: SPEC_INT8 4's tolerances."""
    B, Hq, Hkv, Nq, Nk, D, causal, kind = case
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D, dtype=dtype)
    out, (dq, _, _) = cpu_against_reference(q, k, v, make_mask(kind, Nq, Nk), causal)
    if kind == "bool":  # the row with no visible key: zero output and gradient, also with a dlse
        assert out[..., 0, :].abs().max() == 0 and dq[..., 0, :].abs().max() == 0


def make_outliers(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, seed=0, device="cpu"):
    """make() with Gemma 3-like channels (SPEC_INT8 2.1b's migration is what makes INT8 accurate on
    them): two K outlier channels (x20, x12), a milder Q outlier (x6), a Q channel of zeros and a
    constant K channel (both s = 1)."""
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D, seed=seed)
    k[..., 3] *= 20.0
    k[..., D // 2 + 1] *= 12.0
    q[..., 1] *= 6.0
    q[..., 2] = 0.0
    k[..., 4] = 2.5
    return [t.to(dtype).to(device) for t in (q, k, v)]


MIGRATION_CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, mask
    (1, 4, 2, 130, 150, 64, True, None),  # GQA
    (2, 3, 1, 130, 70, 32, False, "bool"),  # MQA, a row with no visible key
    (1, 1, 1, 100, 200, 256, False, None),  # Gemma 3's head dim
]


def check_migration_against_reference(case, dtype, device, kernel="auto"):
    """The ops on `device` against the reference, on make_outliers' inputs: SPEC_INT8 4's
    tolerances, and much nearer the migrated reference than the spec without migration (~10%
    away on these inputs): the backend migrates."""
    B, Hq, Hkv, Nq, Nk, D, causal, kind = case
    q, k, v = make_outliers(B, Hq, Hkv, Nq, Nk, D, dtype=dtype, device=device)
    mask = make_mask(kind, Nq, Nk)
    mask = None if mask is None else mask.to(device)
    if device == "cpu":
        out, (dq, dk, dv) = cpu_against_reference(q, k, v, mask, causal)
    else:
        out, (dq, dk, dv) = check_against_reference(q, k, v, mask, causal, kernel=kernel)
    scale = 1.0 / math.sqrt(D)
    cpu = [t.cpu() for t in (q, k, v)]
    cmask = None if mask is None else mask.cpu()
    before, _ = R8.attention_forward(*cpu, cmask, causal, scale, migrate=None)
    mig, _ = R8.attention_forward(*cpu, cmask, causal, scale)
    out = out.cpu()
    assert rel_l1(out, mig.to(dtype)) < 0.05 * rel_l1(out, before.to(dtype))
    exact = exact_attention(*(t.double() for t in cpu), cmask, causal, enable_gqa=True)
    assert cos(out, exact) >= 0.999


def cpu_against_reference(q, k, v, mask, causal):
    """test_cpu_backend_against_reference's checks; returns out and (dq, dk, dv)."""
    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, mask, causal, scale)
    ref, ref_lse = R8.attention_forward(q, k, v, mask, causal, scale)
    assert out.dtype == dtype and rel_l1(out, ref.to(dtype)) < 2e-3
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3
    g = torch.Generator().manual_seed(21)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grad_lse = torch.randn(lse.shape, generator=g)
    got = torch.ops.fp4attn.int8_attention_backward(grad_out, grad_lse, q, k, v, out, lse, mask,
                                                    causal, scale)
    want = R8.attention_backward(grad_out, q, k, v, out, lse, mask, causal, scale, grad_lse=grad_lse)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert rel_l1(a, b.to(dtype)) < 5e-3 or b.abs().max() < 1e-6
    assert torch.equal(got[0][torch.isinf(lse)] == 0, want[0][torch.isinf(lse)] == 0)
    return out, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MIGRATION_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_backend_migrates_channel_outliers(case, dtype):
    check_migration_against_reference(case, dtype, "cpu")


def step16(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` (FP16 or BF16) at |x| (float64): one step of its rounding."""
    mant, emin = (10, -14) if dtype == torch.float16 else (7, -126)
    e = (torch.frexp(x.double().abs()).exponent - 1).clamp_min(emin)  # floor(log2 |x|)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - mant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_backend_is_the_reference_up_to_rounding(case, dtype):
    """The C forward computes SPEC_INT8 2 as the reference does: the same codes, P16 and V16, the
    same exact P16 V16 products summed in double; they differ by expf against torch.exp (one ulp
    in ~1% of the exponentials, which moves l and, rarely, a P16 across a tie) and summation
    orders (l, the lse shift): rel_l1 ~1e-7, lse ~2e-6 on these cases, where SPEC_INT8 4 allows
    2e-3 (and P in e4m3 would give >1e-3). FP16 / BF16 outputs are the reference's float32 output
    rounded to the input dtype but for rare flips of that rounding (a difference of ~1e-7 across
    a tie moves an element by one 16-bit step): under 0.1% of the elements, each within one step
    of the reference; rel_l1 < 1e-5 unless the one flipped element is 1 of the 130 of the
    head-dim-1 case (rel_l1 ~1e-5 alone)."""
    B, Hq, Hkv, Nq, Nk, D, causal, kind = case
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D, dtype=dtype)
    mask = make_mask(kind, Nq, Nk)
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, mask, causal, 1.0 / math.sqrt(D))
    ref, ref_lse = R8.attention_forward(q, k, v, mask, causal, 1.0 / math.sqrt(D))
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert rel_l1(out, ref) < 1e-5
    else:
        flips = int((out != ref.to(dtype)).sum())
        assert flips <= max(1, out.numel() // 1000)
        assert ((out.double() - ref.double()).abs() <= step16(ref, dtype)).all()
        assert rel_l1(out, ref.to(dtype)) < 1e-5 or flips <= 1
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-5


def check_nan_in_v_at_a_masked_key(dtype, bad, device, kernel="auto", out_tol=1e-5,
                                   lse_tol=2e-5):
    """V16 carries no scale, so a NaN or Inf in V reaches O only through ``0 * V16`` where its key
    is masked: the backends sum those products too, as the reference (and exact attention, and a
    tensor core) does, and that channel of the rows that step over the key is NaN in both;
    everything else is untouched."""
    q, k, v = make(1, 4, 2, 70, 300, 16, dtype=dtype, seed=11)
    v[0, 0, 20, 3] = bad  # KV head 0 (query heads 0, 1), key 20 (step 0)
    mask = torch.rand(1, 1, 70, 300, generator=torch.Generator().manual_seed(12)) > 0.3
    mask[..., 20] = False  # no row sees key 20
    out, lse = torch.ops.fp4attn.int8_attention(*(t.to(device) for t in (q, k, v, mask)), False,
                                                0.25, kernel)
    out, lse = out.cpu(), lse.cpu()
    ref, ref_lse = R8.attention_forward(q, k, v, mask, False, 0.25)
    assert out[0, :2, :, 3].isnan().all() and out.isnan().sum() == 2 * 70
    assert torch.equal(out.isnan(), ref.isnan())
    fine = ~ref.isnan()
    assert rel_l1(out[fine], ref[fine].to(dtype)) < out_tol
    assert (lse - ref_lse).abs().max() < lse_tol  # l sums W: V does not enter it


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cpu_backend_nan_in_v_at_a_masked_key_stays_visible(dtype, bad):
    check_nan_in_v_at_a_masked_key(dtype, bad, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_backend_v16(dtype):
    """V16 in the C backend, seen through the output: with Q = 0 every visible key gets
    P16 = fl16(448) = 448 exactly, so each output row is the plain mean of its visible keys' V16
    (SPEC_INT8 2.2: V in its own 16-bit type, FP32 rounded to BF16, no scale), and rows that see
    1, 2, 4, ... keys expose single elements. Against that mean in float64 to 2^-22 of the
    channel's amax (a few FP32 roundings); V in FP32 unrounded, or V rounded to e4m3 pairs, is
    far off for FP32 inputs. GQA, Nq != Nk, a short last key block (300 = 2 * 128 + 44), channel
    magnitudes over 2^20 (2^46 in FP32), a channel all zero, and a row with no visible key (lse
    -inf); lse = m + log(l) - log(448) is log(count) here."""
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 200, 300, 24
    g = torch.Generator().manual_seed(13)
    q = torch.zeros(B, Hq, Nq, D)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g) * (1 + 2.0**-12)  # off the BF16 grid
    v[..., 0, :] = 1.0 + 3 * 2.0**-10  # BF16 rounds it to 1 (FP16 keeps it)
    span = 12.0 if dtype == torch.float32 else 5.0
    v = v * torch.exp2((torch.arange(D) / (D - 1) - 0.5) * 2 * span) ** 2  # channel magnitudes
    v[0, 0, 128:256, 3] = 0.0
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # row i sees a prefix of ~1.5 i keys (rows 0, 1, 2 see 1, 2, 4 keys), some dropped; row 9 none
    i, n = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
    mask = (n <= (i * Nk) // Nq) & ((torch.rand(Nq, Nk, generator=g) > 0.2) | (n == 0))
    mask[9] = False
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, mask, False, 0.125)
    count = mask.sum(dim=-1).double()
    v16 = v.to(torch.float16 if dtype == torch.float16 else torch.bfloat16).double()
    mean = lambda x: ((mask.double() @ x) / count.clamp_min(1)[:, None]).repeat_interleave(  # noqa: E731
        Hq // Hkv, dim=1)
    want = mean(v16)
    tol = 2.0**-22 * v.abs().amax(dim=2, keepdim=True).repeat_interleave(Hq // Hkv, dim=1).double()
    if dtype != torch.float32:  # the output's own rounding (FP16's subnormals: steps of 2^-24)
        tol = tol + 2.0**-8 * want.abs() + 2.0**-24
    assert ((out.double() - want).abs() <= tol).all()
    if dtype == torch.float32:  # V16 is BF16: neither V itself nor its e4m3 pair
        assert ((out.double() - mean(v.double())).abs() > tol).any()
    assert out[..., 9, :].abs().max() == 0 and (lse[..., 9] == -math.inf).all()
    seen = count > 0
    assert (lse[..., seen].double() - count[seen].log()).abs().max() < 1e-5


def dk_of_quiet_keys(device, kernel="auto"):
    """Keys 64..127 of a key block with attention weights e^-8 below keys 0..63 (an additive
    mask): their dS is ~3000x smaller. With one dS^ scale per 64 x 128 block their codes round to
    0 and their dK vanishes; SPEC_INT8 3 scales each 64 keys on their own. Returns the cos of those
    keys' dK against float64 autograd."""
    q, k, v = make(1, 2, 2, 64, 128, 64, seed=9)
    mask = torch.zeros(1, 1, 64, 128)
    mask[..., 64:] = -8.0
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    _, _, rk, _ = exact_with_grads(q, k, v, mask, False, grad_out)
    q, k, v, mask, grad_out = (t.to(device) for t in (q, k, v, mask, grad_out))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = torch.ops.fp4attn.int8_attention(qq, kk, vv, mask, False, 0.125, kernel)
    out.backward(grad_out)
    return cos(kk.grad[..., 64:, :].cpu(), rk[..., 64:, :])


def test_ds_scale_per_64_keys():
    q, k, v = make(1, 2, 2, 64, 128, 64, seed=9)
    mask = torch.zeros(1, 1, 64, 128)
    mask[..., 64:] = -8.0
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    out, lse = R8.attention_forward(q, k, v, mask, False)
    _, dk, _ = R8.attention_backward(grad_out, q, k, v, out, lse, mask, False)
    _, _, rk, _ = exact_with_grads(q, k, v, mask, False, grad_out)
    assert cos(dk[..., 64:, :], rk[..., 64:, :]) >= 0.99  # the reference
    assert dk_of_quiet_keys("cpu") >= 0.99  # the C backend


def dq_with_a_large_key_mean(device, kernel="auto", grad_lse=False):
    """Keys with a per-channel mean 30x their spread and scores of a few tens (attention nearly
    one-hot, as in training runs whose logits grow). Softmax ignores Q . kbar, so dQ's smoothing
    term is scale * dlse * kbar exactly; summing the quantized dS for it instead multiplies its
    quantization error by |kbar| (dQ cos 0.91 here). Returns the cos of dQ against float64."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 128, 64, generator=g) * 4
    k = torch.randn(1, 2, 192, 64, generator=g) + 30 * torch.randn(1, 2, 1, 64, generator=g)
    v = torch.randn(1, 2, 192, 64, generator=g)
    grad_out = torch.randn(q.shape, generator=g)
    dlse = torch.randn(1, 2, 128, generator=g) if grad_lse else None
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    s = (qq @ kk.transpose(-1, -2) / 8.0).masked_fill(~torch.ones(128, 192, dtype=torch.bool).tril(), -math.inf)
    loss = (torch.softmax(s, -1) @ vv * grad_out.double()).sum()
    if grad_lse:
        loss = loss + (torch.logsumexp(s, -1) * dlse.double()).sum()
    loss.backward()
    q, k, v, grad_out = (t.to(device) for t in (q, k, v, grad_out))
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, None, True, 0.125, kernel)
    dq, _, _ = torch.ops.fp4attn.int8_attention_backward(
        grad_out, None if dlse is None else dlse.to(device), q, k, v, out, lse, None, True, 0.125,
        kernel)
    return cos(dq.cpu(), qq.grad)


@pytest.mark.parametrize("grad_lse", [False, True], ids=["dO", "dO+dlse"])
def test_dq_smoothing_term_is_dlse_kbar(grad_lse):
    assert dq_with_a_large_key_mean("cpu", grad_lse=grad_lse) >= 0.999  # the C backend
    g = torch.Generator().manual_seed(11)  # the reference: same inputs as above
    q = torch.randn(1, 2, 128, 64, generator=g) * 4
    k = torch.randn(1, 2, 192, 64, generator=g) + 30 * torch.randn(1, 2, 1, 64, generator=g)
    v = torch.randn(1, 2, 192, 64, generator=g)
    grad_out = torch.randn(q.shape, generator=g)
    out, lse = R8.attention_forward(q, k, v, None, True)
    dq, _, _ = R8.attention_backward(grad_out, q, k, v, out, lse, None, True)
    _, rq, _, _ = exact_with_grads(q, k, v, None, True, grad_out)
    assert cos(dq, rq) >= 0.999


#: dQ's bar on drifting_keys(): between one dS^ scale per block (0.976) and the spec (0.9915)
DQ_BAR_DRIFTING = 0.99


def drifting_keys():
    """q, k, v, dO with keys of a large position-dependent mean (a linear drift 10x their
    spread, as learned position embeddings give early in training) and rows of different |dS|:
    dQ only sees K - mean K (rowsum dS = 0), a quantization error of dS multiplies the drift.
    SPEC_INT8 3's per-row (dQ) and per-key (dK) scales give dQ cos 0.9915 here, one dS^ scale per
    64 x 64 block 0.976 (dK 0.999 either way). The rest of the gap to 1 is the forward's: out's
    error enters Drow, so that rowsum dS != 0 (0.9947 with the earlier INT8 P.V)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(4))
    k = k + torch.linspace(-1, 1, 256)[:, None] * torch.randn(1, 64, generator=g) * 10
    return q, k, v, grad_out


def gradients_with_drifting_keys(device, kernel="auto"):
    """The ops on `device` (CUDA kernel `kernel`) on drifting_keys(): cos of dQ, dK, dV against
    float64 autograd."""
    q, k, v, grad_out = drifting_keys()
    _, rq, rk, rv = exact_with_grads(q, k, v, None, True, grad_out)
    q, k, v, grad_out = (t.to(device) for t in (q, k, v, grad_out))
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, None, True, 0.125, kernel)
    got = torch.ops.fp4attn.int8_attention_backward(grad_out, None, q, k, v, out, lse, None, True,
                                                    0.125, kernel)
    return [cos(a.cpu(), b) for a, b in zip(got, (rq, rk, rv))]


def test_ds_scales_per_row_for_dq_and_per_key_for_dk():
    q, k, v, grad_out = drifting_keys()  # the reference, then the C backend
    out, lse = R8.attention_forward(q, k, v, None, True)
    grads = R8.attention_backward(grad_out, q, k, v, out, lse, None, True)
    want = exact_with_grads(q, k, v, None, True, grad_out)[1:]
    dq, dk, dv = (cos(a, b) for a, b in zip(grads, want))
    assert dq >= DQ_BAR_DRIFTING and min(dk, dv) >= 0.998
    dq, dk, dv = gradients_with_drifting_keys("cpu")  # the C backend
    assert dq >= DQ_BAR_DRIFTING and min(dk, dv) >= 0.998


def test_lse_is_the_log_sum_exp_of_the_scores():
    q, k, v = make(1, 2, 2, 150, 300, 64, seed=4)
    _, lse = R8.attention_forward(q, k, v, None, True)
    s = (q.double() @ k.double().transpose(-1, -2)) / 8.0
    s = s.masked_fill(~torch.ones(150, 300, dtype=torch.bool).tril(), -math.inf)
    assert (lse.double() - torch.logsumexp(s, dim=-1)).abs().max() < 0.05  # INT8 score error


def test_grad_of_lse_enters_the_backward():
    q, k, v = make(1, 2, 2, 70, 90, 32, seed=5)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = fp4attn.sdpa(qq, kk, vv, precision="int8", return_lse=True)
    (out.sum() + lse.sum()).backward()
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(32)
    (torch.softmax(s, -1) @ v64).sum().add(torch.logsumexp(s, -1).sum()).backward()
    for got, want in ((qq.grad, q64.grad), (kk.grad, k64.grad), (vv.grad, v64.grad)):
        assert cos(got, want) >= 0.99


# ------------------------------------------------------------------------ ops and front end


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sdpa_int8_gradients_in_input_dtype(dtype):
    q, k, v = (t.requires_grad_() for t in make(2, 4, 2, 80, 80, 32, dtype=dtype, seed=6))
    out = fp4attn.sdpa(q, k, v, is_causal=True, enable_gqa=True, precision="int8")
    assert out.dtype == dtype
    out.float().square().sum().backward()
    assert q.grad.dtype == dtype and k.grad.shape == k.shape and v.grad.dtype == dtype


def test_sdpa_int8_errors():
    q, k, v = make(1, 2, 2, 16, 16, 32)
    with pytest.raises(ValueError, match=r"precision must be one of \['fp4', 'int8'\], got 'int4'"):
        fp4attn.sdpa(q, k, v, precision="int4")
    mask = torch.zeros(16, 16, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask must not require grad"):
        fp4attn.sdpa(q, k, v, attn_mask=mask, precision="int8")
    with pytest.raises(ValueError, match="precision must be one of"):
        fp4attn.patch(precision="bf16")


def test_sdpa_int8_does_not_modify_inputs_and_leading_dims():
    q, k, v = make(1, 2, 2, 40, 40, 16, seed=8)
    copies = [t.clone() for t in (q, k, v)]
    out = fp4attn.sdpa(q[0], k[0], v[0], precision="int8")  # 3-D inputs
    assert out.shape == q[0].shape
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


def test_patch_precision_int8_trains_without_fallback():
    import warnings

    torch.manual_seed(0)
    q, k, v = (t.requires_grad_() for t in make(2, 4, 4, 20, 20, 8, seed=13))
    try:
        fp4attn.patch(precision="int8")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to torch SDPA would warn
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.square().mean().backward()
    finally:
        fp4attn.unpatch()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_opcheck_with_autograd():
    q, k, v = (t.requires_grad_() for t in make(1, 2, 1, 20, 30, 16, seed=9))
    mask = torch.rand(20, 30) > 0.2
    torch.library.opcheck(torch.ops.fp4attn.int8_attention.default, (q, k, v, mask, False, 0.25))
    torch.library.opcheck(torch.ops.fp4attn.int8_attention.default, (q, k, v, None, True, 0.25))


def test_ops_registered_in_cpp_with_reference_kernels_for_other_devices():
    """The ops' CPU (and CUDA) kernels and the forward's autograd are C++ registrations, no Python
    on the call path; a device without a kernel of its own gets fp4attn.int8's reference kernels,
    which refuse a CUDA kernel request as the C++ kernels do."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in ("fp4attn::int8_attention", "fp4attn::int8_attention_backward"):
        assert has(op, "CPU") and has(op, "CompositeExplicitAutograd") and has(op, "Meta")
        assert has(op, "CUDA") == fp4attn.build_info()["cuda"]
    assert has("fp4attn::int8_attention", "Autograd")
    q, k, v = make(1, 2, 1, 20, 30, 16, seed=11)
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, None, True, 0.25)
    ref_out, ref_lse = fp4attn.int8._reference_forward(q, k, v, None, True, 0.25)
    assert cos(ref_out, out) > 0.99999 and cos(ref_lse, lse) > 0.99999
    grad_out = torch.randn_like(out)
    got = torch.ops.fp4attn.int8_attention_backward(grad_out, None, q, k, v, out, lse, None, True,
                                                    0.25)
    want = fp4attn.int8._reference_backward(grad_out, None, q, k, v, out, lse, None, True, 0.25)
    assert all(cos(a, b) > 0.9999 for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="cuda_kernel 'sm90' needs CUDA tensors"):
        fp4attn.int8._reference_forward(q, k, v, None, True, 0.25, "sm90")


def test_autograd_passes_the_kernel_request_and_refuses_double_backward():
    """The C++ autograd hands the forward's cuda_kernel to the backward op (seen here on meta
    tensors, which run the fake kernels), and a second derivative raises instead of giving zeros."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((func, args))
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, 4, 70, 32, device="meta", requires_grad=True) for _ in range(3))
    with Calls() as calls:
        out, _ = torch.ops.fp4attn.int8_attention(q, k, v, None, True, 0.125, "sm80")
        out.sum().backward()
    bwd = [a for f, a in calls.seen if f == torch.ops.fp4attn.int8_attention_backward.default]
    assert len(bwd) == 1 and bwd[0][-1] == "sm80"
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    q, k, v = (t.requires_grad_() for t in make(1, 2, 1, 20, 30, 16, seed=12))
    out, _ = torch.ops.fp4attn.int8_attention(q, k, v, None, True, 0.25)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="derivative|not implemented|autograd"):
        torch.autograd.grad(dq.sum(), q)


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = make(1, 2, 2, 40, 40, 16, seed=10)

    def f(q, k, v):
        return fp4attn.sdpa(q, k, v, is_causal=True, precision="int8").square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (f, compiled):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv).backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ CUDA kernels (csrc/cuda/int8)

GPU_CASES = CASES + [
    (2, 8, 2, 700, 900, 128, True, None),  # several blocks both ways, GQA 4, causal Nq < Nk
    (1, 4, 4, 300, 520, 256, False, "bool"),  # head dim 256: dK/dV/dQ split over two blocks
    (1, 2, 1, 1000, 1000, 96, True, "additive"),
]


def forward_against_reference(q, k, v, mask, causal, kernel="auto"):
    """The forward op on q's device (CUDA kernel `kernel`) against the reference (computed on the
    CPU): SPEC_INT8 4. Returns out and lse (lse on the CPU)."""
    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, mask, causal, scale, kernel)
    cpu = [t.cpu() for t in (q, k, v)]
    ref, ref_lse = R8.attention_forward(*cpu, None if mask is None else mask.cpu(), causal, scale)
    err = rel_l1(out.cpu(), ref.to(dtype))
    assert out.dtype == dtype and err < 2e-3, f"out: rel_l1 {err:.2e}"
    lse = lse.cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3
    return out, lse


def check_against_reference(q, k, v, mask, causal, seed=21, kernel="auto"):
    """The ops on q's device (CUDA kernels `kernel`) against the reference (computed on the CPU):
    SPEC_INT8 4."""
    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = forward_against_reference(q, k, v, mask, causal, kernel)
    cpu = [t.cpu() for t in (q, k, v)]
    cmask = None if mask is None else mask.cpu()
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grad_lse = torch.randn(lse.shape, generator=g)
    dev = q.device
    got = torch.ops.fp4attn.int8_attention_backward(grad_out.to(dev), grad_lse.to(dev), q, k, v,
                                                    out, lse.to(dev), mask, causal, scale, kernel)
    want = R8.attention_backward(grad_out, *cpu, out.cpu(), lse, cmask, causal, scale,
                                 grad_lse=grad_lse)
    for name, a, b in zip("qkv", got, want):
        a = a.cpu()
        assert a.dtype == dtype and a.shape == b.shape and torch.isfinite(a).all()
        err = rel_l1(a, b.to(dtype))
        assert err < 5e-3 or b.abs().max() < 1e-6, f"d{name}: rel_l1 {err:.2e}"
    return out, got


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_kernels_against_reference(case, dtype, kernel):
    """Forward and backward of each kernel family, requested by name, against the reference."""
    B, Hq, Hkv, Nq, Nk, D, causal, kind = case
    skip_unless_kernel_runs(kernel, D)
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D, dtype=dtype, device="cuda")
    mask = make_mask(kind, Nq, Nk)
    out, (dq, dk, dv) = check_against_reference(q, k, v, None if mask is None else mask.cuda(),
                                                causal, kernel=kernel)
    if kind == "bool":  # the row with no visible key: zero output and gradient
        assert out[..., 0, :].abs().max() == 0 and dq[..., 0, :].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MIGRATION_CASES + [(2, 8, 2, 700, 900, 128, True, None)],
                         ids=lambda c: "-".join(map(str, c)))
def test_cuda_kernels_migrate_channel_outliers(case, dtype, kernel):
    """SPEC_INT8 2.1b in prepare, finish_dq and the dK epilogue: each kernel family on channel
    outliers (GQA, MQA, a zero Q channel, a constant K channel) against the reference."""
    skip_unless_kernel_runs(kernel, case[5])
    check_migration_against_reference(case, dtype, "cuda", kernel)


def q_outlier_in_last_rows(device, kernel="auto"):
    """A Q channel outlier (x100) only in the last 60 rows of one query head of a GQA pair, past
    the last full 128-row block of the statistics pass: qa_c, and so s_c, must see it. Returns the
    output's rel_l1 against the reference and against the reference without the migration."""
    q, k, v = make(1, 4, 2, 700, 520, 128, seed=4)
    q[:, 3, 640:, 7] *= 100.0
    scale = 128 ** -0.5
    ref, _ = R8.attention_forward(q, k, v, None, False, scale)
    before, _ = R8.attention_forward(q, k, v, None, False, scale, migrate=None)
    qd, kd, vd = (t.to(device) for t in (q, k, v))
    out, _ = torch.ops.fp4attn.int8_attention(qd, kd, vd, None, False, scale, kernel)
    out = out.cpu()
    return rel_l1(out, ref), rel_l1(out, before)


def test_q_outlier_in_the_last_rows_reaches_the_migration():
    err, err_before = q_outlier_in_last_rows("cpu")
    assert err < 2e-3 and err < 0.05 * err_before


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_cuda_q_outlier_in_the_last_rows_reaches_the_migration(kernel):
    skip_unless_kernel_runs(kernel, 128)
    err, err_before = q_outlier_in_last_rows("cuda", kernel)
    assert err < 2e-3 and err < 0.05 * err_before


SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def skip_unless_kernel_runs(kernel: str, head_dim: int = 64, backward: bool = True) -> None:
    """Skips a test of the sm90 kernels where they do not run (compute capability 9.0; head dims
    <= 256 forward, <= 128 backward)."""
    if kernel == "sm90" and (not SM90 or head_dim > (128 if backward else 256)):
        pytest.skip("the sm90 kernels run on compute capability 9.0, head dims <= 256 forward and "
                    "<= 128 backward")


# Shapes for the forward kernels: several tiles each way and a ring of K^/V^ stages that wraps
# around (Nk > 512), lengths off the 64/128 blocks (a 128-row block whose second Q^ block is
# padding: Nq = 130), GQA and MQA, causal with Nq < Nk and Nq > Nk, head dims padded to 64 / 128 /
# 256 (the sm90 forward's P.V in halves and 2-stage ring there: Nk > 256 wraps it). The sm90
# forward reads V16 by rows at head dim 256 and where the caller's V is V16 already up to 4,096
# keys (2,048 at head dim 64, twice that causal), else the preparation's tiles (heuristics.h,
# Int8Plan): FP32 inputs and the two cases of 4,200-4,500 keys take the tiles. The last three
# have more items (192 query rows, 128 at head dim 256) than an H100 or H200 has SMs, the head
# dim 128 one two waves and more: there the sm90 forward's persistent blocks take several items
# each, causal ones of different lengths.
FORWARD_CASES = GPU_CASES[:-2] + [
    (1, 2, 2, 1100, 1300, 64, True, None),
    (1, 4, 1, 130, 2000, 128, False, None),
    (2, 2, 2, 2048, 2048, 128, True, None),
    (1, 3, 3, 1500, 700, 80, True, None),
    (1, 2, 2, 300, 700, 128, False, "bool"),
    (1, 2, 1, 500, 500, 40, True, "additive"),
    (1, 4, 1, 700, 1300, 256, True, None),
    (2, 2, 2, 130, 600, 256, False, "bool"),
    (1, 2, 2, 520, 400, 200, True, "additive"),
    (1, 2, 1, 96, 4500, 128, False, None),
    (1, 2, 1, 64, 4200, 64, False, "bool"),
    (1, 160, 40, 200, 300, 64, False, None),
    (2, 24, 8, 1100, 1100, 128, True, None),
    (1, 70, 70, 300, 400, 256, False, None),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_forward_kernels_against_reference(case, dtype, kernel):
    """Each 8-bit forward kernel, requested by name, against the reference."""
    B, Hq, Hkv, Nq, Nk, D, causal, kind = case
    skip_unless_kernel_runs(kernel, D, backward=False)
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D, dtype=dtype, device="cuda")
    mask = make_mask(kind, Nq, Nk)
    out, _ = forward_against_reference(q, k, v, None if mask is None else mask.cuda(), causal,
                                       kernel)
    if kind == "bool":  # the row with no visible key: zero output
        assert out[..., 0, :].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_cuda_ds_scale_per_64_keys(kernel):
    skip_unless_kernel_runs(kernel)
    assert dk_of_quiet_keys("cuda", kernel) >= 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("grad_lse", [False, True], ids=["dO", "dO+dlse"])
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_cuda_dq_smoothing_term_is_dlse_kbar(kernel, grad_lse):
    skip_unless_kernel_runs(kernel)
    assert dq_with_a_large_key_mean("cuda", kernel, grad_lse) >= 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_cuda_ds_scales_per_row_for_dq_and_per_key_for_dk(kernel):
    skip_unless_kernel_runs(kernel)
    dq, dk, dv = gradients_with_drifting_keys("cuda", kernel)
    assert dq >= DQ_BAR_DRIFTING and min(dk, dv) >= 0.998


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_int8_kernel_requests():
    """auto takes the wgmma kernels on Hopper (forward: head dims <= 256, backward: <= 128); a
    kernel that cannot run is refused with the reason, in the forward and in the backward."""
    from fp4attn._ops import attention_kernel

    dev = torch.cuda.current_device()
    assert attention_kernel(dev, 128, "int8") == ("sm90" if SM90 else "sm80")
    assert attention_kernel(dev, 256, "int8") == ("sm90" if SM90 else "sm80")
    q, k, v = make(1, 2, 2, 64, 64, 256, device="cuda")
    if not SM90:
        with pytest.raises(RuntimeError, match="kernel sm90 needs"):
            torch.ops.fp4attn.int8_attention(q, k, v, None, False, 0.125, "sm90")
    with pytest.raises(RuntimeError, match="no 'sm120' kernel"):
        torch.ops.fp4attn.int8_attention(q, k, v, None, False, 0.125, "sm120")
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, None, False, 0.125, "sm80")
    with pytest.raises(RuntimeError, match="kernel sm90 needs .* head dim <= 128 for the backward"):
        torch.ops.fp4attn.int8_attention_backward(out, None, q, k, v, out, lse, None, False, 0.125,
                                                  "sm90")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_backward_refuses_grad_lse_on_another_device():
    """grad_lse on the CPU beside CUDA tensors: an error naming it (a host pointer reached the
    kernel: an illegal address)."""
    q, k, v = make(1, 2, 2, 64, 64, 64, device="cuda")
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, None, False, 0.125)
    with pytest.raises(RuntimeError, match="grad_lse must be on the device of query"):
        torch.ops.fp4attn.int8_attention_backward(out, lse.cpu(), q, k, v, out, lse, None, False,
                                                  0.125)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_head_dim_256_forward_and_backward_with_auto():
    """auto at head dim 256: the sm90 forward on Hopper, the mma.sync backward (from the same
    saved out and lse), both against the reference."""
    q, k, v = make(1, 4, 2, 300, 520, 256, dtype=torch.bfloat16, device="cuda")
    check_against_reference(q, k, v, None, True, kernel="auto")


def test_int8_kernel_request_needs_cuda():
    q, k, v = make(1, 2, 2, 16, 16, 32)
    with pytest.raises(RuntimeError, match="cuda_kernel 'sm90' needs CUDA tensors"):
        torch.ops.fp4attn.int8_attention(q, k, v, None, False, 0.125, "sm90")
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, None, False, 0.125)
    with pytest.raises(RuntimeError, match="cuda_kernel 'sm90' needs CUDA tensors"):
        torch.ops.fp4attn.int8_attention_backward(out, None, q, k, v, out, lse, None, False, 0.125,
                                                  "sm90")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("device,kernel", [("cpu", "auto"),
                                           pytest.param("cuda", "sm80", marks=pytest.mark.gpu),
                                           pytest.param("cuda", "sm90", marks=pytest.mark.gpu)])
def test_backward_writes_every_gradient_element(device, kernel, head_dim):
    """The CUDA backward allocates dQ, dK and dV without zero fills, so each element must be
    written: zeros for the keys no query sees (causal top-left, Nq < Nk), also where the allocator
    hands out memory it last held full of NaN."""
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    skip_unless_kernel_runs(kernel, head_dim)
    q, k, v = make(1, 4, 2, 100, 333, head_dim, dtype=torch.bfloat16, seed=17, device=device)
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, None, True, 0.125, kernel)
    grad_out = torch.randn_like(out)
    for _ in range(2):
        # many freed NaN blocks of the gradients' sizes: the caching allocator hands them out next
        poison = [torch.full_like(t, float("nan")) for t in (q, k, v) for _ in range(16)]
        poisoned = {t.data_ptr() for t in poison}
        del poison
        dq, dk, dv = torch.ops.fp4attn.int8_attention_backward(grad_out, None, q, k, v, out, lse,
                                                               None, True, 0.125, kernel)
        if device == "cuda":  # else the check below could pass on fresh memory
            assert {g.data_ptr() for g in (dq, dk, dv)} & poisoned, "no gradient reused NaN memory"
        assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))
        assert dk[:, :, 100:].abs().max() == 0 and dv[:, :, 100:].abs().max() == 0
        assert dk[:, :, :100].abs().max() > 0 and dv[:, :, :100].abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_kernels_against_float64_autograd():
    q, k, v = make(2, 4, 2, 300, 400, 64, dtype=torch.bfloat16, seed=14, device="cuda")
    grad_out = torch.randn(2, 4, 300, 64, generator=torch.Generator().manual_seed(15))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = fp4attn.sdpa(qq, kk, vv, is_causal=True, enable_gqa=True, precision="int8")
    out.backward(grad_out.to(out))
    ref, rq, rk, rv = exact_with_grads(q.cpu(), k.cpu(), v.cpu(), None, True, grad_out)
    assert cos(out.cpu(), ref) >= 0.999
    for got, want in ((qq.grad, rq), (kk.grad, rk), (vv.grad, rv)):
        assert cos(got.cpu(), want) >= 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_non_contiguous_inputs_and_strided_grad():
    """[B, N, H, D] views give the contiguous inputs' bits, forward and backward, and so does a
    transposed grad_out."""
    q, k, v = make(1, 3, 3, 130, 150, 64, dtype=torch.float16, seed=16, device="cuda")
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # [B,N,H,D]
    a = torch.ops.fp4attn.int8_attention(q, k, v, None, False, 0.125)
    b = torch.ops.fp4attn.int8_attention(qt, kt, vt, None, False, 0.125)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    g = torch.randn_like(a[0])
    gt = g.transpose(1, 2).contiguous().transpose(1, 2)
    assert not gt.is_contiguous()
    ga = torch.ops.fp4attn.int8_attention_backward(g, None, q, k, v, a[0], a[1], None, False, 0.125)
    gb = torch.ops.fp4attn.int8_attention_backward(gt, None, qt, kt, vt, b[0], b[1], None, False,
                                                   0.125)
    for x, y in zip(ga, gb):  # dQ's FP32 sums run in any order: equal to rounding, not bits
        torch.testing.assert_close(x, y, rtol=2e-3, atol=2e-3)
    ref = torch.ops.fp4attn.int8_attention_backward(g.cpu(), None, q.cpu(), k.cpu(), v.cpu(),
                                                    a[0].cpu(), a[1].cpu(), None, False, 0.125)
    for x, y in zip(gb, ref):
        assert torch.nn.functional.cosine_similarity(x.float().cpu().flatten(), y.float().flatten(),
                                                     dim=0) > 0.999


def v_layouts(v: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same V values in layouts the sm90 kernels load directly (contiguous, [B, N, H, D] seen
    through a transpose, a slice of a NaN-filled buffer with wider rows and more keys: the loads
    must stop at head_dim and len_k) and in ones the preparation copies first (a base 2 bytes off
    16-byte alignment, a head broadcast with stride 0)."""
    B, H, N, D = v.shape
    buf = torch.empty(v.numel() + 1, dtype=v.dtype, device=v.device)
    shifted = buf[1:].view(v.shape).copy_(v)
    big = torch.full((B, H, N + 200, D + 16), math.nan, dtype=v.dtype, device=v.device)
    big[:, :, :N, :D] = v
    return {"contiguous": v, "transposed": v.transpose(1, 2).contiguous().transpose(1, 2),
            "nan-padded": big[:, :, :N, :D], "misaligned": shifted,
            "broadcast": v[:, :1].expand(v.shape)}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [48, 128])
def test_cuda_v_read_in_place_or_copied_gives_the_same_bits(kernel, dtype, D):
    """V16 is V itself for 16-bit inputs: the sm90 kernels TMA-load the caller's V where its
    layout allows (the forward as rows, MN-major) and the preparation's copy otherwise (the
    forward's transposed tiles, K-major), the sm80 kernels always the copy. Every layout of the
    same values gives the same lse and gradients, and the same output bits where the forward reads
    the same way (up to one 16-bit step between rows and tiles). Keys off the 128-key blocks and a
    head dim below the padded one check that the loads stop at len_k and head_dim."""
    skip_unless_kernel_runs(kernel, D)
    q, k, v = make(2, 4, 2, 100, 333, D, dtype=dtype, seed=5, device="cuda")
    v = v[:, :1].expand(v.shape).contiguous()  # equal heads, so that "broadcast" has the values
    g = torch.Generator().manual_seed(6)
    grad_out = torch.randn(2, 4, 100, D, generator=g).to(dtype).cuda()
    scale = D**-0.5
    results = {}
    for name, vl in v_layouts(v).items():
        before = vl.clone()
        out, lse = torch.ops.fp4attn.int8_attention(q, k, vl, None, True, scale, kernel)
        grads = torch.ops.fp4attn.int8_attention_backward(grad_out, None, q, k, vl, out, lse, None,
                                                          True, scale, kernel)
        assert torch.equal(vl, before)
        results[name] = (out, lse, grads)
    out0, lse0, grads0 = results["contiguous"]
    assert torch.isfinite(out0).all()
    for name, (out, lse, grads) in results.items():
        assert torch.equal(lse, lse0), name
        if name in ("transposed", "nan-padded") or kernel == "sm80":
            assert torch.equal(out, out0), name
        else:
            assert rel_l1(out.float(), out0.float()) < 1e-5, name
        for a, b in zip(grads, grads0):  # dQ sums FP32 atomics: equal up to their order
            assert rel_l1(a.float(), b.float()) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cuda_nan_in_v_at_a_masked_key_stays_visible(dtype, bad, kernel):
    """As the C backend's test, on the tensor cores (P16 = 0 times V16 at the masked key)."""
    skip_unless_kernel_runs(kernel, 16, backward=False)
    check_nan_in_v_at_a_masked_key(dtype, bad, "cuda", kernel, out_tol=5e-3, lse_tol=1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("kernel", ["auto", "sm80", "sm90"])
def test_rows_seeing_only_finfo_min_keys_average_v(device, kernel):
    """transformers' additive "hidden" value, torch.finfo(float32).min, is finite: a row whose
    every key carries it attends to all of them alike (torch and the reference: the mean of V).
    In log2 units (the CUDA kernels) it overflowed to -inf, which hid every key: zeros."""
    if device == "cpu" and kernel != "auto":
        pytest.skip("the C backend has one kernel")
    if device == "cuda":
        skip_unless_kernel_runs(kernel, 64, backward=False)
    q, k, v = make(2, 4, 2, 130, 200, 64, dtype=torch.bfloat16, device=device)
    keep = torch.ones(2, 200, dtype=torch.bool)
    keep[0, 150:] = False
    keep[1] = False  # batch item 1: every key at finfo.min
    mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :].to(device)
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, mask, False, 0.125, kernel)
    ref, _ = R8.attention_forward(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), False, 0.125)
    out, lse = out.cpu(), lse.cpu()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_l1(out, ref.to(out.dtype)) < 2e-3
    mean_v = v[1].cpu().float().mean(dim=1, keepdim=True).repeat_interleave(2, dim=0)
    assert rel_l1(out[1].float(), mean_v.expand(4, 130, 64)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_graph_capture_forward_and_backward():
    q, k, v = make(1, 4, 2, 150, 200, 64, seed=11, device="cuda")
    grad_out = torch.randn(1, 4, 150, 64, generator=torch.Generator().manual_seed(12)).cuda()
    static = [t.clone().requires_grad_() for t in (q, k, v)]
    fp4attn.sdpa(*static, is_causal=True, enable_gqa=True, precision="int8").backward(grad_out)
    eager = [t.grad.clone() for t in static]
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp4attn.sdpa(*static, is_causal=True, enable_gqa=True, precision="int8")
        out.backward(grad_out)
    graph.replay()
    torch.cuda.synchronize()
    ref = fp4attn.sdpa(q, k, v, is_causal=True, enable_gqa=True, precision="int8")
    assert torch.equal(out, ref)
    for got, want in zip(static, eager):  # FP32 atomics: equal up to summation order
        assert rel_l1(got.grad, want) < 1e-5


@pytest.fixture
def deterministic_mode():
    """torch.use_deterministic_algorithms(True) for one test (warn_only set by the test)."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def int8_backward(q, k, v, causal, grad_out, kernel="auto"):
    """(dq, dk, dv) of the 8-bit attention by its backward op (kernel: the CUDA request)."""
    scale = q.shape[-1] ** -0.5
    out, lse = torch.ops.fp4attn.int8_attention(q, k, v, None, causal, scale, kernel)
    return torch.ops.fp4attn.int8_attention_backward(grad_out, None, q, k, v, out, lse, None,
                                                     causal, scale, kernel)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_deterministic_mode(device, deterministic_mode):
    """torch.use_deterministic_algorithms: the backward runs (CUDA: dQ's key blocks added in a
    fixed order) and repeats its bits, through autograd."""
    q, k, v = (torch.randn(1, 2, 70, 64, device=device, requires_grad=True) for _ in range(3))
    fp4attn.sdpa(q, k, v, is_causal=True, precision="int8").sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    fp4attn.sdpa(q, k, v, is_causal=True, precision="int8").sum().backward()
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
@pytest.mark.parametrize("case", [(1, 4, 2, 700, 900, 64, False), (1, 4, 2, 900, 700, 128, True),
                                  (1, 3, 1, 130, 1500, 96, True), (1, 2, 2, 300, 500, 256, True),
                                  (4, 16, 16, 2048, 2048, 128, False),
                                  (4, 16, 8, 2048, 2048, 64, True),
                                  (1, 1, 1, 20480, 20480, 64, False),
                                  (1, 1, 1, 20480, 20480, 64, True)],
                         ids=lambda c: "-".join(map(str, c)))
def test_cuda_backward_deterministic(case, kernel, deterministic_mode):
    """Deterministic mode: repeated calls give the same bits (dQ's key blocks added in a fixed
    order, also over several waves: the 2K cases; and where one head's 160 key blocks outnumber
    the blocks a GPU holds at once, so that blocks wait for ones launched in an earlier wave: the
    20K cases; head dim 256 splits the columns over two blocks), and the gradients of the
    default order up to FP32 summation order (the sm90 key blocks' walks over the query blocks
    start elsewhere there, so its dK and dV differ too)."""
    B, Hq, Hkv, Nq, Nk, D, causal = case
    skip_unless_kernel_runs(kernel, D)
    q, k, v = make(B, Hq, Hkv, Nq, Nk, D, dtype=torch.bfloat16, device="cuda")
    grad_out = torch.randn_like(q)
    first = int8_backward(q, k, v, causal, grad_out, kernel)
    for _ in range(3):
        again = int8_backward(q, k, v, causal, grad_out, kernel)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    torch.use_deterministic_algorithms(False)
    free = int8_backward(q, k, v, causal, grad_out, kernel)
    for a, b in zip(first, free):  # BF16 roundings of differently ordered sums
        assert rel_l1(a, b) < 2e-3
