"""GPU tests of the fused split-KV decode of plain attention calls (kernel "decode",
csrc/cuda/decode/sdpa_decode.cu): agreement with fp4attn.reference (SPEC 5: rel_l1 < 2e-3 on the
output, lse within 1e-3) over query rows, GQA / MQA, head dims (padded and not), key lengths,
dtypes, causal, non-contiguous K/V and return_lse; and which calls AUTO sends to it."""

from __future__ import annotations

import math

import pytest
import torch

import fp4attn
from fp4attn import reference as R
from fp4attn._ops import attention_kernel

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

ops = torch.ops.fp4attn


@pytest.fixture(autouse=True)
def _need_backend():
    if HAS_CUDA and not fp4attn.build_info()["cuda"]:
        pytest.skip("fp4attn was built without its CUDA backend")
    if HAS_CUDA and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the decode kernel needs compute capability 8.0")


def rand(shape, dtype, seed, device="cuda"):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return x.to(dtype).to(device)


def run(q, k, v, causal=False, kernel="decode", mask=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    return ops.attention(q, k, v, mask, causal, scale, True, kernel)


def check(q, k, v, causal=False, kernel="decode"):
    out, lse = run(q, k, v, causal, kernel)
    torch.cuda.synchronize()
    # the fused decode implements SPEC 4 before the V smoothing amendment (SPEC 4.3) so far
    smooth_v = False if kernel == "decode" else "weighted"
    ref, ref_lse = R.attention(q.cpu(), k.cpu(), v.cpu(), None, causal, None, return_lse=True,
                               smooth_v=smooth_v)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out.float()).all()
    # SPEC 4.6 casts O to the input dtype: compare with the reference's output cast alike (the
    # cast alone is rel_l1 ~1.4e-3 in bfloat16, most of the budget if ref stayed in float32)
    err = R.metrics(out.float().cpu(), ref.to(q.dtype).float())["rel_l1"]
    assert err < 2e-3, err
    dl = (lse.cpu() - ref_lse).abs().max().item()
    assert dl < 1e-3, dl
    return out, lse


def qkv(B, Hq, Hkv, Nq, Nk, D, dtype, seed):
    q = rand((B, Hq, Nq, D), dtype, seed) + 0.5 * rand((1, 1, 1, D), dtype, seed + 3)
    k = rand((B, Hkv, Nk, D), dtype, seed + 1) + 0.3 * rand((1, 1, 1, D), dtype, seed + 4)
    v = rand((B, Hkv, Nk, D), dtype, seed + 2)
    return q, k, v


HEADS = [(32, 8), (8, 8), (8, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Nk", [1000, 4096, 8191])
@pytest.mark.parametrize("D", [64, 128, 80, 72, 40])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("Nq", [1, 4, 16])
def test_decode_vs_reference_grid(Nq, heads, D, Nk, causal, dtype):
    Hq, Hkv = heads
    if Nk == 8191 and D in (72, 40) and Nq != 4:
        pytest.skip("covered by the other lengths")  # keeps the grid within a few minutes
    q, k, v = qkv(1 if Nk > 1000 else 2, Hq, Hkv, Nq, Nk, D, dtype, Nq * 131 + Nk + D)
    check(q, k, v, causal)


QUICK = [  # Nq, (Hq, Hkv), D, Nk, causal, dtype: one of each kind of the grid above
    (1, (32, 8), 128, 4096, False, torch.float16),
    (4, (32, 8), 128, 1000, True, torch.bfloat16),
    (16, (8, 8), 64, 8191, False, torch.bfloat16),
    (1, (8, 1), 80, 1000, False, torch.float16),
    (4, (8, 1), 40, 4096, True, torch.float16),
    (16, (32, 8), 72, 1000, False, torch.bfloat16),
]


@pytest.mark.parametrize("case", QUICK, ids=lambda c: "-".join(map(str, c[:5])))
def test_decode_vs_reference(case):
    Nq, (Hq, Hkv), D, Nk, causal, dtype = case
    q, k, v = qkv(1 if Nk > 1000 else 2, Hq, Hkv, Nq, Nk, D, dtype, Nq * 131 + Nk + D)
    check(q, k, v, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_decode_noncontiguous_cache_slice(dtype, D):
    """K/V as the first Nk tokens of a larger [B, Hkv, capacity, D] cache, and [B, N, H, D]
    projections transposed (token stride H * D)."""
    B, Hq, Hkv, cap, Nk = 2, 16, 4, 6000, 3000
    kc = rand((B, Hkv, cap, D), dtype, 5)
    vc = rand((B, Hkv, cap, D), dtype, 6)
    k, v = kc[:, :, :Nk], vc[:, :, :Nk]
    assert not k.is_contiguous()
    q = rand((B, 1, Hq, D), dtype, 7).transpose(1, 2)
    check(q, k, v)
    k = rand((B, Nk, Hkv, D), dtype, 8).transpose(1, 2)
    v = rand((B, Nk, Hkv, D), dtype, 9).transpose(1, 2)
    check(q, k, v, causal=True)


def test_decode_large_query_mean_and_tile_maxima():
    """A dominant common query direction (the qbar . K correction carries the scores) and key tiles
    whose score ranges lie far apart (the splits' maxima differ by a lot in the merge)."""
    B, Hq, Hkv, Nq, Nk, D = 1, 8, 2, 3, 2048, 128
    q = rand((B, Hq, Nq, D), torch.bfloat16, 11) + 4.0 * rand((1, 1, 1, D), torch.bfloat16, 12)
    k = rand((B, Hkv, Nk, D), torch.bfloat16, 13) + rand((1, 1, 1, D), torch.bfloat16, 14)
    v = rand((B, Hkv, Nk, D), torch.bfloat16, 15)
    for i, f in enumerate([2.0, 40.0, 0.05, 40.0, 80.0, 0.5]):
        k[:, :, i * 128:(i + 1) * 128] *= f
    check(q, k, v)


def test_decode_deterministic_and_auto():
    """AUTO runs the decode kernel for decode shapes (same bytes as requesting it), the general
    kernels for len_q > 16, short keys, more than 32 (batch, KV head) pairs with GQA groups of
    fewer than 4 heads, and an attn_mask."""
    q, k, v = qkv(2, 32, 8, 1, 4096, 128, torch.float16, 21)
    a, la = run(q, k, v)
    b, lb = run(q, k, v)
    assert torch.equal(a, b) and torch.equal(la, lb)
    c, lc = run(q, k, v, kernel="auto")
    assert torch.equal(a, c) and torch.equal(la, lc)
    assert torch.equal(fp4attn.sdpa(q, k, v, enable_gqa=True), a)
    general = attention_kernel(torch.cuda.current_device(), 128)  # what AUTO runs for other shapes
    q2, k2, v2 = qkv(5, 32, 8, 1, 1024, 128, torch.float16, 24)  # 40 pairs, groups of 4
    assert torch.equal(run(q2, k2, v2, kernel="auto")[0], run(q2, k2, v2)[0])
    for B, nq, nk in ((1, 17, 4096), (1, 1, 255), (5, 1, 4096)):
        q2, k2, v2 = qkv(B, 8, 8, nq, nk, 128, torch.float16, 22)
        x, lx = run(q2, k2, v2, kernel="auto")
        y, ly = run(q2, k2, v2, kernel=general)
        assert torch.equal(x, y) and torch.equal(lx, ly)
    mask = torch.ones(1, 1, 1, 4096, dtype=torch.bool, device="cuda")
    q2, k2, v2 = qkv(1, 8, 8, 1, 4096, 128, torch.float16, 23)
    x, _ = run(q2, k2, v2, kernel="auto", mask=mask)
    y, _ = run(q2, k2, v2, kernel=general, mask=mask)
    assert torch.equal(x, y)


def test_decode_rejects_what_it_cannot_run():
    q, k, v = qkv(1, 4, 4, 1, 512, 64, torch.float16, 31)
    with pytest.raises(RuntimeError, match="kernel decode needs no attn_mask"):
        run(q, k, v, mask=torch.ones(1, 1, 1, 512, dtype=torch.bool, device="cuda"))
    with pytest.raises(RuntimeError, match="kernel decode needs float16 or bfloat16"):
        run(q.float(), k.float(), v.float())
    q2, k2, v2 = qkv(1, 4, 4, 1, 512, 60, torch.float16, 32)
    with pytest.raises(RuntimeError, match="kernel decode needs K and V rows 16-byte aligned"):
        run(q2, k2, v2)
    q3 = rand((1, 4, 129, 64), torch.float16, 33)
    with pytest.raises(RuntimeError, match="kernel decode needs len_q <= 128"):
        run(q3, k, v)
