"""Tests of fp4attn/reference.py, the oracle: number formats, phi, FP4MM and the attention.

The oracle is checked against things that do not share its code: brute-force searches over the
format grids, torch's own float8 conversion, the C helpers of numerics.h (compiled on the fly when
a C compiler exists), a slow loop-by-loop transcription of SPEC 4, and float64 exact attention.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fp4attn import reference as R

ROOT = Path(__file__).resolve().parents[1]
E2M1_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_near(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """|actual - expected| <= atol + rtol * |expected| elementwise, same shape, NaN-free.

    (torch.testing.assert_close would do, but its first call costs seconds of imports.)
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    err = (a - e).abs() - (atol + rtol * e.abs())
    assert not torch.isnan(err).any() and torch.all(err <= 0), (
        f"max excess {err.max().item():.3g} (max abs diff {(a - e).abs().max().item():.3g})"
    )


def nextafter(x: torch.Tensor, direction: float) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, direction))


# ---------------------------------------------------------------------------------------------
# Brute-force models of the formats (independent of the bit tricks in reference.py)
# ---------------------------------------------------------------------------------------------


def brute_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Nearest of the 127 finite non-negative E4M3 values, ties to the even code, saturating.

    Distances are float64: for inputs near a midpoint (>= 2^-10) both the float32 input and the
    grid value are multiples of 2^-33 below 2^9, so the differences are exact; for smaller inputs
    the nearest value is never in doubt.
    """
    grid = R.e4m3_decode(torch.arange(127, dtype=torch.uint8)).double()
    codes = torch.arange(127)
    v64 = v.double()
    dist = (v64[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    key = (dist != best).to(torch.int64) * 2 + (codes[None, :] & 1)  # candidates, even first
    out = key.argmin(dim=1)
    out = torch.where(v64 > 448, 126, out)
    out = torch.where(torch.isnan(v64), 127, out)
    return out.to(torch.uint8)


def brute_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Nearest of the 8 E2M1 magnitudes, ties to the even code, sign kept unless zero."""
    grid = torch.tensor(E2M1_MAGS, dtype=torch.float64)
    a = y.double().abs()
    dist = (a[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    key = (dist != best).to(torch.int64) * 2 + (torch.arange(8)[None, :] & 1)
    code = key.argmin(dim=1)
    code = torch.where(a > 6, 7, code)
    code = torch.where((y < 0) & (code != 0), code | 8, code)
    return code.to(torch.uint8)


def e4m3_special_inputs() -> torch.Tensor:
    finite = R.e4m3_decode(torch.arange(127, dtype=torch.uint8))
    mids = (finite[1:] + finite[:-1]) / 2  # every tie (exact in float32)
    pts = torch.cat([finite, mids])
    extra = torch.tensor(
        [
            0.0,
            2.0**-10,
            2.0**-9,
            2.0**-6,
            1e-45,
            1e-40,
            1e-30,
            448.0,
            447.0,
            448.5,
            460.0,
            464.0,
            465.0,
            1e10,
            3.0e38,
            math.inf,
        ],
        dtype=torch.float32,
    )
    pts = torch.cat([pts, extra])
    return torch.cat([pts, nextafter(pts, math.inf), nextafter(pts, 0.0)])


def random_log_uniform(n: int, lo: float, hi: float, seed: int) -> torch.Tensor:
    u = torch.rand(n, generator=gen(seed), dtype=torch.float64)
    return torch.exp2(lo + (hi - lo) * u).float()


# ---------------------------------------------------------------------------------------------
# SPEC 1: formats
# ---------------------------------------------------------------------------------------------


def test_e4m3_decode_table_matches_torch():
    b = torch.arange(256, dtype=torch.uint8)
    ours = R.e4m3_decode(b)
    theirs = b.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    assert torch.isnan(ours).sum() == 2  # 0x7F and 0xFF only
    ok = ~torch.isnan(ours)
    assert torch.equal(ours[ok], theirs[ok])
    assert ours[0x7E] == 448 and ours[0x08] == 2.0**-6 and ours[0x01] == 2.0**-9
    assert ours[0xFE] == -448


def test_e4m3_encode_matches_brute_force():
    v = torch.cat([e4m3_special_inputs(), random_log_uniform(20000, -14, 10, seed=1)])
    assert torch.equal(R.e4m3_encode_sat(v), brute_e4m3(v))
    # the named edge cases of SPEC 1
    special = torch.tensor([2.0**-10, 2.0**-10 * (1 + 2**-23), 448.0, 449.0, math.inf, math.nan])
    assert R.e4m3_encode_sat(special).tolist() == [0x00, 0x01, 0x7E, 0x7E, 0x7E, 0x7F]
    # ties go to the even code: 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39)
    assert R.e4m3_encode_sat(torch.tensor([1.0625, 1.1875])).tolist() == [0x38, 0x3A]


def test_e4m3_encode_matches_torch_float8_on_finite_inputs():
    v = torch.cat([e4m3_special_inputs(), random_log_uniform(20000, -14, 12, seed=2)])
    v = v[torch.isfinite(v)]
    theirs = torch.clamp(v, max=448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(R.e4m3_encode_sat(v), theirs)


def test_e2m1_encode_thresholds_and_ties():
    # every tie and the expected (even) code, SPEC 1
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    t = torch.tensor(list(ties), dtype=torch.float32)
    assert R.e2m1_encode(t).tolist() == list(ties.values())
    assert R.e2m1_encode(-t).tolist() == [c | 8 if c else 0 for c in ties.values()]
    # just above / below every threshold
    above, below = nextafter(t, math.inf), nextafter(t, 0.0)
    assert R.e2m1_encode(above).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert R.e2m1_encode(below).tolist() == [0, 1, 2, 3, 4, 5, 6]
    special = torch.tensor(
        [0.0, -0.0, -0.1, 6.0, 7.0, 1e30, math.inf, -math.inf, math.nan, -math.nan]
    )
    assert R.e2m1_encode(special).tolist() == [0, 0, 0, 7, 7, 7, 7, 15, 7, 7]


def test_e2m1_encode_matches_brute_force():
    g = gen(3)
    y = torch.cat(
        [
            torch.randn(20000, generator=g) * 3,
            (torch.arange(-800, 801) / 100.0),  # a dense grid through every threshold
            (
                torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
                * torch.tensor([[1.0], [-1.0]])
            ).flatten(),
        ]
    ).float()
    assert torch.equal(R.e2m1_encode(y), brute_e2m1(y))


def test_e2m1_decode_table():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = R.e2m1_decode(codes)
    assert vals.tolist() == E2M1_MAGS + [-m for m in E2M1_MAGS]
    # encode(decode(c)) == c except -0 (code 8), which is always stored as 0
    back = R.e2m1_encode(vals)
    assert back.tolist() == [c if c != 8 else 0 for c in range(16)]


def test_global_scales():
    amax = torch.tensor([0.0, 1.0, 3.0, 1e-45, math.inf, math.nan, 1e30])
    a = amax.tolist()  # the float32 values, exactly, as Python floats

    def f32(x: float) -> float:  # a float64 quotient rounded to float32 is the IEEE f32 quotient
        return torch.tensor(x, dtype=torch.float32).item()

    enc, dec = R.global_scales(amax)
    assert enc[0] == 1 and dec[0] == 1
    assert enc[1] == 2688 and dec[1] == f32(1 / 2688)
    assert enc[2] == f32(2688 / 3) and dec[2] == f32(3 / 2688)
    assert enc[3] == 1 and dec[3] == 1  # enc would overflow
    assert enc[4] == 0 and math.isnan(dec[4])  # numerics.h: 2688/Inf = 0 is finite
    assert enc[5] == 1 and math.isnan(dec[5])
    assert enc[6] == f32(2688 / a[6]) and dec[6] == f32(a[6] / 2688)
    # the reciprocal-then-multiply shortcut would differ in the last bit here
    x = torch.tensor([0.08847743272781372], dtype=torch.float32)
    assert R.global_scales(x)[0].item() == f32(2688 / x.item()) != (2688.0 / x).item()


# ---------------------------------------------------------------------------------------------
# SPEC 2: quantize / dequantize
# ---------------------------------------------------------------------------------------------


def test_packing_low_nibble_first():
    # With global_scale=False and a block max of 6 the scale is exactly 1 (0x38) and the codes
    # are the E2M1 codes of x itself.
    x = torch.tensor([[6.0, -0.5, 1.0, 0.0, -6.0, 3.0, 0.0, 0.0] + [0.0] * 8])
    codes, scales, dec = R.quantize(x, global_scale=False)
    assert scales.tolist() == [[0x38]] and dec.item() == 1.0
    assert codes.shape == (1, 8) and codes.dtype == torch.uint8
    assert codes[0, :4].tolist() == [0x7 | (0x9 << 4), 0x2 | (0x0 << 4), 0xF | (0x5 << 4), 0x00]
    assert torch.equal(R.dequantize(codes, scales, dec, 16), x)


def test_quantize_zeros():
    x = torch.zeros(3, 5, 40)
    codes, scales, dec = R.quantize(x)
    assert codes.shape == (3, 5, 24) and scales.shape == (3, 5, 3) and dec.shape == (3,)
    assert not codes.any() and not scales.any() and torch.all(dec == 1)
    assert torch.equal(R.fake_quantize(x), x)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_single_nan_or_inf(bad):
    x = torch.randn(4, 48, generator=gen(4))
    x[1, 20] = bad
    codes, scales, dec = R.quantize(x)
    assert math.isnan(dec.item())
    assert scales[1, 1] == 0x7F  # NaN block scale (NaN block max, or Inf * enc=0 = NaN)
    assert torch.all(R._unpack(codes)[1, 16:32] == 7)  # 1/NaN * x = NaN -> code 7, no sign
    if math.isinf(bad):
        # amax = Inf -> enc = 0: every other block is scaled to zero
        others = torch.ones_like(scales, dtype=torch.bool)
        others[1, 1] = False
        assert not scales[others].any()
    assert torch.isnan(R.fake_quantize(x)).all()
    # other matrices of the batch are unaffected
    xb = torch.stack([x, torch.ones_like(x)])
    db = R.quantize(xb)[2]
    assert math.isnan(db[0]) and db[1] == torch.tensor(1 / 2688, dtype=torch.float32)


def test_quantize_local_inf_saturates():
    x = torch.zeros(1, 16)
    x[0, 3] = math.inf
    scales, dec = R.quantize(x, global_scale=False)[1:]
    assert scales.item() == 0x7E and dec.item() == 1
    assert R.fake_quantize(x, global_scale=False)[0, 3] == 2688


@pytest.mark.parametrize("mag", [1e-6, 1e-3, 1.0, 300.0, 6e4])
def test_quantize_magnitudes(mag):
    base = torch.randn(8, 64, generator=gen(5))
    x = base * mag
    xq = R.fake_quantize(x)
    rel = (xq - x).abs().sum() / x.abs().sum()
    assert rel < 0.12, rel  # no vanishing blocks (tiny inputs) nor saturation (huge ones)
    assert (xq != 0).float().mean() > 0.8
    # the global scale makes phi invariant under power-of-two scaling of the input
    c0, s0, d0 = R.quantize(base)
    e = round(math.log2(mag))
    c1, s1, d1 = R.quantize(base * 2.0**e)
    assert torch.equal(c0, c1) and torch.equal(s0, s1) and d1 == d0 * 2.0**e
    # without it, tiny inputs vanish: the reason for the two-level recipe
    if mag == 1e-6:
        assert not R.fake_quantize(x, global_scale=False).any()


@pytest.mark.parametrize("K", [1, 7, 16, 20, 33, 100])
def test_quantize_k_not_multiple_of_16(K):
    x = torch.randn(2, 3, K, generator=gen(K))
    codes, scales, dec = R.quantize(x)
    nb = -(-K // 16)
    assert codes.shape == (2, 3, nb * 8) and scales.shape == (2, 3, nb) and dec.shape == (2,)
    padded = torch.nn.functional.pad(x, (0, nb * 16 - K))
    cp, sp, dp = R.quantize(padded)
    assert torch.equal(codes, cp) and torch.equal(scales, sp) and torch.equal(dec, dp)
    assert not R._unpack(codes)[..., K:].any()  # padding codes are zero
    assert R.dequantize(codes, scales, dec, K).shape == x.shape


def test_quantize_input_dtypes():
    x = torch.randn(4, 32, generator=gen(6))
    for dt in (torch.float16, torch.bfloat16):
        xd = x.to(dt)
        for a, b in zip(R.quantize(xd), R.quantize(xd.float())):
            assert torch.equal(a, b)


def test_dequantize_error_bound():
    """Each element is within one E2M1 half-step of its block: |x' - x| <= (1 + 1/16) * s_ideal
    where s_ideal = blockmax/6 (E4M3 relative rounding <= 1/16; the widest half-step is 1*s,
    between 4 and 6; saturation above 6*s costs at most 0.4*s)."""
    x = torch.randn(64, 256, generator=gen(7)) * torch.exp(torch.randn(64, 1, generator=gen(8)))
    xq = R.fake_quantize(x)
    bmax = x.abs().reshape(64, 16, 16).amax(-1, keepdim=True).expand(64, 16, 16).reshape(64, 256)
    bound = (1 + 1 / 16) * bmax / 6 * (1 + 1e-5)
    assert torch.all((xq - x).abs() <= bound)
    # and the bound is not vacuous: errors reach a sizeable fraction of it
    assert ((xq - x).abs() / bound).max() > 0.5
    # the block maximum itself is reproduced within E4M3 rounding
    amax_err = (xq.abs().reshape(64, 16, 16).amax(-1) - x.abs().reshape(64, 16, 16).amax(-1)).abs()
    assert torch.all(amax_err <= x.abs().reshape(64, 16, 16).amax(-1) / 16 * (1 + 1e-5))


def test_dequantize_rejects_bad_shapes():
    codes, scales, dec = R.quantize(torch.randn(2, 32))
    with pytest.raises(ValueError):
        R.dequantize(codes[:, :7], scales, dec, 32)
    with pytest.raises(ValueError):
        R.dequantize(codes, scales, dec, 33)


# --- bit-exactness against the C helpers themselves ------------------------------------------

_HARNESS = r"""
#include <stdint.h>
#include "fp4attn/numerics.h"
void enc_e4m3(const float *v, uint8_t *o, int64_t n) { for (int64_t i = 0; i < n; ++i) o[i] = fp4attn_e4m3_encode_sat(v[i]); }
void enc_e2m1(const float *v, uint8_t *o, int64_t n) { for (int64_t i = 0; i < n; ++i) o[i] = fp4attn_e2m1_encode(v[i]); }
void gscales(const float *a, float *e, float *d, int64_t n) { for (int64_t i = 0; i < n; ++i) fp4attn_global_scales(a[i], &e[i], &d[i]); }
/* one matrix rows x cols, global scale, unpacked codes [rows, nb*16], scales [rows, nb] */
void quant(const float *x, int64_t rows, int64_t cols, uint8_t *codes, uint8_t *scales, float *dec) {
  float amax = 0.0f, enc, d;
  for (int64_t i = 0; i < rows * cols; ++i) amax = fp4attn_nanmax(amax, x[i] < 0 ? -x[i] : x[i]);
  fp4attn_global_scales(amax, &enc, &d);
  *dec = d;
  int64_t nb = (cols + 15) / 16;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float xs[16];
      int n = 0;
      for (int64_t c = b * 16; c < cols && c < b * 16 + 16; ++c) xs[n++] = x[r * cols + c] * enc;
      for (int i = n; i < 16; ++i) codes[r * nb * 16 + b * 16 + i] = 0;
      scales[r * nb + b] = fp4attn_quantize_block(xs, n, codes + r * nb * 16 + b * 16);
    }
}
"""


@pytest.fixture(scope="module")
def numerics_lib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build numerics.h")
    d = tmp_path_factory.mktemp("numerics")
    (d / "harness.c").write_text(_HARNESS)
    lib = d / "libharness.so"
    cmd = [
        cc,
        "-O2",
        "-ffp-contract=off",
        "-shared",
        "-fPIC",
        "-I",
        str(ROOT / "csrc" / "include"),
        str(d / "harness.c"),
        "-o",
        str(lib),
    ]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot compile numerics.h harness: {res.stderr[:500]}")
    return ctypes.CDLL(str(lib))


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def _c_map(lib, name, v: torch.Tensor) -> torch.Tensor:
    v = v.contiguous()
    out = torch.empty(v.shape, dtype=torch.uint8)
    getattr(lib, name)(_ptr(v), _ptr(out), ctypes.c_int64(v.numel()))
    return out


def test_encoders_match_numerics_h(numerics_lib):
    v = torch.cat(
        [
            e4m3_special_inputs(),
            random_log_uniform(50000, -30, 12, seed=9),
            torch.tensor([math.nan, -math.nan, -0.0]),
        ]
    )
    assert torch.equal(R.e4m3_encode_sat(v), _c_map(numerics_lib, "enc_e4m3", v))
    y = torch.cat([v, -v, torch.randn(50000, generator=gen(10)) * 4])
    assert torch.equal(R.e2m1_encode(y), _c_map(numerics_lib, "enc_e2m1", y))
    amax = torch.cat([v, torch.tensor([0.0, 1e-45, 1e-39, 3e38])])
    enc, dec = torch.empty_like(amax), torch.empty_like(amax)
    numerics_lib.gscales(_ptr(amax), _ptr(enc), _ptr(dec), ctypes.c_int64(amax.numel()))
    renc, rdec = R.global_scales(amax)
    assert torch.equal(renc, enc)
    assert torch.equal(torch.isnan(rdec), torch.isnan(dec))
    assert torch.equal(rdec.nan_to_num(), dec.nan_to_num())


@pytest.mark.parametrize("case", ["gauss", "wide", "tiny", "nan", "inf", "ragged"])
def test_quantize_matches_numerics_h(numerics_lib, case):
    g = gen(11)
    rows, cols = 24, 80
    x = torch.randn(rows, cols, generator=g)
    if case == "wide":
        x = x * torch.exp2(torch.randint(-40, 40, (rows, cols), generator=g).float())
    elif case == "tiny":
        x = x * 1e-30
    elif case == "nan":
        x[3, 17] = math.nan
    elif case == "inf":
        x[5, 70] = -math.inf
    elif case == "ragged":
        cols = 45
        x = x[:, :cols].contiguous() * 100
    nb = -(-cols // 16)
    codes = torch.empty(rows, nb * 16, dtype=torch.uint8)
    scales = torch.empty(rows, nb, dtype=torch.uint8)
    dec = torch.empty(1, dtype=torch.float32)
    numerics_lib.quant(
        _ptr(x), ctypes.c_int64(rows), ctypes.c_int64(cols), _ptr(codes), _ptr(scales), _ptr(dec)
    )
    rc, rs, rd = R.quantize(x)
    assert torch.equal(R._unpack(rc), codes)
    assert torch.equal(rs, scales)
    assert (math.isnan(rd.item()) and math.isnan(dec.item())) or rd.item() == dec.item()


# ---------------------------------------------------------------------------------------------
# SPEC 3: FP4MM
# ---------------------------------------------------------------------------------------------


def test_fp4mm_matches_dequantize_then_matmul():
    a = torch.randn(3, 40, 70, generator=gen(12)) * 5
    b = torch.randn(3, 24, 70, generator=gen(13)) * 0.01
    c = R.fp4mm(a, b)
    assert c.dtype == torch.float32 and c.shape == (3, 40, 24)
    ref = R.fake_quantize(a).double() @ R.fake_quantize(b).double().mT
    assert_near(c.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    # and it is an approximation of the float product, not something else
    exact = a.double() @ b.double().mT
    cos = R.metrics(c, exact)["cos"]
    assert 0.98 < cos < 0.99999


def test_fp4mm_broadcasts_and_quantizes_each_matrix():
    a = torch.randn(2, 3, 8, 32, generator=gen(14))
    b = torch.randn(5, 32, generator=gen(15))
    c = R.fp4mm(a, b)
    assert c.shape == (2, 3, 8, 5)
    for i in range(2):
        for j in range(3):
            assert_near(c[i, j], R.fp4mm(a[i, j], b), rtol=1e-6, atol=1e-6)
    # a matrix's global scale must not depend on its batch neighbours
    a2 = a.clone()
    a2[0, 0] *= 1000
    assert torch.equal(R.fp4mm(a2, b)[1], c[1])


# ---------------------------------------------------------------------------------------------
# SPEC 4: attention
# ---------------------------------------------------------------------------------------------

NO_QUANT = {"quantize_q": False, "quantize_k": False, "quantize_v": False, "quantize_p": False}


def qkv(B, Hq, Hkv, Nq, Nk, D, seed, dtype=torch.float32, Dv=None):
    g = gen(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, Dv or D, generator=g).to(dtype)
    return q, k, v


ATTN_CASES = {
    "plain": {"shape": (2, 2, 2, 50, 50, 32)},
    "causal": {"shape": (1, 2, 2, 70, 70, 16), "is_causal": True},
    "causal_nq_lt_nk": {"shape": (1, 2, 1, 20, 90, 16), "is_causal": True},
    "causal_nq_gt_nk": {"shape": (1, 2, 2, 90, 20, 16), "is_causal": True},
    "gqa": {"shape": (2, 6, 2, 33, 65, 24)},
    "bool_mask": {"shape": (1, 4, 2, 40, 77, 16), "mask": "bool"},
    "additive_mask": {"shape": (2, 2, 2, 40, 77, 16), "mask": "float"},
    "mask_and_causal": {"shape": (1, 2, 1, 64, 64, 16), "mask": "bool", "is_causal": True},
    "len1": {"shape": (1, 2, 2, 1, 1, 16)},
    "q_len1": {"shape": (2, 4, 2, 1, 100, 32)},
    "k_len1": {"shape": (1, 2, 2, 30, 1, 16)},
    "dv_differs": {"shape": (1, 2, 2, 40, 40, 16), "Dv": 24},
}


def make_mask(kind, B, Hq, Nq, Nk, seed):
    if kind is None:
        return None
    g = gen(seed + 100)
    m = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
    m[..., 3, :] = False  # a fully masked row
    if kind == "bool":
        return m
    add = torch.randn(B, 1, Nq, Nk, generator=g)
    return torch.where(m, add, -math.inf)


def run_case(name, seed=0, **kw):
    case = ATTN_CASES[name]
    B, Hq, Hkv, Nq, Nk, D = case["shape"]
    q, k, v = qkv(B, Hq, Hkv, Nq, Nk, D, seed, Dv=case.get("Dv"))
    mask = make_mask(case.get("mask"), B, Hq, Nq, Nk, seed) if Nq > 3 else None
    causal = case.get("is_causal", False)
    out = R.attention(q, k, v, attn_mask=mask, is_causal=causal, **kw)
    ref = R.exact_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return out, ref, (q, k, v, mask, causal)


@pytest.mark.parametrize("name", list(ATTN_CASES))
@pytest.mark.parametrize("smooth", [True, False])
def test_attention_without_quantization_is_exact(name, smooth):
    out, ref, _ = run_case(
        name, block_q=16, block_kv=32, smooth_q=smooth, smooth_k=smooth, **NO_QUANT
    )
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_near(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_attention_quantized_is_close_and_finite(name):
    out, ref, inputs = run_case(name, block_q=16, block_kv=32)
    mask = inputs[3]
    assert torch.isfinite(out).all()
    m = R.metrics(out, ref)
    assert m["cos"] > 0.97, m
    if mask is not None:  # fully masked rows give exactly 0
        assert not out[:, :, 3].any()


def test_attention_gaussian_cosine():
    q, k, v = qkv(1, 2, 2, 256, 256, 64, seed=1)
    out = R.attention(q, k, v)
    m = R.metrics(out, R.exact_attention(q, k, v))
    # about 0.98 is what FP4 attention gets on near-uniform (Gaussian) attention
    assert m["cos"] > 0.98 and m["rel_l1"] < 0.25, m


def test_attention_half_precision_inputs():
    q, k, v = qkv(1, 2, 2, 100, 130, 32, seed=2, dtype=torch.bfloat16)
    out = R.attention(q, k, v, is_causal=True)
    assert out.dtype == torch.float32
    assert R.metrics(out, R.exact_attention(q, k, v, is_causal=True))["cos"] > 0.98


def test_fully_masked_rows_and_empty_keys():
    q, k, v = qkv(1, 2, 2, 8, 40, 16, seed=3)
    mask = torch.ones(8, 40, dtype=torch.bool)
    mask[2] = False
    mask[5, :32] = False  # masked for the whole first tile only
    out, lse = R.attention(q, k, v, attn_mask=mask, block_kv=32, return_lse=True)
    assert torch.isfinite(out).all()
    assert not out[:, :, 2].any() and torch.all(lse[:, :, 2] == -math.inf)
    assert torch.isfinite(lse[:, :, 5]).all() and out[:, :, 5].abs().sum() > 0
    assert R.metrics(out, R.exact_attention(q, k, v, attn_mask=mask))["cos"] > 0.98
    # additive -inf everywhere, and no keys at all
    add = torch.full((8, 40), -math.inf)
    assert not R.attention(q, k, v, attn_mask=add).any()
    out0, lse0 = R.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert out0.shape == (1, 2, 8, 16) and not out0.any() and torch.all(lse0 == -math.inf)
    assert not R.exact_attention(q, k, v, attn_mask=add).any()


@pytest.mark.parametrize("smooth", [True, False])
def test_lse_matches_logsumexp(smooth):
    q, k, v = qkv(2, 4, 2, 50, 70, 16, seed=4)
    q, k = q + 2.0, k - 3.0  # offsets make the smoothing shifts non-trivial
    mask = torch.rand(50, 70, generator=gen(40)) > 0.2
    mask[7] = False
    scale = 0.3
    _out, lse = R.attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=True,
        scale=scale,
        block_q=16,
        block_kv=32,
        smooth_q=smooth,
        smooth_k=smooth,
        return_lse=True,
        **NO_QUANT,
    )
    assert lse.shape == (2, 4, 50) and lse.dtype == torch.float32
    s = scale * q.double() @ k.double().repeat_interleave(2, dim=1).mT
    allowed = mask & torch.ones(50, 70, dtype=torch.bool).tril()
    ref = torch.logsumexp(s.masked_fill(~allowed, -math.inf), dim=-1)
    assert torch.all(lse[:, :, 7] == -math.inf) and torch.all(ref[:, :, 7] == -math.inf)
    ok = torch.isfinite(ref)
    assert_near(lse.double()[ok], ref[ok], rtol=1e-5, atol=1e-4)
    if not smooth:
        return
    # With quantization, l sums the *unquantized* exponentials of the quantized scores, so the
    # LSE is exactly the logsumexp of S_q = scale * (Q^ . K^ + qbar . K + (q - qbar) . kbar).
    _, lse_q = R.attention(
        q, k, v, attn_mask=mask, is_causal=True, scale=scale, block_q=16, return_lse=True
    )
    qbar = torch.cat(
        [
            q[:, :, i : i + 16].mean(2, keepdim=True).expand(-1, -1, min(16, 50 - i), -1)
            for i in range(0, 50, 16)
        ],
        dim=2,
    )
    kbar = k.mean(2, keepdim=True)
    kr, kbr = k.repeat_interleave(2, dim=1), kbar.repeat_interleave(2, dim=1)
    s_q = scale * (
        R.fake_quantize(q - qbar).double()
        @ R.fake_quantize(k - kbar).double().repeat_interleave(2, dim=1).mT
        + qbar.double() @ kr.double().mT
        + ((q - qbar).double() * kbr.double()).sum(-1, keepdim=True)
    )
    ref_q = torch.logsumexp(s_q.masked_fill(~allowed, -math.inf), dim=-1)
    assert_near(lse_q.double()[ok], ref_q[ok], rtol=1e-5, atol=1e-4)
    assert (ref_q[ok] - ref[ok]).abs().max() > 0.01  # quantization did change the scores


def test_gqa_is_repeat_interleave_of_kv():
    q, k, v = qkv(2, 6, 3, 40, 50, 16, seed=5)
    # per-head quantization: repeating heads changes nothing but V smoothing's mean query, which
    # averages the KV head's G query heads (SPEC 4.3)
    out = R.attention(q, k, v, is_causal=True, smooth_v=False)
    rep = R.attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True,
        smooth_v=False,
    )
    assert torch.equal(out, rep)
    out = R.attention(q, k, v, is_causal=True)
    tiled = R.attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)
    assert not torch.allclose(out, tiled)  # and the head mapping is h // G, not h % Hkv
    with pytest.raises(ValueError):
        R.attention(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1))  # 6 % 4 != 0
    with pytest.raises(ValueError):
        R.exact_attention(q, k, v, enable_gqa=False)


def test_inputs_are_not_modified():
    q, k, v = qkv(1, 2, 2, 30, 30, 16, seed=6)
    copies = [t.clone() for t in (q, k, v)]
    R.attention(q, k, v, is_causal=True)
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b)


def test_every_quantization_switch_is_used():
    q, k, v = qkv(1, 2, 2, 64, 64, 32, seed=7)
    base = R.attention(q, k, v, **NO_QUANT)
    for name in ("quantize_q", "quantize_k", "quantize_v", "quantize_p"):
        kw = dict(NO_QUANT, **{name: True})
        out = R.attention(q, k, v, **kw)
        assert not torch.allclose(out, base, rtol=1e-4, atol=1e-4), name
    full = R.attention(q, k, v)
    for kw in (
        {"global_scale": False},
        {"two_level_p": False},
        {"smooth_q": False},
        {"smooth_k": False},
        {"block_q": 32},
        {"block_kv": 16},
    ):
        assert not torch.equal(R.attention(q, k, v, **kw), full), kw


def test_smoothing_removes_channel_offsets():
    """SageAttention's reason for smoothing: a large common offset in K (or Q) dominates the
    FP4 block scales. Smoothing removes it exactly, so it must improve accuracy a lot."""
    q, k, v = qkv(1, 2, 2, 128, 128, 64, seed=8)
    offset = 6.0 * torch.randn(64, generator=gen(80))
    qk_only = {"quantize_v": False, "quantize_p": False}
    for target in ("k", "q"):
        qq, kk = (q + offset, k) if target == "q" else (q, k + offset)
        ref = R.exact_attention(qq, kk, v)
        on = R.metrics(R.attention(qq, kk, v, **qk_only), ref)["rel_l1"]
        off = R.metrics(R.attention(qq, kk, v, smooth_q=False, smooth_k=False, **qk_only), ref)
        assert on < 0.5 * off["rel_l1"], (target, on, off)


def test_two_level_p_keeps_small_probabilities():
    """One-level P quantization flushes blocks whose largest probability is below 6*2^-10 to
    zero; the per-row, per-tile first level (SPEC 4.5) rescales each tile to 2688 first."""
    B, H, N, D = 1, 1, 16, 16
    q = torch.zeros(B, H, N, D)
    k = torch.zeros(B, H, 256, D)
    v = 1.0 + 0.5 * torch.randn(B, H, 256, D, generator=gen(9))  # the lost mass must show
    scores = -6.0 + 0.1 * torch.randn(N, 256, generator=gen(90))
    scores[:, 0] = 0.0  # one dominant key; the other 255 hold ~40% of the mass
    ref = R.exact_attention(q, k, v, attn_mask=scores)
    # without V smoothing, which would subtract the offset that makes the lost mass show
    p_only = {"quantize_q": False, "quantize_k": False, "quantize_v": False, "smooth_v": False}
    two = R.metrics(R.attention(q, k, v, attn_mask=scores, **p_only), ref)["rel_l1"]
    one = R.metrics(R.attention(q, k, v, attn_mask=scores, two_level_p=False, **p_only), ref)[
        "rel_l1"
    ]
    assert two < 0.05 and one > 0.3, (two, one)


def test_argument_validation():
    q, k, v = qkv(1, 2, 2, 8, 8, 16, seed=10)
    with pytest.raises(ValueError):
        R.attention(q, k, v, block_kv=24)
    with pytest.raises(ValueError):
        R.attention(q, k, v, block_q=0)
    with pytest.raises(ValueError):
        R.attention(q[0], k, v)
    with pytest.raises(TypeError):
        R.attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.int32))


def test_default_scale_is_inverse_sqrt_d():
    q, k, v = qkv(1, 1, 1, 20, 20, 36, seed=11)
    a = R.attention(q, k, v, **NO_QUANT)
    b = R.attention(q, k, v, scale=1 / 6, **NO_QUANT)
    assert torch.equal(a, b)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert_near(R.exact_attention(q, k, v), sdpa(q.double(), k.double(), v.double()), 1e-6, 1e-6)


def test_exact_attention_matches_torch_sdpa():
    q, k, v = (t.double() for t in qkv(2, 4, 2, 30, 45, 16, seed=13))
    mask = torch.rand(2, 1, 30, 45, generator=gen(130)) > 0.3
    mask[..., 0] = True  # no fully masked rows: SDPA's answer for those is not 0
    add = torch.randn(1, 4, 30, 45, generator=gen(131), dtype=torch.float64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for kw in ({"is_causal": True}, {"attn_mask": mask}, {"attn_mask": add}, {"scale": 0.7}):
        ours = R.exact_attention(q, k, v, **kw)
        assert_near(ours, sdpa(q, k, v, enable_gqa=True, **kw), 1e-6, 1e-6)  # CPU SDPA: ~1e-8


# --- a slow, loop-by-loop transcription of SPEC 4 (one (b, h), one query block at a time) ----


def slow_spec_attention(q, k, v, is_causal, scale, block_q, block_kv):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, Nq, v.shape[3])
    for b in range(B):
        for h in range(Hq):
            K, V, Q = k[b, h // G].float(), v[b, h // G].float(), q[b, h].float()
            kbar = K.mean(0)
            ck, sk, dk = R.quantize(K - kbar)
            Kq = R.dequantize(ck, sk, torch.tensor(1.0), D)
            # SPEC 4.3 V smoothing: softmax of the group's mean query against the keys some row
            # sees (causal: keys j < Nq; every row sees key 0, so every row counts in qm)
            qm = q[b, h // G * G : (h // G + 1) * G].float().mean(dim=(0, 1))
            seen = min(Nq, Nk) if is_causal else Nk
            vbar = torch.softmax(scale * (K[:seen] @ qm), 0) @ V[:seen]
            V = V - vbar
            cv, sv, dv = R.quantize(V.T)
            Vq = R.dequantize(cv, sv, torch.tensor(1.0), Nk)  # [Dv, Nk]
            qbars = [Q[i : i + block_q].mean(0) for i in range(0, Nq, block_q)]
            Qs = torch.cat(
                [Q[i : i + block_q] - qbars[i // block_q] for i in range(0, Nq, block_q)]
            )
            cq, sq, dq = R.quantize(Qs)
            Qq = R.dequantize(cq, sq, torch.tensor(1.0), D)
            for i0 in range(0, Nq, block_q):
                rows = torch.arange(i0, min(i0 + block_q, Nq))
                qbar = qbars[i0 // block_q]
                m = torch.full((len(rows),), -math.inf)
                l = torch.zeros(len(rows))
                o = torch.zeros(len(rows), v.shape[3])
                for j0 in range(0, Nk, block_kv):
                    cols = torch.arange(j0, min(j0 + block_kv, Nk))
                    mm = (Qq[rows].double() @ Kq[cols].double().T).float()
                    s = scale * ((dq * dk) * mm + (K[cols] @ qbar)[None, :])
                    if is_causal:
                        s = s.masked_fill(cols[None, :] > rows[:, None], -math.inf)
                    t = s.max(1).values
                    m_new = torch.maximum(m, t)
                    seen = t > -math.inf  # rows with a visible key in this tile
                    alpha = torch.where(m > -math.inf, torch.exp(m - m_new), 0.0)
                    beta = torch.where(seen, torch.exp(t - m_new), 0.0)
                    e = torch.exp(s - torch.where(seen, t, 0.0)[:, None])
                    pq = R.fake_quantize(2688.0 * e, global_scale=False)
                    pv = (pq.double() @ Vq[:, cols].double().T).float() * dv
                    l = alpha * l + beta * e.sum(1)
                    o = alpha[:, None] * o + (beta / 2688.0)[:, None] * pv
                    m = m_new
                out[b, h, rows] = torch.where(
                    l[:, None] > 0, o / l.clamp_min(1e-38)[:, None] + vbar, 0.0
                )
    return out


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_matches_slow_transcription_of_spec(is_causal):
    q, k, v = qkv(1, 4, 2, 45, 75, 24, seed=12)
    q, k = q + 0.5 * torch.randn(24, generator=gen(120)), k + torch.randn(24, generator=gen(121))
    fast = R.attention(q, k, v, is_causal=is_causal, scale=0.25, block_q=16, block_kv=32)
    slow = slow_spec_attention(q, k, v, is_causal, 0.25, block_q=16, block_kv=32)
    # identical numerics up to float32 summation order (which may flip a rare E2M1 rounding)
    assert R.metrics(fast, slow)["rel_l1"] < 1e-4
    # the test can tell tilings apart
    other = slow_spec_attention(q, k, v, is_causal, 0.25, block_q=16, block_kv=64)
    assert R.metrics(fast, other)["rel_l1"] > 1e-3


# ---------------------------------------------------------------------------------------------
# SPEC 5: metrics
# ---------------------------------------------------------------------------------------------


def test_metrics():
    ref = torch.tensor([1.0, -2.0, 3.0, 0.0])
    m = R.metrics(ref.clone(), ref)
    assert m == {"cos": pytest.approx(1.0), "rel_l1": 0.0, "rmse": 0.0}
    out = torch.tensor([1.0, -2.0, 3.0, 2.0])
    m = R.metrics(out, ref)
    assert m["rel_l1"] == pytest.approx(2 / 6) and m["rmse"] == pytest.approx(1.0)
    assert m["cos"] == pytest.approx(14 / (math.sqrt(14) * math.sqrt(18)))
    assert all(isinstance(x, float) for x in m.values())
    assert math.isnan(R.metrics(torch.tensor([math.nan, 0, 0, 0]), ref)["cos"])
    assert R.metrics(-ref, ref)["cos"] == pytest.approx(-1.0)
