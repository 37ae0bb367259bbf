"""The masked vbar of the reference (``attention(..., vbar_mask=...)``, ``v_mean_masked``): SPEC
4.3's mean-query weighted vbar with the masks applied (keys no row sees get weight 0, the mean
query over the rows that see a key). Off by default; equal to the SPEC's vbar where no key is
hidden from every row; padding keys do not change it; fully masked rows and heads stay finite.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp4attn import reference as R


def qkv(B, Hq, Hkv, Nq, Nk, D=64, seed=0, v_offset=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g) + 0.5
    v = torch.randn(B, Hkv, Nk, D, generator=g) + v_offset
    return q, k, v


def spec_vbar(q, k, v, scale=None, block_q=128):
    """SPEC 4.3's vbar as attention computes it (v_mean on the query-block means)."""
    return R.v_mean_masked(q, k, v, None, False, scale, block_q=block_q)


def test_default_off_and_validation():
    q, k, v = qkv(1, 2, 2, 40, 40)
    mask = torch.ones(40, 40, dtype=torch.bool)
    mask[:, 30:] = False
    assert torch.equal(R.attention(q, k, v, mask), R.attention(q, k, v, mask, vbar_mask=False))
    assert not torch.equal(R.attention(q, k, v, mask), R.attention(q, k, v, mask, vbar_mask=True))
    with pytest.raises(ValueError):
        R.attention(q, k, v, vbar_mask="keys")
    with pytest.raises(ValueError):
        R.attention(q, k, v, smooth_v="mean", vbar_mask=True)


@pytest.mark.parametrize("mode", [True, "self"])
@pytest.mark.parametrize("case", ["none", "causal", "causal_more_queries", "bool_all_true",
                                  "bool_random"])
def test_equal_to_spec_without_padding(mode, case):
    """Masks that hide no key from every row and no row from every key (and no mask at all):
    the masked vbar is the SPEC's, so the output is bit-identical (GQA, two query blocks)."""
    Nq, Nk = (200, 120) if case == "causal_more_queries" else (150, 150)
    q, k, v = qkv(2, 6, 2, Nq, Nk, seed=1)
    mask, causal = None, case.startswith("causal")
    if case == "bool_all_true":
        mask = torch.ones(2, 1, Nq, Nk, dtype=torch.bool)
    elif case == "bool_random":
        mask = torch.rand(2, 6, Nq, Nk, generator=torch.Generator().manual_seed(2)) > 0.5
        mask |= torch.eye(Nq, Nk, dtype=torch.bool)  # every row sees a key, every key is seen
    spec = R.attention(q, k, v, mask, causal)
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
    while the SPEC's vbar moves toward the padding V; with "self" the padding queries are left
    out of qm too (keys hidden by -inf or False only), and vbar is the SPEC's vbar of the
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
    # the SPEC's unmasked vbar is pulled toward the padding V (50), the masked one is not
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
    rows back to at most the unsmoothed SPEC's, where the SPEC's vbar is worse than both."""
    n_real, n = 70, 100
    q, k, v = _padded(n_real, n)
    v[:, :, n_real:] = 0.0  # padding V 0, real V around 3: the SPEC's vbar sits between them
    v[:, :, :n_real] += 3.0 * torch.randn(1, 2, 1, 64)
    mask = key_padding_masks(n_real, n)["bool"]
    exact = R.exact_attention(q, k, v, mask)[:, :, :n_real]

    def err(**kw):
        return R.metrics(R.attention(q, k, v, mask, **kw)[:, :, :n_real], exact)["rel_l1"]

    masked, spec, none = err(vbar_mask=True), err(), err(smooth_v=False)
    assert masked < spec and masked <= 1.05 * none, (masked, spec, none)


def test_causal_fewer_queries_hides_later_keys():
    """Causal top-left with Nq < Nk: keys j >= Nq are seen by no row, so the masked vbar is the
    SPEC's vbar of the first Nq keys (to the order of the sums)."""
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
