"""CPU quantize / dequantize / fp4mm: bit-exact against fp4attn.reference (SPEC 2-3)."""

import pytest
import torch

import fp4attn
from fp4attn import reference as R

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_same_quantization(x):
    t = fp4attn.quantize(x)
    codes, scales, dec = R.quantize(x)
    assert t.codes.dtype == torch.uint8 and t.scales.dtype == torch.float8_e4m3fn
    assert t.codes.shape == codes.shape and t.scales.shape == scales.shape and t.dec.shape == dec.shape
    assert torch.equal(t.codes, codes)
    assert torch.equal(t.scales.view(torch.uint8), scales)
    assert torch.equal(torch.isnan(t.dec), torch.isnan(dec)) and torch.equal(t.dec.nan_to_num(), dec.nan_to_num())
    ours, ref = fp4attn.dequantize(t), R.dequantize(codes, scales, dec, x.shape[-1])
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert torch.equal(ours.nan_to_num(), ref.nan_to_num())  # -0 == +0 for equal
    return t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1.0, 37.0, 6e4])
@pytest.mark.parametrize("cols", [16, 64, 70, 5])
def test_quantize_bit_exact_random(dtype, magnitude, cols):
    x = (torch.randn(3, 33, cols) * magnitude).to(dtype)
    assert_same_quantization(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_bit_exact_structured(dtype):
    # Per-row magnitudes spanning 12 decades inside one matrix: block scales hit E4M3 subnormals
    # (and 0) for the small rows while the global scale is set by the large ones.
    rows = torch.logspace(-8, 4, 64).unsqueeze(1)
    x = (torch.randn(64, 48) * rows).to(dtype)
    t = assert_same_quantization(x)
    s = t.scales.view(torch.uint8)
    assert ((s > 0) & (s < 8)).any(), "expected some subnormal block scales"
    assert (s == 0).any(), "expected some zero block scales"


def test_quantize_ties_and_thresholds():
    # Row 1 holds 2688 so that enc = dec = 1; row 0's block max is 6, so its block scale is 1 and
    # x * r is x itself: every E2M1 threshold is hit exactly and must round to the even code.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x = torch.zeros(2, 16)
    x[0] = torch.cat([ties, -ties])
    x[1, 0] = 2688.0
    t = assert_same_quantization(x)
    assert t.dec.item() == 1.0 and t.scales.view(torch.uint8)[0, 0] == 0x38  # E4M3 1.0
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])
    torch.testing.assert_close(fp4attn.dequantize(t)[0], torch.cat([expected, -expected]),
                               rtol=0, atol=0)
    nibbles = torch.stack([t.codes[0] & 0xF, t.codes[0] >> 4], -1).flatten()
    assert nibbles.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 0, 10, 10, 12, 12, 14, 14, 15]


def test_quantize_saturation_zero_nan_inf():
    x = torch.zeros(2, 4, 32)
    x[0, 0, :16] = 1e30  # float32 huge: still finite, global scale handles it
    t = assert_same_quantization(x)
    assert t.dec[1] == 1.0 and (fp4attn.dequantize(t)[1] == 0).all()  # zero matrix
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.randn(2, 4, 32)
        y[0, 1, 3] = bad
        t = assert_same_quantization(y)
        assert torch.isnan(t.dec[0]) and torch.isfinite(t.dec[1])
        assert torch.isnan(fp4attn.dequantize(t)[0]).all()


def test_fp16_extremes():
    x = torch.tensor([[65504.0, -65504.0, 6.1e-5, 6e-8] * 8], dtype=torch.float16)
    assert_same_quantization(x)


def test_dequantize_error_bound():
    x = torch.randn(8, 256)
    y = fp4attn.dequantize(fp4attn.quantize(x))
    rel = (y - x).norm() / x.norm()
    assert 0.02 < rel < 0.15  # NVFP4 on Gaussian data: about 9-10%


def test_quantize_does_not_mutate_and_accepts_noncontiguous():
    x = torch.randn(4, 64, 40)
    before = x.clone()
    xt = x.transpose(-1, -2)  # non-contiguous view, quantized along its own last dim
    assert_same_quantization(xt)
    assert torch.equal(x, before)


def test_swizzled_scales_layout():
    x = torch.randn(130, 80)  # 130 rows (2 row tiles), 5 scale columns (2 column tiles)
    t = fp4attn.quantize(x)
    sw = t.swizzled_scales().view(torch.uint8)
    lin = t.scales.view(torch.uint8)
    assert sw.numel() == 256 * 8
    kt = 2
    for r in (0, 1, 31, 32, 127, 128, 129):
        for kb in range(5):
            off = ((r // 128) * kt + kb // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + kb % 4
            assert sw[off] == lin[r, kb]
    assert sw[((1 * kt + 1) * 512) + 31 * 16 + 3 * 4 + 3] == 0  # padding is zero


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_fp4mm_matches_reference(out_dtype):
    a, b = torch.randn(2, 37, 72), torch.randn(2, 29, 72)
    out = fp4attn.fp4mm(a, b, out_dtype=out_dtype)
    ref = R.fp4mm(a, b)
    assert out.shape == (2, 37, 29) and out.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_fp4mm_with_prequantized_weight_and_broadcast():
    w = torch.randn(48, 96)
    qw = fp4attn.quantize(w)
    x = torch.randn(3, 5, 96)
    out = fp4attn.fp4mm(x, qw)
    assert out.shape == (3, 5, 48)
    ref = torch.stack([R.fp4mm(x[i], w) for i in range(3)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    # dequantize-then-matmul gives the same numbers: the FP4 products are exact
    deq = fp4attn.dequantize(fp4attn.quantize(x)) @ fp4attn.dequantize(qw).T
    torch.testing.assert_close(out, deq, rtol=1e-5, atol=1e-4)


def test_quantize_errors():
    with pytest.raises(ValueError, match="x must have at least 2 dims"):
        fp4attn.quantize(torch.randn(5))
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):
        fp4attn.quantize(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="t must be an fp4attn.NVFP4Tensor"):
        fp4attn.dequantize(torch.randn(2, 2))
    with pytest.raises(ValueError, match="same last dim K"):
        fp4attn.fp4mm(torch.randn(2, 16), torch.randn(2, 32))
    with pytest.raises(TypeError, match="out_dtype"):
        fp4attn.fp4mm(torch.randn(2, 16), torch.randn(2, 16), out_dtype=torch.int8)


def test_ops_refuse_scales_of_other_matrices_and_take_empty_ones():
    """scales must have codes' leading dims (a view of fewer matrices was read past its end);
    matrices without rows quantize to empty codes with dec = 1, as the fake kernel says."""
    codes, scales, dec = torch.ops.fp4attn.quantize(torch.randn(4, 8, 32))
    with pytest.raises(RuntimeError, match="scales must be .* with codes' leading dims"):
        torch.ops.fp4attn.dequantize(codes, scales[:1].expand(4, 8, 2).contiguous()[:1], dec, 32)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.fp4attn.fp4mm(codes, scales[:1], dec, codes, scales, dec, 32, torch.float32)
    for shape in [(2, 0, 32), (0, 32), (0, 4, 32)]:
        c, s, d = torch.ops.fp4attn.quantize(torch.empty(shape))
        assert c.shape == (*shape[:-1], 16) and s.shape == (*shape[:-1], 2)
        assert d.shape == shape[:-2] and (d == 1).all()
    assert fp4attn.fp4mm(torch.empty(0, 32), torch.randn(3, 32)).shape == (0, 3)


def test_fp4mm_of_no_matrices_is_empty_as_in_torch():
    """A batch of 0 matrices against one matrix: torch.matmul's empty result (the op read past
    the empty side's view, and the front end passed it an empty operand)."""
    a, b = torch.randn(0, 4, 48), torch.randn(6, 48)
    for x, y in ((a, b), (b[None, :4], torch.randn(0, 6, 48)), (torch.randn(3, 0, 48), b),
                 (torch.randn(3, 4, 48), torch.randn(0, 48))):
        assert fp4attn.fp4mm(x, y).shape == torch.matmul(x, y.transpose(-1, -2)).shape
    # the op itself, on a 0-matrix view into a larger pool
    big = torch.ops.fp4attn.quantize(torch.randn(2, 4, 32))
    one = torch.ops.fp4attn.quantize(torch.randn(1, 3, 32))
    out = torch.ops.fp4attn.fp4mm(big[0][1:1], big[1][1:1], big[2][1:1], *one, 32, torch.float32)
    assert out.shape == (0, 4, 3)
    out = torch.ops.fp4attn.fp4mm(*one, big[0][1:1], big[1][1:1], big[2][1:1], 32, torch.float32)
    assert out.shape == (0, 3, 4)


def test_swizzle_scales_refuses_other_dtypes_and_shapes():
    t = fp4attn.quantize(torch.randn(4, 48))
    with pytest.raises(TypeError, match="scales must be float8_e4m3fn or uint8"):
        fp4attn.swizzle_scales(t.scales.float())  # its bytes would be read as scales
    with pytest.raises(ValueError, match="at least 2-D"):
        fp4attn.swizzle_scales(t.scales[0])
    assert torch.equal(fp4attn.swizzle_scales(t.scales.view(torch.uint8)).view(torch.uint8),
                       fp4attn.swizzle_scales(t.scales).view(torch.uint8))
