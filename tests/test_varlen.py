"""fp4attn.varlen_attn: packed variable-length sequences with torch's varlen_attn interface."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import fp4attn

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU")])]


class Aux:  # what torch.nn.attention.varlen.AuxRequest(lse=True) is to varlen_attn
    lse = True


def packed(lengths, heads, dim, device, seed, requires_grad=False):
    """A [total, heads, dim] tensor of sequences back to back, and its int32 starts."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(sum(lengths), heads, dim, generator=g).to(device)
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    return t.requires_grad_(requires_grad), cu


def bottom_right(nq, nk, device="cpu"):
    """FlashAttention's causal pattern for nq queries and nk keys (the queries are the last
    positions), as a boolean mask."""
    return torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)


def dense(t, cu, i):
    """Sequence i of a packed tensor as a [1, heads, n, dim] view."""
    return t[cu[i]:cu[i + 1]].transpose(0, 1)[None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp4", "int8"])
@pytest.mark.parametrize("causal", [False, True])
def test_sequences_are_their_own_sdpa_calls(device, precision, causal):
    """Bit for bit each sequence's fp4attn.sdpa call (GQA, one-query and equal-length sequences,
    cross-attention lengths with the causal pattern aligned bottom-right, as FlashAttention's),
    out [Tq, Hq, D] contiguous, lse [Hq, Tq]; close to exact attention."""
    q_lens, k_lens = [20, 1, 150, 33], [40, 7, 150, 33]
    q, cu_q = packed(q_lens, 4, 32, device, 0)
    k, cu_k = packed(k_lens, 2, 32, device, 1)
    v, _ = packed(k_lens, 2, 32, device, 2)
    out, lse = fp4attn.varlen_attn(q, k, v, cu_q, cu_k, 150, 150, return_aux=Aux(),
                                   window_size=(-1, 0) if causal else (-1, -1), enable_gqa=True,
                                   precision=precision)
    assert out.shape == (q.shape[0], 4, 32) and out.is_contiguous() and lse.shape == (4, q.shape[0])
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        qi, ki, vi = dense(q, cq, i), dense(k, ck, i), dense(v, ck, i)
        mask = bottom_right(nq, nk, device) if causal and nq != nk else None
        o, l = fp4attn.sdpa(qi, ki, vi, mask, is_causal=causal and nq == nk, enable_gqa=True,
                            precision=precision, return_lse=True)
        assert torch.equal(out[cq[i]:cq[i + 1]], o[0].transpose(0, 1))
        assert torch.equal(lse[:, cq[i]:cq[i + 1]], l[0])
        exact = F.scaled_dot_product_attention(qi, ki, vi, mask, is_causal=causal and nq == nk,
                                               enable_gqa=True)
        assert (o - exact).abs().max() < (0.5 if precision == "fp4" else 0.1)


def test_causal_queries_before_the_first_key_and_empty_sequences():
    """More queries than keys under the causal pattern: the first queries see no key (zeros, lse
    -inf); a sequence without keys or queries, and an empty batch."""
    q, cu_q = packed([5, 0, 3], 2, 16, "cpu", 0)
    k, cu_k = packed([2, 4, 0], 2, 16, "cpu", 1)
    out, lse = fp4attn.varlen_attn(q, k, k, cu_q, cu_k, 5, 4, return_aux=Aux(),
                                   window_size=(-1, 0), precision="int8")
    assert out[:3].abs().max() == 0 and torch.isinf(lse[:, :3]).all()
    assert out[3:5].abs().max() > 0 and torch.isfinite(lse[:, 3:5]).all()
    assert out[5:].abs().max() == 0 and (lse[:, 5:] == -float("inf")).all()
    none = torch.zeros(1, dtype=torch.int32)
    empty = fp4attn.varlen_attn(q[:0], k[:0], k[:0], none, none, 0, 0)
    assert empty.shape == (0, 2, 16)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_takes_the_first_keys(causal):
    """Sequence i uses its first seqused_k[i] keys, the causal pattern aligned to those."""
    q, cu_q = packed([6, 9], 2, 32, "cpu", 0)
    k, cu_k = packed([10, 12], 2, 32, "cpu", 1)
    used = torch.tensor([4, 8], dtype=torch.int32)
    window = (-1, 0) if causal else (-1, -1)
    out = fp4attn.varlen_attn(q, k, k, cu_q, cu_k, 9, 12, seqused_k=used, window_size=window,
                              precision="int8")
    for i, (qa, nq, ka, nk) in enumerate([(0, 6, 0, 4), (6, 9, 10, 8)]):
        ki = k[None, ka:ka + nk].transpose(1, 2)
        mask = bottom_right(nq, nk) if causal else None
        want = fp4attn.sdpa(dense(q, [0, 6, 15], i), ki, ki, mask, precision="int8")
        assert torch.equal(out[qa:qa + nq], want[0].transpose(0, 1))


def test_int8_gradients_are_the_per_sequence_ones():
    q, cu_q = packed([30, 70], 2, 32, "cpu", 0, requires_grad=True)
    k, cu_k = packed([50, 70], 2, 32, "cpu", 1, requires_grad=True)
    v, _ = packed([50, 70], 2, 32, "cpu", 2, requires_grad=True)
    g = torch.randn(100, 2, 32)
    fp4attn.varlen_attn(q, k, v, cu_q, cu_k, 70, 70, window_size=(-1, 0),
                        precision="int8").backward(g)
    grads = [t.grad for t in (q, k, v)]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    outs = []
    for i, (nq, nk) in enumerate([(30, 50), (70, 70)]):
        qi, ki, vi = (dense(t, c, i) for t, c in zip(leaves, ([0, 30, 100], [0, 50, 120],
                                                               [0, 50, 120])))
        mask = bottom_right(nq, nk) if nq != nk else None
        outs.append(fp4attn.sdpa(qi, ki, vi, mask, is_causal=nq == nk,
                                 precision="int8")[0].transpose(0, 1))
    torch.cat(outs).backward(g)
    for got, t in zip(grads, leaves):
        assert torch.equal(got, t.grad)


@pytest.mark.parametrize("kwargs, match", [
    ({"window_size": (3, 0)}, "window_size must be"),
    ({"window_size": (-1, 2)}, "window_size must be"),
    ({"block_table": torch.zeros(2, 1, dtype=torch.int32)}, "block_table"),
    ({"cu_seq_k": None}, "cu_seq_k is required"),
    ({"cu_seq_q": torch.tensor([0, 3, 9])}, "cu_seq_q must rise from 0 to the 10"),
    ({"cu_seq_k": torch.tensor([0, 7, 13])}, "cu_seq_k must rise from 0 to at most the 12"),
    ({"cu_seq_q": torch.tensor([0.0, 10.0])}, "cu_seq_q must be a 1-D integer tensor"),
    ({"cu_seq_k": torch.tensor([0, 12])}, "same number of sequences"),
    ({"max_q": 5}, "max_q and max_k must bound"),
    ({"seqused_k": torch.tensor([3, 9])}, "seqused_k must give each"),
    ({"num_splits": -1}, "num_splits must be"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    q, cu_q = packed([4, 6], 2, 16, "cpu", 0)
    k, cu_k = packed([5, 7], 2, 16, "cpu", 1)
    args = {"cu_seq_q": cu_q, "cu_seq_k": cu_k, "max_q": 6, "max_k": 7, **kwargs}
    with pytest.raises(ValueError, match=match):
        fp4attn.varlen_attn(q, k, k, args.pop("cu_seq_q"), args.pop("cu_seq_k"),
                            args.pop("max_q"), args.pop("max_k"), **args)
    with pytest.raises(ValueError, match="query must be a"):
        fp4attn.varlen_attn(q[None], k, k, cu_q, cu_k, 6, 7)
    with pytest.raises(TypeError, match="max_k must be an int"):
        fp4attn.varlen_attn(q, k, k, cu_q, cu_k, 6, 7.5)
    none = torch.zeros(1, dtype=torch.int32)  # checked without any sequence to compute, too
    with pytest.raises(ValueError, match="query has 2 heads and key / value 3"):
        fp4attn.varlen_attn(q[:0], k[:0, :1].expand(0, 3, 16), k[:0, :1].expand(0, 3, 16), none,
                            none, 0, 0)
    with pytest.raises(ValueError, match="share their dtype"):
        fp4attn.varlen_attn(q[:0], k[:0].double(), k[:0], none, none, 0, 0)


def test_window_and_key_forms_torch_accepts():
    """Windows whose sides reach past every key are full or causal attention, num_splits=0
    (torch's "choose") is accepted, and keys after the last sequence are not used."""
    q, cu_q = packed([4, 6], 2, 16, "cpu", 0)
    k, cu_k = packed([5, 7], 2, 16, "cpu", 1)
    causal = fp4attn.varlen_attn(q, k, k, cu_q, cu_k, 6, 7, window_size=(-1, 0))
    assert torch.equal(causal, fp4attn.varlen_attn(q, k, k, cu_q, cu_k, 6, 7, window_size=[7, 0],
                                                   num_splits=0))
    full = fp4attn.varlen_attn(q, k, k, cu_q, cu_k, 6, 7)
    assert torch.equal(full, fp4attn.varlen_attn(q, k, k, cu_q, cu_k, 6, 7, window_size=(9, 6)))
    padded = torch.cat([k, torch.full((3, 2, 16), float("nan"))])
    assert torch.equal(full, fp4attn.varlen_attn(q, padded, padded, cu_q, cu_k, 6, 7))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_against_torch_varlen_attn():
    """The same calls as torch's own varlen_attn (FlashAttention) within the low-bit error: the
    causal alignment, GQA and the lse's [Hq, Tq] layout."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    q, cu_q = packed([20, 1, 150, 33], 4, 64, "cuda", 0)
    k, cu_k = packed([40, 7, 150, 33], 2, 64, "cuda", 1)
    v, _ = packed([40, 7, 150, 33], 2, 64, "cuda", 2)
    q, k, v = (t.half() for t in (q, k, v))
    # torch's keywords vary by release (2.11 has no enable_gqa, older ones take is_causal)
    accepts = inspect.signature(varlen.varlen_attn).parameters
    kt, vt = (k, v) if "enable_gqa" in accepts else (t.repeat_interleave(2, dim=1) for t in (k, v))
    for window in ((-1, -1), (-1, 0)):
        mode = ({"window_size": window} if "window_size" in accepts
                else {"is_causal": window == (-1, 0)})
        gqa = {"enable_gqa": True} if "enable_gqa" in accepts else {}
        want, want_lse = varlen.varlen_attn(q, kt, vt, cu_q, cu_k, 150, 150, **mode, **gqa,
                                            return_aux=varlen.AuxRequest(lse=True))
        got, lse = fp4attn.varlen_attn(q, k, v, cu_q, cu_k, 150, 150, window_size=window,
                                       enable_gqa=True, return_aux=varlen.AuxRequest(lse=True),
                                       precision="int8")
        assert got.shape == want.shape and lse.shape == want_lse.shape
        assert (got.float() - want.float()).abs().max() < 0.05
        assert (lse - want_lse).abs().max() < 0.05
