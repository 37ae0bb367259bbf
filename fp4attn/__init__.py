"""fp4attn: low-bit attention for PyTorch, SageAttention3 numerics.

    fp4attn.sdpa(q, k, v, ...)        drop-in for torch.nn.functional.scaled_dot_product_attention:
                                      precision="fp4" (NVFP4, inference) or "int8" (trainable)
    fp4attn.varlen_attn(q, k, v, cu_seq_q, cu_seq_k, ...)   packed variable-length sequences,
                                      torch.nn.attention.varlen.varlen_attn's interface
    fp4attn.patch() / unpatch() / patched()   swap it into existing models
    fp4attn.Policy, calibrate         per-layer precision (fp4 / int8 / bf16), and finding one
                                      that keeps a model within an accuracy budget
    fp4attn.quantize / dequantize / fp4mm     the NVFP4 quantizer and block-scaled FP4 matmul
    fp4attn.FP4KVCache, decode, decode_paged  the FP4 KV cache and decode attention on it
    fp4attn.reference                 pure-PyTorch implementation of docs/SPEC.md (the oracle)
    fp4attn.reference_int8            the same for docs/SPEC_INT8.md, forward and backward
"""

from ._ops import build_info
from .kv_cache import FP4KVCache, decode, decode_paged
from .calibration import calibrate
from .patch import is_patched, patch, patched, unpatch
from .policy import Policy
from .sdpa import FP4AttnFallbackError, sdpa
from .tensor import NVFP4Tensor, dequantize, fp4mm, quantize, swizzle_scales
from .varlen import varlen_attn

__version__ = "0.2.0.dev0"

__all__ = [
    "FP4AttnFallbackError",
    "FP4KVCache",
    "NVFP4Tensor",
    "Policy",
    "build_info",
    "calibrate",
    "decode",
    "decode_paged",
    "dequantize",
    "fp4mm",
    "is_patched",
    "patch",
    "patched",
    "quantize",
    "sdpa",
    "swizzle_scales",
    "unpatch",
    "varlen_attn",
]
