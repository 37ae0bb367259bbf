"""The INT8 reference's scale-granularity options (issue 33; docs/accuracy.md "INT8 scale
granularity"): the defaults reproduce the spec's results bit for bit, finer Q / K scales run and
are what they say, and the study's plumbing (report modes, <bos> per perplexity window, Gemma 3's
rebuilt tokenizer) works. CPU only, small sizes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fp4attn.reference_int8 as R8
from fp4attn.eval import int8_granularity as G
from fp4attn.eval import models as M
from fp4attn.eval import report as RP
from fp4attn.reference import exact_attention, metrics


class _SpecQuantized:
    """fp4attn.reference_int8._Quantized as it was before the granularity options (one scale per
    64 query rows and per 128 keys, applied per block) and the channel migration: the old results
    to reproduce (with ``migrate=None``), V for any P.V of the spec."""

    def __init__(self, q32, k32, v32, G, q_block=64, k_block=128, migrate=None, migrate_pow2=None,
                 v_block=128, pv="16bit"):
        assert (q_block, k_block, migrate, v_block) == (64, 128, None, 128)
        assert pv in ("16bit", "fp8", "int8")
        B, Hq, Nq, D = q32.shape
        Nk = k32.shape[2]
        BQ, BK = 64, 128
        self.kbar = k32.mean(dim=2, keepdim=True)
        qc, sq = R8.psi(R8._blocks(q32, BQ), (3, 4))
        kc, sk = R8.psi(R8._blocks(k32 - self.kbar, BK), (3, 4))
        if pv == "int8":
            vc, sv = R8.psi(R8._blocks(v32, BK), (3,))
        elif pv == "16bit":  # V16 as attention_forward passes it, no scale
            vc = R8._blocks(v32, BK)
            sv = vc.new_ones(*vc.shape[:3], 1, D)
        else:
            hi, lo, sv = R8.psi_e4m3_pair(R8._blocks(v32, BK), (3,))
            vc = hi + lo
        nqb, nkb = qc.shape[2], kc.shape[2]
        self.qc = qc.reshape(B, Hq, nqb * BQ, D)[:, :, :Nq]
        self.sq = sq.reshape(B, Hq, nqb, 1).repeat_interleave(BQ, dim=2)[:, :, :Nq]
        self.kc = R8._per_q_head(kc.reshape(B, -1, nkb * BK, D)[:, :, :Nk], G)
        self.sk = R8._per_q_head(sk.reshape(B, -1, nkb), G)
        self.vc = R8._per_q_head(vc.reshape(B, -1, nkb * BK, D)[:, :, :Nk], G)
        self.sv = R8._per_q_head(sv.reshape(B, -1, nkb, D), G)

    def scores(self, j, scale, allowed, additive):
        j0, j1 = j * 128, min((j + 1) * 128, self.kc.shape[2])
        acc = R8._mm64(self.qc, self.kc[:, :, j0:j1].transpose(-1, -2))
        return R8._mask_scores(acc * ((self.sq * self.sk[:, :, j, None, None]) * scale), allowed,
                               additive, j0, j1)


def _inputs(Nq=150, Nk=300, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, Nq, D, generator=g)
    k = torch.randn(2, 2, Nk, D, generator=g) + 0.5  # a key mean to smooth; GQA 4 / 2
    v = torch.randn(2, 2, Nk, D, generator=g)
    return [t.to(dtype) for t in (q, k, v)]


@pytest.mark.parametrize("case", ["causal", "mask_fp16"])
def test_defaults_reproduce_the_spec_bit_for_bit(monkeypatch, case):
    dtype = torch.float16 if case == "mask_fp16" else torch.float32
    q, k, v = _inputs(dtype=dtype)
    mask = None
    if case == "mask_fp16":  # a boolean mask with a fully hidden row
        g = torch.Generator().manual_seed(3)
        mask = torch.rand(2, 1, q.shape[2], k.shape[2], generator=g) > 0.3
        mask[:, :, 7] = False
    kw = dict(attn_mask=mask, is_causal=case == "causal", migrate=None)  # before the migration
    new = R8.attention_forward(q, k, v, **kw)
    explicit = R8.attention_forward(q, k, v, **kw, q_block=64, k_block=128)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    new_grads = R8.attention_backward(do, q, k, v, new[0].to(dtype), new[1], **kw)
    with monkeypatch.context() as mp:
        mp.setattr(R8, "_Quantized", _SpecQuantized)
        old = R8.attention_forward(q, k, v, **kw)
        old_grads = R8.attention_backward(do, q, k, v, old[0].to(dtype), old[1], **kw)
    for a, b, c in zip(new + new_grads, old + old_grads, explicit + (None,) * 3):
        assert torch.equal(a, b)
        if c is not None:
            assert torch.equal(c, b)


def test_finer_scales_run_and_are_per_group():
    q, k, v = _inputs()
    exact = exact_attention(q, k, v, is_causal=True, enable_gqa=True)
    for qb, kb in [(16, 128), (32, 64), (16, 32), (1, 1), (64, 256)]:
        out, lse = R8.attention_forward(q, k, v, is_causal=True, q_block=qb, k_block=kb)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert metrics(out, exact)["cos"] > 0.999
    q[0, 1, 5] *= 100.0  # one outlier query row: its 64-row block is coarse, its 16-row block too
    k[1, 0, 40] *= 100.0  # one outlier key
    exact = exact_attention(q, k, v, is_causal=True, enable_gqa=True)
    ops = R8._Quantized(q, k, v, 2, 16, 32, migrate=None)  # the scales of Q and Ks themselves
    # Q scale of every row = amax of its 16-row group / 127; K scale of every key likewise (32)
    for r in (0, 15, 16, 63, 149):
        grp = q[:, :, r // 16 * 16 : r // 16 * 16 + 16]
        assert torch.equal(ops.sq[..., r, 0], R8._div_rn(grp.abs().amax(dim=(2, 3)), 127.0))
    ks = k - k.mean(dim=2, keepdim=True)
    for key in (0, 31, 32, 40, 299):
        grp = ks[:, :, key // 32 * 32 : key // 32 * 32 + 32].abs().amax(dim=(2, 3))
        assert torch.equal(ops.sk_key[:, ::2, key], R8._div_rn(grp, 127.0))
    res = {}
    for qb, kb in [(64, 128), (16, 128), (64, 32), (16, 32), (1, 1)]:
        out, _ = R8.attention_forward(q, k, v, is_causal=True, q_block=qb, k_block=kb)
        # rows 16..63 of the outlier's head: coarse Q scale only with 64-row blocks
        res[qb, kb] = metrics(out[0, 1, 16:64], exact[0, 1, 16:64])["rel_l1"]
    assert res[16, 128] < 0.5 * res[64, 128]
    assert res[16, 32] < 0.5 * res[64, 32]
    with pytest.raises(ValueError, match="q_block and k_block"):
        R8.attention_forward(q, k, v, q_block=0)


def test_report_mode_runs_the_granularity():
    q, k, v = _inputs(Nq=70, Nk=70)
    mode = RP.int8_granularity_mode(16, 32)
    assert mode == "int8ref:q16k32" and "16 rows" in RP.mode_label(mode)
    with RP.attention_mode(None, mode, "fp4attn"):  # always the reference
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want, _ = R8.attention_forward(q, k, v, is_causal=True, q_block=16, k_block=32)
    assert torch.equal(got, want)
    assert G.parse_granularities("64x128, 16X32") == [(64, 128), (16, 32)]


def test_fold_options_p_against_the_running_max_and_coarser_v_scales():
    """reference_int8's p_max / v_block for the INT8 P.V (pv="int8"; docs/accuracy.md "P and V
    scales across key steps"): the defaults are its spec, V's scale per block is the amax of its
    keys, P's codes against the running maximum stay close to exact, and the report mode reaches
    them."""
    q, k, v = _inputs()
    exact = exact_attention(q, k, v, is_causal=True, enable_gqa=True)
    spec = R8.attention_forward(q, k, v, is_causal=True, pv="int8")
    assert all(torch.equal(a, b) for a, b in zip(
        spec, R8.attention_forward(q, k, v, is_causal=True, p_max="tile", v_block=128, pv="int8")))
    for kw in [{"p_max": "running"}, {"v_block": 256}, {"v_block": 0}, {"p_max": "running", "v_block": 0}]:
        out, lse = R8.attention_forward(q, k, v, is_causal=True, pv="int8", **kw)
        assert torch.isfinite(out).all() and metrics(out, exact)["cos"] > 0.999, kw
        assert torch.allclose(lse, spec[1], atol=1e-5)  # l is unquantized in every variant
    v[0, 1, 200] *= 50.0  # a V outlier row in the first 256-key block (softmax steps 0 and 1)
    for vb, amax_keys in [(256, slice(0, 256)), (0, slice(None))]:
        ops = R8._Quantized(q, k, v, 2, v_block=vb, migrate=None, pv="int8")  # q heads 2, 3: KV 1
        want = R8._div_rn(v[0, 1, amax_keys].abs().amax(dim=0), 127.0)
        assert torch.equal(ops.sv[0, 2, 0], want) and torch.equal(ops.sv[0, 3, 1], want)
        assert torch.equal(ops.sv[0, 2, 2], want) == (vb == 0)  # keys 256.. : own block at 256
    with pytest.raises(ValueError, match="p_max"):
        R8.attention_forward(q, k, v, p_max="row")
    with pytest.raises(ValueError, match="v_block"):
        R8.attention_forward(q, k, v, v_block=100)
    mode = RP.int8_granularity_mode(64, 128, "running", 0, pv="int8")
    assert "running max" in RP.mode_label(mode)
    with RP.attention_mode(None, mode, "fp4attn"):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(got, R8.attention_forward(q, k, v, is_causal=True, p_max="running",
                                                 v_block=0, pv="int8")[0])


def test_fold_option_p_exponentials_in_fp16():
    """reference_int8's p_exp for the INT8 P.V (pv="int8"): E is an FP16 exp2 of an FP16 argument
    (every E an FP16 value, P^ = rne(255 E) of it), within 2^-10 of the spec's E (absolutely:
    E <= 1, and P's codes are absolute); the noisy
    variant stays in [0, 1]; the report mode reaches it."""
    q, k, v = _inputs()
    s = torch.randn(2, 3, 128) * 4
    t = s.amax(dim=-1)
    e16 = R8._exp_fp16(s, t, None)
    assert torch.equal(e16, e16.half().float()) and e16.max() <= 1.0
    assert (e16 - torch.exp(s - t[..., None])).abs().max() <= 2.0 ** -10
    noisy = R8._exp_fp16(s, t, torch.Generator().manual_seed(1))
    assert noisy.max() <= 1.0 and not torch.equal(noisy, e16)
    spec = R8.attention_forward(q, k, v, is_causal=True, pv="int8")
    for p_exp in ("fp16", "fp16-noisy"):
        out, lse = R8.attention_forward(q, k, v, is_causal=True, p_exp=p_exp, pv="int8")
        assert not torch.equal(out, spec[0]) and metrics(out, spec[0])["cos"] > 0.99999, p_exp
        assert torch.allclose(lse, spec[1], atol=1e-3)
    with pytest.raises(ValueError, match="p_exp"):
        R8.attention_forward(q, k, v, p_exp="bf16")
    with pytest.raises(ValueError, match="p_max"):
        R8.attention_forward(q, k, v, p_exp="fp16", p_max="running")
    with pytest.raises(ValueError, match="l_sum"):
        R8.attention_forward(q, k, v, l_sum="p")
    with pytest.raises(ValueError, match="p_max"):
        R8.attention_forward(q, k, v, l_sum="codes", p_max="running")
    # l from the codes (a sum of rne(255 E) / 255 instead of E): the output stays close
    out, lse = R8.attention_forward(q, k, v, is_causal=True, p_exp="fp16", l_sum="codes",
                                    pv="int8")
    assert metrics(out, spec[0])["cos"] > 0.9999 and torch.isfinite(out).all()
    assert "codes" in RP.mode_label(RP.int8_granularity_mode(64, 128, p_exp="fp16", l_sum="codes",
                                                             pv="int8"))
    mode = RP.int8_granularity_mode(64, 128, p_exp="fp16", pv="int8")
    assert "FP16" in RP.mode_label(mode).upper()
    with RP.attention_mode(None, mode, "fp4attn"):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(got, R8.attention_forward(q, k, v, is_causal=True, p_exp="fp16",
                                                 pv="int8")[0])


@pytest.mark.parametrize("fix", G.OUTLIER_FIXES)
def test_outlier_fixes_keep_qk(fix):
    q, k, _ = _inputs(Nq=40, Nk=40)
    k[:, :, :, 3] *= 20.0  # an outlier channel
    qf, kf = G.outlier_fix(fix, q, k)
    want = q.double() @ R8._per_q_head(k, 2).double().transpose(-1, -2)
    got = qf.double() @ R8._per_q_head(kf, 2).double().transpose(-1, -2)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    assert kf.abs().amax() < k.abs().amax()


def test_perplexity_with_bos_per_window():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(3, 50, (21,))
    got = RP.perplexity(model, ids, window=10, modes=["exact"], backend="reference", bos_id=1)
    assert got["exact"]["tokens"] == 9 + 9 + 0  # windows of 10, 10, 1 tokens: 9 + 9 targets
    nll = 0.0
    for s in (0, 10):
        chunk = torch.cat([torch.tensor([1]), ids[s : s + 10]])[None]
        with torch.no_grad():
            lp = torch.log_softmax(model(chunk).logits[0, 1:-1].float(), -1)
        nll -= lp.gather(-1, chunk[0, 2:, None]).sum().item()
    assert math.isclose(got["exact"]["ppl"], math.exp(nll / 18), rel_tol=1e-6)


def _gemma3_missing() -> str | None:
    try:
        M.gemma3_gguf_parts()
    except M.MissingResourceError as exc:
        return str(exc)
    return None


@pytest.mark.skipif(_gemma3_missing() is not None, reason=_gemma3_missing() or "")
def test_gemma3_tokenizer_is_sentencepiece_bpe(tmp_path):
    """transformers' own GGUF conversion splits ' world' into ' w|or|ld'; the rebuilt tokenizer
    gives Gemma's pieces (ids checked against a transcription of llama.cpp's SentencePiece BPE
    on 60,000 characters of Pride and Prejudice when this was written)."""
    pytest.importorskip("gguf")
    parts = M.gemma3_gguf_parts()
    path = parts[0] if len(parts) == 1 else M._assemble_gemma3(parts, tmp_path / M.GEMMA3_GGUF)
    tok = M.gemma3_tokenizer(path)
    ids = tok("Hello world. It is a truth universally acknowledged,\n\nHowever").input_ids
    assert ids == [2, 9259, 1902, 236761, 1030, 563, 496, 9043, 69127, 30285, 236764, 108, 9675]
    assert tok.decode(ids[1:]) == "Hello world. It is a truth universally acknowledged,\n\nHowever"
