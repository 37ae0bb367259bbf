"""Tests of the native Blackwell (sm_120a) FP4 attention path and its exact MMA emulation.

CPU (run everywhere): a model of the block-scaled MMA instruction straight from the PTX fragment
and scale-register layouts, checked against plain matrix algebra; the emulation's derivation
(four FP16 m16n8k16 MMAs on the same registers, the FP16 bit tricks, exactness of every
product) replayed in numpy against that model; the K token permutation and the way the kernel
maps accumulator positions to key indices; the P-scale word assembly of the kernel.

GPU (marked `gpu`): the primitive `torch.ops.fp4attn_testing.mma_fp4` (a private test op) (the inline PTX on sm_120a,
the emulation elsewhere) against the CPU model for random fragments, every lane and every
selector; then the whole sm120 kernel (kernel "sm120", emulated on Hopper) against
`fp4attn.reference.attention` (rel_l1 < 2e-3) over shapes, dtypes, masks, causal, GQA and LSE.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp4attn import reference as R

E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
E4M3 = R.e4m3_decode(torch.arange(256, dtype=torch.uint8)).double().numpy()
KERNEL_SM120 = "sm120"
HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# CPU model of mma.sync.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X (ue4m3)
# ---------------------------------------------------------------------------------------------


def nibbles(words: np.ndarray) -> np.ndarray:
    """[..., ] uint32 -> [..., 8] codes, element i = nibble i (low first)."""
    w = words.astype(np.uint64)[..., None]
    return ((w >> (4 * np.arange(8, dtype=np.uint64))) & 0xF).astype(np.int64)


def fragments_to_matrices(a, b, c, sfa, sfb, tid_a, tid_b):
    """Per-lane registers -> A [16,64] codes, B [64,8] codes, C [16,8], scale values."""
    a = np.asarray(a, dtype=np.int64) & 0xFFFFFFFF
    b = np.asarray(b, dtype=np.int64) & 0xFFFFFFFF
    sfa = np.asarray(sfa, dtype=np.int64) & 0xFFFFFFFF
    sfb = np.asarray(sfb, dtype=np.int64) & 0xFFFFFFFF
    A = np.zeros((16, 64), dtype=np.int64)
    B = np.zeros((64, 8), dtype=np.int64)
    C = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        na = nibbles(a[lane])  # [4, 8]
        nb = nibbles(b[lane])  # [2, 8]
        A[g, 8 * t : 8 * t + 8] = na[0]
        A[g + 8, 8 * t : 8 * t + 8] = na[1]
        A[g, 32 + 8 * t : 40 + 8 * t] = na[2]
        A[g + 8, 32 + 8 * t : 40 + 8 * t] = na[3]
        B[8 * t : 8 * t + 8, g] = nb[0]
        B[32 + 8 * t : 40 + 8 * t, g] = nb[1]
        C[g, 2 * t : 2 * t + 2] = c[lane][0:2]
        C[g + 8, 2 * t : 2 * t + 2] = c[lane][2:4]
    SA = np.zeros((16, 4))
    SB = np.zeros((8, 4))
    for g in range(8):
        for j in range(4):
            SA[g, j] = E4M3[(sfa[4 * g + 2 * tid_a] >> (8 * j)) & 0xFF]
            SA[g + 8, j] = E4M3[(sfa[4 * g + 2 * tid_a + 1] >> (8 * j)) & 0xFF]
            SB[g, j] = E4M3[(sfb[4 * g + tid_b] >> (8 * j)) & 0xFF]
    return A, B, C, SA, SB


def mma_model(a, b, c, sfa, sfb, tid_a, tid_b):
    """The instruction in float64: returns (d [32,4], bound [32,4]) in the per-lane layout;
    bound = sum |products| + |c|, the scale of an FP32 accumulation error."""
    A, B, C, SA, SB = fragments_to_matrices(a, b, c, sfa, sfb, tid_a, tid_b)
    As = E2M1[A] * np.repeat(SA, 16, axis=1)
    Bs = E2M1[B] * np.repeat(SB.T, 16, axis=0)
    D = As @ Bs + C
    bound = np.abs(As) @ np.abs(Bs) + np.abs(C)
    return to_lanes(D), to_lanes(bound)


def to_lanes(M: np.ndarray) -> np.ndarray:
    out = np.zeros((32, 4))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out[lane] = [M[g, 2 * t], M[g, 2 * t + 1], M[g + 8, 2 * t], M[g + 8, 2 * t + 1]]
    return out


def random_fragments(rng: np.random.Generator, scale_bytes=(0, 127)):
    a = rng.integers(0, 2**32, size=(32, 4), dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, size=(32, 2), dtype=np.uint64).astype(np.uint32)
    c = rng.standard_normal((32, 4)).astype(np.float32) * 100
    lo, hi = scale_bytes
    sb = rng.integers(lo, hi, size=(2, 32, 4))  # E4M3 bytes without NaN (0x7F) and sign
    sfa = (sb[0] << np.array([0, 8, 16, 24])).sum(-1).astype(np.uint32)
    sfb = (sb[1] << np.array([0, 8, 16, 24])).sum(-1).astype(np.uint32)
    return a, b, c, sfa, sfb


def test_model_matches_matrix_algebra():
    """Pack random A, B, scales into registers by the documented layout and back through the
    model: the result must equal the plain scaled matrix product."""
    rng = np.random.default_rng(0)
    for tid_a in (0, 1):
        for tid_b in range(4):
            A = rng.integers(0, 16, size=(16, 64))
            B = rng.integers(0, 16, size=(64, 8))
            SAb = rng.integers(0, 127, size=(16, 4))
            SBb = rng.integers(0, 127, size=(8, 4))
            a = np.zeros((32, 4), dtype=np.uint64)
            b = np.zeros((32, 2), dtype=np.uint64)
            sfa = rng.integers(0, 2**32, size=32, dtype=np.uint64)  # unused lanes: garbage
            sfb = rng.integers(0, 2**32, size=32, dtype=np.uint64)
            sh = np.arange(8, dtype=np.uint64) * 4
            for lane in range(32):
                g, t = lane >> 2, lane & 3

                def pack(v, sh=sh):
                    return int((v.astype(np.uint64) << sh).sum())

                a[lane] = [
                    pack(A[g, 8 * t : 8 * t + 8]),
                    pack(A[g + 8, 8 * t : 8 * t + 8]),
                    pack(A[g, 32 + 8 * t : 40 + 8 * t]),
                    pack(A[g + 8, 32 + 8 * t : 40 + 8 * t]),
                ]
                b[lane] = [pack(B[8 * t : 8 * t + 8, g]), pack(B[32 + 8 * t : 40 + 8 * t, g])]
            for g in range(8):
                word = lambda bs: int(sum(int(x) << (8 * j) for j, x in enumerate(bs)))
                sfa[4 * g + 2 * tid_a] = word(SAb[g])
                sfa[4 * g + 2 * tid_a + 1] = word(SAb[g + 8])
                sfb[4 * g + tid_b] = word(SBb[g])
            c = np.zeros((32, 4), dtype=np.float32)
            d, _ = mma_model(a, b, c, sfa, sfb, tid_a, tid_b)
            expect = (E2M1[A] * np.repeat(E4M3[SAb], 16, axis=1)) @ (
                E2M1[B] * np.repeat(E4M3[SBb].T, 16, axis=0)
            )
            np.testing.assert_array_equal(d, to_lanes(expect))


# ---------------------------------------------------------------------------------------------
# The emulation's derivation, replayed on the CPU
# ---------------------------------------------------------------------------------------------


def f16_bits(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float64)


def test_emulation_bit_tricks_are_exact():
    """e2m1x2_to_h2_scaled and e4m3_to_h2_x128 of mma_fp4.cuh, and every product, exactly."""
    for byte in range(256):  # both nibbles of a byte
        y = byte
        h = ((y & 0x7) << 9) | ((y & 0x8) << 12) | ((y & 0x70) << 21) | ((y & 0x80) << 24)
        lo, hi = f16_bits(h & 0xFFFF), f16_bits(h >> 16)
        assert lo == E2M1[byte & 0xF] * 2.0**-14 and math.copysign(1, lo) == math.copysign(
            1, E2M1[byte & 0xF]
        )
        assert hi == E2M1[byte >> 4] * 2.0**-14
    for c in range(127):
        s8 = f16_bits((c & 0x7F) << 7)
        assert s8 == E4M3[c] * 2.0**-8
        s = np.float16(s8) * np.float16(2.0**15)  # exact in FP16
        assert float(s) == E4M3[c] * 2.0**7
        for code in range(16):
            prod = np.float16(E2M1[code] * 2.0**-14) * s  # the hmul2 of the emulation
            assert float(prod) == E2M1[code] * E4M3[c] * 2.0**-7, (code, c)


def emulation_model(a, b, c, sfa, sfb, tid_a, tid_b):
    """Four FP16 m16n8k16 MMAs on nibbles 2j, 2j+1 of the same registers (float64 sums)."""
    a = np.asarray(a, dtype=np.int64) & 0xFFFFFFFF
    b = np.asarray(b, dtype=np.int64) & 0xFFFFFFFF
    sfa = np.asarray(sfa, dtype=np.int64) & 0xFFFFFFFF
    sfb = np.asarray(sfb, dtype=np.int64) & 0xFFFFFFFF
    acc = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        acc[g, 2 * t : 2 * t + 2] = np.asarray(c[lane][0:2]) * 2.0**-14
        acc[g + 8, 2 * t : 2 * t + 2] = np.asarray(c[lane][2:4]) * 2.0**-14
    for j in range(4):
        A16 = np.zeros((16, 16))
        B16 = np.zeros((16, 8))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            sa_lo, sa_hi = sfa[4 * g + 2 * tid_a], sfa[4 * g + 2 * tid_a + 1]
            sb = sfb[4 * g + tid_b]
            b0, b1 = t >> 1, 2 + (t >> 1)

            def deq(reg, word, blk, j=j):
                s = np.float16(E4M3[(word >> (8 * blk)) & 0x7F] * 2.0**7)
                vals = [E2M1[(reg >> (4 * (2 * j + e))) & 0xF] * 2.0**-14 for e in (0, 1)]
                return [float(np.float16(v) * s) for v in vals]

            A16[g, 2 * t : 2 * t + 2] = deq(a[lane, 0], sa_lo, b0)
            A16[g + 8, 2 * t : 2 * t + 2] = deq(a[lane, 1], sa_hi, b0)
            A16[g, 2 * t + 8 : 2 * t + 10] = deq(a[lane, 2], sa_lo, b1)
            A16[g + 8, 2 * t + 8 : 2 * t + 10] = deq(a[lane, 3], sa_hi, b1)
            B16[2 * t : 2 * t + 2, g] = deq(b[lane, 0], sb, b0)
            B16[2 * t + 8 : 2 * t + 10, g] = deq(b[lane, 1], sb, b1)
        acc = acc + A16 @ B16
    return to_lanes(acc * 2.0**14)


@pytest.mark.parametrize("tid_a", [0, 1])
@pytest.mark.parametrize("tid_b", [0, 1, 2, 3])
def test_emulation_derivation_matches_instruction_model(tid_a, tid_b):
    rng = np.random.default_rng(10 + 4 * tid_a + tid_b)
    a, b, c, sfa, sfb = random_fragments(rng)
    d, bound = mma_model(a, b, c, sfa, sfb, tid_a, tid_b)
    e = emulation_model(a, b, c, sfa, sfb, tid_a, tid_b)
    assert np.all(np.abs(e - d) <= 1e-12 * bound + 1e-30)


# ---------------------------------------------------------------------------------------------
# K token permutation and the kernel's index maps
# ---------------------------------------------------------------------------------------------


def perm(c: int) -> int:
    return (c & ~31) | (c & 1) | ((c & 24) >> 2) | ((c & 6) << 2)


def test_permutation_is_an_involution_on_32_groups():
    for c in range(256):
        assert perm(perm(c)) == c
        assert perm(c) // 32 == c // 32
    assert sorted(perm(c) for c in range(128)) == list(range(128))


def test_accumulator_columns_are_consecutive_tokens():
    """QK^T accumulator (n-tile nt, element e) of thread t holds stored position 8nt + 2t + (e&1)
    = token perm(that); the kernel computes the token as 32(nt>>2) + 8t + 2(nt&3) + (e&1), and
    a thread's 8 columns of each 32-key group must be tokens 8t..8t+7 in register order."""
    for t in range(4):
        for q in range(4):
            toks = []
            for i in range(8):  # nibble i of the P register = column (nt = 4q + i//2, e = i%2)
                nt, e = 4 * q + (i >> 1), i & 1
                pos = 8 * nt + 2 * t + e
                kernel_token = 32 * (nt >> 2) + 8 * t + 2 * (nt & 3) + e
                assert perm(pos) == kernel_token
                toks.append(kernel_token)
            assert toks == list(range(32 * q + 8 * t, 32 * q + 8 * t + 8))


def test_causal_mask_through_permutation():
    """Model of the causal mask as the kernel applies it (via the permutation), compared to the
    plain mask on tokens, for a tile straddling the diagonal and Nk not a multiple of 32."""
    Nk, key0 = 97, 0
    for row in (0, 5, 31, 40, 96, 130):
        got = np.zeros(128, dtype=bool)
        for pos in range(128):
            tok = key0 + perm(pos)
            got[perm(pos)] = tok <= row and tok < Nk
        want = np.array([(j <= row and j < Nk) for j in range(128)])
        np.testing.assert_array_equal(got, want)


def test_pquant_scale_word_assembly():
    """The kernel's P scale words: thread t owns bytes t>>1 and 2+(t>>1) of each (k-step, row)
    word, exchanges with lane t^2 once, and must end holding word (ks = t>>1, row half t&1),
    which is what thread-id-a = ks selects (lanes 4g+2ks: row g, 4g+2ks+1: row g+8)."""
    rng = np.random.default_rng(3)
    # block scale of (group q, row half r, block half bh = t >> 1) for one quad
    sc = rng.integers(0, 127, size=(4, 2, 2))
    own = {}
    for t in range(4):
        sh = 8 * (t >> 1)
        own[t] = {
            (ks, r): (int(sc[2 * ks, r, t >> 1]) << sh)
            | (int(sc[2 * ks + 1, r, t >> 1]) << (16 + sh))
            for ks in (0, 1)
            for r in (0, 1)
        }
    for t in range(4):
        r, mine_ks = t & 1, t >> 1
        partner = t ^ 2
        theirs = own[partner][(1 - (partner >> 1), partner & 1)]  # what the partner sends
        word = own[t][(mine_ks, r)] | theirs
        # expected: byte jb = 2*(q&1) + half of the 64-key slice ks = t >> 1
        exp = 0
        for jb in range(4):
            q = 2 * mine_ks + (jb >> 1)
            exp |= int(sc[q, r, jb & 1]) << (8 * jb)
        assert word == exp
        # and the MMA reads it from the lane the selector names
        assert (t >> 1) == mine_ks and 2 * mine_ks + r == t


# ---------------------------------------------------------------------------------------------
# GPU: the primitive
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _ops():
    import fp4attn  # registers torch.ops.fp4attn

    if not fp4attn.build_info().get("cuda"):
        pytest.skip("this fp4attn build has no CUDA backend")
    return torch.ops.fp4attn


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scales", [(0, 127), (0, 16), (40, 80)], ids=["all", "subnormal", "mid"])
def test_mma_primitive_matches_model(scales):
    ops = _ops()
    dev = torch.device("cuda")
    rng = np.random.default_rng(100 + scales[0])
    for trial in range(4):
        a, b, c, sfa, sfb = random_fragments(rng, scales)
        for tid_a in (0, 1):
            for tid_b in range(4):
                d = (
                    torch.ops.fp4attn_testing.mma_fp4(
                        torch.from_numpy(a.view(np.int32)).to(dev),
                        torch.from_numpy(b.view(np.int32)).to(dev),
                        torch.from_numpy(c).to(dev),
                        torch.from_numpy(sfa.view(np.int32)).to(dev),
                        torch.from_numpy(sfb.view(np.int32)).to(dev),
                        tid_a,
                        tid_b,
                    )
                    .cpu()
                    .double()
                    .numpy()
                )
                ref, bound = mma_model(a, b, c, sfa, sfb, tid_a, tid_b)
                err = np.abs(d - ref) - (1e-5 * bound + 1e-30)
                assert np.all(err <= 0), (trial, tid_a, tid_b, float(np.abs(d - ref).max()))


# ---------------------------------------------------------------------------------------------
# GPU: the kernel (emulated on non-Blackwell GPUs) against fp4attn.reference
# ---------------------------------------------------------------------------------------------

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# (B, Hq, Hkv, Nq, Nk, D, causal, mask, dtype)
CASES = [
    (1, 2, 2, 128, 128, 64, False, None, "fp16"),
    (2, 4, 4, 256, 384, 128, False, None, "fp16"),
    (1, 2, 2, 256, 256, 128, True, None, "bf16"),
    (1, 2, 2, 300, 300, 64, True, None, "fp16"),
    (1, 2, 2, 97, 97, 128, True, None, "fp16"),  # Nk not a multiple of 32
    (1, 2, 2, 200, 333, 128, True, None, "fp16"),  # Nq < Nk, causal top-left
    (1, 2, 2, 333, 150, 64, True, None, "fp16"),  # Nq > Nk, causal
    (1, 2, 2, 1, 77, 128, False, None, "fp16"),  # single query
    (1, 2, 2, 50, 1, 64, True, None, "fp16"),  # single key
    (2, 8, 2, 130, 257, 128, False, None, "bf16"),  # GQA
    (1, 8, 1, 129, 200, 64, True, None, "fp16"),  # MQA, causal
    (1, 2, 2, 160, 190, 32, False, None, "fp32"),  # padded head dims
    (1, 2, 2, 160, 190, 80, True, None, "fp16"),
    (1, 2, 1, 140, 130, 96, False, None, "bf16"),
    (1, 2, 2, 140, 130, 160, True, None, "fp16"),
    (1, 2, 2, 140, 260, 256, False, None, "fp16"),
    (1, 2, 2, 140, 150, 100, True, None, "fp16"),  # K rows not 16-byte aligned: scalar loads
    (1, 2, 1, 70, 90, 57, False, None, "fp32"),  # odd head dim
    (2, 4, 2, 200, 300, 128, False, "bool", "fp16"),
    (2, 4, 2, 200, 300, 64, True, "bool", "bf16"),
    (1, 2, 2, 150, 270, 128, False, "additive", "fp16"),
    (2, 2, 2, 150, 270, 128, False, "padding", "fp32"),
    (1, 2, 2, 1024, 1024, 128, True, None, "fp16"),
    (1, 4, 4, 2048, 2048, 64, True, None, "bf16"),
]


def make_inputs(case, seed):
    B, Hq, Hkv, Nq, Nk, D, _causal, mask_kind, dt = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g) * 1.5
    k = torch.randn(B, Hkv, Nk, D, generator=g) + 0.5 * torch.randn(1, 1, 1, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    dtype = DTYPES[dt]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
        mask[:, :, 3] = False  # a row that sees nothing
    elif mask_kind == "additive":
        mask = (torch.randn(1, Hq, Nq, Nk, generator=g) * 2).to(dtype)
        mask[0, 0, :, 5:9] = -math.inf
    elif mask_kind == "padding":
        lens = torch.tensor([Nk, Nk - 37])
        mask = torch.zeros(B, 1, 1, Nk)
        mask[torch.arange(Nk)[None, None, None, :] >= lens[:, None, None, None]] = -math.inf
        mask = mask.to(dtype)
    return q, k, v, mask


def check_against_reference(q, k, v, mask, causal, scale=None):
    ops = _ops()
    dev = torch.device("cuda")
    D = q.shape[-1]
    sc = 1.0 / math.sqrt(D) if scale is None else scale
    out, lse = ops.attention(
        q.to(dev),
        k.to(dev),
        v.to(dev),
        None if mask is None else mask.to(dev),
        causal,
        sc,
        True,
        KERNEL_SM120,
    )
    ref, ref_lse = R.attention(q, k, v, attn_mask=mask, is_causal=causal, scale=sc, return_lse=True)
    out_dtype = out.dtype
    out = out.float().cpu()
    lse = lse.cpu()
    assert torch.isfinite(out).all()
    m = R.metrics(out, ref)
    assert m["rel_l1"] < 2e-3, m  # the SPEC bound, output rounding included
    # Against the reference rounded to the output dtype, what is left is the kernel's own
    # deviation (accumulation order, exp rounding): far below the output rounding itself.
    m_same = R.metrics(out, ref.to(out_dtype).float())
    assert m_same["rel_l1"] < 2e-4, m_same
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "rows without visible keys differ"
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-3
    zero_rows = ~fin
    if zero_rows.any():
        assert out[zero_rows].abs().max().item() == 0
    print(
        f"sm120 vs reference {tuple(q.shape)} {tuple(k.shape)} causal={causal}: "
        f"rel_l1={m['rel_l1']:.2e} cos={m['cos']:.6f} rmse={m['rmse']:.2e} "
        f"(vs reference in {out_dtype}: rel_l1={m_same['rel_l1']:.2e})"
    )
    return m


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("idx", range(len(CASES)), ids=["-".join(str(x) for x in c) for c in CASES])
def test_sm120_kernel_matches_reference(idx):
    case = CASES[idx]
    q, k, v, mask = make_inputs(case, seed=1000 + idx)
    check_against_reference(q, k, v, mask, case[6])


@pytest.mark.gpu
@gpu
def test_sm120_kernel_strided_inputs_and_scale():
    """[B, N, H, D] tensors viewed as [B, H, N, D] (non-contiguous) and a custom scale."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 150, 4, 64, generator=g).half().transpose(1, 2)
    k = torch.randn(2, 170, 2, 64, generator=g).half().transpose(1, 2)
    v = torch.randn(2, 170, 2, 64, generator=g).half().transpose(1, 2)
    check_against_reference(q, k, v, None, True, scale=0.3)


@pytest.mark.gpu
@gpu
def test_sm120_kernel_values_near_the_top_of_the_float_range():
    """|V| up to 2^120 in BF16: FP4MM(P^, V^) dV before the 1/2688 factor overflowed from about
    2^110 (SPEC 4.5 groups the factor with P's scale first)."""
    g = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, 2, 200, 128, generator=g).bfloat16() for _ in range(2))
    v = (torch.randn(1, 2, 200, 128, generator=g).clamp(-1, 1) * 2.0**120).bfloat16()
    check_against_reference(q, k, v, None, False)


@pytest.mark.gpu
@gpu
def test_sm120_kernel_does_not_modify_inputs():
    ops = _ops()
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 130, 128, generator=g).half().cuda() for _ in range(3))
    copies = [t.clone() for t in (q, k, v)]
    ops.attention(q, k, v, None, True, 0.1, False, KERNEL_SM120)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


@pytest.mark.gpu
@gpu
def test_sm120_sdpa_env_opt_in(monkeypatch):
    """FP4ATTN_KERNEL=sm120 routes fp4attn.sdpa to this kernel (emulated off Blackwell)."""
    import fp4attn

    _ops()
    monkeypatch.setenv("FP4ATTN_KERNEL", "sm120")
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 100, 64, generator=g).half() for _ in range(3))
    out = fp4attn.sdpa(q.cuda(), k.cuda(), v.cuda(), is_causal=True).float().cpu()
    ref = R.attention(q, k, v, is_causal=True)
    assert R.metrics(out, ref)["rel_l1"] < 2e-3
