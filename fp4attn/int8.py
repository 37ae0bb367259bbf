"""The 8-bit trainable attention ops (docs/SPEC_INT8.md): forward and backward, registered with their
CPU and CUDA kernels and their autograd in C++ (csrc/torch_bindings.cpp, no Python on the call
path); this module adds the fake kernels and the reference kernels for other devices.

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
other devices (and CUDA tensors on a build without CUDA) run the PyTorch implementation of the
spec (fp4attn.reference_int8): correct, not fast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _ops  # (loads fp4attn._C, which defines the ops)
from . import reference_int8

int8_attention = torch.ops.fp4attn.int8_attention.default


@_ops.register_fake("int8_attention")
def _int8_attention_fake(q, k, v, attn_mask, is_causal, scale, cuda_kernel="auto"):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@_ops.register_fake("int8_attention_backward")
def _int8_attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, attn_mask, is_causal,
                                  scale, cuda_kernel="auto"):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _refuse_kernel_request(cuda_kernel: str) -> None:
    """As the C++ kernels refuse it on CPU tensors."""
    if cuda_kernel != "auto":
        raise RuntimeError(f"cuda_kernel '{cuda_kernel}' needs CUDA tensors")


def _reference_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                       scale: float, cuda_kernel: str = "auto") -> tuple[Tensor, Tensor]:
    _refuse_kernel_request(cuda_kernel)
    out, lse = reference_int8.attention_forward(q, k, v, attn_mask, is_causal, scale)
    return out.to(q.dtype), lse


def _reference_backward(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                        out: Tensor, lse: Tensor, attn_mask: Tensor | None, is_causal: bool,
                        scale: float, cuda_kernel: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    _refuse_kernel_request(cuda_kernel)
    dq, dk, dv = reference_int8.attention_backward(
        grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, grad_lse=grad_lse
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# Every backend without a kernel of its own (the C++ CPU and CUDA kernels take precedence); the
# C++ autograd kernel sits above it, so the reference path is trainable too.
_reference_lib = torch.library.Library("fp4attn", "IMPL")
_reference_lib.impl("int8_attention", _reference_forward, "CompositeExplicitAutograd")
_reference_lib.impl("int8_attention_backward", _reference_backward, "CompositeExplicitAutograd")
