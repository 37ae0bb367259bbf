"""The FP4 KV cache and decode (docs/SPEC.md section 6): the stored rows bit for bit against the
reference quantizer, decode against exact attention on the dequantized cache, paged and ragged
use, errors, memory; on a GPU the CUDA kernels against the CPU backend and graph replays with
changing lengths."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import fp4attn
from fp4attn import reference

HAS_CUDA = torch.cuda.is_available()
#: CPU, and CUDA where there is a GPU (marked gpu)
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


def lse_close(got, want) -> bool:
    """CUDA vs CPU decode lse: SPEC 6 lets a 16-bit tensor-core decode round the rotated query once
    to FP16, so the scores carry a relative error of about 2^-11 of their size (the uneven-channel
    test's reach the hundreds): 2e-3 absolute plus 1e-3 of |lse|."""
    got = got.cpu()
    return bool(((got - want).abs() <= 2e-3 + 1e-3 * want.abs()).all())


def rel_l1(a, b) -> float:
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum().clamp_min(1e-30)).item()


def kv(B, H, n, D, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, n, D, generator=g) * 2 + 1.5  # a mean for the smoothing to remove
    v = torch.randn(B, H, n, D, generator=g)
    return k.to(dtype).to(device), v.to(dtype).to(device)


def exact_decode(q, k, v, lens, window=None, exact=None, key_start=None):
    """float64 attention of the last nq positions of each sequence on k, v [B, Hkv, >=L, D] (each
    query sees its last `window` keys with a window, none before key_start[b]; a query without
    keys: 0 and lse -inf). exact=(kx, vx, R, S): each query's newest R keys still among the last
    S (SPEC 6's residual) from kx, vx instead."""
    B, Hq, nq, D = q.shape
    G = Hq // k.shape[1]
    outs, lses = [], []
    for b in range(B):
        L = int(lens[b])
        pos = torch.arange(L)
        o, lse = torch.empty(Hq, nq, D, dtype=torch.float64), torch.empty(Hq, nq, dtype=torch.float64)
        for t in range(nq):
            last = L - nq + t
            kk, vv = k[b, :, :L].double(), v[b, :, :L].double()
            if exact is not None:
                kx, vx, R, S = exact
                sel = ((pos > last - R) & (pos >= L - S))[None, :, None]
                kk = torch.where(sel, kx[b, :, :L].double(), kk)
                vv = torch.where(sel, vx[b, :, :L].double(), vv)
            kk, vv = kk.repeat_interleave(G, 0), vv.repeat_interleave(G, 0)
            s = (kk @ q[b, :, t].double()[:, :, None])[..., 0] / math.sqrt(D)  # [Hq, L]
            seen = pos <= last
            if window is not None:
                seen &= pos > last - window
            if key_start is not None:
                seen &= pos >= key_start[b]
            s = s.masked_fill(~seen, -math.inf)
            vv = torch.where(seen[None, :, None], vv, 0.0)  # an unseen key's value is not read
            o[:, t] = (torch.softmax(s, -1)[:, None, :] @ vv)[:, 0] if seen.any() else 0.0
            lse[:, t] = torch.logsumexp(s, -1)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def cache_decode_reference(q, cache, k, v, lens=None, window=None, key_start=None):
    """exact_decode as SPEC 6's decode computes on `cache`, which holds k, v [B, Hkv, L, D] as
    appended: the stored rows (zeros before a windowed cache's start: outside every window), each
    query's residual keys from k, v."""
    kd, vd = cache.dequantize(torch.float32, residual=False)
    pad = torch.zeros(*kd.shape[:2], cache.start, kd.shape[3], device=kd.device)
    kd, vd = torch.cat([pad, kd], 2).cpu(), torch.cat([pad, vd], 2).cpu()
    S = cache.res_k.shape[2]
    lens = [len(cache)] * cache.batch if lens is None else lens
    return exact_decode(q.cpu(), kd, vd, lens, window=window,
                        exact=(k.float().cpu(), v.float().cpu(), cache.residual_length, S),
                        key_start=key_start)


def filled_cache(B, H, D, dtype, appends, page_size=None, device="cpu", seed=0,
                 residual_length=fp4attn.kv_cache.DEFAULT_RESIDUAL):
    cache = fp4attn.FP4KVCache(B, H, D, dtype=dtype, device=device, page_size=page_size,
                               residual_length=residual_length)
    ks, vs = [], []
    for i, n in enumerate(appends):
        k, v = kv(B, H, n, D, dtype, seed + i, device)
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
    return cache, torch.cat(ks, 2), torch.cat(vs, 2)


def token_order_mean(k):
    """The mean over dim 2 as SPEC 6 sums it: in token order, float32, one division."""
    s = torch.zeros_like(k[:, :, 0], dtype=torch.float32)
    for i in range(k.shape[2]):
        s = s + k[:, :, i].float()
    return s / k.shape[2]


def stored_rows(cache, length):
    """The cache's stored rows in token order: (K codes, K scales, K row-scale bytes, V codes,
    V scales, V dec) [B, H, length, ...], through the block table."""
    idx = cache.block_table.long()
    out = []
    for t in cache.storage()[:6]:
        x = t[idx].transpose(1, 2)  # [B, H, pages, page_size, ...]
        out.append(x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])[:, :, :length])
    return out


@pytest.mark.parametrize("D", [1, 16, 33, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_rows_are_bit_exact_with_the_reference_quantizer(D, dtype):
    """The C backend's bytes are the reference's: K5 rows of (K - kmean) / kscale (kmean over the
    first 128 tokens, summed in token order; kscale from the same tokens), NVFP4 rows of V."""
    cache, k, v = filled_cache(2, 3, D, dtype, [37, 100, 5], page_size=16)
    kmean = token_order_mean(k[:, :, :128])
    assert torch.equal(cache.kmean, kmean)
    x = k.float() - kmean[:, :, None]
    kscale = reference.k5_channel_scales(x[:, :, :128])
    assert torch.equal(cache.kscale, kscale)
    kc, ks, ke, vc, vs, vd = stored_rows(cache, 142)
    want = reference.k5_quantize(reference._div_rn(x, kscale[:, :, None]))
    assert torch.equal(kc, want[0]) and torch.equal(ks, want[1]) and torch.equal(ke, want[2])
    wc, ws, wd = reference.quantize(v.float()[..., None, :])
    assert torch.equal(vc, wc[..., 0, :]) and torch.equal(vs, ws[..., 0, :]) and torch.equal(vd, wd)


def edge_rows(D: int, dtype) -> torch.Tensor:
    """[1, 1, n, D] key rows that probe the K5 quantizer's edges: zeros, one value, huge and tiny
    magnitudes, subnormals, a NaN, infinities, constant rows, near-ties of the scale search."""
    big = torch.finfo(dtype).max
    rows = [torch.zeros(D), torch.full((D,), 3.0), torch.full((D,), -1e-3)]
    one = torch.zeros(D)
    one[D // 2] = 7.0
    rows.append(one)
    g = torch.Generator().manual_seed(D)
    for scale in (1e-30, 1e-7, 1.0, 1e4, big / 300):
        rows.append(torch.randn(D, generator=g) * scale)
    nan = torch.randn(D, generator=g)
    nan[0] = math.nan
    inf = torch.randn(D, generator=g)
    inf[-1] = -math.inf
    rows += [nan, inf, torch.full((D,), big)]
    ints = torch.randint(-15, 16, (D,), generator=g).float() * 0.375  # exact codes x a scale
    rows.append(ints)
    return torch.stack(rows).to(dtype)[None, None]


@pytest.mark.parametrize("D", [16, 48, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_k5_edge_rows_are_bit_exact(D, dtype):
    """Rows at the quantizer's edges, appended after a mean-fixing first append of zeros (so each
    row is stored as it is): the C bytes equal the reference's; a row with a NaN or an infinity
    (after the rotation) stores the row-scale byte 255 and dequantizes to NaN; a zero row to
    zeros."""
    rows = edge_rows(D, dtype)
    n = rows.shape[2]
    cache = fp4attn.FP4KVCache(1, 1, D, dtype=dtype, page_size=8)
    zeros = torch.zeros(1, 1, 128, D, dtype=dtype)
    cache.append(zeros, zeros)
    cache.append(rows, torch.zeros_like(rows))
    kc, ks, ke = stored_rows(cache, 128 + n)[:3]
    want = reference.k5_quantize(rows.float())
    assert torch.equal(kc[:, :, 128:], want[0]) and torch.equal(ks[:, :, 128:], want[1])
    assert torch.equal(ke[:, :, 128:], want[2])
    dp = -(-D // 16) * 16  # finite after the rotation (BF16 / FP32 maxima overflow in its sums)
    rotated = reference.k5_rotate(torch.nn.functional.pad(rows.float(), (0, dp - D)))
    finite = torch.isfinite(rotated).all(-1)[0, 0]
    assert (ke[0, 0, 128:][~finite] == 255).all() and (ke[0, 0, 128:][finite] < 255).all()
    kd = cache.dequantize(torch.float32, residual=False)[0][0, 0, 128:]
    assert torch.isnan(kd[~finite]).all() and not torch.isnan(kd[finite]).any()
    assert torch.equal(kd[0], torch.zeros(D))


@pytest.mark.parametrize("D", [64, 128])
def test_k5_rows_are_close_and_codes_exact(D):
    """Dequantized K5 rows are within a few percent of the rows; a row of exact codes x one scale
    per 64 values x a power of two comes back exactly after the rotation is undone."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 50, D, generator=g) * 3
    back = reference.k5_dequantize(*reference.k5_quantize(x), D)
    assert ((back - x).norm() / x.norm()).item() < 0.06
    q = torch.randint(-15, 16, (D,), generator=g).float()
    rot = q * 0.5  # a rotated row of codes x 0.5: stored exactly, the rotation undone exactly
    row = reference.k5_rotate(rot[None])[0] / D  # D a power of two: H H = D I
    codes, scales, exp = reference.k5_quantize(row[None])
    assert torch.equal(reference.k5_dequantize(codes, scales, exp, D)[0], row)


def uneven_keys(B, H, n, D, dtype, seed):
    """Keys whose channels differ in size by up to 2^14 (a few near zero, one zero in the first
    tokens only, one huge), around a mean: what the channel scales even out."""
    g = torch.Generator().manual_seed(seed)
    size = torch.exp2(torch.linspace(-10, 4, D))[torch.randperm(D, generator=g)]
    k = torch.randn(B, H, n, D, generator=g) * size + 3.0
    if D > 2:
        k[:, :, :128, 1] = 3.0  # constant while the scales are fixed: r = 0, the floor
        k[:, :, :, 2] *= 100.0
    return k.to(dtype)


def test_channel_scales():
    """SPEC 6's channel scales: sqrt of each channel's largest |K - kmean| over the first tokens,
    at least 2^-6 of the largest; 1 everywhere for all-zero or non-finite first tokens."""
    x = torch.tensor([[[1.0, 4.0, 0.0, -1e-6], [-9.0, 2.0, 0.0, 0.0]]])
    assert reference.k5_channel_scales(x).tolist() == [[3.0, 2.0, 3.0 / 64, 3.0 / 64]]
    assert torch.equal(reference.k5_channel_scales(torch.zeros(2, 5, 8)), torch.ones(2, 8))
    for bad in (math.nan, math.inf):
        x = torch.randn(3, 8)
        x[1, 4] = bad
        assert torch.equal(reference.k5_channel_scales(x), torch.ones(8))
    y = torch.randn(50, 64) * 7
    r = y.abs().amax(0).double().sqrt().float()  # correctly rounded
    assert torch.equal(reference.k5_channel_scales(y), torch.maximum(r, r.amax() / 64))


@pytest.mark.parametrize("D, dtype", [(16, torch.float32), (64, torch.float16), (128, torch.float32),
                                      (256, torch.float16)], ids=str)
def test_uneven_channels_are_stored_and_decoded(D, dtype):
    """Keys of very uneven channels: the C backend's kscale and rows are the reference's, the
    typical channel's error relative to its size is less than half what K5 of K - kmean alone
    gives (whose error, spread evenly by the rotation, swamps the small channels), and the decode
    (queries times kscale, rotated) matches exact attention on the dequantized keys."""
    B, H, n = 1, 2, 200
    k = uneven_keys(B, H, n, D, dtype, D)
    v = torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    cache = fp4attn.FP4KVCache(B, H, D, dtype=dtype, page_size=32)
    cache.append(k[:, :, :50], v[:, :, :50])
    cache.append(k[:, :, 50:], v[:, :, 50:])
    kmean = token_order_mean(k[:, :, :128])
    x = k.float() - kmean[:, :, None]
    kscale = reference.k5_channel_scales(x[:, :, :128])
    assert torch.equal(cache.kscale, kscale) and kscale.amax() / kscale.amin() > 32
    want = reference.k5_quantize(reference._div_rn(x, kscale[:, :, None]))
    got = stored_rows(cache, n)[:3]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    kd, vd = cache.dequantize(torch.float32, residual=False)
    plain = reference.k5_dequantize(*reference.k5_quantize(x), D) + kmean[:, :, None]
    rel = lambda y: ((y - k.float()).norm(dim=2) / x.norm(dim=2)).median()  # the typical channel
    assert rel(kd) < 0.8 and rel(kd) < 0.5 * rel(plain)
    q = torch.randn(B, 4, 2, D, generator=torch.Generator().manual_seed(2)).to(dtype) * 0.1
    out, lse = fp4attn.decode(q, cache, return_lse=True)
    ref, ref_lse = cache_decode_reference(q, cache, k, v)
    assert rel_l1(out, ref) < 3e-3 and (lse.double() - ref_lse).abs().max() < 2e-3


@pytest.mark.parametrize("window", [None, 40])
def test_cache_does_not_depend_on_how_the_first_tokens_were_appended(window):
    """K's mean is that of the first 128 tokens stored (SPEC 6; a windowed cache of window 40:
    the first 55), rows stored before then are stored again exactly: first appends of 1, 16 or
    128 tokens give the same cache."""
    B, H, D, N = 2, 2, 64, 300
    k, v = kv(B, H, N, D, torch.float16, 11)
    caches = []
    chunkings = ([N], [1] * 20 + [N - 20], [16] * 8 + [N - 128], [128, N - 128], [1] * 140 + [N - 140])
    if window is not None:  # appends it stores whole (one longer than window + 15 keeps its end)
        chunkings = ([55] * 5 + [25], [1] * 100 + [50] * 4, [16] * 18 + [12], [5] * 60)
    for chunks in chunkings:
        c = fp4attn.FP4KVCache(B, H, D, dtype=torch.float16, page_size=32, window=window)
        i = 0
        for n in chunks:
            c.append(k[:, :, i:i + n], v[:, :, i:i + n])
            i += n
        caches.append(c)
    want = caches[0].dequantize()
    for c in caches[1:]:
        assert torch.equal(c.kmean, caches[0].kmean) and torch.equal(c.kscale, caches[0].kscale)
        got = c.dequantize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if window is None:
        assert torch.equal(caches[0].kmean, token_order_mean(k[:, :, :128]))



def padded_cache(k, v, padding, chunks, device="cpu", paddings=None):
    """A cache of k, v appended in `chunks`, told `padding` with the first (or `paddings[i]`
    with append i)."""
    B, H, _, D = k.shape
    c = fp4attn.FP4KVCache(B, H, D, dtype=k.dtype, device=device, page_size=32)
    i = 0
    for j, n in enumerate(chunks):
        pad = paddings[j] if paddings is not None else (padding if j == 0 else None)
        c.append(k[:, :, i:i + n].to(device), v[:, :, i:i + n].to(device), padding=pad)
        i += n
    return c


def test_padding_is_left_out_of_the_key_statistics():
    """A left-padded batch (padding 0, 5 and 140 tokens; the pad keys large): each sequence's
    K mean and channel scales are those of its first 128 tokens after its padding, and its
    tokens are stored as the same sequence alone, unpadded, stores them; however the first
    tokens were split into appends (the padding told with the first, or learnt chunk by chunk
    while the statistics are open)."""
    B, H, D, N = 3, 2, 64, 300
    padding = [0, 5, 140]
    k, v = kv(B, H, N, D, torch.float16, 21)
    for b, p in enumerate(padding):
        k[b, :, :p] = 300.0  # pad keys: far from the real ones
    caches = [padded_cache(k, v, padding, chunks) for chunks in
              ([N], [1] * 20 + [N - 20], [16] * 10 + [N - 160], [200, 100])]
    # learnt chunk by chunk: each chunk's mask shows the padding seen so far
    chunks = [16] * 12 + [N - 192]
    seen = [[min(p, 16 * (j + 1)) for p in padding] for j in range(len(chunks))]
    caches.append(padded_cache(k, v, None, chunks, paddings=seen))
    want = caches[0].dequantize(), stored_rows(caches[0], N)
    for c in caches:
        assert c.padding == tuple(padding) and c.statistics_fixed
        got = c.dequantize(), stored_rows(c, N)
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    c = caches[0]
    for b, p in enumerate(padding):
        real = k[b:b + 1, :, p:]
        assert torch.equal(c.kmean[b:b + 1], token_order_mean(real[:, :, :128]))
        x = real[:, :, :128].float() - c.kmean[b:b + 1, :, None]
        assert torch.equal(c.kscale[b:b + 1], reference.k5_channel_scales(x))
        alone = padded_cache(real, v[b:b + 1, :, p:], None, [N - p])
        assert torch.equal(alone.kmean, c.kmean[b:b + 1])
        rows, alone_rows = stored_rows(c, N), stored_rows(alone, N - p)
        assert all(torch.equal(r[b:b + 1, :, p:], a) for r, a in zip(rows, alone_rows))


def test_padding_keeps_the_statistics_open_until_each_sequence_has_its_tokens():
    """Statistics stay open while a sequence has fewer than 128 tokens after its padding (here
    one with 100 pads among 150 tokens), and a sequence with no token yet gets kmean 0, kscale 1."""
    B, H, D = 2, 1, 32
    k, v = kv(B, H, 240, D, torch.float32, 22)
    c = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32)
    c.append(k[:, :, :50], v[:, :, :50], padding=[0, 60])
    assert not c.statistics_fixed
    assert torch.equal(c.kmean[1], torch.zeros(H, D)) and torch.equal(c.kscale[1], torch.ones(H, D))
    c.append(k[:, :, 50:150], v[:, :, 50:150], padding=[0, 100])
    assert not c.statistics_fixed  # sequence 1 has 50 of its 128
    assert torch.equal(c.kmean[1:], token_order_mean(k[1:, :, 100:150]))
    c.append(k[:, :, 150:], v[:, :, 150:])
    assert c.statistics_fixed and torch.equal(c.kmean[1:], token_order_mean(k[1:, :, 100:228]))
    assert torch.equal(c.kmean[:1], token_order_mean(k[:1, :, :128]))


def test_statistics_close_at_256_stored_tokens_whatever_the_padding():
    """A long padded prompt beside a short one (300 of 400 tokens padding): the statistics are
    fixed at once from the 100 tokens the short sequence has, and no exact copy is kept; a
    padding past every stored token (a huge value) gives kmean 0, kscale 1 until then."""
    B, H, D = 2, 1, 32
    k, v = kv(B, H, 400, D, torch.float32, 25)
    c = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32)
    c.append(k, v, padding=[0, 300])
    assert c.statistics_fixed and c._early is None
    assert torch.equal(c.kmean[1], token_order_mean(k[1:, :, 300:])[0])
    c = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32)
    c.append(k[:, :, :200], v[:, :, :200], padding=[0, 2**40])
    assert not c.statistics_fixed
    assert torch.equal(c.kmean[1], torch.zeros(H, D)) and torch.equal(c.kscale[1], torch.ones(H, D))
    c.append(k[:, :, 200:], v[:, :, 200:])
    assert c.statistics_fixed and torch.equal(c.kmean[:1], token_order_mean(k[:1, :, :128]))


def test_bad_padding_is_refused_and_leaves_the_cache_unchanged():
    k, v = kv(2, 2, 130, 32, torch.float16, 23)
    c = fp4attn.FP4KVCache(2, 2, 32, dtype=torch.float16)
    for bad in ([1], [1, -1], [1, 2.0], [True, 0], "ab", torch.tensor([0.5, 1.0])):
        with pytest.raises(ValueError, match="padding must be 2 ints >= 0"):
            c.append(k, v, padding=bad)
    assert len(c) == 0
    c.append(k, v, padding=torch.tensor([0, 2]))
    assert c.statistics_fixed and c.padding == (0, 2)
    state = [t.clone() for t in c.storage()]
    with pytest.raises(ValueError, match="after K's statistics were fixed"):
        c.append(k[:, :, :1], v[:, :, :1], padding=[0, 3])
    c.append(k[:, :, :1], v[:, :, :1], padding=[0, 2])  # the same: accepted
    assert len(c) == 131 and all(torch.equal(a, b) for a, b in zip(state[6:], c.storage()[6:]))
    with pytest.raises(ValueError, match="windowed cache does not take padding"):
        fp4attn.FP4KVCache(2, 2, 32, dtype=torch.float16, window=8).append(k, v, padding=[0, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_padded_statistics_are_the_cpu_bytes():
    B, H, D, N = 3, 2, 128, 260
    padding = [0, 7, 131]
    k, v = kv(B, H, N, D, torch.bfloat16, 24)
    for chunks in ([N], [16] * 9 + [N - 144]):
        want = padded_cache(k, v, padding, chunks)
        got = padded_cache(k, v, padding, chunks, device="cuda")
        assert torch.equal(got.kmean.cpu(), want.kmean) and torch.equal(got.kscale.cpu(), want.kscale)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(stored_rows(got, N), stored_rows(want, N)))


CASES = [  # B, Hq, Hkv, D, appends, nq, page_size
    (2, 8, 2, 128, [300, 1, 1], 1, None),
    (1, 8, 2, 128, [200, 4], 4, 16),
    (2, 4, 4, 64, [129], 1, 32),
    (1, 6, 2, 80, [50, 3], 3, 7),
    (1, 2, 1, 256, [90], 2, None),
    (3, 2, 2, 16, [5, 1], 1, None),
    (2, 16, 2, 128, [400, 2], 2, 96),  # 16 query rows per KV head; pages of 3 chunks
    (1, 12, 1, 64, [333], 1, 96),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_matches_exact_attention_on_the_dequantized_cache(case, dtype):
    B, Hq, Hkv, D, appends, nq, page = case
    cache, k, v = filled_cache(B, Hkv, D, dtype, appends, page_size=page)
    q = torch.randn(B, Hq, nq, D, generator=torch.Generator().manual_seed(9)).to(dtype)
    out, lse = fp4attn.decode(q, cache, return_lse=True)
    ref, ref_lse = cache_decode_reference(q, cache, k, v)
    assert out.dtype == dtype and rel_l1(out, ref) < 3e-3
    assert (lse.double() - ref_lse).abs().max() < 2e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_decode_key_start_leaves_each_sequences_padding_unseen(dtype, window, device):
    """key_start: a left-padded batch's decode (what FP4Cache passes for transformers' padding
    masks). Sequences with no padding, padding in the stored rows, and padding reaching the
    residual ring (the first query then sees no key: 0 and lse -inf, the second one key)."""
    B, Hq, Hkv, D, nq = 3, 8, 2, 128, 2
    cache, k, v = filled_cache(B, Hkv, D, dtype, [150, 2], page_size=32, device=device)
    q = torch.randn(B, Hq, nq, D, generator=torch.Generator().manual_seed(11)).to(dtype)
    starts = [0, 37, 151]
    out, lse = fp4attn.decode(q.to(device), cache, return_lse=True, window=window,
                              key_start=starts)
    ref, ref_lse = cache_decode_reference(q, cache, k, v, window=window, key_start=starts)
    out, lse = out.cpu(), lse.cpu()
    assert rel_l1(out[:2], ref[:2]) < 3e-3 and rel_l1(out[2, :, 1], ref[2, :, 1]) < 3e-3
    assert (out[2, :, 0] == 0).all() and (lse[2, :, 0] == -math.inf).all()
    seen = torch.isfinite(ref_lse)
    assert (lse.double()[seen] - ref_lse[seen]).abs().max() < 2e-3
    plain = fp4attn.decode(q.to(device), cache, window=window).cpu()
    assert torch.equal(out[0], plain[0])  # no padding: the same bits as without key_start


@pytest.mark.parametrize("device", DEVICES)
def test_decode_key_start_hides_non_finite_padding(device):
    """Padding before key_start that holds NaN values (NaN decs and scales in the stored rows and
    the exact ones in the ring): no query sees it, so nothing of it reaches the outputs (on CUDA
    a masked key's 0 x NaN would spread through the MMA to every row of its tile)."""
    B, Hq, Hkv, D, nq = 3, 8, 2, 128, 2
    k, v = kv(B, Hkv, 152, D, torch.float16, 3)
    starts = [0, 37, 151]  # 37: inside a 32-key chunk; 151: the ring's rows before it too
    for b, s in enumerate(starts):
        v[b, :, :s] = math.nan
    cache = fp4attn.FP4KVCache(B, Hkv, D, dtype=torch.float16, device=device, page_size=32)
    cache.append(k.to(device), v.to(device))
    q = torch.randn(B, Hq, nq, D, generator=torch.Generator().manual_seed(12)).half()
    out, lse = fp4attn.decode(q.to(device), cache, return_lse=True, key_start=starts)
    ref, ref_lse = cache_decode_reference(q, cache, k, v, key_start=starts)
    out, lse = out.cpu(), lse.cpu()
    assert torch.isfinite(out).all()
    assert rel_l1(out[:2], ref[:2]) < 3e-3 and rel_l1(out[2, :, 1], ref[2, :, 1]) < 3e-3
    assert (out[2, :, 0] == 0).all() and (lse[2, :, 0] == -math.inf).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 4])
def test_decode_key_start_past_the_sequence_leaves_its_queries_without_keys(window, device):
    """key_start beyond a sequence's length (legal: the padding list of a batch whose shorter
    sequence is all padding) leaves its queries without keys (0, lse -inf) and reads nothing past
    its end; the other sequence is answered as without key_start. A windowed cache too."""
    B, H, D = 2, 1, 32
    k, v = kv(B, H, 20, D, torch.float32, 5)
    cache = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32, device=device, page_size=16,
                               window=window)
    cache.append(k.to(device), v.to(device))
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(6)).to(device)
    for starts in ([0, 21], [0, 100], [0, 20]):
        out, lse = fp4attn.decode(q, cache, return_lse=True, key_start=starts)
        plain, plain_lse = fp4attn.decode(q, cache, return_lse=True)
        assert (out[1] == 0).all() and (lse[1] == -math.inf).all(), starts
        assert torch.equal(out[0], plain[0]) and torch.equal(lse[0], plain_lse[0]), starts


def _state(cache):
    return [t.cpu() for t in (*cache.storage(), cache.seq_lens, cache.res_k, cache.res_v)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,appends", [(None, [50, 1]), (None, [150, 3]), (20, [60, 2])])
def test_select_keeps_each_picked_sequence_whole(window, appends, device):
    """select(indices) (beam search's reorder, a batch repeated or narrowed): the cache is, byte
    for byte, the one built by appending the picked sequences' tokens, also while K's statistics
    are still open (50 tokens < 128) and with padding, and it goes on appending alike."""
    B, H, D = 3, 2, 64
    picks = [2, 0, 0, 1]
    toks = [kv(B, H, n, D, torch.float16, 20 + i) for i, n in enumerate(appends)]
    pad = None if window is not None else [0, 5, 2]

    def build(rows):
        c = fp4attn.FP4KVCache(len(rows), H, D, dtype=torch.float16, device=device, page_size=16,
                               window=window)
        for i, (k, v) in enumerate(toks[:-1]):
            c.append(k[rows].to(device), v[rows].to(device),
                     padding=None if pad is None or i else [pad[r] for r in rows])
        return c

    cache = build(list(range(B)))
    cache.select(torch.tensor(picks))
    want = build(picks)
    assert cache.batch == 4 and cache.padding == want.padding
    assert all(torch.equal(a, b) for a, b in zip(_state(cache), _state(want)))
    k, v = toks[-1]
    cache.append(k[picks].to(device), v[picks].to(device))
    want.append(k[picks].to(device), v[picks].to(device))
    assert all(torch.equal(a, b) for a, b in zip(_state(cache), _state(want)))
    q = torch.randn(4, 4, 1, D, generator=torch.Generator().manual_seed(3)).half().to(device)
    assert torch.equal(fp4attn.decode(q, cache), fp4attn.decode(q, want))


def test_select_refuses_bad_indices_and_leaves_the_cache():
    cache, _, _ = filled_cache(2, 1, 32, torch.float32, [20])
    before = _state(cache)
    for bad in ([], [2], [-1], [0.5], [[0, 1]], torch.tensor([True, False])):
        with pytest.raises(ValueError, match="indices must be a non-empty 1-D"):
            cache.select(bad)
    assert cache.batch == 2 and all(torch.equal(a, b) for a, b in zip(_state(cache), before))


def _kept(cache, length):
    """What a crop to `length` must keep of a cache: its stored rows, K's statistics and the
    residual ring's slots of the tokens a one-position decode reads exactly."""
    R, S = cache.residual_length, cache.res_k.shape[2]
    at = torch.arange(max(0, length - R), length, device=cache.device) % S
    return [t.cpu() for t in (*stored_rows(cache, length), cache.kmean, cache.kscale,
                              cache.res_k[:, :, at], cache.res_v[:, :, at], cache.seq_lens)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("appends,length", [([50, 20], 55), ([150, 20], 160), ([150, 20], 0)])
def test_crop_decodes_as_the_cache_of_the_kept_tokens(appends, length, device):
    """crop(length) (speculative decoding's rejected tokens): byte for byte the cache appended
    only the kept tokens, while K's statistics are open (50 tokens, stored again) and after
    (150: a crop of at most 15 keeps every one-position decode's exact keys), and both go on
    appending and decoding alike (16 new tokens refresh every ring slot a decode reads)."""
    B, H, D = 2, 2, 64
    cache, k, v = filled_cache(B, H, D, torch.float16, appends, device=device, page_size=32)
    cache.crop(length)
    want = fp4attn.FP4KVCache(B, H, D, dtype=torch.float16, device=device, page_size=32)
    if length:
        want.append(k[:, :, :length], v[:, :, :length])
    assert len(cache) == length
    assert all(torch.equal(a, b) for a, b in zip(_kept(cache, length), _kept(want, length)))
    g = torch.Generator().manual_seed(5)
    if length:
        q = torch.randn(B, 4, 1, D, generator=g).half().to(device)
        assert torch.equal(fp4attn.decode(q, cache), fp4attn.decode(q, want))
    k2, v2 = kv(B, H, 16, D, torch.float16, 77, device)
    cache.append(k2, v2)
    want.append(k2, v2)
    q = torch.randn(B, 4, 16, D, generator=g).half().to(device)
    assert torch.equal(fp4attn.decode(q, cache), fp4attn.decode(q, want))


@pytest.mark.parametrize("device", DEVICES)
def test_crop_of_more_than_the_ring_reads_the_stored_rows_there(device):
    """A crop of 40 tokens (more than the ring's 31): the newest kept tokens' ring slots were
    overwritten by cropped ones, so the ring holds their stored values instead; the decode reads
    what dequantize() reports, for one and for 16 positions."""
    B, H, D = 1, 2, 64
    cache, k, v = filled_cache(B, H, D, torch.float32, [180, 40], device=device, page_size=32)
    cache.crop(180)
    stored, _ = cache.dequantize(torch.float32, residual=False)
    ring, _ = cache.dequantize(torch.float32)
    assert torch.equal(ring[:, :, -16:], stored[:, :, -16:])  # no cropped token's values
    q = torch.randn(B, 4, 16, D, generator=torch.Generator().manual_seed(8)).to(device)
    out = fp4attn.decode(q, cache)
    for t in (0, 15):
        kd, vd = cache.dequantize(torch.float32, position=180 - 16 + t)
        one, _ = exact_decode(q[:, :, t:t + 1].cpu(), kd.cpu(), vd.cpu(), [180 - 16 + t + 1])
        assert rel_l1(out[:, :, t:t + 1].cpu(), one) < 3e-3


@pytest.mark.parametrize("device", DEVICES)
def test_crop_of_a_windowed_cache_keeps_what_its_windows_see(device):
    """A windowed cache that dropped tokens (window 20, 60 appended: it keeps 25..59) can drop
    tokens as long as the next queries' windows stay stored (to 58: they see 39..58), then decodes
    on them; a deeper crop is refused and changes nothing."""
    B, H, D, W = 1, 2, 64, 20
    cache = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32, device=device, page_size=16, window=W)
    k, v = kv(B, H, 60, D, torch.float32, 3, device)
    cache.append(k, v)
    before = _state(cache)
    with pytest.raises(ValueError, match="it can drop at most 16 tokens"):
        cache.crop(40)
    assert len(cache) == 60 and all(torch.equal(a, b) for a, b in zip(_state(cache), before))
    cache.crop(44)
    assert len(cache) == 44 and cache.start == 25
    # the windows of positions 28..43 reach 9..24, no longer stored: refused, not read
    with pytest.raises(ValueError, match="no longer stores the keys before position 25"):
        fp4attn.decode(torch.zeros(B, 4, 16, D, device=device), cache)
    k2, v2 = kv(B, H, 3, D, torch.float32, 4, device)
    cache.append(k2, v2)
    kk, vv = torch.cat([k[:, :, :44], k2], 2), torch.cat([v[:, :, :44], v2], 2)
    q = torch.randn(B, 4, 3, D, generator=torch.Generator().manual_seed(6)).to(device)
    out = fp4attn.decode(q, cache)
    ref, _ = cache_decode_reference(q, cache, kk, vv, window=W)
    assert rel_l1(out.cpu(), ref) < 3e-3


@pytest.mark.parametrize("device", DEVICES)
def test_crop_within_a_windowed_caches_rollback_decodes_as_the_kept_tokens(device):
    """rollback=24 keeps 24 tokens more: a crop of 24 from a cache that dropped tokens leaves
    every window of a 16-position decode stored, and the decode reads what a cache of the kept
    tokens holds there (checked against exact attention on its dequantized rows)."""
    B, H, D, W = 1, 2, 64, 20
    cache = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32, device=device, page_size=16,
                               window=W, rollback=24)
    k, v = kv(B, H, 200, D, torch.float32, 13, device)
    cache.append(k[:, :, :150], v[:, :, :150])
    cache.append(k[:, :, 150:], v[:, :, 150:])
    cache.crop(176)
    assert cache.start == 200 - (W + 15 + 24)
    q = torch.randn(B, 4, 16, D, generator=torch.Generator().manual_seed(14)).to(device)
    out = fp4attn.decode(q, cache)
    for t in (0, 15):
        kd, vd = cache.dequantize(torch.float32, position=176 - 16 + t)
        pad = torch.zeros(B, H, cache.start, D, device=kd.device)
        kd, vd = torch.cat([pad, kd], 2).cpu(), torch.cat([pad, vd], 2).cpu()
        one, _ = exact_decode(q[:, :, t:t + 1].cpu(), kd, vd, [176 - 16 + t + 1], window=W)
        assert rel_l1(out[:, :, t:t + 1].cpu(), one) < 3e-3
    for bad, what in ((-1, "rollback must be an int >= 0"), (True, "rollback must be an int"),
                      (8, "rollback applies to a windowed cache")):
        with pytest.raises(ValueError, match=what):
            fp4attn.FP4KVCache(B, H, D, window=None if bad == 8 else W, rollback=bad)


def test_crop_keeps_fp16_keys_near_the_maximum_finite():
    """A crop that puts stored values into the ring: keys near FP16's maximum dequantize up to
    ~12 % larger, clamped to the dtype's range there (not Inf, which made the decode NaN)."""
    B, H, D = 1, 1, 32
    k = torch.full((B, H, 200, D), 6.0e4).half() * torch.randn(B, H, 200, D).sign().half()
    v = torch.randn(B, H, 200, D).half()
    cache = fp4attn.FP4KVCache(B, H, D, dtype=torch.float16)
    cache.append(k, v)
    cache.crop(150)
    assert torch.isfinite(cache.res_k.float()).all()
    assert torch.isfinite(fp4attn.decode(torch.randn(B, 2, 1, D).half() * 1e-3, cache)).all()


def test_crop_refuses_bad_lengths_and_leaves_the_cache():
    cache, _, _ = filled_cache(1, 1, 32, torch.float32, [20])
    before = _state(cache)
    for bad in (-1, 21, 1.5, True, None):
        with pytest.raises(ValueError, match=r"length must be an int in \[0, 20\]"):
            cache.crop(bad)
    assert len(cache) == 20 and all(torch.equal(a, b) for a, b in zip(_state(cache), before))


def test_decode_key_start_arguments_are_checked():
    cache, _, _ = filled_cache(2, 1, 32, torch.float32, [20])
    q = torch.randn(2, 2, 1, 32)
    for bad in ([-1, 0], [0], [0, 1.5], "0,1", [True, 0]):
        with pytest.raises(ValueError, match="key_start must be 2 ints >= 0"):
            fp4attn.decode(q, cache, key_start=bad)
    args = (q, *cache.storage(), cache.seq_lens)
    for bad in (torch.zeros(2), torch.zeros(3, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="key_start must be a contiguous int32 \\[batch=2\\]"):
            fp4attn.decode_paged(*args, key_start=bad, **cache.residual())
    # below 0 acts as 0 (the device's values are not read on the host)
    neg = fp4attn.decode_paged(*args, key_start=torch.tensor([-5, 0], dtype=torch.int32),
                               **cache.residual())
    assert torch.equal(neg, fp4attn.decode(q, cache))
    # an int32 [B] tensor on the cache's device goes to the kernel as is, unchecked (decode_paged)
    for starts in (torch.tensor([-5, 3], dtype=torch.int32),
                   torch.tensor([0, 3], dtype=torch.int32)):
        assert torch.equal(fp4attn.decode(q, cache, key_start=starts),
                           fp4attn.decode(q, cache, key_start=[0, 3]))


WINDOW_CASES = [  # B, Hq, Hkv, D, tokens, nq, page_size, window
    (2, 8, 2, 128, 300, 1, None, 100),
    (1, 8, 2, 128, 700, 4, 32, 64),
    (1, 4, 4, 64, 90, 3, 7, 1),
    (2, 2, 1, 80, 50, 2, None, 500),
]


def check_window_case(case, dtype, device):
    B, Hq, Hkv, D, n, nq, page, window = case
    cache, k, v = filled_cache(B, Hkv, D, dtype, [n], page_size=page, device=device)
    q = torch.randn(B, Hq, nq, D, generator=torch.Generator().manual_seed(5)).to(dtype)
    out, lse = fp4attn.decode(q.to(device), cache, return_lse=True, window=window)
    ref, ref_lse = cache_decode_reference(q, cache, k, v, window=window)
    assert rel_l1(out.cpu(), ref) < 3e-3
    assert (lse.cpu().double() - ref_lse).abs().max() < 2e-3


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sliding_window_decode(case):
    check_window_case(case, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="window"):
        check_window_case(case[:-1] + (0,), torch.bfloat16, "cpu")


def test_windowed_cache_keeps_the_window_in_a_ring():
    """A windowed cache stores only the last window + 15 tokens (a long first append, then single
    tokens wrapping the ring many times), its memory stays put, and its decodes agree with exact
    windowed attention on what it keeps."""
    B, H, D, W, page = 2, 2, 64, 40, 16
    cache = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32, window=W, page_size=page, max_tokens=600)
    k, v = kv(B, H, 300, D, torch.float32, 1)
    cache.append(k, v)
    pool = cache.k_codes.numel()
    assert cache.start == 300 - (W + 15) and cache.k_codes.shape[0] == B * (-(-(W + 15) // page) + 1)
    for i in range(120):
        kn, vn = kv(B, H, 1, D, torch.float32, 100 + i)
        cache.append(kn, vn)
        k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
    assert len(cache) == 420 and cache.start == 420 - (W + 15) and cache.k_codes.numel() == pool
    assert cache.dequantize(torch.float32)[0].shape == (B, H, W + 15, D)
    for nq, window in ((1, None), (4, None), (16, 25)):
        q = torch.randn(B, 8, nq, D, generator=torch.Generator().manual_seed(nq))
        out, lse = fp4attn.decode(q, cache, return_lse=True, window=window)
        ref, ref_lse = cache_decode_reference(q, cache, k, v, window=window or W)
        assert rel_l1(out, ref) < 3e-3 and (lse.double() - ref_lse).abs().max() < 2e-3
    with pytest.raises(ValueError, match="exceeds the cache's window=40"):
        fp4attn.decode(torch.zeros(B, 8, 1, D), cache, window=41)
    with pytest.raises(ValueError, match="serves at most 16"):
        fp4attn.decode(torch.zeros(B, 8, 17, D), cache)
    with pytest.raises(ValueError, match="window must be"):
        fp4attn.FP4KVCache(1, 1, 64, window=0)


def test_paged_ragged_batch_with_a_shuffled_block_table():
    B, H, D, page = 3, 2, 64, 8
    lens = [5, 40, 17]
    pages_per_seq = 5
    perm = torch.randperm(B * pages_per_seq, generator=torch.Generator().manual_seed(1))
    table = perm.view(B, pages_per_seq).to(torch.int32)
    caches = []
    for b in range(B):  # each sequence filled through its own rows of the shared pool
        c = fp4attn.FP4KVCache(1, H, D, dtype=torch.float16, page_size=page, max_tokens=40)
        k, v = kv(1, H, lens[b], D, torch.float16, 30 + b)
        c.append(k, v)
        caches.append((c, k, v))
    pool = [torch.zeros(B * pages_per_seq, *t.shape[1:], dtype=t.dtype) for t in caches[0][0].storage()[:6]]
    for b, (c, _, _) in enumerate(caches):
        for i in range(pages_per_seq):
            for dst, src in zip(pool, c.storage()[:6]):
                dst[table[b, i]] = src[i]
    kmean = torch.cat([c.kmean for c, _, _ in caches])
    kscale = torch.cat([c.kscale for c, _, _ in caches])
    ring = {"residual_k": torch.cat([c.res_k for c, _, _ in caches]),  # each sequence's own ring
            "residual_v": torch.cat([c.res_v for c, _, _ in caches]), "residual_length": 16}
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(B, 4, 2, D, dtype=torch.float16)
    out = fp4attn.decode_paged(q, *pool, kmean, kscale, table, seq_lens, **ring)
    plain = fp4attn.decode_paged(q, *pool, kmean, kscale, table, seq_lens)  # the stored rows only
    for b, (c, k, v) in enumerate(caches):
        ref, _ = cache_decode_reference(q[b:b + 1], c, k, v)
        assert rel_l1(out[b:b + 1], ref) < 3e-3
        kd, vd = c.dequantize(torch.float32, residual=False)
        ref, _ = exact_decode(q[b:b + 1], kd, vd, [lens[b]])
        assert rel_l1(plain[b:b + 1], ref) < 3e-3


def test_residual_keys_are_each_querys_newest():
    """SPEC 6's residual: a query reads its newest R keys exactly whatever the call's number of
    query positions (a decode of 4 positions gives, per row, what one-position decodes of the
    shorter caches give); a residual as long as the sequence is exact attention; residual 0 reads
    the stored rows only."""
    B, H, D, L = 1, 2, 64, 170
    k, v = kv(B, H, L, D, torch.float32, 31)
    q = torch.randn(B, 4, 4, D, generator=torch.Generator().manual_seed(32))
    full = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32)
    full.append(k, v)
    out = fp4attn.decode(q, full)
    for t in range(4):
        part = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32)
        part.append(k[:, :, :L - 3 + t], v[:, :, :L - 3 + t])
        one = fp4attn.decode(q[:, :, t:t + 1], part)
        assert torch.allclose(one[:, :, 0], out[:, :, t], rtol=1e-5, atol=1e-6)
    everything = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32, residual_length=L)
    everything.append(k, v)
    ref, ref_lse = exact_decode(q, k, v, [L])
    got, lse = fp4attn.decode(q, everything, return_lse=True)
    assert rel_l1(got, ref) < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-4
    none = fp4attn.FP4KVCache(B, H, D, dtype=torch.float32, residual_length=0)
    none.append(k, v)
    assert none.res_k.numel() == 0 and torch.equal(none.dequantize()[0], none.dequantize(residual=False)[0])
    kd, vd = none.dequantize(torch.float32)
    ref0, _ = exact_decode(q, kd, vd, [L])
    got0 = fp4attn.decode(q, none)
    assert rel_l1(got0, ref0) < 3e-3 and rel_l1(out, ref) < rel_l1(got0, ref)


def test_residual_of_a_long_decode_call_is_what_the_ring_still_holds():
    """A decode of more positions than the ring serves (40 > 16, a non-windowed cache): each
    query reads from the ring only its newest residual keys that are still there (j >= L - 31),
    the rest from the pages, as SPEC 6 says; the reference builds each query's keys itself."""
    cache, k, v = filled_cache(1, 2, 64, torch.float32, [230], page_size=32)
    q = torch.randn(1, 4, 40, 64, generator=torch.Generator().manual_seed(41))
    out, lse = fp4attn.decode(q, cache, return_lse=True)
    ref, ref_lse = cache_decode_reference(q, cache, k, v)
    assert rel_l1(out, ref) < 3e-3 and (lse.double() - ref_lse).abs().max() < 2e-3
    for t in (0, 20, 39):  # the first queries read no ring row; the last ones their newest 16
        kd, vd = cache.dequantize(torch.float32, position=230 - 40 + t)
        one, _ = exact_decode(q[:, :, t:t + 1], kd, vd, [230 - 40 + t + 1])
        assert rel_l1(out[:, :, t:t + 1], one) < 3e-3


def test_residual_arguments_are_checked():
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="residual_length"):
            fp4attn.FP4KVCache(1, 2, 32, residual_length=bad)


def test_sizes_must_be_ints_not_bools_and_dequantize_takes_float_dtypes():
    for name in ("page_size", "max_tokens"):
        with pytest.raises(ValueError, match=name):
            fp4attn.FP4KVCache(1, 2, 32, **{name: True})
    for i, name in enumerate(("batch", "kv_heads", "head_dim")):
        args = [1, 2, 32]
        args[i] = True
        with pytest.raises(ValueError, match=name):
            fp4attn.FP4KVCache(*args)
    cache = fp4attn.FP4KVCache(1, 2, 32)
    cache.append(*kv(1, 2, 4, 32, torch.float16, 0))
    with pytest.raises(ValueError, match="dtype must be one of"):
        cache.dequantize(dtype=torch.int32)
    assert cache.dequantize(dtype=torch.float32)[0].dtype == torch.float32
    cache = fp4attn.FP4KVCache(1, 2, 32, dtype=torch.float16)
    cache.append(*kv(1, 2, 20, 32, torch.float16, 0))
    q = torch.randn(1, 2, 1, 32, dtype=torch.float16)
    args = (q, *cache.storage(), cache.seq_lens)
    with pytest.raises(ValueError, match="residual_k and residual_v are given together"):
        fp4attn.decode_paged(*args, residual_k=cache.res_k, residual_v=cache.res_v)
    with pytest.raises(ValueError, match="residual_k and residual_v are given together"):
        fp4attn.decode_paged(*args, residual_k=cache.res_k, residual_length=16)
    for ring, length in (((cache.res_k[:, :, :8], cache.res_v[:, :, :8]), 16),  # fewer slots than R
                         ((cache.res_k.float(), cache.res_v.float()), 16),  # not q's dtype
                         ((cache.res_k[:1, :1], cache.res_v[:1, :1]), 16)):  # not [B, Hkv, S, D]
        with pytest.raises((ValueError, RuntimeError), match="res_k and res_v must be"):
            fp4attn.decode_paged(*args, residual_k=ring[0], residual_v=ring[1], residual_length=length)


def test_decode_paged_in_the_order_before_kscale_is_refused():
    """decode_paged gained kscale after kmean; a call in the old order (block_table where kscale
    goes) must fail with an error that names kscale, not compute with the wrong tensors."""
    cache = fp4attn.FP4KVCache(1, 2, 32, dtype=torch.float16)
    cache.append(*kv(1, 2, 20, 32, torch.float16, 0))
    *pages, kmean, kscale, table = cache.storage()
    q = torch.randn(1, 2, 1, 32, dtype=torch.float16)
    with pytest.raises(TypeError, match="seq_lens"):
        fp4attn.decode_paged(q, *pages, kmean, table, cache.seq_lens)
    with pytest.raises((ValueError, RuntimeError), match="kscale"):  # with the scale positional
        fp4attn.decode_paged(q, *pages, kmean, table, cache.seq_lens, 0.125)


def test_growth_keeps_the_stored_tokens():
    cache = fp4attn.FP4KVCache(2, 2, 32, dtype=torch.float16, page_size=4)
    k, v = kv(2, 2, 130, 32, torch.float16, 0)  # past the 128 tokens that fix K's mean
    cache.append(k, v)
    before = cache.dequantize(residual=False)
    for i in range(20):
        cache.append(*kv(2, 2, 1, 32, torch.float16, i + 1))
    assert len(cache) == 150 and cache.capacity >= 150
    after = cache.dequantize(residual=False)
    assert torch.equal(after[0][:, :, :130], before[0]) and torch.equal(after[1][:, :, :130], before[1])


def test_memory_is_at_least_3_2x_smaller_than_fp16():
    """Head dim 128: K 80 code bytes + 2 scales + 1 row scale, V 64 + 8 + 4: 159 bytes per token
    and head against 512, plus the residual ring of 31 FP16 tokens: 3.21x at 32K tokens,
    everything counted."""
    cache = fp4attn.FP4KVCache(1, 8, 128, dtype=torch.float16, max_tokens=32768)
    per_token = sum(t[0, 0, 0].numel() * t.element_size() for t in cache.storage()[:6])
    assert per_token == 159
    assert cache.res_k.shape == (1, 8, 31, 128) and cache.res_k.dtype == torch.float16
    fp16_bytes = 2 * 8 * 32768 * 128 * 2
    ring = 2 * cache.res_k.numel() * 2
    assert cache.nbytes >= 8 * 32768 * 159 + ring and fp16_bytes / cache.nbytes >= 3.2


def test_errors_leave_the_cache_unchanged():
    cache = fp4attn.FP4KVCache(1, 2, 32, dtype=torch.float16, max_tokens=8)
    k, v = kv(1, 2, 6, 32, torch.float16, 0)
    cache.append(k, v)
    state = [t.clone() for t in (*cache.storage(), cache.res_k, cache.res_v)]
    bad = [
        (kv(1, 3, 1, 32, torch.float16, 1), "kv_heads=2"),
        (kv(1, 2, 1, 16, torch.float16, 1), "head_dim=32"),
        (kv(1, 2, 1, 32, torch.float32, 1), "must be torch.float16"),
        (kv(1, 2, 3, 32, torch.float16, 1), "exceeds max_tokens=8"),
    ]
    for (bk, bv), msg in bad:
        with pytest.raises(ValueError, match=msg):
            cache.append(bk, bv)
    assert len(cache) == 6 and all(torch.equal(a, b) for a, b in
                                   zip(state, (*cache.storage(), cache.res_k, cache.res_v)))
    with pytest.raises(ValueError, match="heads"):
        fp4attn.decode(torch.zeros(1, 3, 1, 32, dtype=torch.float16), cache)
    with pytest.raises(ValueError, match="the cache holds 6 tokens"):
        fp4attn.decode(torch.zeros(1, 2, 7, 32, dtype=torch.float16), cache)
    with pytest.raises(ValueError, match="page_size"):
        fp4attn.FP4KVCache(1, 2, 32, page_size=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_cache_is_bit_exact_and_decode_matches(case, dtype):
    B, Hq, Hkv, D, appends, nq, page = case
    cpu, k, v = filled_cache(B, Hkv, D, dtype, appends, page_size=page)
    gpu, _, _ = filled_cache(B, Hkv, D, dtype, appends, page_size=page, device="cuda")
    for a, b in zip((*cpu.storage(), cpu.res_k, cpu.res_v), (*gpu.storage(), gpu.res_k, gpu.res_v)):
        assert torch.equal(a, b.cpu())
    q = torch.randn(B, Hq, nq, D, generator=torch.Generator().manual_seed(9)).to(dtype)
    out, lse = fp4attn.decode(q.cuda(), gpu, return_lse=True)
    ref, ref_lse = cache_decode_reference(q, cpu, k, v)
    assert out.dtype == dtype and rel_l1(out.cpu(), ref) < 3e-3
    assert (lse.cpu().double() - ref_lse).abs().max() < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_sliding_window_decode(case, dtype):
    check_window_case(case, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [2**31 - 1, 2**31, 2**33 + 5])
def test_cuda_window_wider_than_int32_is_no_window(window):
    """The C API takes the window as int64: widths of 2^31 and more see every key, as no window."""
    cache, _, _ = filled_cache(2, 2, 128, torch.float16, [300], page_size=32, device="cuda")
    q = torch.randn(2, 8, 3, 128, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    want, want_lse = fp4attn.decode(q.cuda(), cache, return_lse=True)
    out, lse = fp4attn.decode(q.cuda(), cache, return_lse=True, window=window)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_decode_long_gqa_matches_the_cpu_backend(D, dtype):
    """Whole pages, many splits and a partial last chunk (the kernel's fast loads), GQA 32/8 with
    4 query positions; the CPU backend computes the same SPEC 6 math in FP32."""
    cpu, _, _ = filled_cache(2, 8, D, dtype, [3001, 2])
    gpu, _, _ = filled_cache(2, 8, D, dtype, [3001, 2], device="cuda")
    q = torch.randn(2, 32, 4, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    out, lse = fp4attn.decode(q.cuda(), gpu, return_lse=True)
    want, want_lse = fp4attn.decode(q, cpu, return_lse=True)
    assert rel_l1(out.cpu(), want) < 3e-3
    assert lse_close(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page", [16, 128])
def test_cuda_windowed_cache_matches_the_cpu_backend(page):
    """A windowed cache wrapping its ring on CUDA holds the CPU's bytes and decodes alike."""
    caches = [fp4attn.FP4KVCache(2, 2, 128, dtype=torch.float16, device=dev, window=100,
                                 page_size=page) for dev in ("cpu", "cuda")]
    for i, n in enumerate([700, 1, 1, 3, 250, 1]):
        k, v = kv(2, 2, n, 128, torch.float16, 40 + i)
        for cache in caches:
            cache.append(k.to(cache.device), v.to(cache.device))
    for a, b in zip(caches[0].storage(), caches[1].storage()):
        assert torch.equal(a, b.cpu())
    q = torch.randn(2, 8, 4, 128, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    want, want_lse = fp4attn.decode(q, caches[0], return_lse=True)
    out, lse = fp4attn.decode(q.cuda(), caches[1], return_lse=True)
    assert rel_l1(out.cpu(), want) < 3e-3 and lse_close(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_graph_replay_with_changing_lengths():
    B, H, D = 2, 2, 128
    cache = fp4attn.FP4KVCache(B, H, D, dtype=torch.float16, device="cuda", max_tokens=2048)
    k, v = kv(B, H, 1500, D, torch.float16, 3, "cuda")
    cache.append(k, v)
    q = torch.randn(B, 8, 1, D, dtype=torch.float16, device="cuda")
    lens = torch.tensor([1500, 700], dtype=torch.int32, device="cuda")
    storage = cache.storage()
    fp4attn.decode_paged(q, *storage, lens)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp4attn.decode_paged(q, *storage, lens)  # the stored rows only: no ring to keep
    kd, vd = cache.dequantize(torch.float32, residual=False)
    for new in ([1500, 700], [3, 1499]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = exact_decode(q.cpu(), kd.cpu(), vd.cpu(), new)
        assert rel_l1(out.cpu(), ref) < 3e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("D, nq, window", [(128, 1, None), (64, 4, None), (256, 3, 40), (80, 16, None)])
def test_cuda_graph_decode_while_appending_reads_the_residual(D, nq, window):
    """Generation as a server runs it: one captured decode (residual ring included) replayed after
    each append of nq tokens, the ring wrapping many times; every replay agrees with the CPU
    backend's decode of the same cache and with the per-query reference."""
    B, H = 2, 2
    caches = [fp4attn.FP4KVCache(B, H, D, dtype=torch.float16, device=dev, max_tokens=1024)
              for dev in ("cpu", "cuda")]
    k, v = kv(B, H, 300, D, torch.float16, 50)
    for cache in caches:
        cache.append(k.to(cache.device), v.to(cache.device))
    gpu = caches[1]
    q = torch.zeros(B, 8, nq, D, dtype=torch.float16, device="cuda")
    args = (q, *gpu.storage(), gpu.seq_lens)
    fp4attn.decode_paged(*args, window=window, **gpu.residual())  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp4attn.decode_paged(*args, window=window, **gpu.residual())
    for step in range(40):
        kn, vn = kv(B, H, nq, D, torch.float16, 60 + step)
        k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
        for cache in caches:
            cache.append(kn.to(cache.device), vn.to(cache.device))
        q.copy_(torch.randn(B, 8, nq, D, generator=torch.Generator().manual_seed(step)).to(q))
        graph.replay()
        if step % 8 == 7:
            torch.cuda.synchronize()
            want = fp4attn.decode(q.cpu(), caches[0], window=window)
            ref, _ = cache_decode_reference(q.cpu(), caches[0], k, v, window=window)
            assert rel_l1(out.cpu(), want) < 3e-3 and rel_l1(out.cpu(), ref) < 3e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("D", [1, 16, 33, 48, 64, 80, 96, 112, 128, 160, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_k5_rows_are_the_cpu_bytes(D, dtype):
    """The CUDA append's K5 rows (every padded head dim and rotation size) and V rows equal the
    CPU's bytes, the edge rows of the quantizer included; the decode agrees with the CPU's."""
    caches = [fp4attn.FP4KVCache(2, 3, D, dtype=dtype, device=dev, page_size=16) for dev in ("cpu", "cuda")]
    k, v = kv(2, 3, 150, D, dtype, 21)
    edge = edge_rows(D, dtype).expand(2, 3, -1, -1)
    k2, v2 = kv(2, 3, 100, D, dtype, 22)
    for kk, vv in ((k, v), (edge, torch.zeros_like(edge)), (k2, v2)):
        for cache in caches:
            cache.append(kk.to(cache.device), vv.to(cache.device))
    for a, b in zip(caches[0].storage(), caches[1].storage()):
        assert torch.equal(a, b.cpu())
    q = torch.randn(2, 6, 3, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    # the last 80 keys: normal rows (a query that sees a NaN row gets an unspecified output)
    want, want_lse = fp4attn.decode(q, caches[0], return_lse=True, window=80)
    out, lse = fp4attn.decode(q.cuda(), caches[1], return_lse=True, window=80)
    assert rel_l1(out.cpu(), want) < 3e-3 and lse_close(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_cache_does_not_depend_on_how_the_first_tokens_were_appended():
    """The re-stored first tokens (K's mean over the first 128) on CUDA: 1-token, 16-token and
    one long first append give the CPU's bytes."""
    B, H, D, N = 2, 2, 128, 300
    k, v = kv(B, H, N, D, torch.bfloat16, 12)
    want = None
    for chunks in ([N], [1] * 20 + [N - 20], [16] * 8 + [N - 128]):
        for dev in ("cpu", "cuda"):
            c = fp4attn.FP4KVCache(B, H, D, dtype=torch.bfloat16, device=dev, page_size=32)
            i = 0
            for n in chunks:
                c.append(k[:, :, i:i + n].to(dev), v[:, :, i:i + n].to(dev))
                i += n
            rows = [t.cpu() for t in stored_rows(c, N)]
            want = rows if want is None else want
            assert all(torch.equal(a, b) for a, b in zip(rows, want))


def test_the_format_study_emulates_the_implemented_keys():
    """fp4attn.eval.kv_format's K5 emulation (the study that chose the format: float matmul
    rotation, its own scale search) gives the reference's dequantized keys."""
    from fp4attn.eval import kv_format

    x = torch.randn(2, 3, 40, 128, generator=torch.Generator().manual_seed(8)) * 2
    want = reference.k5_dequantize(*reference.k5_quantize(x), 128)
    got = kv_format.int5_rows(x, rot=True, search=reference.K5_SEARCH)
    assert (got - want).abs().max() <= 1e-6 * x.abs().max()


@pytest.mark.parametrize("D", [64, 128])
def test_the_format_study_emulates_the_channel_scales(D):
    """kv_format's "int5 rot mean chan" variant (the emulation behind the channel scales' numbers
    in docs/accuracy.md) gives FP4KVCache's dequantized keys on uneven channels, up to the float
    rounding of its kmean and kscale; without "chan" the keys are much worse."""
    from fp4attn.eval import kv_format

    k = uneven_keys(1, 2, 200, D, torch.float32, 5)
    v = torch.randn(1, 2, 200, D, generator=torch.Generator().manual_seed(6))
    cache = fp4attn.FP4KVCache(1, 2, D, dtype=torch.float32)
    cache.append(k, v)
    kd, _ = cache.dequantize(torch.float32, residual=False)
    emu, _ = kv_format.quantized_kv(k, v, "int5 rot mean chan", 128)
    plain, _ = kv_format.quantized_kv(k, v, "int5 rot mean", 128)
    x = k - token_order_mean(k[:, :, :128])[:, :, None]
    assert (emu - kd).abs().max() <= 1e-5 * x.abs().max()
    rel = lambda y: ((y - k).norm(dim=2) / x.norm(dim=2)).median()  # the typical channel
    assert rel(plain) > 2 * rel(kd)


def test_the_format_study_models_the_decodes_fp8_p_v():
    """_pv_e4m3 (P x V's scale in E4M3 per key and 16 channels, against V's E2M1 values) is P @ V
    on the dequantized values up to that one rounding (a few percent), and V's factors are exact."""
    from fp4attn.eval import kv_format

    g = torch.Generator().manual_seed(3)
    v = torch.randn(1, 2, 60, 48, generator=g) * torch.rand(1, 2, 60, 1, generator=g) * 4
    parts = kv_format.nvfp4_parts(v)
    vq = kv_format.nvfp4_rows(v)
    assert torch.equal(parts[0] * parts[1].repeat_interleave(16, -1) * parts[2][..., None], vq)
    p = torch.softmax(torch.randn(1, 2, 5, 60, generator=g) * 2, -1)
    got = kv_format._pv_e4m3(p, parts)
    rel = ((got - p @ vq).norm() / (p @ vq).norm()).item()
    assert 1e-3 < rel < 0.05  # E4M3's 3 mantissa bits: rounded, but not garbage


def test_the_format_study_keeps_the_recent_keys_exact():
    """kv_format's recentW variants: each row's last W keys and values exact, older ones as
    quantized; W past the row's first key is exact attention, W = 0 attention on the quantized
    keys and values, and W = 1 differs from that only through each row's own key."""
    from fp4attn.eval import kv_format

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 40, 32, generator=g) for h in (4, 2, 2))
    kq, vq = (t + 0.3 * torch.randn(t.shape, generator=g) for t in (k, v))
    first = 8  # rows 8.. of a causal square
    mask = torch.ones(40, 40, dtype=torch.bool).tril()[first:]
    sdpa = lambda kk, vv: torch.nn.functional.scaled_dot_product_attention(
        q[:, :, first:], kk, vv, attn_mask=mask, enable_gqa=True)
    run = lambda w: kv_format._recent_exact(q[:, :, first:], k, v, kq, vq, mask, None, first, w)
    assert torch.allclose(run(40), sdpa(k, v), atol=1e-5)
    assert torch.allclose(run(0), sdpa(kq, vq), atol=1e-5)
    diag = torch.zeros(40, dtype=torch.bool)
    for r in range(first, 40):  # row r with only its own key exact
        diag[:] = False
        diag[r] = True
        kk = torch.where(diag[:, None], k, kq)
        vv = torch.where(diag[:, None], v, vq)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, r:r + 1], kk, vv, attn_mask=mask[r - first:r - first + 1], enable_gqa=True)
        assert torch.allclose(run(1)[:, :, r - first:r - first + 1], want, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("D", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_uneven_channels_are_the_cpu_bytes(D, dtype):
    """Channel scales on CUDA (kv_mean_kernel: a channel at the 2^-6 floor, a huge one; first
    appends of 50 then 150 tokens, re-stored) equal the CPU's, so do the rows; the decode (queries
    times kscale) agrees with the CPU's."""
    k = uneven_keys(2, 2, 200, D, dtype, D)
    v = torch.randn(2, 2, 200, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    caches = [fp4attn.FP4KVCache(2, 2, D, dtype=dtype, device=dev, page_size=32) for dev in ("cpu", "cuda")]
    for cache in caches:
        cache.append(k[:, :, :50].to(cache.device), v[:, :, :50].to(cache.device))
        cache.append(k[:, :, 50:].to(cache.device), v[:, :, 50:].to(cache.device))
    for a, b in zip(caches[0].storage(), caches[1].storage()):
        assert torch.equal(a, b.cpu())
    q = torch.randn(2, 4, 2, D, generator=torch.Generator().manual_seed(4)).to(dtype) * 0.1
    want, want_lse = fp4attn.decode(q, caches[0], return_lse=True)
    out, lse = fp4attn.decode(q.cuda(), caches[1], return_lse=True)
    assert rel_l1(out.cpu(), want) < 3e-3 and lse_close(lse, want_lse)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_paged_length_past_the_block_table_is_not_answered(device):
    """seq_lens[b] beyond the tokens its block-table row addresses would read another sequence's
    pages: the CPU backend refuses it; the CUDA decode (no host copy of seq_lens) gives that
    sequence NaN rows and the other sequences their answers."""
    B, H, D, P = 2, 1, 64, 32
    c = fp4attn.FP4KVCache(B, H, D, dtype=torch.float16, residual_length=0, page_size=P,
                           max_tokens=64, device=device)
    k, v = kv(B, H, 64, D, torch.float16, 5)
    c.append(k.to(device), v.to(device))
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(6)).half().to(device)
    good = fp4attn.decode(q, c)
    lens = torch.tensor([96, 64], dtype=torch.int32, device=device)
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 96 is outside \[0, 64\]"):
            fp4attn.decode_paged(q, *c.storage(), lens)
        return
    out = fp4attn.decode_paged(q, *c.storage(), lens)
    assert out[0].isnan().all() and torch.equal(out[1], good[1])


def test_decode_says_that_no_gradient_flows():
    c = fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32)
    k, v = kv(1, 2, 40, 64, torch.float32, 7)
    c.append(k, v)
    q = torch.randn(1, 4, 1, 64, requires_grad=True)
    with pytest.warns(UserWarning, match="the decode has no backward"):
        fp4attn.decode(q, c)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            fp4attn.decode(q, c)


def test_append_of_tensors_that_require_grad_warns_and_keeps_no_graph():
    """The cache stores no graph: appending k / v that require grad warns that no gradient flows,
    and neither the residual ring nor the first tokens' copy keeps the caller's graph alive."""
    c = fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32)
    w = torch.nn.Parameter(torch.ones(64))
    k, v = kv(1, 2, 40, 64, torch.float32, 8)
    with pytest.warns(UserWarning, match="no gradient flows back through it"):
        c.append(k * w, v)
    assert not c.res_k.requires_grad and c.res_k.grad_fn is None
    assert all(not t.requires_grad for t in c._early)
    out = fp4attn.decode(torch.randn(1, 2, 1, 64), c)
    assert not out.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            c.append(k * w, v)


def test_ops_refuse_bad_cache_arguments_before_writing():
    """Direct op calls: a cache without KV heads and a negative residual_len are errors (the
    first divided by zero, the second was taken as 0); an append whose block table points
    outside the pool, or whose statistics' rows are badly given, raises before writing anything."""
    c = fp4attn.FP4KVCache(2, 1, 32, dtype=torch.float32, page_size=4, max_tokens=8,
                           residual_length=0)
    k, v = kv(2, 1, 5, 32, torch.float32, 8)
    c.append(k, v)
    st = list(c.storage())
    q = torch.randn(2, 1, 1, 32)
    with pytest.raises(RuntimeError, match="heads_kv >= 1"):
        torch.ops.fp4attn.decode(q[:, :0], *st[:6], st[6][:, :0], st[7][:, :0], st[8], c.seq_lens,
                                 0.1, 0, None, None, 0)
    with pytest.raises(RuntimeError, match="residual_len must be >= 0"):
        torch.ops.fp4attn.decode(q, *st, c.seq_lens, 0.1, 0, None, None, -7)
    # empty pools and tables are named, not "null storage pointer"
    with pytest.raises(RuntimeError, match="block_table must have max_pages >= 1"):
        torch.ops.fp4attn.decode(q, *st[:8], st[8][:, :0], c.seq_lens, 0.1, 0, None, None, 0)
    with pytest.raises(RuntimeError, match="k_codes must have pages >= 1 and page_size >= 1"):
        torch.ops.fp4attn.kv_append(k, v, *(t[:0] for t in st[:6]), *st[6:], 0, False)
    with pytest.raises(RuntimeError, match="k_codes must have pages >= 1 and page_size >= 1"):
        torch.ops.fp4attn.kv_append(k, v, *(t[:, :, :0] for t in st[:6]), *st[6:], 0, False)
    # an append of no tokens still needs a start inside the block table
    for start in (-1, 9):
        with pytest.raises(RuntimeError, match=r"start must be in \[0, 8\]"):
            torch.ops.fp4attn.kv_append(k[:, :, :0], v[:, :, :0], *st, start, False)
    before = [t.clone() for t in st]
    table = st[8].clone()
    table[1, 0] = 999
    for set_mean in (False, True):
        with pytest.raises(RuntimeError, match=r"block_table\[1, 0\] = 999 is outside the page pool"):
            torch.ops.fp4attn.kv_append(k, v, *st[:8], table, 0, set_mean)
        assert all(torch.equal(a, b) for a, b in zip(st, before))
    for mean_from, rows, msg in ((torch.zeros(2), 4, "mean_from must be a contiguous int32 \\[batch=2\\]"),
                                 (torch.zeros(3, dtype=torch.int32), 4, "mean_from must be"),
                                 (None, -1, "mean_rows must be >= 0")):
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.fp4attn.kv_append(k, v, *st, 0, True, mean_from, rows)
        assert all(torch.equal(a, b) for a, b in zip(st, before))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["decode", "append"])
def test_cuda_page_outside_the_pool_is_a_device_error(op):
    """A block-table entry outside the page pool stops the CUDA kernel (the CPU backend raises),
    rather than reading or skipping memory that is not the cache's. The kernel traps, which ends
    the process's CUDA context: the call runs in a subprocess."""
    import subprocess
    import sys

    code = f"""
import torch, fp4attn
c = fp4attn.FP4KVCache(1, 1, 64, dtype=torch.float16, residual_length=0, page_size=32,
                       max_tokens=64, device="cuda")
k = torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16)
c.append(k, k)
st = list(c.storage()); st[8] = st[8].clone(); st[8][0, 1] = 999
try:
    if "{op}" == "decode":
        fp4attn.decode_paged(torch.randn(1, 1, 1, 64, device="cuda").half(), *st, c.seq_lens)
    else:
        torch.ops.fp4attn.kv_append(k, k, *st, 0, False)
    torch.cuda.synchronize()
    print("no error")
except RuntimeError as e:
    print("device error:", str(e)[:80])
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "no error" not in p.stdout, p.stdout + p.stderr
    assert p.returncode != 0 or "device error" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_positions_and_windows_do_not_overflow(device):
    """An append start near 2^63 is refused (start + len overflowed the range check); a window
    near 2^63 is no window, also for a sequence shorter than the query positions (the CUDA
    decode's window arithmetic overflowed into a negative chunk)."""
    import sys

    c = fp4attn.FP4KVCache(2, 1, 64, dtype=torch.float16, page_size=32, max_tokens=64,
                           residual_length=0, device=device)
    k, v = kv(2, 1, 40, 64, torch.float16, 9, device)
    c.append(k, v)
    st = list(c.storage())
    with pytest.raises(RuntimeError, match="do not fit the block table"):
        torch.ops.fp4attn.kv_append(k[:, :, :1], v[:, :, :1], *st, 2**63 - 1, False)
    q = torch.randn(2, 1, 3, 64, generator=torch.Generator().manual_seed(1)).half().to(device)
    lens = torch.tensor([0, 40], dtype=torch.int32, device=device)
    out = fp4attn.decode_paged(q, *st, lens, window=sys.maxsize)
    assert torch.equal(out, fp4attn.decode_paged(q, *st, lens))
    assert (out[0] == 0).all() and torch.isfinite(out[1]).all()


def test_append_bumps_the_versions_of_what_it_overwrites():
    """kv_append writes the cache in place: a gradient through a cache tensor saved before an
    append raises, as for any in-place op (it came out silently wrong)."""
    c = fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32)
    before = [t._version for t in c.storage()[:8]]
    w = torch.randn(1, 2, 64, requires_grad=True)
    y = (w * c.kscale).sum()  # saves kscale, which the first append sets
    c.append(*kv(1, 2, 20, 64, torch.float32, 3))
    assert all(t._version > v for t, v in zip(c.storage()[:8], before))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_decode_steps_do_not_recompile_per_token(backend):
    """torch.compile(fullgraph=True) of append + decode: the cache's length is a symbolic int (a
    graph per token before: the op's `start` was specialized), results equal eager, and q that
    requires grad does not break the graph (the warning is eager-only)."""
    from torch._dynamo.utils import counters

    def step(cache, k, v, q):
        cache.append(k, v)
        return fp4attn.decode(q, cache)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend=backend)  # (aot: functionalized)
    c, e = (fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32, max_tokens=256) for _ in range(2))
    for cache in (c, e):
        cache.append(*kv(1, 2, 140, 64, torch.float32, 5))
    for i in range(10):
        k, v = kv(1, 2, 1, 64, torch.float32, 100 + i)
        # (AOTAutograd traces a backward, which the decode has not: q requiring grad raises)
        q = torch.randn(1, 4, 1, 64, requires_grad=i > 5 and backend == "eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.equal(compiled(c, k, v, q), step(e, k, v, q))
    assert counters["stats"]["unique_graphs"] <= 3
    torch._dynamo.reset()


# Tests from a mutation run of kv_cache.py (each pins a behaviour a plausible bug would break).

def offset_kv(B, H, n, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g) * 2 + 1.5, torch.randn(B, H, n, D, generator=g)


def test_crop_to_zero_forgets_the_padding():
    cache = fp4attn.FP4KVCache(2, 2, 64, dtype=torch.float32)
    cache.append(*offset_kv(2, 2, 200, 64, 0), padding=[3, 0])
    cache.crop(0)
    assert len(cache) == 0 and cache.padding == (0, 0)  # as new


def test_crop_refills_every_overwritten_ring_slot():
    """A crop of 40 (> the ring's 31 slots): every kept ring slot a cropped token overwrote holds
    the stored row, the oldest (position length - 31) included, which the first query of a
    16-position decode reads."""
    cache = fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32, page_size=32)
    cache.append(*offset_kv(1, 2, 180, 64, 0))
    cache.append(*offset_kv(1, 2, 40, 64, 1))
    cache.crop(180)
    stored_k, stored_v = cache.dequantize(torch.float32, residual=False)
    k, v = cache.dequantize(torch.float32, position=180 - 16)
    assert torch.equal(k[:, :, 149:], stored_k[:, :, 149:])
    assert torch.equal(v[:, :, 149:], stored_v[:, :, 149:])


def test_dequantize_position_must_be_below_len():
    cache = fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32)
    cache.append(*offset_kv(1, 2, 20, 64, 0))
    cache.dequantize(position=19)
    with pytest.raises(ValueError, match="position"):
        cache.dequantize(position=20)


def test_decode_forwards_scale_and_takes_a_strided_key_start():
    cache = fp4attn.FP4KVCache(2, 2, 64, dtype=torch.float32)
    cache.append(*offset_kv(2, 2, 50, 64, 0))
    q = torch.randn(2, 4, 1, 64)
    out = fp4attn.decode(q, cache, scale=0.02)
    assert torch.equal(out, fp4attn.decode_paged(q, *cache.storage(), cache.seq_lens, scale=0.02,
                                                 **cache.residual()))
    assert not torch.allclose(out, fp4attn.decode(q, cache))
    strided = torch.tensor([5, 0, 0, 0], dtype=torch.int32)[::2]  # [5, 0], not contiguous
    assert torch.equal(fp4attn.decode(q, cache, key_start=strided),
                       fp4attn.decode(q, cache, key_start=[5, 0]))


def test_windowed_append_longer_than_kept_takes_the_statistics_of_the_kept_tokens():
    cache = fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32, window=20, page_size=16)
    k, v = offset_kv(1, 2, 60, 64, 0)
    cache.append(k, v)  # keeps 20 + 15 = 35 tokens: 25..59
    assert cache.start == 25
    torch.testing.assert_close(cache.kmean, k[:, :, 25:].mean(2), rtol=0, atol=1e-4)
