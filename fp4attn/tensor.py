"""NVFP4Tensor and the quantize / dequantize / fp4mm front ends (SPEC.md sections 2-3)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from ._ops import ops

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor quantized to NVFP4 along its last dimension (the linear layout of SPEC 2).

    codes:  uint8 [..., R, ceil(K/16)*8], two E2M1 codes per byte, element 2i in the low nibble
    scales: float8_e4m3fn [..., R, ceil(K/16)], one scale per block of 16 values
    dec:    float32 [...], one global dequantization scale per matrix (the last two dims)
    shape:  the original shape [..., R, K]
    """

    codes: torch.Tensor
    scales: torch.Tensor
    dec: torch.Tensor
    shape: torch.Size

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)

    def swizzled_scales(self) -> torch.Tensor:
        """Block scales in the 128x4 swizzled layout of cuBLASLt / torch._scaled_mm / CUTLASS.

        Returns float8_e4m3fn of shape [..., round_up(R,128) * round_up(ceil(K/16),4)] (zero
        padded); the 4 scales of one row and one 64-wide K slice form one aligned 32-bit word.
        """
        return swizzle_scales(self.scales)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[..., R, nKB] linear scales -> [..., ceil(R/128)*128*ceil(nKB/4)*4] swizzled (see docs)."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a tensor, got {type(scales).__name__}")
    if scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"scales must be float8_e4m3fn or uint8 (E4M3 bytes), got {scales.dtype}")
    if scales.dim() < 2:
        raise ValueError(f"scales must be [..., R, nKB] (at least 2-D), got shape "
                         f"{tuple(scales.shape)}")
    s = scales.view(torch.uint8)
    *lead, rows, nkb = s.shape
    rt, kt = -(-rows // 128), -(-nkb // 4)
    padded = s.new_zeros((*lead, rt * 128, kt * 4))
    padded[..., :rows, :nkb] = s
    # offset(r, kb) = ((r//128)*kt + kb//4)*512 + (r%32)*16 + ((r//32)%4)*4 + kb%4
    tiles = padded.reshape(*lead, rt, 4, 32, kt, 4)  # r = 128*rt + 32*i + j ; kb = 4*kt + c
    tiles = tiles.permute(*range(len(lead)), -5, -2, -3, -4, -1)  # rt, kt, j(32), i(4), c(4)
    return tiles.reshape(*lead, -1).contiguous().view(torch.float8_e4m3fn)


def _check_float_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims [..., rows, cols], got shape {tuple(x.shape)}")
    if x.shape[-1] == 0:
        raise ValueError(f"{name} must have at least one column, got shape {tuple(x.shape)}")


def _warn_if_grad(x, name: str, op: str, stacklevel: int = 3) -> None:
    """The FP4 formats have no gradient: say so where a gradient was asked for, rather than
    return a constant that silently stops it."""
    if torch.is_grad_enabled() and x.requires_grad:
        warnings.warn(f"fp4attn.{op}: {name} requires grad, but NVFP4 quantization has no gradient: "
                      f"none flows back to {name} (call it under torch.no_grad(), or on "
                      f"{name}.detach(), to silence this)", stacklevel=stacklevel)


def quantize(x: torch.Tensor) -> NVFP4Tensor:
    """NVFP4-quantize x [..., R, K] along K, one FP32 global scale per [R, K] matrix (SPEC 2).
    Not differentiable (a warning where x requires grad)."""
    _check_float_tensor(x, "x")
    _warn_if_grad(x, "x", "quantize")
    return _quantize(x)


def _quantize(x: torch.Tensor) -> NVFP4Tensor:
    codes, scales, dec = ops.quantize(x.detach())
    return NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), dec, x.shape)


def dequantize(t: NVFP4Tensor) -> torch.Tensor:
    """float32 [..., R, K] = (value(code) * scale) * dec."""
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"t must be an fp4attn.NVFP4Tensor, got {type(t).__name__}")
    return ops.dequantize(t.codes, t.scales.view(torch.uint8), t.dec, t.cols)


def _as_nvfp4(x, name: str) -> NVFP4Tensor:
    if isinstance(x, NVFP4Tensor):
        return x
    _check_float_tensor(x, name)
    _warn_if_grad(x, name, "fp4mm", stacklevel=4)  # the caller of fp4mm
    return _quantize(x)


def fp4mm(a, b, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-scaled FP4 matmul (SPEC 3): a [..., M, K] times b [..., N, K]^T -> [..., M, N].

    a and b are float tensors (quantized here, one global scale per matrix) or NVFP4Tensors
    (e.g. a weight quantized once). Leading dimensions broadcast like torch.matmul. Not
    differentiable (a warning where a or b requires grad).
    """
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    qa, qb = _as_nvfp4(a, "a"), _as_nvfp4(b, "b")
    if qa.cols != qb.cols:
        raise ValueError(f"a and b must have the same last dim K, got {qa.cols} and {qb.cols}")
    if qa.device != qb.device:
        raise ValueError(f"a and b must be on one device, got {qa.device} and {qb.device}")
    lead_a, lead_b = tuple(qa.shape[:-2]), tuple(qb.shape[:-2])
    try:
        lead = tuple(torch.broadcast_shapes(lead_a, lead_b))
    except RuntimeError as exc:
        raise ValueError(f"a and b batch dims {lead_a} and {lead_b} do not broadcast") from exc
    rows, cols = qa.shape[-2], qb.shape[-2]
    if math.prod(lead) * rows * cols == 0:  # nothing to compute (the op takes no empty operand)
        return torch.zeros((*lead, rows, cols), dtype=out_dtype, device=qa.device)
    # The op takes equal matrix counts or one side with a single matrix (broadcast in C).
    if lead_a != lead_b and qa.dec.numel() != 1 and qb.dec.numel() != 1:
        qa, qb = _expand(qa, lead), _expand(qb, lead)
    out = ops.fp4mm(qa.codes, qa.scales.view(torch.uint8), qa.dec, qb.codes,
                    qb.scales.view(torch.uint8), qb.dec, qa.cols, out_dtype)
    return out.reshape(*lead, *out.shape[-2:])


def _expand(t: NVFP4Tensor, lead) -> NVFP4Tensor:
    def ex(x, tail):
        return x.expand(*lead, *tail).contiguous()

    return NVFP4Tensor(ex(t.codes, t.codes.shape[-2:]), ex(t.scales.view(torch.uint8),
                       t.scales.shape[-2:]).view(torch.float8_e4m3fn), ex(t.dec, ()),
                       torch.Size((*lead, *t.shape[-2:])))
