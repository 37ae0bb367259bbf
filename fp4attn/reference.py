"""Pure-PyTorch reference implementation of docs/SPEC.md: the oracle every backend is tested against.

Nothing here is fast; everything here is meant to be obviously right. The number formats and the
quantization ``phi`` (SPEC sections 1-2) are bit-exact with ``csrc/include/fp4attn/numerics.h``:
the encoders below are written with the same binary32 operations (correctly rounded divisions,
``1 / s`` followed by a multiplication, NaN-propagating block maxima) so that the C backends and
this file produce identical bytes. The attention (SPEC section 4) is vectorised over batch, heads
and query rows and loops only over key tiles, exactly as the online softmax does.

Precision choices of the oracle:

* Every FP4MM (SPEC 3) multiplies the exactly dequantized operands (``value(code) * scale`` is
  exact in float32) in **float64** and rounds the sum once to float32, then applies the float32
  global scales. float64 makes the block sums practically exact, so whatever a kernel differs by
  is its own accumulation error.
* Everything else in the attention (smoothing means, the ``qbar . K`` correction, exp, the
  online-softmax statistics) is float32, as SPEC prescribes for the kernels.

Conventions shared by all functions: codes are uint8, unpacked (one 4-bit code per byte) unless a
name says *packed*; E4M3 scales travel as their raw uint8 bytes (``.view(torch.float8_e4m3fn)``
turns them into the torch dtype without changing a bit).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "NVFP4_RANGE",
    "attention",
    "attention_fp4pv",
    "dequantize",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode_sat",
    "exact_attention",
    "fake_quantize",
    "fp4mm",
    "global_scales",
    "k5_channel_scales",
    "k5_dequantize",
    "k5_quantize",
    "k5_rotate",
    "metrics",
    "quantize",
    "v_mean",
]

#: Elements sharing one E4M3 block scale (NVFP4).
BLOCK = 16
#: Largest magnitude of (E4M3 scale) x (E2M1 code) = 448 * 6; also the first-level P range.
NVFP4_RANGE = 2688.0
#: Largest finite E4M3 value.
E4M3_MAX = 448.0

_E4M3_MAX_CODE = 0x7E
_E4M3_NAN_CODE = 0x7F


def _build_e4m3_table() -> Tensor:
    """Value of every E4M3 byte, from the format definition (bias 7, 3 mantissa bits)."""
    vals = []
    for c in range(256):
        e, m = (c >> 3) & 0xF, c & 7
        if c & 0x7F == 0x7F:
            v = math.nan
        elif e == 0:
            v = m * 2.0**-9  # subnormal: m * 2^-9
        else:
            v = 2.0 ** (e - 7) * (1.0 + m / 8.0)
        vals.append(-v if c & 0x80 else v)
    return torch.tensor(vals, dtype=torch.float32)  # every value is exact in float32


_E4M3_TABLE = _build_e4m3_table()
# Magnitudes of E2M1 codes 0..7, then the same negated for codes 8..15 (-0.0 for code 8).
_E2M1_TABLE = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)


def _div_rn(a: Tensor | float, b: Tensor | float) -> Tensor:
    """Correctly rounded float32 division ``a / b`` (SPEC notation ``/``).

    torch does not promise it: ``scalar / tensor`` is evaluated as ``reciprocal(tensor) * scalar``
    (two roundings), which often differs from a true division in the last bit (``2688 / amax``
    did for about a quarter of random inputs). Dividing in float64 and rounding once to float32 is exact IEEE division, because a
    quotient of 24-bit operands rounded first to 53 >= 2*24 + 2 bits cannot suffer from double
    rounding.
    """
    a64 = torch.as_tensor(a, dtype=torch.float64) if not isinstance(a, Tensor) else a.double()
    b64 = torch.as_tensor(b, dtype=torch.float64) if not isinstance(b, Tensor) else b.double()
    return (a64 / b64).to(torch.float32)


def _as_float32(x: Tensor) -> Tensor:
    """float16/bfloat16/float32 convert exactly; float64 is rounded to the float32 a backend sees."""
    if not torch.is_floating_point(x):
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    return x.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# SPEC 1: number formats
# ---------------------------------------------------------------------------------------------


def e2m1_encode(y: Tensor) -> Tensor:
    """``rne_e2m1`` of SPEC 1: the 4-bit code of every element (uint8, unpacked, 0..15).

    The thresholds are written out exactly as in SPEC / numerics.h: ``<=`` at ties whose lower
    neighbour has the even code (0.25, 1.25, 2.5, 5) and ``<`` where the upper one does (0.75,
    1.75, 3.5). Magnitudes above 5 saturate to 6. Zero (of either sign) is code 0, never 0x8.
    NaN fails every comparison, so, like the C helper, it becomes code 7 *without* a sign bit (the
    sign of a NaN is not portable); its slice is NaN anyway through the global scale.
    """
    y = _as_float32(y)
    a = y.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    code = torch.where(torch.isnan(a), torch.full_like(code, 7), code)
    negative = (y < 0) & (code != 0)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """float32 value of every E2M1 code (bit 3 = sign; only the low 4 bits are read)."""
    return _E2M1_TABLE.to(codes.device)[codes.to(torch.int64) & 0xF]


def e4m3_encode_sat(v: Tensor) -> Tensor:
    """``rne_e4m3_sat`` of SPEC 1: E4M3 bytes (uint8) of ``v >= 0``, round to nearest even.

    Values above 448 (and +Inf) saturate to 448 (0x7E), NaN gives 0x7F, subnormals (multiples of
    2^-9) are kept, and ``v <= 2^-10`` gives 0. The integer manipulation mirrors
    ``fp4attn_e4m3_encode_sat``: normals keep the top 3 mantissa bits and round on the other 20;
    values below 2^-6 are scaled exactly by 512 and rounded to an integer, half to even (which is
    what ``torch.round`` does). As in the C helper the sign bit is ignored, so a negative input
    encodes its magnitude.
    """
    v = _as_float32(v).contiguous()
    bits = v.view(torch.int32) & 0x7FFFFFFF  # |v| as bits
    a = bits.view(torch.float32)
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    # Normal E4M3 range [2^-6, 448): float32 exponent e maps to E4M3 exponent e - 127 + 7.
    code = ((exp - 120) << 3) | (mant >> 20)
    rem = mant & 0xFFFFF
    round_up = (rem > 0x80000) | ((rem == 0x80000) & ((code & 1) == 1))
    code = torch.clamp(code + round_up.to(torch.int32), max=_E4M3_MAX_CODE)
    # Below 2^-6 (float32 exponent field < 121): the subnormal grid m * 2^-9, m in 0..8
    # (m == 8 is the smallest normal, code 0x08, which the same integer happens to encode).
    sub = torch.round(a * 512.0).to(torch.int32)
    code = torch.where(exp < 121, sub, code)
    code = torch.where(a >= E4M3_MAX, torch.full_like(code, _E4M3_MAX_CODE), code)
    code = torch.where(torch.isnan(v), torch.full_like(code, _E4M3_NAN_CODE), code)
    return code.to(torch.uint8)


def e4m3_decode(b: Tensor) -> Tensor:
    """float32 value of every E4M3 byte (sign honoured; 0x7F and 0xFF are NaN)."""
    return _E4M3_TABLE.to(b.device)[b.to(torch.int64) & 0xFF]


def global_scales(amax: Tensor) -> tuple[Tensor, Tensor]:
    """Per-slice global scales of SPEC 2, elementwise: ``(enc, dec)``, both float32.

    ``enc = 2688 / amax`` maps the slice maximum onto the top of the NVFP4 range, so the E4M3
    block scales neither underflow (tiny tensors) nor saturate (huge ones). Both are correctly
    rounded float32 divisions. An all-zero slice, or one whose ``enc`` overflows (subnormal
    amax), uses 1. A NaN/Inf amax makes ``dec`` NaN, so the whole slice dequantizes to NaN rather
    than to plausible garbage. Note amax = +Inf gives ``enc = 0`` (finite) as in numerics.h.
    """
    amax = _as_float32(amax)
    enc = _div_rn(NVFP4_RANGE, amax)
    dec = _div_rn(amax, NVFP4_RANGE)
    reset = (amax == 0) | ~torch.isfinite(enc)
    one = torch.ones_like(amax)
    enc = torch.where(reset, one, enc)
    dec = torch.where(reset, one, dec)
    dec = torch.where(torch.isfinite(amax), dec, torch.full_like(dec, math.nan))
    return enc, dec


# ---------------------------------------------------------------------------------------------
# SPEC 2: NVFP4 quantization phi
# ---------------------------------------------------------------------------------------------


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    pad = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _phi(x32: Tensor, global_scale: bool) -> tuple[Tensor, Tensor, Tensor]:
    """phi of SPEC 2 on float32 ``x32 [..., R, K]``, one global scale per matrix.

    Returns unpacked codes ``[..., R, Kp]`` (Kp = K rounded up to 16; padding encodes to 0), E4M3
    scale bytes ``[..., R, Kp/16]`` and ``dec [...]``. This is the single implementation of the
    quantizer; ``quantize`` only packs its codes.
    """
    if x32.dim() < 2:
        raise ValueError(
            f"quantize needs at least 2 dims [..., rows, cols], got {tuple(x32.shape)}"
        )
    lead = x32.shape[:-2]
    if global_scale:
        if x32.shape[-1] == 0 or x32.shape[-2] == 0:
            amax = x32.new_zeros(lead)
        else:
            amax = x32.abs().amax(dim=(-2, -1))  # torch.amax propagates NaN, like fp4attn_nanmax
        enc, dec = global_scales(amax)
        xs = x32 * enc[..., None, None]
    else:
        dec = x32.new_ones(lead)
        xs = x32
    # Padding after scaling: zeros stay zeros whatever enc is (enc is never NaN or Inf).
    xs = _pad_last(xs, BLOCK)
    blocks = xs.reshape(*xs.shape[:-1], xs.shape[-1] // BLOCK, BLOCK)
    if blocks.shape[-2] == 0:
        bmax = blocks.new_zeros(blocks.shape[:-1])
    else:
        bmax = blocks.abs().amax(dim=-1)  # NaN-propagating, as in fp4attn_quantize_block
    scales = e4m3_encode_sat(_div_rn(bmax, 6.0))  # correctly rounded division, RNE to E4M3
    s = e4m3_decode(scales)
    r = _div_rn(1.0, s)  # the reciprocal first, then a multiplication: SPEC 2 / numerics.h
    codes = e2m1_encode(blocks * r[..., None])
    # A zero scale (all-zero block or one that underflows E4M3) stores zeros; 1/0 = Inf would
    # otherwise turn 0 * Inf into NaN -> code 7.
    codes = torch.where((s == 0)[..., None], torch.zeros_like(codes), codes)
    return codes.reshape(xs.shape), scales, dec


def _block_values(codes: Tensor, scales: Tensor) -> Tensor:
    """``value(code) * scale`` in float32 (exact: at most 6 significant bits), unpacked codes."""
    vals = e2m1_decode(codes)
    s = e4m3_decode(scales).repeat_interleave(BLOCK, dim=-1)
    return vals * s


def _pack(codes: Tensor) -> Tensor:
    """Two codes per byte, element 2i in the low nibble (torch.float4_e2m1fn_x2 convention)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: Tensor) -> Tensor:
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize(x: Tensor, *, global_scale: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """NVFP4-quantize ``x [..., R, K]`` along its last dim (SPEC 2), one global scale per matrix.

    Returns ``(codes, scales, dec)``: ``codes`` uint8 ``[..., R, ceil(K/16)*8]`` packed two per
    byte (element 2i in the low nibble), ``scales`` uint8 ``[..., R, ceil(K/16)]`` (E4M3 bytes),
    ``dec`` float32 ``[...]``. ``global_scale=False`` is ``phi_local`` (enc = dec = 1), used for
    P in the attention and for the ablation. ``x`` is converted to float32 first (exact for
    float16/bfloat16/float32).
    """
    codes, scales, dec = _phi(_as_float32(x), global_scale)
    return _pack(codes), scales, dec


def dequantize(codes: Tensor, scales: Tensor, dec: Tensor, cols: int) -> Tensor:
    """Inverse of ``quantize``: float32 ``[..., R, cols]`` with ``x' = (value(code) * s) * dec``."""
    nblocks = scales.shape[-1]
    if codes.shape[-1] != nblocks * BLOCK // 2:
        raise ValueError(
            f"codes must have {nblocks * BLOCK // 2} bytes per row for {nblocks} scales, "
            f"got {codes.shape[-1]}"
        )
    if not 0 <= cols <= nblocks * BLOCK:
        raise ValueError(f"cols must be in [0, {nblocks * BLOCK}], got {cols}")
    vals = _block_values(_unpack(codes), scales)
    dec = _as_float32(torch.as_tensor(dec))
    return (vals * dec[..., None, None])[..., :cols]


def fake_quantize(x: Tensor, *, global_scale: bool = True) -> Tensor:
    """``dequantize(quantize(x))``: float32, same shape as ``x``."""
    codes, scales, dec = quantize(x, global_scale=global_scale)
    return dequantize(codes, scales, dec, x.shape[-1])



# ---------------------------------------------------------------------------------------------
# SPEC 6: the KV cache's key rows (rotated 5-bit integers)
# ---------------------------------------------------------------------------------------------

#: Values per E4M3 scale of a key row (K5).
K5_BLOCK = 64
#: Largest key code magnitude; codes are stored as u = code + K5_MAX in 0..30.
K5_MAX = 15
#: Largest |code x scale|: 15 x 448; the row scale 2^e puts the row's maximum at most there.
K5_RANGE = 6720.0
#: Candidates on each side of the nearest scale code that the scale search tries.
K5_SEARCH = 3


def k5_padded(head_dim: int) -> int:
    """Dp: the head dim rounded up to a multiple of 16 (the stored row's length)."""
    return -(-head_dim // 16) * 16


def k5_rotation_size(dp: int) -> int:
    """n: the largest power of two dividing Dp (16 .. 256); the rotation acts on blocks of n."""
    return dp & -dp


def k5_code_bytes(head_dim: int) -> int:
    """Bytes of a key row's codes: Dp/2 of low nibbles, then Dp/8 of high bits."""
    return 5 * k5_padded(head_dim) // 8


def k5_scale_count(head_dim: int) -> int:
    """E4M3 scales per key row: one per K5_BLOCK values (the last block may be shorter)."""
    return -(-k5_padded(head_dim) // K5_BLOCK)


def k5_rotate(x: Tensor) -> Tensor:
    """``x [..., Dp]`` (float32) times the block-diagonal Sylvester-Hadamard matrix (entries +-1,
    blocks of n = k5_rotation_size(Dp)), by SPEC 6's butterfly: for h = 1, 2, .., n/2, every pair
    (i, i + h) with bit h of i clear becomes (x_i + x_{i+h}, x_i - x_{i+h}), float32 each. The
    matrix is symmetric and squares to n I, so applying it twice and dividing by n undoes it."""
    x = _as_float32(x)
    dp = x.shape[-1]
    n = k5_rotation_size(dp)
    h = 1
    while h < n:
        y = x.reshape(*x.shape[:-1], dp // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(x.shape)
        h *= 2
    return x


def _block_hadamard(x: Tensor, n: int) -> Tensor:
    """``x [..., L]`` (float32, L a multiple of the power of two ``n``) times the block-diagonal
    Sylvester-Hadamard matrix with blocks of ``n`` (entries +-1, ``k5_rotate``'s butterfly on each
    block of n consecutive values). Symmetric, squares to ``n I``: the FP4 rotation study's
    rotation (``attention(..., rotate_qk=, rotate_v=)``; not SPEC)."""
    lead, L = x.shape[:-1], x.shape[-1]
    return k5_rotate(x.reshape(*lead, L // n, n)).reshape(*lead, L)


def _rotation_block(rotate: bool | int, length: int, what: str, over: str, smallest: int) -> int:
    """The Hadamard block n of a rotation option (``rotate_qk`` / ``rotate_v`` over the padded head
    dim, ``rotate_pv`` over the key tile ``block_kv``): 0 (off), True (the largest power of two
    dividing ``length``, as ``k5_rotation_size``) or a power of two ``smallest <= n`` that divides
    ``length``. ``rotate_pv``'s smallest is 16, so that its blocks span whole quantization blocks."""
    if rotate is False or rotate is None or (not isinstance(rotate, bool) and rotate == 0):
        return 0
    if rotate is True:
        return length & -length
    n = int(rotate)
    if n != rotate or n < smallest or n & (n - 1) or length % n:
        raise ValueError(f"{what} must be False, True or a power of two >= {smallest} dividing "
                         f"{over} {length}, got {rotate!r}")
    return n


def k5_channel_scales(x: Tensor) -> Tensor:
    """SPEC 6's channel scales ``kscale [..., D]`` (float32) from ``x [..., M, D]``, the rows
    ``K - kmean`` of the tokens that fix kmean: ``r_c = sqrt(max_t |x_tc|)`` (correctly rounded,
    NaN-propagating), ``g = max_c r_c``; ``kscale_c = max(r_c, g x 2^-6)``, or 1 in every channel
    when g is 0, infinite or NaN. Key rows are stored as ``(K - kmean) / kscale`` and queries
    multiplied by kscale: ``q . (K - kmean)`` is unchanged, the keys' channels are evened out."""
    x = _as_float32(x)
    a = x.abs().amax(dim=-2)  # NaN-propagating
    # torch's float32 sqrt is not always correctly rounded; float64's, rounded once, is (53 >= 2*24
    # + 2 bits: no double rounding)
    r = torch.sqrt(a.double()).float()
    g = r.amax(dim=-1, keepdim=True)
    ok = torch.isfinite(g) & (g > 0)
    return torch.where(ok, torch.maximum(r, g * 2.0 ** -6), torch.ones_like(r))


def _k5_exponent(amax: Tensor) -> Tensor:
    """The row scale's exponent e (int32): the smallest e >= -126 with 2^e >= amax / 6720 (a
    correctly rounded division), read off the quotient's bits."""
    t = _div_rn(amax, K5_RANGE).contiguous()
    bits = t.view(torch.int32)
    ef, mant = bits >> 23, bits & 0x7FFFFF
    e = ef - 127 + (mant != 0).to(torch.int32)
    return torch.clamp(torch.where(ef == 0, torch.full_like(e, -126), e), min=-126)


def _k5_block_error(d: Tensor) -> Tensor:
    """Squared error of blocks ``d [..., 64]`` in SPEC 6's order: 8 sequential sums of 8
    consecutive squares (float32: a product, then a sum), combined as
    ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))."""
    d2 = (d * d).reshape(*d.shape[:-1], 8, 8)
    p = d2[..., 0]
    for i in range(1, 8):
        p = p + d2[..., i]
    p = p[..., 0::2] + p[..., 1::2]
    p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0] + p[..., 1]


def k5_quantize(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """SPEC 6's key row format of every row of ``x [..., D]``: ``(codes [..., 5 Dp/8] uint8,
    scales [..., ceil(Dp/64)] E4M3 bytes, exp [...] uint8)``.

    The row, zero-padded to Dp, is rotated (``k5_rotate``); its row scale is 2^e
    (``_k5_exponent`` of its largest magnitude; stored as the byte e + 127, 255 for a row with a
    NaN or infinite value); y = rotated row x 2^-e. Per block of 64 values of y (zero-padded):
    c0 = rne_e4m3_sat(max|y| / 15); each scale code c from max(c0 - 3, 1) to min(c0 + 3, 126) in
    turn gives codes q = clamp(rne(y / s_c), -15, 15) and the error of ``_k5_block_error`` over
    y - q s_c; the first c with the smallest error is stored. A block of zeros stores scale 0; a
    non-finite row stores scales 0 and codes 0. Codes are stored as u = q + 15: u & 15 packed two
    per byte (element 2i in the low nibble), then u >> 4 packed eight per byte (element 8j + b at
    bit b)."""
    x = _as_float32(x)
    D = x.shape[-1]
    dp = k5_padded(D)
    xr = k5_rotate(torch.nn.functional.pad(x, (0, dp - D)))
    amax = xr.abs().amax(dim=-1) if dp else xr.new_zeros(xr.shape[:-1])
    finite = torch.isfinite(amax)
    e = _k5_exponent(torch.where(finite, amax, torch.zeros_like(amax)))
    y = xr * torch.ldexp(torch.ones_like(amax), -e)[..., None]
    nb = -(-dp // K5_BLOCK)
    yb = torch.nn.functional.pad(y, (0, nb * K5_BLOCK - dp)).reshape(*y.shape[:-1], nb, K5_BLOCK)
    yb = torch.where(finite[..., None, None], yb, torch.zeros_like(yb))
    bmax = yb.abs().amax(dim=-1)
    c0 = e4m3_encode_sat(_div_rn(bmax, float(K5_MAX))).to(torch.int32)
    best_err = torch.full_like(bmax, math.inf)
    best_c = torch.zeros_like(c0)
    best_q = torch.zeros_like(yb)
    for off in range(-K5_SEARCH, K5_SEARCH + 1):
        c = c0 + off
        valid = (c >= 1) & (c <= _E4M3_MAX_CODE) & (bmax > 0)
        c = torch.clamp(c, 1, _E4M3_MAX_CODE)
        s = e4m3_decode(c.to(torch.uint8))[..., None]
        q = torch.clamp(torch.round(_div_rn(yb, s)), -K5_MAX, K5_MAX)
        err = _k5_block_error(yb - q * s)
        better = valid & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_c = torch.where(better, c, best_c)
        best_q = torch.where(better[..., None], q, best_q)
    u = (best_q.reshape(*y.shape[:-1], nb * K5_BLOCK)[..., :dp] + K5_MAX).to(torch.uint8)
    low = u & 0xF
    high = (u >> 4).reshape(*u.shape[:-1], dp // 8, 8)
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.int32, device=x.device)
    plane = (high.to(torch.int32) * weights).sum(-1).to(torch.uint8)
    codes = torch.cat((_pack(low), plane), dim=-1)
    exp = torch.where(finite, e + 127, torch.full_like(e, 255)).to(torch.uint8)
    return codes, best_c.to(torch.uint8), exp


def k5_rotated_values(codes: Tensor, scales: Tensor, exp: Tensor, head_dim: int) -> Tensor:
    """The stored rotated rows ``[..., Dp]`` float32: ``(q x s) x 2^(exp - 127)`` (exact; the
    byte 255 gives NaN)."""
    dp = k5_padded(head_dim)
    if codes.shape[-1] != 5 * dp // 8 or scales.shape[-1] != -(-dp // K5_BLOCK):
        raise ValueError(f"codes / scales must have {5 * dp // 8} / {-(-dp // K5_BLOCK)} bytes per "
                         f"row for head_dim {head_dim}, got {codes.shape[-1]} / {scales.shape[-1]}")
    low = _unpack(codes[..., : dp // 2])
    plane = codes[..., dp // 2:].to(torch.int32)
    high = torch.stack([(plane >> b) & 1 for b in range(8)], dim=-1).reshape(*plane.shape[:-1], dp)
    q = (low.to(torch.int32) + 16 * high - K5_MAX).to(torch.float32)
    s = e4m3_decode(scales).repeat_interleave(K5_BLOCK, dim=-1)[..., :dp]
    e = exp.to(torch.int32)
    r = torch.where(e == 255, torch.full(e.shape, math.nan, device=e.device),
                    torch.ldexp(torch.ones(e.shape, device=e.device), e - 127))
    return (q * s) * r[..., None]


def k5_dequantize(codes: Tensor, scales: Tensor, exp: Tensor, head_dim: int) -> Tensor:
    """The key rows ``[..., head_dim]`` float32 a decode computes with: the stored rotated rows
    divided by n (exactly, a power of two: first, so that no sum overflows) and rotated back
    (``k5_rotate``)."""
    dp = k5_padded(head_dim)
    v = k5_rotated_values(codes, scales, exp, head_dim) * (1.0 / k5_rotation_size(dp))
    return k5_rotate(v)[..., :head_dim]


# ---------------------------------------------------------------------------------------------
# SPEC 3: FP4MM
# ---------------------------------------------------------------------------------------------


def _mm64(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b^T`` of float32 operands, accumulated in float64, rounded once to float32."""
    return torch.matmul(a.double(), b.double().transpose(-1, -2)).float()


def fp4mm(a: Tensor, b: Tensor) -> Tensor:
    """Block-scaled FP4 matmul (SPEC 3): ``phi(a) @ phi(b)^T`` with float32 output.

    ``a [..., M, K]`` and ``b [..., N, K]`` (leading dims broadcastable) are each quantized along
    K with one global scale per matrix of their own shape (a broadcast operand is quantized once).
    The block products are summed in float64 and rounded to float32, then multiplied by the
    float32 product ``dA * dB``.
    """
    a32, b32 = _as_float32(a), _as_float32(b)
    if a32.dim() < 2 or b32.dim() < 2 or a32.shape[-1] != b32.shape[-1]:
        raise ValueError(
            f"fp4mm needs a [..., M, K] and b [..., N, K], got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    ca, sa, da = _phi(a32, True)
    cb, sb, db = _phi(b32, True)
    acc = _mm64(_block_values(ca, sa), _block_values(cb, sb))
    return (da * db)[..., None, None] * acc


# ---------------------------------------------------------------------------------------------
# SPEC 4: FP4 attention forward
# ---------------------------------------------------------------------------------------------


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool = True) -> int:
    """Validate the [B, H, N, D] layout; return the GQA group size Hq // Hkv."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, N, D], got shape {tuple(t.shape)}")
        if not torch.is_floating_point(t):
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"key and value must agree in [B, H, N], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"query and key batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"query and key head dims differ: {q.shape[3]} vs {k.shape[3]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"query heads ({hq}) != key/value heads ({hkv}) needs enable_gqa=True")
    return hq // hkv


def _mask_bias(
    attn_mask: Tensor | None,
    is_causal: bool,
    shape: tuple[int, int, int, int],
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """Return (allowed bool, additive float32) views broadcast to [B, Hq, Nq, Nk] (None = none).

    Causal masking is top-left aligned (query i sees keys j <= i) like torch SDPA; it combines
    with an explicit mask when both are given. Nothing [B, Hq, Nq, Nk]-sized is materialised
    here: the tiles slice these expanded views.
    """
    Nq, Nk = shape[2], shape[3]
    allowed = None
    additive = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = torch.broadcast_to(attn_mask.to(device), shape)
        elif torch.is_floating_point(attn_mask):
            additive = torch.broadcast_to(attn_mask.to(device, torch.float32), shape)
        else:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if is_causal:
        causal = torch.ones(Nq, Nk, dtype=torch.bool, device=device).tril()
        causal = torch.broadcast_to(causal, shape)
        allowed = causal if allowed is None else (allowed & causal)
    return allowed, additive


def _mask_scores(s: Tensor, allowed: Tensor | None, additive: Tensor | None, j0: int,
                 j1: int) -> Tensor:
    """Scores of keys [j0, j1) with the masks of ``_mask_bias`` applied: hidden keys -inf, then
    the additive mask (SPEC 4 step 4)."""
    if allowed is not None:
        s = torch.where(allowed[..., j0:j1], s, -math.inf)
    if additive is not None:
        s = s + additive[..., j0:j1]
    return s


def _online_softmax_step(m: Tensor, s: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One key step of the online softmax (SPEC 4.5, SPEC_INT8 2.4) for scores ``s [..., keys]``
    and the running row maximum ``m``: ``(t, m_new, alpha, beta, e)`` with t the step's row
    maximum, alpha = exp(m - m_new), beta = exp(t - m_new) and e = exp(s - t) in [0, 1]. A row
    masked for the whole step (t = -inf) gets beta = 0 and e = 0: it adds nothing, never NaN."""
    t = s.amax(dim=-1)
    m_new = torch.maximum(m, t)
    empty = t == -math.inf
    alpha = torch.where(m == -math.inf, 0.0, torch.exp(m - m_new))
    beta = torch.where(empty, 0.0, torch.exp(t - m_new))
    e = torch.exp(s - torch.where(empty, 0.0, t)[..., None])
    return t, m_new, alpha, beta, e


def _normalise(acc: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:
    """SPEC 4.6: (acc / l, visible); rows without any visible key (l = 0) stay 0, never 0/0;
    a NaN l (a NaN reached the row) gives NaN."""
    visible = l != 0
    return torch.where(visible[..., None], acc / torch.where(visible, l, 1.0)[..., None], 0.0), visible


def v_mean(
    qbar: Tensor,
    counts: Tensor,
    k32: Tensor,
    v32: Tensor,
    nq: int,
    scale: float,
    chunk: int = 128,
    *,
    key_bias: Tensor | None = None,
) -> Tensor:
    """``vbar`` of SPEC 4.3 (V smoothing): V averaged with the mean query's softmax weights.

    ``qbar [B, Hq, nqb, D]`` are the query-block means of SPEC 4.2 and ``counts [nqb]`` their real
    rows; ``k32 [B, Hkv, Nk, D]`` and ``v32 [B, Hkv, Nk, Dv]`` the keys and values in float32.
    Returns float32 ``[B, Hkv, 1, Dv]``. All float32, in the order SPEC 4.3 writes:

    * ``qm = (sum over the KV head's G query heads h, then blocks i, in order, of n_i * qbar_hi)
      / (G * Nq)``;
    * per key ``s_j = scale * (qm . K_j)``, no mask;
    * per chunk c of ``chunk`` keys (SPEC: 128, whatever the kernels' key tile):
      ``M_c = max s_j``, ``l_c = sum exp(s_j - M_c)``, ``a_c = sum exp(s_j - M_c) V_j``; then
      ``M = max_c M_c``, ``L = sum_c exp(M_c - M) l_c``, ``A = sum_c exp(M_c - M) a_c``
      (c ascending) and ``vbar = A / L`` (correctly rounded);
    * a channel whose ``vbar`` is not finite, and every channel where ``M`` is not finite (NaN or
      overflowing scores), uses 0: no smoothing, as before the amendment.

    Masked form (SPEC 4.3 with a mask or causal, ``attention``'s default; ``_vbar_visibility``):
    ``counts`` is then ``[B, Hq, nqb]``, the rows of each block that count (``qbar`` their mean,
    0 where none), ``qm`` divides by the sum of those counts instead of ``G * Nq`` (0 rows: qm = 0),
    and ``key_bias [B, Hkv, Nk]`` (0 for a key some row sees, -inf for one no row sees, the
    largest additive mask value over the rows that see it) is added to ``s_j``; a chunk whose
    keys are all -inf adds nothing (M_c = -inf: l_c = a_c = 0, no -inf - -inf), and with every
    key -inf, M = -inf gives vbar = 0 by the rule above. With ``counts`` 1-D and no ``key_bias``
    this is the SPEC computation, bit for bit.
    """
    B, Hkv, Nk, D = k32.shape
    Hq, nqb = qbar.shape[1], qbar.shape[2]
    G = Hq // Hkv
    if counts.dim() == 1:  # SPEC 4.3: every row of every block counts
        weighted = (qbar * counts.to(torch.float32)[:, None]).reshape(B, Hkv, G * nqb, D)
        total = None
    else:  # masked form: [B, Hq, nqb] rows that count per block
        c32 = counts.to(torch.float32)
        weighted = (qbar * c32[..., None]).reshape(B, Hkv, G * nqb, D)
        total = c32.reshape(B, Hkv, G * nqb).sum(dim=-1)  # integers, exact in float32
    acc = weighted[:, :, 0]
    for i in range(1, G * nqb):  # (h, i) ascending, one float32 addition each
        acc = acc + weighted[:, :, i]
    if total is None:
        qm = _div_rn(acc, float(G * nq))  # [B, Hkv, D]
    else:
        some = total > 0
        qm = torch.where(some[..., None],
                         _div_rn(acc, torch.where(some, total, 1.0)[..., None]), 0.0)
    s = scale * torch.einsum("bhd,bhkd->bhk", qm, k32)
    if key_bias is not None:
        s = s + key_bias
    l_all = a_all = None
    ms, ls, as_ = [], [], []
    for j0 in range(0, Nk, chunk):
        sc = s[..., j0:j0 + chunk]
        mc = sc.amax(dim=-1)  # NaN-propagating
        if key_bias is not None:  # a chunk of hidden keys only: exp(-inf - 0) = 0, adds nothing
            e = torch.exp(sc - torch.where(mc == -math.inf, 0.0, mc)[..., None])
        else:
            e = torch.exp(sc - mc[..., None])
        ms.append(mc)
        ls.append(e.sum(dim=-1))
        as_.append((e[..., None] * v32[:, :, j0:j0 + chunk]).sum(dim=-2))
    m_all = torch.stack(ms, dim=-1).amax(dim=-1)
    for c in range(len(ms)):
        w = torch.exp(ms[c] - m_all)
        if key_bias is not None:  # M_c = M = -inf (no visible key at all): 0, not NaN
            w = torch.where(ms[c] == -math.inf, 0.0, w)
        l_all = w * ls[c] if l_all is None else l_all + w * ls[c]
        a_all = w[..., None] * as_[c] if a_all is None else a_all + w[..., None] * as_[c]
    vbar = _div_rn(a_all, l_all[..., None])
    ok = torch.isfinite(vbar) & torch.isfinite(m_all)[..., None]
    return torch.where(ok, vbar, 0.0)[:, :, None]


def _vbar_visibility(
    allowed: Tensor | None,
    additive: Tensor | None,
    G: int,
    chunk: int = 128,
    self_rows: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Masked ``vbar`` (SPEC 4.3, ``attention(..., vbar_mask=...)``): which query rows count in
    ``qm`` and the bias of each key in vbar's softmax, from the views of ``_mask_bias``
    ([B, Hq, Nq, Nk]).

    Entry (h, i, j) is *hidden* when ``allowed`` is False there (bool mask False, or causal
    ``j > i``) or the additive mask is -inf. Returns ``(rows, key_bias)``:

    * ``rows [B, Hq, Nq]`` bool: query row i of head h sees at least one key (some entry not
      hidden). With ``self_rows`` and Nq == Nk, also key i must be seen by some row of the KV
      head's query heads (in self-attention a key hidden from every row is padding, and so is the
      query row at its position);
    * ``key_bias [B, Hkv, Nk]`` float32: -inf for a key hidden from every row of the KV head's G
      query heads, else the largest additive mask value over the (h, i) that see it (0 without an
      additive mask). A finite mask value such as ``finfo.min`` is not hidden, but its bias gives
      the key weight exp(finfo.min) = 0 beside any seen key.

    ``(None, None)`` when there is no mask at all.
    """
    if allowed is None and additive is None:
        return None, None
    ref = allowed if allowed is not None else additive
    B, Hq, Nq, Nk = ref.shape
    Hkv = Hq // G
    rows = torch.zeros(B, Hq, Nq, dtype=torch.bool, device=ref.device)
    bias = []
    for j0 in range(0, Nk, chunk):
        j1 = min(j0 + chunk, Nk)
        seen = torch.ones(B, Hq, Nq, j1 - j0, dtype=torch.bool, device=ref.device)
        if allowed is not None:
            seen = seen & allowed[..., j0:j1]
        if additive is not None:
            seen = seen & (additive[..., j0:j1] > -math.inf)
        rows |= seen.any(dim=-1)
        if additive is None:
            b = torch.where(seen.reshape(B, Hkv, G * Nq, j1 - j0).any(dim=2), 0.0, -math.inf)
        else:
            a = torch.where(seen, additive[..., j0:j1], -math.inf)
            b = a.reshape(B, Hkv, G * Nq, j1 - j0).amax(dim=2)
        bias.append(b.to(torch.float32))
    key_bias = torch.cat(bias, dim=-1)
    if self_rows and Nq == Nk:
        own = (key_bias > -math.inf).repeat_interleave(G, dim=1)  # [B, Hq, Nk], Nk == Nq
        rows &= own
    return rows, key_bias


def v_mean_masked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    block_q: int = 128,
    self_rows: bool = False,
) -> Tensor:
    """The masked ``vbar`` of ``attention(..., smooth_v="weighted", vbar_mask=True)`` (``"self"``:
    ``self_rows=True``): float32 ``[B, Hkv, 1, Dv]``, what ``attention`` adds back.

    SPEC 4.3's computation (``v_mean``) with the masks applied (``_vbar_visibility``): keys that
    no query row of the KV head sees get weight 0 (an additive mask contributes its largest value
    over the rows that see the key), and ``qm`` is the mean over the query rows that see some key,
    per block as in SPEC 4.2 (``qbar`` of those rows times their count, (h, i) ascending, divided
    by the number of rows that count). No mask: exactly ``v_mean``; no visible key: 0.
    """
    G = _check_qkv(q, k, v)
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q32, k32, v32 = _as_float32(q), _as_float32(k), _as_float32(v)
    allowed, additive = _mask_bias(attn_mask, is_causal, (B, Hq, Nq, Nk), q.device)
    nqb = -(-Nq // block_q)
    qpad = torch.nn.functional.pad(q32, (0, 0, 0, nqb * block_q - Nq))
    rows, key_bias = _vbar_visibility(allowed, additive, G, self_rows=self_rows)
    if rows is None:  # no mask: the SPEC's vbar, as attention computes it
        starts = torch.arange(nqb, device=q32.device) * block_q
        counts = torch.clamp(Nq - starts, max=block_q).to(torch.float32)
        qmeans = qpad.reshape(B, Hq, nqb, block_q, D).sum(dim=3) / counts[:, None]
        return v_mean(qmeans, counts, k32, v32, Nq, scale)
    rpad = torch.nn.functional.pad(rows, (0, nqb * block_q - Nq))
    rq = torch.where(rpad[..., None], qpad, 0.0)
    rcounts = rpad.reshape(B, Hq, nqb, block_q).sum(dim=3).to(torch.float32)
    rsums = rq.reshape(B, Hq, nqb, block_q, D).sum(dim=3)
    rmeans = torch.where(rcounts[..., None] > 0,
                         rsums / torch.where(rcounts > 0, rcounts, 1.0)[..., None], 0.0)
    return v_mean(rmeans, rcounts, k32, v32, Nq, scale, key_bias=key_bias)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    block_q: int = 128,
    block_kv: int = 128,
    smooth_q: bool = True,
    smooth_k: bool = True,
    two_level_p: bool = True,
    global_scale: bool = True,
    quantize_q: bool = True,
    quantize_k: bool = True,
    quantize_v: bool = True,
    quantize_p: bool = True,
    smooth_v: bool | str = "weighted",
    vbar_mask: bool | str = True,
    quantized_rowsum: bool = False,
    qk: str = "fp4",
    migrate_qk: bool | str = False,
    rotate_qk: bool | int = False,
    rotate_v: bool | int = False,
    rotate_pv: bool | int = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """FP4 attention forward of SPEC 4; float32 output ``[B, Hq, Nq, Dv]`` (and optionally LSE).

    ``q [B, Hq, Nq, D]``, ``k [B, Hkv, Nk, D]``, ``v [B, Hkv, Nk, Dv]``; query head h reads KV head
    ``h // (Hq // Hkv)``. ``block_q`` is the query-smoothing block, ``block_kv`` the key tile of
    the online softmax (a multiple of 16 so P's blocks line up with V's token blocks).

    Ablation switches: ``smooth_q`` / ``smooth_k`` (SPEC 4.1-4.2), ``global_scale`` (False uses
    phi_local for Q, K and V), ``quantize_{q,k,v,p}`` (False keeps that operand in float32), and
    ``two_level_p=False``, which drops the per-row, per-tile first level of P: P~ = exp(S - m_new)
    in [0, 1] is quantized directly with phi_local and ``O = alpha * O + FP4MM(P^, V^) * dV``.
    With every quantization off this is exact attention in float32.

    ``smooth_v`` is SPEC 4.3's V smoothing: ``"weighted"`` (the SPEC, default) quantizes
    ``V - vbar`` with ``vbar = v_mean(...)`` (V averaged with the mean query's softmax weights
    over the keys some row sees, per (batch, KV head); ``vbar_mask``) and adds ``vbar`` to every
    visible row after the normalisation (``O / l + vbar``); exact in real arithmetic because each
    row of softmax(S) sums to one. Rows with no visible key stay 0 and the LSE is unchanged.
    Variants measured in docs/accuracy.md "V smoothing for FP4"
    (``python -m fp4attn.eval.fp4_variants``): ``False`` (no smoothing: SPEC 4 before the
    amendment), ``True`` or ``"mean"`` (V's mean over the ``Nk`` keys, SageAttention2's form),
    ``"first"`` (V's first key row).

    ``vbar_mask`` (SPEC 4.3, default ``True``; only used with ``smooth_v="weighted"``) applies
    the masks to ``vbar`` (``_vbar_visibility``, ``v_mean``): a key hidden from every query row of
    the KV head (bool mask False, additive -inf or causal for every row, e.g. padding) gets
    weight 0, an additive mask adds its largest value over the rows that see the key, and ``qm``
    is the mean over the query rows that see at least one key. No visible key at all gives
    vbar = 0. Without a mask and without causal it is the unmasked computation (the same code);
    with a mask that has no additive values, hides no key from every row and leaves every row
    some key (causal with Nq >= Nk, for one) it gives the same bits. ``False``: SPEC 4.3 before
    the amendment (vbar over all keys whatever the masks), kept for comparisons. ``"self"`` (not
    SPEC): in self-attention (Nq == Nk) also leave out of ``qm`` the query rows at the
    positions of such keys (padding queries).

    ``quantized_rowsum`` (not SPEC, off by default): ``l`` sums the quantized P^ (dequantized,
    first level undone) instead of the unquantized exponentials, so ``O / l`` is a convex
    combination of V^'s rows with the weights the FP4MM actually used.

    ``qk`` (not SPEC; docs/accuracy.md "fp4pv"): where the scores come from. ``"fp4"`` (the
    SPEC) is SPEC 4.1-4.4; ``"int8"`` takes them from SPEC_INT8 2.1-2.3 instead (K smoothed,
    channels migrated, Q^ per 64 rows, K^ per 128 keys, int32-exact products times
    ``sQ sK scale``: ``reference_int8``'s own operands and scores), everything after the scores
    (V smoothing, two-level FP4 P, NVFP4 V, the 128-key online softmax) as SPEC 4.3 and 4.5-4.6.
    ``attention_fp4pv`` is this with the SPEC's other defaults. Needs ``block_kv`` = 128 (both
    specs' key step); ``smooth_q``, ``smooth_k``, ``global_scale``, ``quantize_q`` and
    ``quantize_k`` then have no effect on the scores (``smooth_q`` still picks vbar's query means).

    Exact rewrites of Q.K^T and P.V (not SPEC, off by default; docs/accuracy.md "Channel
    migration and Hadamard rotation for FP4", ``python -m fp4attn.eval.fp4_variants``):

    * ``migrate_qk``: SPEC_INT8 2.1b's channel migration on the FP4 operands: per (batch, KV
      head) and channel, ``s_c = reference_int8.channel_migration`` (the power of two nearest
      ``sqrt(ka_c / qa_c)``, ka_c = max |Ks_c|), ``Qs_c * s_c`` and ``Ks_c / s_c`` are quantized
      instead of Qs and Ks. ``True`` / ``"smoothed"``: ``qa_c`` = max |Qs_c| over the KV head's
      query rows, the smoothed Q that is quantized; ``"raw"``: max |Q_c| of the unsmoothed Q (as
      SPEC_INT8, which has no Q smoothing). s is a power of two, so migrating before or after the
      per-block Q smoothing gives the same operands bit for bit (``(Q s) - qbar s = (Q - qbar) s``
      exactly); only which maximum sets s differs. The correction ``qbar . K`` keeps the
      unmigrated operands (``qbar s . K / s`` is the same number).
    * ``rotate_qk``: Qs and Ks (migrated first, if both) zero-padded to Dp = D rounded up to 16
      and multiplied by the same block-diagonal Sylvester-Hadamard matrix H (blocks of n:
      ``True`` = the largest power of two dividing Dp, as SPEC 6's K5 rotation, or an int n),
      Ks's by ``H / n`` (a power of two): ``(Qs H)(Ks H / n)^T = Qs Ks^T`` since ``H H = n I``.
      The butterfly is ``k5_rotate``'s, float32.
    * ``rotate_v``: ``V - vbar`` (or V) multiplied by H along the head dim (zero-padded to a
      multiple of 16) before it is quantized (along tokens, as ever), and the accumulated output
      by ``H / n`` after the last key step, before ``vbar`` is added back: exact since the output
      is linear in V.

    * ``rotate_pv`` (docs/accuracy.md "Hadamard rotation along the keys for FP4 P.V"): P.V is
      computed as ``(P H)(H V) / n`` with the block-diagonal Sylvester-Hadamard H along the
      *keys* (blocks of n = 16, 32, 64 or 128 consecutive keys inside each ``block_kv`` tile;
      ``True`` = the largest power of two dividing ``block_kv``), so a token outlier of V and a
      peak of P are spread over n keys. V - vbar (or V; after ``rotate_v``, if both), zero-padded
      to a multiple of n keys, is multiplied by H along the tokens and NVFP4-quantized along the
      tokens as ever (16-token blocks per channel, global scale of the rotated V). Per tile and
      row, ``e = exp(S - t)`` (zero-padded likewise) is rotated, ``eH`` (float32 butterfly), and
      P's first level is applied to the rotated row: ``P = eH * c`` with ``c = 2688 / max_j
      |eH_j|`` (a correctly rounded division; the maximum is the largest block sum of e, since
      H's first column is all ones), so the row's tile maximum magnitude sits at 2688 as in SPEC
      4.5. P is signed, and is quantized by phi_local (SPEC 2 without a global scale): per block
      of 16 keys the E4M3 scale ``rne_e4m3_sat(amax / 6)`` of the block's largest magnitude and
      E2M1 codes with their sign bit (the 8 magnitudes 0 .. 6 and their negatives). The FP4MM
      ``P^ . (HV)^`` is scaled by ``sP = (beta / c) / n`` (1 / n a power of two) and the global
      scale of V. ``two_level_p=False``: ``P = beta * eH / n`` (|P| <= 1), no further scaling;
      ``quantized_rowsum``: ``l`` sums the un-rotated P^ (``P^ H``, times sP). Exact in real
      arithmetic (``H H = n I``); the LSE is unchanged (but for ``quantized_rowsum``). It
      also applies with ``qk="int8"`` (fp4pv's FP4 P.V).

    The LSE is computed as without them (``rotate_qk``'s scores differ by float32 rounding).
    ``qk="int8"`` takes none of them but ``rotate_pv``.

    Rows that see no key (masks, causal with Nq > Nk, Nk == 0) give 0 and LSE -inf.

    ``lse`` (float32 ``[B, Hq, Nq]``) is the natural-log log-sum-exp of the scaled scores
    ``scale * q.k + mask``. One clarification of SPEC 4.6: the smoothed scores S omit the
    per-row constant ``(q_r - qbar_i) . kbar`` (it cancels in the softmax), so ``m + log(l)``
    alone would be off by ``scale * (q_r - qbar_i) . kbar``; that term is added back (float32),
    which makes the LSE of partial key ranges with different ``kbar`` mergeable.
    """
    G = _check_qkv(q, k, v)
    if block_q < 1:
        raise ValueError(f"block_q must be positive, got {block_q}")
    if block_kv < BLOCK or block_kv % BLOCK:
        raise ValueError(f"block_kv must be a positive multiple of {BLOCK}, got {block_kv}")
    if smooth_v not in (False, True, "mean", "first", "weighted"):
        raise ValueError(
            f"smooth_v must be False, True, 'mean', 'first' or 'weighted', got {smooth_v!r}")
    if vbar_mask not in (False, True, "visible", "self"):
        raise ValueError(f"vbar_mask must be False, True, 'visible' or 'self', got {vbar_mask!r}")
    if qk not in ("fp4", "int8"):
        raise ValueError(f"qk must be 'fp4' (SPEC 4.4) or 'int8' (SPEC_INT8 2.3), got {qk!r}")
    if qk == "int8" and block_kv != 128:
        raise ValueError(f"qk='int8' needs block_kv=128 (SPEC_INT8's key step), got {block_kv}")
    if qk == "int8" and v.shape[3] != q.shape[3]:
        raise ValueError(f"qk='int8' needs value head dim == query head dim, got {v.shape[3]}, "
                         f"{q.shape[3]}")
    if migrate_qk not in (False, True, "smoothed", "raw"):
        raise ValueError(f"migrate_qk must be False, True, 'smoothed' or 'raw', got {migrate_qk!r}")
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    n_qk = _rotation_block(rotate_qk, k5_padded(D), "rotate_qk", "the padded head dim", 2)
    n_v = _rotation_block(rotate_v, k5_padded(Dv), "rotate_v", "the padded head dim", 2)
    if qk == "int8" and (migrate_qk or n_qk or n_v):
        raise ValueError("qk='int8' takes no migrate_qk / rotate_qk / rotate_v")
    n_pv = _rotation_block(rotate_pv, block_kv, "rotate_pv", "the key tile block_kv =", BLOCK)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    allowed, additive = _mask_bias(attn_mask, is_causal, (B, Hq, Nq, Nk), q.device)

    q32, k32, v32 = _as_float32(q), _as_float32(k), _as_float32(v)  # copies never alias inputs
    out = q32.new_zeros(B, Hq, Nq, Dv)
    lse = q32.new_full((B, Hq, Nq), -math.inf)
    if Nk == 0 or Nq == 0 or B == 0 or Hq == 0:
        return (out, lse) if return_lse else out

    # SPEC 4.1: smooth K by its mean over the real tokens (a per-row constant shift of S).
    kbar = k32.mean(dim=2, keepdim=True) if smooth_k else k32.new_zeros(B, Hkv, 1, D)
    ks = k32 - kbar

    # SPEC 4.2: smooth Q per block of block_q rows (the last one possibly short).
    nqb = -(-Nq // block_q)
    qpad = torch.nn.functional.pad(q32, (0, 0, 0, nqb * block_q - Nq))
    sums = qpad.reshape(B, Hq, nqb, block_q, D).sum(dim=3)
    starts = torch.arange(nqb, device=q32.device) * block_q
    counts = torch.clamp(Nq - starts, max=block_q).to(torch.float32)  # real rows per block
    qmeans = sums / counts[:, None]  # [B, Hq, nqb, D]
    qbar = qmeans if smooth_q else q32.new_zeros(B, Hq, nqb, D)
    qbar_rows = qbar.repeat_interleave(block_q, dim=2)[:, :, :Nq]  # [B, Hq, Nq, D]
    qs = q32 - qbar_rows

    # SPEC 4.3: quantize. Values are value(code) * scale (exact float32); the global dec scales
    # stay separate and are applied in float32 after each FP4MM, as SPEC 1/3 require.
    def operand(x: Tensor, on: bool) -> tuple[Tensor, Tensor]:
        if not on:
            return x, x.new_ones(x.shape[:-2])
        codes, scales, dec = _phi(x, global_scale)
        return _block_values(codes, scales)[..., : x.shape[-1]], dec

    # Exact rewrites of Qs Ks^T (not SPEC): channel migration, then the Hadamard rotation.
    qop, kop = qs, ks
    if migrate_qk:
        from .reference_int8 import channel_migration

        mig = channel_migration(qs if migrate_qk != "raw" else q32, k32, kbar, G)  # [B,Hkv,1,D]
        qop, kop = qs * mig.repeat_interleave(G, dim=1), _div_rn(ks, mig)
    if n_qk:
        dpad = k5_padded(D) - D
        qop = _block_hadamard(torch.nn.functional.pad(qop, (0, dpad)), n_qk)
        kop = _block_hadamard(torch.nn.functional.pad(kop, (0, dpad)), n_qk) * (1.0 / n_qk)

    # (qk="int8": the scores come from SPEC_INT8's operands; these FP4 ones go unused)
    qv, dq = operand(qop, quantize_q and qk == "fp4")  # [B, Hq, Nq, D], [B, Hq]
    kv, dk = operand(kop, quantize_k and qk == "fp4")  # [B, Hkv, Nk, D], [B, Hkv]
    # SPEC 4.3: V smoothing; quantize V - vbar, add vbar back after normalising.
    if smooth_v == "first":
        vbar = v32[:, :, :1].clone()  # [B, Hkv, 1, Dv]
    elif smooth_v == "weighted" and vbar_mask and (allowed is not None or additive is not None):
        # SPEC 4.3 with masks: keys some row sees, rows that see one
        vbar = v_mean_masked(q32, k32, v32, attn_mask, is_causal, scale, block_q=block_q,
                             self_rows=vbar_mask == "self")
    elif smooth_v == "weighted":  # V averaged with the mean query's softmax weights, no mask
        vbar = v_mean(qmeans, counts, k32, v32, Nq, scale)
    else:
        vbar = v32.mean(dim=2, keepdim=True) if smooth_v else None  # [B, Hkv, 1, Dv]
    vs = v32 - vbar if smooth_v else v32
    if n_v:  # not SPEC: V (smoothed) times H along the head dim; the output is rotated back
        vs = _block_hadamard(torch.nn.functional.pad(vs, (0, k5_padded(Dv) - Dv)), n_v)
    vst = vs.transpose(-1, -2)  # [B, Hkv, Dv, Nk]
    nkp = -(-Nk // n_pv) * n_pv if n_pv else Nk
    if n_pv:  # not SPEC: (V - vbar) times H along the tokens, zero-padded to whole blocks of n
        vst = _block_hadamard(torch.nn.functional.pad(vst, (0, nkp - Nk)), n_pv)
    vt, dv = operand(vst, quantize_v)  # V^T [B, Hkv, Dv, Nk (nkp)]: along tokens

    # GQA: every query head reads its KV head; repeat after quantizing, so the global scales
    # are per (batch, KV head) as the kernels compute them.
    def per_q_head(x: Tensor) -> Tensor:
        return x.repeat_interleave(G, dim=1) if G > 1 else x

    kv, dk, vt, dv, kin = (
        per_q_head(kv),
        per_q_head(dk),
        per_q_head(vt),
        per_q_head(dv),
        per_q_head(k32),
    )
    dqk = (dq * dk)[..., None, None]
    dv = dv[..., None, None]
    ops8 = None
    if qk == "int8":  # SPEC_INT8 2.1-2.2's operands (V^ too, unused here), bit for bit
        from .reference_int8 import BK, _Quantized

        ops8 = _Quantized(q32, k32, v32, G)

    m = q32.new_full((B, Hq, Nq), -math.inf)
    l = q32.new_zeros(B, Hq, Nq)
    acc = q32.new_zeros(B, Hq, Nq, vs.shape[-1])
    for j0 in range(0, Nk, block_kv):
        j1 = min(j0 + block_kv, Nk)
        if ops8 is not None:  # SPEC_INT8 2.3: S = float(Q^ K^T) * ((sQ sK) * scale), masked
            s = ops8.scores(j0 // BK, scale, allowed, additive)
        else:
            # SPEC 4.4: S = scale * (FP4MM(Q^, K^) + qbar . K^T); the correction is a GEMV per
            # query block against the keys in input precision (float32), expanded to its rows.
            qkp = dqk * _mm64(qv, kv[:, :, j0:j1])
            corr = torch.matmul(qbar, kin[:, :, j0:j1].transpose(-1, -2))  # [B, Hq, nqb, tile]
            s = _mask_scores(scale * (qkp + corr.repeat_interleave(block_q, dim=2)[:, :, :Nq]),
                             allowed, additive, j0, j1)

        # SPEC 4.5: online softmax; a row fully masked in this tile (t = -inf) adds nothing.
        _, m_new, alpha, beta, e = _online_softmax_step(m, s)
        if not quantized_rowsum:
            l = alpha * l + beta * e.sum(dim=-1)  # l from the unquantized exponentials
        jp = min(j0 + block_kv, nkp)  # = j1 unless rotate_pv pads the last tile
        if n_pv:  # not SPEC: e H along the keys (signed), first level on the rotated row
            eh = _block_hadamard(torch.nn.functional.pad(e, (0, jp - j1)), n_pv)
            if two_level_p:
                a = eh.abs().amax(dim=-1)  # the largest block sum of e; 0 for an empty row
                c = torch.where(a > 0, _div_rn(NVFP4_RANGE, a), 1.0)
                p = eh * c[..., None]  # the row's tile maximum magnitude sits at 2688
                sp = _div_rn(beta, c) * (1.0 / n_pv)  # undoes c, and H H = n I
            else:
                p = eh * (beta * (1.0 / n_pv))[..., None]  # |P| <= 1
        elif two_level_p:
            p = NVFP4_RANGE * e  # first level: each row's tile maximum sits exactly at 2688
            sp = _div_rn(beta, NVFP4_RANGE)
        else:
            p = beta[..., None] * e  # ablation: P~ = exp(S - m_new) in [0, 1], one level only
        if quantize_p:
            codes, scales, _ = _phi(p, global_scale=False)  # phi_local: blocks of 16 keys
            p = _block_values(codes, scales)[..., : jp - j0]
        if quantized_rowsum:  # l from the P^ the FP4MM uses (first level undone, un-rotated)
            ps = (_block_hadamard(p, n_pv) if n_pv else p).sum(dim=-1)
            l = alpha * l + (sp * ps if two_level_p else ps)
        pv = _mm64(p, vt[..., j0:jp])  # FP4MM(P^, V^_j) without its global scale, [B,Hq,Nq,Dv]
        if two_level_p:
            pv = sp[..., None] * pv  # undo the first level: sP
        acc = alpha[..., None] * acc + pv * dv
        m = m_new

    if n_v:  # undo the rotation of V: (P (V H)) H / n = P V
        acc = (_block_hadamard(acc, n_v) * (1.0 / n_v))[..., :Dv]
    out, visible = _normalise(acc, l)
    if smooth_v:  # softmax rows sum to one: O = softmax(S) (V - vbar) + vbar; hidden rows stay 0
        out = torch.where(visible[..., None], out + per_q_head(vbar), 0.0)
    if not return_lse:
        return out
    if ops8 is not None:  # SPEC_INT8 2.5: the scores omit scale * (q . kbar), Q unsmoothed
        from .reference_int8 import _lse_shift

        shift = _lse_shift(q32, ops8.kbar, G, scale)
    else:
        shift = scale * (qs * kbar.repeat_interleave(G, dim=1)).sum(dim=-1) if smooth_k else 0.0
    lse = torch.where(visible, m + torch.log(l) + shift, -math.inf)
    return out, lse


def attention_fp4pv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The "fp4pv" study precision (not SPEC; docs/accuracy.md "fp4pv"): QK^T in 8 bits as
    SPEC_INT8 2.1-2.3 computes it, P.V in FP4 as SPEC 4.3 and 4.5-4.6 (V smoothing with the masked vbar, two-level
    P, NVFP4 V^), one 128-key online softmax. Half of the attention FLOPs (the P.V product) run
    in FP4. ``attention(..., qk="int8")``; float32 output (and the LSE of the scaled scores)."""
    return attention(q, k, v, attn_mask, is_causal, scale, qk="int8", return_lse=return_lse)


def exact_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = True,
) -> Tensor:
    """Exact softmax attention in float64 (same masking / GQA conventions as ``attention``).

    Rows with no visible key give 0 instead of the NaN of a plain softmax.
    """
    G = _check_qkv(q, k, v, enable_gqa)
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q64, k64, v64 = q.double(), k.double(), v.double()
    if G > 1:
        k64, v64 = k64.repeat_interleave(G, dim=1), v64.repeat_interleave(G, dim=1)
    s = scale * torch.matmul(q64, k64.transpose(-1, -2))
    allowed, additive = _mask_bias(attn_mask, is_causal, (B, Hq, Nq, Nk), q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    if additive is not None:
        s = s + additive.double()
    mx = s.amax(dim=-1, keepdim=True) if Nk else s.new_full((B, Hq, Nq, 1), -math.inf)
    mx = torch.where(torch.isfinite(mx), mx, 0.0)
    p = torch.exp(s - mx)
    denom = p.sum(dim=-1, keepdim=True)
    return torch.where(denom != 0, torch.matmul(p, v64) / torch.where(denom != 0, denom, 1.0), 0.0)


# ---------------------------------------------------------------------------------------------
# SPEC 5: metrics
# ---------------------------------------------------------------------------------------------


def metrics(out: Tensor, ref: Tensor) -> dict[str, float]:
    """SPEC 5 accuracy metrics in float64: cosine similarity, relative L1, RMSE.

    Degenerate cases: two all-zero tensors have cos = 1 and rel_l1 = 0; an all-zero reference
    against a non-zero output gives rel_l1 = inf; cos is 0 if exactly one side is all zero.
    NaNs propagate (a NaN output must never look accurate).
    """
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    o = out.detach().double().flatten()
    r = ref.detach().double().flatten()
    diff = o - r
    no, nr = torch.linalg.vector_norm(o).item(), torch.linalg.vector_norm(r).item()
    dot = torch.dot(o, r).item()
    if no == 0 and nr == 0:
        cos = 1.0
    elif no == 0 or nr == 0:
        cos = 0.0 if not (math.isnan(no) or math.isnan(nr)) else math.nan
    else:
        cos = dot / (no * nr)
    l1_diff = diff.abs().sum().item()
    l1_ref = r.abs().sum().item()
    if l1_ref == 0:
        rel_l1 = 0.0 if l1_diff == 0 else math.inf
    else:
        rel_l1 = l1_diff / l1_ref
    rmse = math.sqrt(diff.pow(2).mean().item()) if diff.numel() else 0.0
    return {"cos": cos, "rel_l1": rel_l1, "rmse": rmse}
