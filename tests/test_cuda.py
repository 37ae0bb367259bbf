"""GPU tests of the CUDA backend (csrc/cuda): every test is marked gpu and skipped without CUDA.

Quantization is bit-exact against the CPU backend; fp4mm matches the CPU backend to FP32
accumulation-order error; attention matches fp4attn.reference (the oracle of SPEC 4) to
rel_l1 < 2e-3 over causal / masks / GQA / Nq != Nk / odd lengths / head dims 32..256 / dtypes,
plus long sequences, > 2^31-element inputs, non-contiguous layouts, torch.compile, CUDA graphs,
no input mutation and error messages.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp4attn
from fp4attn import reference as R

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

ops = torch.ops.fp4attn


def has_cuda_backend() -> bool:
    try:
        return bool(fp4attn.build_info()["cuda"])
    except Exception:  # pragma: no cover
        return False


@pytest.fixture(autouse=True)
def _need_backend():
    if HAS_CUDA and not has_cuda_backend():
        pytest.skip("fp4attn was built without its CUDA backend")


def sm90_available() -> bool:
    """The Hopper wgmma kernel runs here: compute capability 9.0 and an sm_90a build."""
    if not (HAS_CUDA and has_cuda_backend()):
        return False
    return torch.cuda.get_device_capability() == (9, 0) and "90a" in fp4attn.build_info()["cuda_archs"]


KERNEL_MMA, KERNEL_SM90 = "sm80", "sm90"
# every attention check runs on the mma.sync kernel and, on Hopper, on the wgmma kernel
KERNELS = [
    pytest.param(KERNEL_MMA, id="sm80"),
    pytest.param(KERNEL_SM90, id="sm90",
                 marks=pytest.mark.skipif(not sm90_available(), reason="needs CC 9.0 + sm_90a build")),
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype=torch.float32, seed=0, scale=1.0, device="cuda"):
    x = torch.randn(shape, generator=gen(seed), dtype=torch.float32) * scale
    return x.to(dtype).to(device)


def attn_cuda(q, k, v, mask=None, causal=False, scale=None, lse=False, kernel=KERNEL_MMA):
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, l = ops.attention(q, k, v, mask, causal, s, lse, kernel)
    return (out, l) if lse else out


def attn_ref(q, k, v, mask=None, causal=False, scale=None, lse=False):
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    return R.attention(cpu(q), cpu(k), cpu(v), cpu(mask), causal, scale, return_lse=lse)


def rel_l1(out, ref):
    return R.metrics(out.float().cpu(), ref.float().cpu())["rel_l1"]


# ---------------------------------------------------------------------------------------------
# quantize / dequantize / fp4mm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 37, 100), (2, 128, 64), (1, 5, 16), (4, 1, 7), (2, 64, 256)])
def test_quantize_bitexact_vs_cpu(dtype, shape):
    x = rand(shape, dtype, seed=sum(shape), device="cpu")
    x[0, 0, 0] = 0.0
    if shape[0] > 1:
        x[1] = x[1] * 1e-3  # small slice: global scale does its job
    if shape[0] > 2:
        x[2] = 0.0  # all-zero slice: dec = 1
    c_cpu, s_cpu, d_cpu = ops.quantize(x)
    c_gpu, s_gpu, d_gpu = ops.quantize(x.cuda())
    assert torch.equal(c_gpu.cpu(), c_cpu)
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(d_gpu.cpu(), d_cpu)
    c_ref, s_ref, d_ref = R.quantize(x)
    assert torch.equal(c_gpu.cpu(), c_ref) and torch.equal(s_gpu.cpu(), s_ref.view(s_gpu.dtype))
    assert torch.equal(d_gpu.cpu(), d_ref)


def test_quantize_special_values_and_strides():
    x = rand((2, 48, 80), torch.float32, seed=3, device="cpu")
    x[0, 3, 5] = float("nan")  # slice 0 -> dec NaN
    x[1, 7, 9] = 1e30
    x[1, 8, 10] = 1e-30
    xs = x[:, :, :72]  # non-contiguous rows
    for t in (x, xs):
        c_cpu, s_cpu, d_cpu = ops.quantize(t)
        c_gpu, s_gpu, d_gpu = ops.quantize(t.cuda())
        assert torch.equal(c_gpu.cpu(), c_cpu)
        assert torch.equal(s_gpu.cpu(), s_cpu)
        assert torch.equal(d_gpu.cpu().isnan(), d_cpu.isnan())
        assert torch.equal(torch.nan_to_num(d_gpu.cpu()), torch.nan_to_num(d_cpu))


def test_dequantize_matches_cpu():
    x = rand((3, 33, 50), torch.float32, seed=5, device="cpu")
    c, s, d = ops.quantize(x)
    out_cpu = ops.dequantize(c, s, d, 50)
    out_gpu = ops.dequantize(c.cuda(), s.cuda(), d.cuda(), 50)
    assert torch.equal(out_gpu.cpu(), out_cpu)
    q = fp4attn.quantize(x.cuda())
    assert torch.equal(fp4attn.dequantize(q).cpu(), out_cpu)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mnk", [(64, 64, 64), (37, 91, 100), (130, 7, 16), (1, 1, 1)])
def test_fp4mm_matches_cpu(out_dtype, mnk):
    m, n, k = mnk
    a = rand((2, m, k), seed=m + k, device="cpu")
    b = rand((2, n, k), seed=n + 7, device="cpu")
    ref = fp4attn.fp4mm(a, b, out_dtype=torch.float32)  # CPU backend, FP32
    out = fp4attn.fp4mm(a.cuda(), b.cuda(), out_dtype=out_dtype).cpu()
    assert out.dtype == out_dtype and out.shape == ref.shape
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[out_dtype]
    assert torch.allclose(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    oracle = R.fp4mm(a, b)
    assert torch.allclose(out.float(), oracle, rtol=tol, atol=tol * oracle.abs().max().item())


def test_fp4mm_broadcast_batch():
    a = rand((3, 40, 48), seed=1, device="cpu")
    b = rand((1, 24, 48), seed=2, device="cpu")
    ref = fp4attn.fp4mm(a, b)
    out = fp4attn.fp4mm(a.cuda(), b.cuda()).cpu()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


# ---------------------------------------------------------------------------------------------
# attention against the reference
# ---------------------------------------------------------------------------------------------

CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, mask
    (1, 2, 2, 128, 128, 64, False, None),
    (2, 2, 2, 333, 333, 128, False, None),
    (1, 4, 2, 127, 333, 64, True, None),
    (1, 2, 1, 17, 17, 128, True, None),
    (1, 1, 1, 1, 1, 64, False, None),
    (1, 1, 1, 1, 300, 128, False, None),
    (1, 3, 3, 300, 1, 64, True, None),
    (2, 4, 1, 200, 150, 128, False, "bool"),
    (1, 2, 2, 150, 260, 64, True, "additive"),
    (1, 2, 2, 129, 257, 32, False, None),
    (1, 2, 2, 129, 257, 48, True, None),
    (1, 2, 2, 100, 100, 80, False, "bool_bcast"),
    (1, 2, 2, 100, 140, 96, False, None),
    (1, 2, 2, 140, 100, 112, True, None),
    (1, 2, 2, 260, 260, 160, False, None),
    (1, 2, 1, 200, 190, 192, True, None),
    (1, 2, 2, 160, 300, 256, False, "additive_bcast"),
    (1, 2, 2, 33, 70, 33, False, None),
    (1, 8, 2, 513, 513, 128, True, None),
]


def make_mask(kind, B, H, Nq, Nk, device="cuda", dtype=torch.float16):
    if kind is None:
        return None
    g = gen(Nq * 31 + Nk)
    if kind == "bool":
        m = torch.rand(B, H, Nq, Nk, generator=g) > 0.3
        m[:, :, 5] = False  # a fully masked row -> 0
        return m.to(device)
    if kind == "bool_bcast":
        return (torch.rand(1, 1, Nq, Nk, generator=g) > 0.5).to(device)
    if kind == "additive":
        m = torch.randn(B, H, Nq, Nk, generator=g) * 2
        m[:, :, :, 7] = -float("inf")
        return m.to(dtype).to(device)
    if kind == "additive_bcast":
        return (torch.randn(1, 1, 1, Nk, generator=g) * 3).to(torch.float32).to(device)
    raise ValueError(kind)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_vs_reference(case, dtype, kernel):
    B, Hq, Hkv, Nq, Nk, D, causal, mkind = case
    if kernel == KERNEL_SM90 and D > 128:
        pytest.skip("the sm90 kernel covers head dims up to 128 (test_sm90_rejects_large_head_dim)")
    seed = Nq * 7 + Nk * 3 + D
    q = rand((B, Hq, Nq, D), dtype, seed)
    k = rand((B, Hkv, Nk, D), dtype, seed + 1)
    v = rand((B, Hkv, Nk, D), dtype, seed + 2)
    q = q + 0.5 * rand((1, 1, 1, D), dtype, seed + 3)  # a mean offset: the smoothing matters
    mask = make_mask(mkind, B, Hq, Nq, Nk, dtype=dtype)
    out, lse = attn_cuda(q, k, v, mask, causal, lse=True, kernel=kernel)
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == (B, Hq, Nq, D)
    ref, ref_lse = attn_ref(q, k, v, mask, causal, lse=True)
    assert torch.isfinite(out.float()).all()
    err = rel_l1(out, ref)
    assert err < 2e-3, err
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (lse.cpu()[fin] - ref_lse[fin]).abs().max().item() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_large_query_mean(dtype, kernel):
    """A large common query direction makes the q-mean correction qbar . K (computed from K in
    input precision; on the sm90 kernel by split-precision MMAs) dominate the scores."""
    B, H, N, D = 1, 2, 300, 128
    q = rand((B, H, N, D), dtype, 11) + 4.0 * rand((1, 1, 1, D), dtype, 12)
    k = rand((B, H, N, D), dtype, 13) + 1.0 * rand((1, 1, 1, D), dtype, 14)
    v = rand((B, H, N, D), dtype, 15)
    out, lse = attn_cuda(q, k, v, None, True, lse=True, kernel=kernel)
    ref, ref_lse = attn_ref(q, k, v, None, True, lse=True)
    assert rel_l1(out, ref) < 2e-3
    assert (lse.cpu() - ref_lse).abs().max().item() < 2e-3


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_values_near_the_top_of_the_float_range(kernel):
    """|V| up to 2^120 in BF16: finite and as the reference on the mma.sync and wgmma kernels
    (the sm120 kernel and the C backend overflowed there; their tests are in test_sm120.py and
    test_attention_cpu.py)."""
    q = rand((1, 2, 300, 128), torch.bfloat16, 31)
    k = rand((1, 2, 300, 128), torch.bfloat16, 32)
    v = (rand((1, 2, 300, 128), torch.float32, 33).clamp(-1, 1) * 2.0**120).to(torch.bfloat16)
    out = attn_cuda(q, k, v, kernel=kernel)
    assert torch.isfinite(out.float()).all()
    assert rel_l1(out, attn_ref(q, k, v)) < 5e-3


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_huge_values_of_both_signs_are_not_taken_for_nan(kernel):
    """V rows of +5e37 and -5e37 (finite FP32): the pre-pass's per-column sums overflow to +inf
    and -inf in different row groups, whose total is NaN; that sum flagged V as holding a NaN,
    and the whole head came out NaN. The C backend gives the exact mean, 0."""
    q = torch.zeros(1, 1, 64, 64, device="cuda")
    k = torch.zeros(1, 1, 256, 64, device="cuda")
    v = torch.full((1, 1, 256, 64), 5e37, device="cuda")
    v[:, :, 1::2] = -5e37
    out = attn_cuda(q, k, v, kernel=kernel)
    ref = attn_ref(q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert (out.cpu() - ref).abs().max() <= 1e-3 * 5e37


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_row_without_keys_stays_zero_beside_nan_in_v(kernel):
    """A NaN in V makes V's dec NaN (SPEC 2) and every row that sees keys NaN; a row that sees no
    key still gives 0 (SPEC 4.6), also now that the sm90 epilogue applies dec last."""
    q, k = rand((1, 2, 128, 64), torch.float16, 51), rand((1, 2, 128, 64), torch.float16, 52)
    v = rand((1, 2, 128, 64), torch.float16, 53)
    v[:, :, 5] = math.nan
    mask = torch.ones(128, 128, dtype=torch.bool, device="cuda")
    mask[3] = False
    out = attn_cuda(q, k, v, mask, kernel=kernel).cpu()
    assert (out[:, :, 3] == 0).all() and out[:, :, :3].isnan().all()


@pytest.mark.parametrize("amax", [1e-34, 8e-36])
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_tiny_values_keep_their_precision(kernel, amax):
    """max |V| = 1e-34 and 8e-36 (FP32; SPEC 2's range reaches 7.9e-36) with 1024 keys seen: the
    sm90 epilogue's row factor exp2(ref - m) dV / (2688 l) was subnormal (dV ~ 4e-38), 17 % off,
    and the sm80 kernel's per-tile factor beta dV / 2688 lost bits below ~1e-34; both apply dV
    last now, as the C backend orders it."""
    q = rand((1, 2, 256, 64), torch.float32, 41)
    k = rand((1, 2, 1024, 64), torch.float32, 42, scale=0.1)
    v = rand((1, 2, 1024, 64), torch.float32, 43).clamp(-1, 1) * amax
    out = attn_cuda(q, k, v, kernel=kernel)
    assert rel_l1(out, attn_ref(q, k, v)) < 2e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_tile_maxima_far_apart(causal, kernel):
    """Key tiles whose score ranges differ by more than 2^64 (log2 units): the in-place O
    accumulation of the sm90 kernel rescales by factors that underflow, and skips tiles far below
    the running maximum; the result must still match the reference."""
    B, H, Nq, Nk, D = 1, 2, 768, 768, 64
    q = rand((B, H, Nq, D), torch.float16, 21)
    k = rand((B, H, Nk, D), torch.float16, 22)
    v = rand((B, H, Nk, D), torch.float16, 23)
    factors = [2.0, 40.0, 0.05, 40.0, 80.0, 0.5]  # per 128-key tile: LSE up to ~340 (natural log)
    for i, f in enumerate(factors):
        k[:, :, i * 128:(i + 1) * 128] *= f
    out, lse = attn_cuda(q, k, v, None, causal, lse=True, kernel=kernel)
    ref, ref_lse = attn_ref(q, k, v, None, causal, lse=True)
    assert torch.isfinite(out.float()).all()
    assert rel_l1(out, ref) < 2e-3
    assert ((lse.cpu() - ref_lse).abs() <= 2e-3 + 1e-5 * ref_lse.abs()).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_sum_counts_blocks_with_zero_scale(kernel):
    """Keys whose Pq lies below 6 * 2^-10 in a 16-key block without a larger one: the block's E4M3
    scale rounds to 0, so its P^q is 0, but its unquantized Pq still count in l (SPEC 4.5). Every
    query row is u, so Q^ = 0 and the scores are exactly scale * u . K: per 128-key tile one key at
    16, the others 13.4 lower (Pq = 2688 e^-13.4 = 0.004). Leaving those 112 keys per tile out of l
    would shift the LSE by -1.7e-4."""
    B, H, N, D = 1, 2, 512, 64
    u = torch.ones(D)
    c = torch.full((N,), 2.0 - 13.4 / 8.0)
    c[::128] = 2.0
    q = u.expand(B, H, N, D).to(torch.float16).cuda()
    k = (c[:, None] * u).expand(B, H, N, D).to(torch.float16).cuda()
    v = rand((B, H, N, D), torch.float16, 31)
    out, lse = attn_cuda(q, k, v, None, False, scale=0.125, lse=True, kernel=kernel)
    ref, ref_lse = attn_ref(q, k, v, None, False, scale=0.125, lse=True)
    assert rel_l1(out, ref) < 2e-3
    assert (lse.cpu() - ref_lse).abs().max().item() < 2e-5


@pytest.mark.parametrize("kernel", ["sm80", "auto", "sm120"])
@pytest.mark.parametrize("dtype,D,offset", [(torch.float32, 200, 0), (torch.float32, 256, 0),
                                            (torch.float16, 33, 0), (torch.bfloat16, 100, 0),
                                            (torch.float32, 64, 1), (torch.float16, 128, 3)])
def test_attention_every_input_form(dtype, D, offset, kernel):
    """One pre-pass for every input: fp32 above head dim 128 (half-chunk quantize items), head
    dims that are no multiple of 8 and unaligned rows (a staged copy of the inputs)."""
    B, H, N = 1, 3, 300
    base = rand((3 * B * H * N * D + offset,), dtype, 61)
    q, k, v = (base[offset + i * B * H * N * D:][: B * H * N * D].view(B, H, N, D) for i in range(3))
    out, lse = attn_cuda(q, k, v, None, True, lse=True, kernel=kernel)
    ref, ref_lse = attn_ref(q, k, v, None, True, lse=True)
    assert rel_l1(out, ref) < 2e-3
    assert (lse.cpu() - ref_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize("kernel", KERNELS + [pytest.param("sm120", id="sm120")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_v_smoothing(dtype, kernel):
    """SPEC 4.3's V smoothing in the pre-pass and each kernel's epilogue: V whose channels share a
    large offset (10 std), GQA 6 / 2, a boolean mask with a row that sees no key. The output
    agrees with the reference, its error against float64 attention is a fraction of the
    unsmoothed SPEC's (the reference with smooth_v=False), the hidden row stays 0 and the LSE is
    the unsmoothed one."""
    B, Hq, Hkv, N, D = 2, 6, 2, 300, 128
    q, k = rand((B, Hq, N, D), dtype, 71), rand((B, Hkv, N, D), dtype, 72)
    v = (rand((B, Hkv, N, D), seed=73) + 10 * rand((B, Hkv, 1, D), seed=74)).to(dtype)
    mask = torch.rand(B, 1, N, N, generator=gen(75)) > 0.3
    mask[:, :, 7] = False
    out, lse = attn_cuda(q, k, v, mask.cuda(), lse=True, kernel=kernel)
    ref, ref_lse = attn_ref(q, k, v, mask, lse=True)
    assert rel_l1(out, ref.to(dtype)) < 2e-3
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    exact = R.exact_attention(qc, kc, vc, mask)
    unsmoothed, lse0 = R.attention(qc, kc, vc, mask, return_lse=True, smooth_v=False)
    assert rel_l1(out, exact) < 0.5 * rel_l1(unsmoothed, exact)
    assert torch.equal(out[:, :, 7].cpu(), torch.zeros_like(out[:, :, 7].cpu()))
    lse = lse.cpu()
    assert torch.all(lse[:, :, 7] == -math.inf)
    finite = torch.isfinite(lse0)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - lse0[finite]).abs().max().item() < 1e-3


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_float32_input_and_scale(kernel):
    q, k, v = (rand((1, 2, 190, 64), torch.float32, s) for s in (1, 2, 3))
    out = attn_cuda(q, k, v, scale=0.3, kernel=kernel)
    assert out.dtype == torch.float32
    assert rel_l1(out, attn_ref(q, k, v, scale=0.3)) < 2e-3


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_deterministic(kernel):
    q, k, v = (rand((2, 4, 700, 128), torch.float16, s) for s in (4, 5, 6))
    a = attn_cuda(q, k, v, causal=True, kernel=kernel)
    b = attn_cuda(q, k, v, causal=True, kernel=kernel)
    assert torch.equal(a, b)


MANY_ITEMS = [
    # B, Hq, Hkv, Nq, Nk, D, causal, mask: more 128-row query blocks than twice the SM count, so
    # every block of the persistent sm90 kernel runs several, of different lengths
    (2, 16, 4, 1100, 1100, 128, True, None),  # GQA, causal: 1..9 tiles per item
    (4, 16, 16, 520, 100, 64, False, None),  # one key tile per item
    (2, 40, 40, 260, 300, 64, False, "bool"),  # attn_mask path
    (3, 24, 8, 700, 333, 128, True, None),  # Nq > Nk, causal
]


@pytest.mark.parametrize("case", MANY_ITEMS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_many_query_blocks(case, kernel):
    B, Hq, Hkv, Nq, Nk, D, causal, mkind = case
    seed = Nq + Nk + D
    q = rand((B, Hq, Nq, D), torch.float16, seed) + 0.5 * rand((1, 1, 1, D), torch.float16, seed + 3)
    k = rand((B, Hkv, Nk, D), torch.float16, seed + 1)
    v = rand((B, Hkv, Nk, D), torch.float16, seed + 2)
    mask = make_mask(mkind, B, Hq, Nq, Nk)
    out, lse = attn_cuda(q, k, v, mask, causal, lse=True, kernel=kernel)
    ref, ref_lse = attn_ref(q, k, v, mask, causal, lse=True)
    assert rel_l1(out, ref) < 2e-3
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (lse.cpu()[fin] - ref_lse[fin]).abs().max().item() < 2e-3
    again = attn_cuda(q, k, v, mask, causal, kernel=kernel)
    assert torch.equal(out, again)


@pytest.mark.skipif(not sm90_available(), reason="needs CC 9.0 + sm_90a build")
def test_sm90_matches_mma_kernel_and_is_auto():
    """Same numerics as the mma.sync kernel (only accumulation order differs), and the default."""
    q, k, v = (rand((2, 4, 1000, 128), torch.bfloat16, s) for s in (51, 52, 53))
    a = attn_cuda(q, k, v, causal=True, kernel=KERNEL_MMA)
    b = attn_cuda(q, k, v, causal=True, kernel=KERNEL_SM90)
    assert rel_l1(a, b) < 1e-3
    assert torch.equal(b, attn_cuda(q, k, v, causal=True, kernel="auto"))


def test_sm90_rejects_where_it_cannot_run():
    q = rand((1, 2, 64, 256 if sm90_available() else 64), torch.float16, 54)
    with pytest.raises(RuntimeError, match="kernel sm90 needs"):
        attn_cuda(q, q, q, kernel=KERNEL_SM90)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_long_sequence_16k(kernel):
    q, k, v = (rand((1, 1, 16384, 64), torch.float16, s) for s in (7, 8, 9))
    for causal in (False, True):
        out = attn_cuda(q, k, v, causal=causal, kernel=kernel)
        assert rel_l1(out, attn_ref(q, k, v, causal=causal)) < 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_more_than_2_31_elements(kernel):
    B, H, N, D = 16400, 8, 128, 128  # B*H*N*D = 2.15e9 > 2^31 (int64 offsets)
    assert B * H * N * D > 2**31
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)
    v = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)
    out = attn_cuda(q, k, v, kernel=kernel)
    for b, h in [(0, 0), (B // 2, 3), (B - 1, H - 1)]:
        sl = lambda t: t[b : b + 1, h : h + 1]  # noqa: E731
        assert rel_l1(sl(out), attn_ref(sl(q), sl(k), sl(v))) < 2e-3
    del q, k, v, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("D", [64, 128])
def test_noncontiguous_layouts(D):
    """At D = 128 the Hopper kernel copies an item's query rows with one TMA load through a map of
    Q in the caller's strides, or, where the driver takes no map of them (a broadcast query head),
    with one bulk copy per row; Q without 16-byte aligned rows is loaded by the consumers."""
    B, N, H = 2, 300, 4
    # transformers / diffusers: [B, N, H, D] projections transposed to [B, H, N, D]
    q = rand((B, N, H, D), torch.float16, 11).transpose(1, 2)
    k = rand((B, N, H, D), torch.float16, 12).transpose(1, 2)
    v = rand((B, N, H, D), torch.float16, 13).transpose(1, 2)
    assert not q.is_contiguous()
    out = fp4attn.sdpa(q, k, v, is_causal=True)
    assert rel_l1(out, attn_ref(q, k, v, causal=True)) < 2e-3
    # a packed qkv projection [B, N, 3, H, D] sliced per operand (strides not multiples of D)
    qkv = rand((B, N, 3, H, D + 8), torch.bfloat16, 14)[..., :D]
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out = fp4attn.sdpa(q, k, v)
    assert rel_l1(out, attn_ref(q, k, v)) < 2e-3
    # odd pointer offset: no 16-byte vector path
    base = rand((B * H * N * D + 3,), torch.float16, 15)
    q = base[3:].view(B, H, N, D)
    out = attn_cuda(q, q, q)
    assert rel_l1(out, attn_ref(q, q, q)) < 2e-3
    # a query head broadcast over the heads (stride 0) and a head dim padded to 128 (zero fill)
    q = rand((B, 1, N, D), torch.float16, 16).expand(B, H, N, D)
    k, v = (rand((B, H, N, D), torch.float16, s) for s in (17, 18))
    out = attn_cuda(q, k, v, None, True, kernel="auto")  # on Hopper: sm90's per-row Q copies
    assert rel_l1(out, attn_ref(q, k, v, None, True)) < 2e-3
    q, k, v = (rand((B, H, N, D - 24), torch.float16, s) for s in (19, 20, 21))
    out = attn_cuda(q, k, v)
    assert rel_l1(out, attn_ref(q, k, v)) < 2e-3


def test_no_input_mutation():
    q, k, v = (rand((1, 2, 257, 128), torch.bfloat16, s) for s in (21, 22, 23))
    mask = make_mask("additive", 1, 2, 257, 257, dtype=torch.bfloat16)
    copies = [t.clone() for t in (q, k, v, mask)]
    fp4attn.sdpa(q, k, v, attn_mask=mask)
    fp4attn.sdpa(q, k, v, is_causal=True)
    for t, c in zip((q, k, v, mask), copies):
        assert torch.equal(t, c)


def test_torch_compile_fullgraph():
    q, k, v = (rand((1, 2, 256, 64), torch.float16, s) for s in (31, 32, 33))

    def f(q, k, v):
        return fp4attn.sdpa(q, k, v, is_causal=True) * 2.0

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out, f(q, k, v))


def test_torch_compile_fullgraph_op():
    q, k, v = (rand((1, 2, 200, 128), torch.bfloat16, s) for s in (34, 35, 36))

    def f(q, k, v):
        out, lse = ops.attention(q, k, v, None, True, 0.1, True, "auto")
        return out.float() + 1.0, lse

    compiled = torch.compile(f, fullgraph=True)
    out, lse = compiled(q, k, v)
    ref_out, ref_lse = f(q, k, v)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("shape", [(2, 4, 300, 128), (4, 40, 300, 64)])
def test_cuda_graph_capture_replay(shape):
    """Replays reset what a launch leaves behind (the sm90 kernel's work ticket at head dim 64,
    where 480 query blocks share fewer persistent blocks)."""
    q, k, v = (rand(shape, torch.float16, s) for s in (41, 42, 43))
    fp4attn.sdpa(q, k, v)  # warm-up outside the capture (module load, attributes)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fp4attn.sdpa(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp4attn.sdpa(q, k, v, is_causal=True)
    for seed in (44, 47):
        q.copy_(rand(shape, torch.float16, seed))
        k.copy_(rand(shape, torch.float16, seed + 1))
        v.copy_(rand(shape, torch.float16, seed + 2))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp4attn.sdpa(q, k, v, is_causal=True))


ERROR_SCRIPT = r"""
import torch, fp4attn
ops = torch.ops.fp4attn
def expect(fn, text):
    try:
        fn()
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError("no error for " + text)
q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.float16)
k = torch.randn(1, 3, 16, 64, device="cuda", dtype=torch.float16)
expect(lambda: ops.attention(q, k, k, None, False, 0.125, False, "sm80"), "must be a multiple of key/value heads")
expect(lambda: ops.attention(q, q.float(), q, None, False, 0.125, False, "sm80"), "one dtype")
big = torch.randn(1, 1, 8, 300, device="cuda", dtype=torch.float16)
expect(lambda: ops.attention(big, big, big, None, False, 0.125, False, "sm80"), "head_dim")
m = torch.ones(3, 5, dtype=torch.bool, device="cuda")
expect(lambda: ops.attention(q, q, q, m, False, 0.125, False, "sm80"), "broadcastable")
expect(lambda: fp4attn.sdpa(q, k, k, strict=True), "enable_gqa=True")
print("errors ok")
"""


def test_error_messages():
    # In a subprocess: a crash in an error path must fail this test, not the whole session.
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", ERROR_SCRIPT], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "errors ok" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("precision", ["fp4", "int8"])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("nq", [1, 150])
def test_a_nan_input_gives_nan_rows_not_zeros(precision, where, nq):
    """As tests/test_api.py's CPU test, on the CUDA kernels (nq = 1: the decode kernel)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, nq, 64, generator=g).cuda().half()
    k, v = (torch.randn(1, 2, 150, 64, generator=g).cuda().half() for _ in range(2))
    clean = fp4attn.sdpa(q, k, v, precision=precision)
    (q if where == "q" else k)[0, 0, 0 if nq == 1 else 3, 5] = float("nan")
    out = fp4attn.sdpa(q, k, v, precision=precision)
    assert out[0, 0, 0 if nq == 1 else 3].isnan().all()
    assert not (out[0, 0] == 0).all(dim=-1).any()
    assert torch.equal(out[0, 1], clean[0, 1])
