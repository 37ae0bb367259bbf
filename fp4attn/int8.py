"""The 8-bit trainable attention ops (docs/SPEC_INT8.md): forward and backward as torch custom ops
with fake kernels, tied together for autograd.

    torch.ops.fp4attn.int8_attention(q, k, v, attn_mask, is_causal, scale, cuda_kernel="auto")
        -> (out, lse)
    torch.ops.fp4attn.int8_attention_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask,
                                              is_causal, scale, cuda_kernel="auto") -> (dq, dk, dv)

q [B, Hq, Nq, D], k / v [B, Hkv, Nk, D] (Hq a multiple of Hkv), one dtype; out in that dtype,
lse float32 [B, Hq, Nq]. The autograd saves q, k, v, out and lse; the backward recomputes the
quantized operands bit-exactly. CPU tensors run the C backend (csrc/cpu/attention_int8.c), CUDA
tensors the INT8 kernels (csrc/cuda/int8: wgmma on Hopper, mma.sync otherwise; `cuda_kernel`
requests a kernel by name, as for the FP4 attention, and the autograd's backward takes the
forward's request);
other devices run the PyTorch implementation of the spec (fp4attn.reference_int8): correct, not
fast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference_int8
from ._ops import _BUILD_INFO, _C


def _native(q: Tensor) -> bool:
    """Whether the compiled backends run this call: CPU always, CUDA when the build has it."""
    return q.device.type == "cpu" or (q.device.type == "cuda" and _BUILD_INFO["cuda"])


@torch.library.custom_op("fp4attn::int8_attention", mutates_args=())
def int8_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float,
    cuda_kernel: str = "auto",
) -> tuple[Tensor, Tensor]:
    if _native(q):
        return _C.int8_attention(q, k, v, attn_mask, is_causal, scale, cuda_kernel)
    if cuda_kernel != "auto":
        raise ValueError(f"cuda_kernel={cuda_kernel!r} needs CUDA tensors")
    out, lse = reference_int8.attention_forward(q, k, v, attn_mask, is_causal, scale)
    return out.to(q.dtype), lse


@int8_attention.register_fake
def _int8_attention_fake(q, k, v, attn_mask, is_causal, scale, cuda_kernel="auto"):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fp4attn::int8_attention_backward", mutates_args=())
def int8_attention_backward(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float,
    cuda_kernel: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    if _native(q):
        return _C.int8_attention_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask,
                                          is_causal, scale, cuda_kernel)
    if cuda_kernel != "auto":
        raise ValueError(f"cuda_kernel={cuda_kernel!r} needs CUDA tensors")
    dq, dk, dv = reference_int8.attention_backward(
        grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, grad_lse=grad_lse
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@int8_attention_backward.register_fake
def _int8_attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, attn_mask, is_causal,
                                  scale, cuda_kernel="auto"):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale = inputs[:6]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.is_causal, ctx.scale = is_causal, scale
    ctx.cuda_kernel = inputs[6] if len(inputs) > 6 else "auto"


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = int8_attention_backward(
        grad_out, grad_lse, q, k, v, out, lse, attn_mask, ctx.is_causal, ctx.scale,
        ctx.cuda_kernel,
    )
    return dq, dk, dv, None, None, None, None


int8_attention.register_autograd(_backward, setup_context=_setup_context)
