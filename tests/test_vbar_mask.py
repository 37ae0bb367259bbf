"""The masked vbar of SPEC 4.3 (reference ``attention(..., vbar_mask=True)``, the default, and
``v_mean_masked``): the mean-query weighted vbar with the masks applied (keys no row sees get
weight 0, the mean query over the rows that see a key). Equal to the unmasked vbar
(``vbar_mask=False``, the SPEC before issue 35) where no key is hidden from every row; padding
keys do not change it; fully masked rows and heads stay finite. The C backend against it:
``test_cpu_backend_*``.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp4attn

from fp4attn import reference as R


def qkv(B, Hq, Hkv, Nq, Nk, D=64, seed=0, v_offset=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g) + 0.5
    v = torch.randn(B, Hkv, Nk, D, generator=g) + v_offset
    return q, k, v


def spec_vbar(q, k, v, scale=None, block_q=128):
    """The unmasked vbar (SPEC 4.3 without masks) as attention computes it (v_mean on the
    query-block means)."""
    return R.v_mean_masked(q, k, v, None, False, scale, block_q=block_q)


def test_default_on_and_validation():
    q, k, v = qkv(1, 2, 2, 40, 40)
    mask = torch.ones(40, 40, dtype=torch.bool)
    mask[:, 30:] = False
    assert torch.equal(R.attention(q, k, v, mask), R.attention(q, k, v, mask, vbar_mask=True))
    assert not torch.equal(R.attention(q, k, v, mask), R.attention(q, k, v, mask, vbar_mask=False))
    with pytest.raises(ValueError):
        R.attention(q, k, v, vbar_mask="keys")
    # the other smoothing forms ignore it
    assert torch.equal(R.attention(q, k, v, mask, smooth_v="mean"),
                       R.attention(q, k, v, mask, smooth_v="mean", vbar_mask=False))


@pytest.mark.parametrize("mode", [True, "self"])
@pytest.mark.parametrize("case", ["none", "causal", "causal_more_queries", "bool_all_true",
                                  "bool_random"])
def test_equal_to_spec_without_padding(mode, case):
    """Masks that hide no key from every row and no row from every key (and no mask at all):
    the masked vbar is the unmasked one, so the output is bit-identical (GQA, two query blocks)."""
    Nq, Nk = (200, 120) if case == "causal_more_queries" else (150, 150)
    q, k, v = qkv(2, 6, 2, Nq, Nk, seed=1)
    mask, causal = None, case.startswith("causal")
    if case == "bool_all_true":
        mask = torch.ones(2, 1, Nq, Nk, dtype=torch.bool)
    elif case == "bool_random":
        mask = torch.rand(2, 6, Nq, Nk, generator=torch.Generator().manual_seed(2)) > 0.5
        mask |= torch.eye(Nq, Nk, dtype=torch.bool)  # every row sees a key, every key is seen
    spec = R.attention(q, k, v, mask, causal, vbar_mask=False)
    assert torch.equal(R.attention(q, k, v, mask, causal, vbar_mask=mode), spec)
    assert torch.equal(R.v_mean_masked(q, k, v, mask, causal, self_rows=mode == "self"),
                       spec_vbar(q, k, v))


def _padded(n_real=70, n=100, seed=3):
    """One padded self-attention batch item: rows/keys n_real.. are padding, with K and V far
    from the real ones."""
    q, k, v = qkv(1, 4, 2, n, n, seed=seed)
    k[:, :, n_real:] = 20.0 * torch.randn(1, 2, n - n_real, 64) - 30.0
    v[:, :, n_real:] = 50.0
    q[:, :, n_real:] = 5.0 * torch.randn(1, 4, n - n_real, 64)
    return q, k, v


def key_padding_masks(n_real, n):
    keep = torch.arange(n) < n_real
    return {
        "bool": torch.broadcast_to(keep, (1, 1, n, n)),
        "additive_inf": torch.where(keep, 0.0, -math.inf).expand(1, 1, n, n),
        "additive_finfo_min": torch.where(keep, 0.0, torch.finfo(torch.float32).min).expand(
            1, 1, n, n),
    }


@pytest.mark.parametrize("kind", ["bool", "additive_inf", "additive_finfo_min"])
def test_padding_keys_do_not_change_vbar(kind):
    """A key-padding mask (bool, additive -inf, additive finfo.min as transformers builds it):
    the padding keys' K and V do not enter the masked vbar (bit for bit, whatever their values),
    while the unmasked vbar moves toward the padding V; with "self" the padding queries are left
    out of qm too (keys hidden by -inf or False only), and vbar is the unmasked vbar of the
    unpadded tensors."""
    n_real, n = 70, 100
    q, k, v = _padded(n_real, n)
    mask = key_padding_masks(n_real, n)[kind]
    on = R.v_mean_masked(q, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, n_real:] = torch.randn(1, 2, n - n_real, 64)
    v2[:, :, n_real:] = -7.0
    assert torch.equal(R.v_mean_masked(q, k2, v2, mask), on)
    assert not torch.equal(R.v_mean_masked(q, k2, v2, None), R.v_mean_masked(q, k, v, None))
    # the unmasked vbar is pulled toward the padding V (50), the masked one is not
    unpadded = spec_vbar(q[:, :, :n_real], k[:, :, :n_real], v[:, :, :n_real])
    assert (R.v_mean_masked(q, k, v, None) - unpadded).abs().max() > 1.0
    assert (on - unpadded).abs().max() < 0.5
    if kind == "additive_finfo_min":  # a finite mask value hides nothing: "self" drops no row
        assert torch.equal(R.v_mean_masked(q, k, v, mask, self_rows=True), on)
        return
    # "self": the padding query rows do not count either
    q2 = q.clone()
    q2[:, :, n_real:] = -3.0
    self_vbar = R.v_mean_masked(q, k, v, mask, self_rows=True)
    assert torch.equal(R.v_mean_masked(q2, k2, v2, mask, self_rows=True), self_vbar)
    torch.testing.assert_close(self_vbar, unpadded, rtol=1e-6, atol=1e-6)


def test_masked_vbar_helps_padded_fp4():
    """With the padding V far from the real one, the masked vbar brings the FP4 error on the real
    rows back to at most no smoothing's, where the unmasked vbar is worse than both."""
    n_real, n = 70, 100
    q, k, v = _padded(n_real, n)
    v[:, :, n_real:] = 0.0  # padding V 0, real V around 3: the unmasked vbar sits between them
    v[:, :, :n_real] += 3.0 * torch.randn(1, 2, 1, 64)
    mask = key_padding_masks(n_real, n)["bool"]
    exact = R.exact_attention(q, k, v, mask)[:, :, :n_real]

    def err(**kw):
        return R.metrics(R.attention(q, k, v, mask, **kw)[:, :, :n_real], exact)["rel_l1"]

    masked, spec, none = err(), err(vbar_mask=False), err(smooth_v=False)
    assert masked < spec and masked <= 1.05 * none, (masked, spec, none)


def test_causal_fewer_queries_hides_later_keys():
    """Causal top-left with Nq < Nk: keys j >= Nq are seen by no row, so the masked vbar is the
    unmasked vbar of the first Nq keys (to the order of the sums)."""
    q, k, v = qkv(1, 2, 1, 100, 300, seed=5)
    v[:, :, 100:] += 40.0
    on = R.v_mean_masked(q, k, v, None, True)
    torch.testing.assert_close(on, spec_vbar(q, k[:, :, :100], v[:, :, :100]), rtol=1e-6,
                               atol=1e-6)


def test_fully_masked_rows_and_heads_finite():
    """A row that sees no key does not count in qm (its Q changes nothing), stays 0 in the
    output; a batch item (all its heads) or one head with every entry hidden gets vbar = 0,
    finite everywhere, bool or additive -inf."""
    q, k, v = qkv(2, 4, 2, 60, 90, seed=6)
    mask = torch.rand(2, 4, 60, 90, generator=torch.Generator().manual_seed(7)) > 0.3
    mask[:, :, 5] = False  # row 5 sees nothing, in every head
    mask[1] = False  # batch item 1: nothing visible at all
    q2 = q.clone()
    q2[:, :, 5] = 1e4
    for m in (mask, torch.where(mask, 0.0, -math.inf)):
        vb = R.v_mean_masked(q, k, v, m)
        assert torch.isfinite(vb).all()
        assert torch.equal(vb[1], torch.zeros_like(vb[1]))
        assert vb[0].abs().min() > 0
        assert torch.equal(R.v_mean_masked(q2, k, v, m), vb)
        out, lse = R.attention(q, k, v, m, vbar_mask=True, return_lse=True)
        assert torch.isfinite(out).all()
        assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.all(lse[1] == -math.inf)
    # one KV head (its two query heads) fully hidden, the other not
    m = torch.ones(1, 4, 60, 90, dtype=torch.bool)
    m[:, 2:] = False
    vb = R.v_mean_masked(q[:1], k[:1], v[:1], m)
    assert torch.equal(vb[:, 1], torch.zeros_like(vb[:, 1])) and vb[:, 0].abs().min() > 0
    assert torch.isfinite(R.attention(q[:1], k[:1], v[:1], m, vbar_mask="self")).all()


def test_hidden_chunk_adds_nothing():
    """A whole 128-key chunk hidden from every row (M_c = -inf) adds nothing, never NaN: the
    masked vbar over keys 0..127 and 256..299 equals the one with that chunk's K and V changed."""
    q, k, v = qkv(1, 2, 2, 64, 300, seed=8)
    mask = torch.ones(64, 300, dtype=torch.bool)
    mask[:, 128:256] = False
    vb = R.v_mean_masked(q, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 128:256] = 1e3
    v2[:, :, 128:256] = -1e3
    assert torch.isfinite(vb).all()
    assert torch.equal(R.v_mean_masked(q, k2, v2, mask), vb)


# ---------------------------------------------------------------------------------------------
# The backends: the C backend (CPU) against the reference, the CUDA pre-pass against both
# ---------------------------------------------------------------------------------------------

TOL = 2e-3  # as tests/test_attention_cpu.py and tests/test_cuda.py: summation order, exp rounding


def _rel_l1(out, ref):
    return R.metrics(out.float().cpu(), ref.float().cpu())["rel_l1"]


def padded_batch(n=300, reals=(70, 260), Hq=4, Hkv=2, D=64, seed=11):
    """Two padded batch items (real lengths 70 and 260 of 300: batch item 0 has two 128-key chunks
    of padding only), GQA 4 / 2; the padding keys like the real ones (so that the unmasked vbar
    gives them their share of the weight), the padding values and queries far from the real."""
    g = torch.Generator().manual_seed(seed)
    B = len(reals)
    q = torch.randn(B, Hq, n, D, generator=g)
    k = torch.randn(B, Hkv, n, D, generator=g) + 0.5
    v = torch.randn(B, Hkv, n, D, generator=g) + 3.0
    keep = torch.arange(n)[None, :] < torch.tensor(reals)[:, None]  # [B, n]
    pad = ~keep
    v[pad[:, None, :, None].expand_as(v)] = 50.0
    q[pad[:, None, :, None].expand_as(q)] = 5.0
    return q, k, v, keep


def mask_case(name, n=300):
    """(q, k, v, attn_mask, is_causal) of one masked case; every one hides keys from every row."""
    q, k, v, keep = padded_batch(n)
    B, Hq = q.shape[0], q.shape[1]
    g = torch.Generator().manual_seed(12)
    causal = name.startswith("causal")
    if name in ("bool_key_padding", "causal_bool_key_padding"):
        mask = keep[:, None, None, :]
    elif name == "additive_inf_key_padding":
        mask = torch.where(keep, 0.0, -math.inf)[:, None, None, :]
    elif name == "additive_finfo_min":  # transformers' padding mask: finite, [B, 1, Nq, Nk]
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
        mask = mask.expand(B, 1, n, n).contiguous()
    elif name == "additive_finfo_min_item":  # batch item 1 sees only finfo.min keys: uniform
        keep[1] = False
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    elif name == "additive_values":  # a key's bias is its (largest) mask value
        mask = torch.where(keep, 0.5 * torch.randn(B, n, generator=g), -math.inf)[:, None, None]
    elif name in ("bool_per_head_rows", "causal_additive_per_head_rows"):
        # per (batch, head, row): random entries of the real keys, row 5 sees nothing, and
        # query row 5 is far off (it must not enter qm)
        see = (torch.rand(B, Hq, n, n, generator=g) > 0.3) & keep[:, None, None, :]
        see[:, :, 5] = False
        q[:, :, 5] = 40.0
        if name == "bool_per_head_rows":
            mask = see
        else:
            see[:, :, :, 0] = True  # causal: every row but 5 still sees key 0
            see[:, :, 5] = False
            mask = torch.where(see, 0.3 * torch.randn(B, Hq, n, n, generator=g), -math.inf)
    elif name == "half_additive_key_padding":
        q, k, v = q.half(), k.half(), v.half()
        mask = torch.where(keep, 0.0, -math.inf)[:, None, None, :].half()
    elif name == "causal_fewer_queries":  # no mask: keys j >= Nq are seen by no row
        q, mask = q[:, :, :100].contiguous(), None
    else:
        raise ValueError(name)
    return q, k, v, mask, causal


MASK_CASES = ["bool_key_padding", "additive_inf_key_padding", "additive_finfo_min",
              "additive_finfo_min_item",
              "additive_values", "bool_per_head_rows", "causal_bool_key_padding",
              "causal_additive_per_head_rows", "half_additive_key_padding",
              "causal_fewer_queries"]


def _cpu(q, k, v, mask, causal, return_lse=False):
    """The C backend through the op (fp4attn.sdpa refuses a mask with is_causal, as torch's
    SDPA does; the op and both backends take them together)."""
    out, lse = torch.ops.fp4attn.attention(q, k, v, mask, causal, 1.0 / math.sqrt(q.shape[-1]),
                                           return_lse, "auto")
    return (out, lse) if return_lse else out


@pytest.mark.parametrize("name", MASK_CASES)
def test_cpu_backend_masked_vbar(name):
    """The C backend implements the masked vbar: its output agrees with the reference (whose
    default it is) to the backends' tolerance and is far from the reference with the unmasked
    vbar (the padding V of 50 pulls that one away from the real V near 3); rows that see no key
    stay 0."""
    q, k, v, mask, causal = mask_case(name)
    out = _cpu(q, k, v, mask, causal)
    ref = R.attention(q, k, v, mask, causal)
    old = R.attention(q, k, v, mask, causal, vbar_mask=False)
    tol = TOL if q.dtype == torch.float32 else 5e-3
    err, err_old = _rel_l1(out, ref), _rel_l1(out, old)
    assert torch.isfinite(out).all()
    assert err < tol and err_old > 3 * err, (err, err_old)
    if name.endswith("per_head_rows"):
        assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))


def test_cpu_backend_mask_that_hides_nothing_is_bit_identical():
    """A mask that hides no key from any row (all True, additive zeros) gives the unmasked bits in
    the C backend (the masked vbar is the unmasked one there); so does causal with Nq >= Nk
    against its own bool form."""
    q, k, v = qkv(2, 6, 2, 150, 140, seed=13)
    plain = _cpu(q, k, v, None, False)
    assert torch.equal(_cpu(q, k, v, torch.ones(150, 140, dtype=torch.bool), False), plain)
    assert torch.equal(_cpu(q, k, v, torch.zeros(1, 1, 1, 140), False), plain)
    tril = torch.ones(150, 140, dtype=torch.bool).tril()
    assert torch.equal(_cpu(q, k, v, tril, False), _cpu(q, k, v, None, True))


def test_cpu_backend_nothing_visible():
    """A batch item where no row sees any key (vbar = 0): zeros, finite, lse -inf; the other
    batch item as with that item alone."""
    q, k, v, keep = padded_batch()
    mask = keep[:, None, None, :].clone()
    mask[1] = False
    out, lse = _cpu(q, k, v, mask, False, return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.all(lse[1] == -math.inf)
    assert torch.equal(out[:1], _cpu(q[:1], k[:1], v[:1], mask[:1], False))
    assert _rel_l1(out, R.attention(q, k, v, mask)) < TOL


HAS_CUDA = torch.cuda.is_available()


def _cuda_kernels():
    ks = [pytest.param("sm80", id="sm80"), pytest.param("sm120", id="sm120")]
    sm90 = (HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
            and "90a" in fp4attn.build_info().get("cuda_archs", ""))
    ks.insert(1, pytest.param("sm90", id="sm90",
                              marks=pytest.mark.skipif(not sm90, reason="needs CC 9.0 + sm_90a")))
    return ks


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", _cuda_kernels())
@pytest.mark.parametrize("name", MASK_CASES)
def test_cuda_masked_vbar_matches_cpu(name, kernel):
    """The CUDA pre-pass's masked vbar (vbar_mask_kernel, the key bias in vbar_chunk_kernel, qm
    over the rows that see a key): the output agrees with the C backend and the reference to the
    backends' tolerance, and is far from the unmasked vbar's; hidden rows stay 0."""
    if not fp4attn.build_info()["cuda"]:
        pytest.skip("fp4attn was built without its CUDA backend")
    q, k, v, mask, causal = mask_case(name)
    cpu = _cpu(q, k, v, mask, causal)
    ref = R.attention(q, k, v, mask, causal)
    old = R.attention(q, k, v, mask, causal, vbar_mask=False)
    dev = lambda t: None if t is None else t.cuda()  # noqa: E731
    out, _ = torch.ops.fp4attn.attention(dev(q), dev(k), dev(v), dev(mask), causal,
                                         1.0 / math.sqrt(q.shape[-1]), False, kernel)
    out = out.cpu()
    assert torch.isfinite(out).all()
    err_cpu, err_ref, err_old = _rel_l1(out, cpu), _rel_l1(out, ref), _rel_l1(out, old)
    tol = TOL if q.dtype == torch.float32 else 5e-3
    assert err_cpu < tol and err_ref < tol, (err_cpu, err_ref)
    assert err_old > 3 * err_ref, (err_ref, err_old)
    if name.endswith("per_head_rows"):
        assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", _cuda_kernels())
def test_cuda_nothing_visible(kernel):
    """CUDA: a batch item that sees no key at all gives zeros (vbar 0, no NaN); the other item
    agrees with the C backend."""
    if not fp4attn.build_info()["cuda"]:
        pytest.skip("fp4attn was built without its CUDA backend")
    q, k, v, keep = padded_batch()
    q, k, v = q.half(), k.half(), v.half()
    mask = keep[:, None, None, :].clone()
    mask[1] = False
    out, _ = torch.ops.fp4attn.attention(q.cuda(), k.cuda(), v.cuda(), mask.cuda(), False,
                                         0.125, False, kernel)
    out = out.cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert _rel_l1(out, _cpu(q, k, v, mask, False)) < 5e-3
