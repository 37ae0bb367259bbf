"""The torch SDPA-compatible front end: argument handling, dispatch, explicit fallbacks.

fp4attn.sdpa mirrors torch.nn.functional.scaled_dot_product_attention argument for argument.
What it does not compute in FP4 (dropout, inputs that need a gradient, dtypes or devices without
a backend, value head dim != query head dim, head dim > 256, empty key sequences) goes to the
original torch function captured at import time, with a warning naming the reason once per
reason; strict mode (keyword `strict=True` or FP4ATTN_STRICT=1) raises FP4AttnFallbackError
instead. Inputs are never modified.
"""

from __future__ import annotations

import math
import os
import warnings
from itertools import pairwise

import torch

from ._ops import HAS_CUDA_BACKEND, ops
from .int8 import int8_attention

try:  # torch's causal_upper_left / causal_lower_right masks (a tensor subclass without values)
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:  # pragma: no cover - older torch
    CausalBias = CausalVariant = None

# The overload itself: calling through the OpOverloadPacket adds a lookup per call.
_fp4_attention = ops.attention.default

# Captured before anyone (fp4attn.patch included) can replace it.
ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention

# The CUDA kernel requests by their C API names (fp4attn_kernel_name in fp4attn.h): "auto" lets the
# dispatch choose; the others force one kernel family (an error where it cannot run). "decode" is
# the fused split-KV kernel for few query rows, which "auto" picks for decode shapes.
KERNELS = ("auto", "sm80", "sm90", "sm120", "decode")
# The numerics: "fp4" (docs/SPEC.md, inference) or "int8" (docs/SPEC_INT8.md, with a backward).
PRECISIONS = ("fp4", "int8")
_warned: set[str] = set()


class FP4AttnFallbackError(RuntimeError):
    """Raised in strict mode when fp4attn would fall back to torch's own SDPA."""


def _strict_default() -> bool:
    return os.environ.get("FP4ATTN_STRICT", "0").lower() in ("1", "true", "yes")


def _kernel_from_env() -> str:
    name = os.environ.get("FP4ATTN_KERNEL", "auto").lower()
    if name not in KERNELS:
        raise ValueError(f"FP4ATTN_KERNEL must be one of {list(KERNELS)}, got {name!r}")
    return name


def _fallback_reason(query, key, value, attn_mask, dropout_p, precision) -> str | None:
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (fp4attn has no dropout)"
    if precision == "fp4" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_mask)
    ):
        return "an input requires grad (the FP4 attention has no backward: use precision='int8')"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype} (supported: float16, bfloat16, float32)"
    dev = query.device.type
    if dev == "cuda" and not HAS_CUDA_BACKEND:
        return "CUDA tensors, but this fp4attn build has no CUDA backend"
    if dev not in ("cpu", "cuda"):
        return f"device {query.device} (supported: cpu, cuda)"
    if value.shape[-1] != query.shape[-1]:
        return f"value head dim {value.shape[-1]} != query head dim {query.shape[-1]}"
    if query.shape[-1] > 256:
        return f"head dim {query.shape[-1]} > 256"
    if query.shape[-1] == 0:
        return "head dim 0"
    if key.shape[-2] == 0:
        return "empty key sequence"
    return None


def _autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast gives t as an argument of torch's SDPA (a lower-precision op): the
    autocast dtype for floating-point tensors but float64 ones, else t's own."""
    if t.is_floating_point() and t.dtype != torch.float64 and \
            torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def _autocast(*tensors):
    """The tensor arguments as autocast casts them (the others as they are)."""
    return tuple(t.to(_autocast_dtype(t)) if isinstance(t, torch.Tensor) else t for t in tensors)


def _from_causal_bias(bias, query, key, is_causal):
    """(attn_mask, is_causal) for torch's CausalBias: its tensor holds no mask values (it is
    uninitialized memory), only the variant and the lengths it was made for."""
    if is_causal:
        raise ValueError("attn_mask and is_causal=True cannot be used together (as in torch SDPA)")
    L, S = query.shape[-2], key.shape[-2]
    if (bias.seq_len_q, bias.seq_len_kv) != (L, S):
        raise ValueError(f"attn_mask is a CausalBias for {bias.seq_len_q} queries and "
                         f"{bias.seq_len_kv} keys, but the call has {L} and {S}")
    if bias.variant == CausalVariant.UPPER_LEFT or (bias.variant == CausalVariant.LOWER_RIGHT and
                                                    L == S):
        return None, True
    if bias.variant == CausalVariant.LOWER_RIGHT:  # the queries are the last L positions
        return torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L), False
    raise ValueError(f"attn_mask: CausalBias variant {bias.variant} is not supported")


def _check_args(query, key, value, attn_mask, is_causal, enable_gqa) -> None:
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):  # as torch SDPA: "False" must not mean True
            raise TypeError(f"{name} must be bool, got {type(flag).__name__}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dims (..., heads?, seq, head_dim), got shape {tuple(t.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"key and value must agree except in the last dim, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key head dim {key.shape[-1]} must equal query head dim {query.shape[-1]}")
    if query.shape[:-3] != key.shape[:-3] or query.dim() != key.dim():
        raise ValueError(f"query and key batch dims must match, got {tuple(query.shape)} and {tuple(key.shape)}")
    hq, hkv = query.shape[-3], key.shape[-3]  # heads (3-D inputs too, as torch SDPA reads them)
    if hq != hkv:
        if not enable_gqa:
            raise ValueError(f"query has {hq} heads but key/value have {hkv}: pass enable_gqa=True for GQA/MQA")
        if hq % hkv != 0:
            raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if attn_mask is not None:
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot be used together (as in torch SDPA)")
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        if attn_mask.device != query.device:  # (a meta mask would dispatch to the fake kernel)
            raise ValueError(f"attn_mask must be on the device of query ({query.device}), got "
                             f"{attn_mask.device}")
        target = (*query.shape[:-1], key.shape[-2])
        try:  # broadcastable *to* the scores: no dims beyond theirs, none that widen them
            broadcastable = torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
        except RuntimeError:
            broadcastable = False
        if not broadcastable:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable to {target}")


_FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FAST_DEVICES = ("cpu", "cuda") if HAS_CUDA_BACKEND else ("cpu",)


def _plain_call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, precision) -> bool:
    """The common call, decided in a few cheap tests: plain 4-D tensors of one dtype and device
    that the low-bit path runs, no mask, no dropout. True implies that _check_args passes and
    that _fallback_reason finds nothing, so a call that is true skips both (they cost ~10 us of
    Python per call, which short calls feel); anything else goes through them."""
    if attn_mask is not None or dropout_p != 0.0 or type(is_causal) is not bool or \
            type(enable_gqa) is not bool or type(query) is not torch.Tensor or \
            type(key) is not torch.Tensor or type(value) is not torch.Tensor:
        return False
    qs, ks = query.shape, key.shape
    if len(qs) != 4 or ks != value.shape or len(ks) != 4 or qs[0] != ks[0] or qs[3] != ks[3] \
            or not 0 < qs[3] <= 256 or ks[2] == 0:
        return False
    if qs[1] != ks[1] and not (enable_gqa and ks[1] > 0 and qs[1] % ks[1] == 0):
        return False
    dtype, device = query.dtype, query.device
    if dtype not in _FAST_DTYPES or key.dtype != dtype or value.dtype != dtype or \
            device.type not in _FAST_DEVICES or key.device != device or value.device != device:
        return False
    return precision != "fp4" or not (torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad))


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False, *, precision="fp4", return_lse=False, strict=None):
    """Low-bit scaled dot-product attention with the torch SDPA contract.

    Same arguments and layout as torch.nn.functional.scaled_dot_product_attention
    (query [..., Hq, L, E], key/value [..., Hkv, S, E]). precision="fp4" computes docs/SPEC.md
    (NVFP4, inference); precision="int8" computes docs/SPEC_INT8.md, whose backward gives
    query, key and value their gradients. With return_lse=True it returns (out, lse) with lse
    float32 [..., Hq, L], natural log of the scaled scores. A call it cannot compute in low bits
    goes to torch's SDPA with a one-time warning, or raises FP4AttnFallbackError with strict (or
    FP4ATTN_STRICT=1) and with return_lse=True. Jagged nested tensors (variable-length
    sequences, [B, H, j, E]) run as one call per sequence (docs/usage.md).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if CausalBias is not None and isinstance(attn_mask, CausalBias) and \
            isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor):
        attn_mask, is_causal = _from_causal_bias(attn_mask, query, key, is_causal)
    if getattr(query, "is_nested", False) or getattr(key, "is_nested", False) or \
            getattr(value, "is_nested", False):
        return _sdpa_jagged(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            precision, return_lse, strict)
    if isinstance(query, torch.Tensor) and query.device.type in ("cpu", "cuda") and \
            torch.is_autocast_enabled(query.device.type):  # (autocast knows no "meta" device)
        query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    if _plain_call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, precision):
        reason = None
    else:
        _check_args(query, key, value, attn_mask, is_causal, enable_gqa)
        if precision == "int8" and attn_mask is not None and attn_mask.requires_grad:
            raise ValueError("attn_mask must not require grad with precision='int8': it gets no "
                             "gradient")
        reason = _fallback_reason(query, key, value, attn_mask, dropout_p, precision)
    if reason is not None:
        strict = _strict_default() if strict is None else bool(strict)
        if strict:
            raise FP4AttnFallbackError(
                f"fp4attn cannot compute this call in {precision.upper()}: {reason}")
        if return_lse:
            raise FP4AttnFallbackError(
                f"return_lse=True needs the {precision.upper()} path, which cannot run: {reason}")
        # (not while dynamo traces, torch.compile or strict export: a warning breaks fullgraph;
        # eager calls and non-strict torch.export, plain Python, still warn)
        if reason not in _warned and not torch.compiler.is_dynamo_compiling():
            _warned.add(reason)
            warnings.warn(f"fp4attn: falling back to torch SDPA: {reason}", stacklevel=2)
        kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, scale=scale, **kwargs)

    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    # The ops take [B, H, N, D]: collapse other leading dims to one batch dim (views, no copies).
    # 4-D inputs, the common case, pass as they are (a reshape costs microseconds per call).
    four_d = query.dim() == 4
    lead = query.shape[:-3]
    q4, k4, v4, mask = query, key, value, attn_mask
    if not four_d:
        q4 = query.reshape(-1, *query.shape[-3:])
        k4 = key.reshape(-1, *key.shape[-3:])
        v4 = value.reshape(-1, *value.shape[-3:])
        if mask is not None and mask.dim() > 3:  # it has a dim on the leading ones: broadcast it
            mask = mask.expand(*query.shape[:-1], key.shape[-2]).reshape(
                -1, *query.shape[-3:-1], key.shape[-2])
    if precision == "int8":
        out, lse = int8_attention(q4, k4, v4, mask, bool(is_causal), scale, _kernel_from_env())
    else:
        out, lse = _fp4_attention(q4, k4, v4, mask, bool(is_causal), scale, bool(return_lse),
                                  _kernel_from_env())
    if not four_d:  # back to the caller's leading dims (3-D inputs: drop the batch of one)
        out = out.reshape(*lead, *out.shape[1:]) if lead else out[0]
        if return_lse:
            lse = lse.reshape(*lead, *lse.shape[1:]) if lead else lse[0]
    return (out, lse) if return_lse else out


def _sequences(t: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    """The [1, H, n_i, D] views of a jagged [B, H, j, D] tensor's sequences."""
    values = t.values()  # [H, total, D]: the ragged dim is values' dim 1
    return [values[None, :, a:b] for a, b in pairwise(offsets)]


def _sequence_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, precision,
                   return_lse, strict, dtype):
    """(out, lse or None) of one sequence of a variable-length batch ([1, H, n, E] views): sdpa,
    or, without keys (or queries), what rows that see none give (0, lse -inf) rather than a
    fallback. dtype: the outputs' (as the batch's calls give it)."""
    if k.shape[2] == 0 or q.shape[2] == 0:
        return (q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype),
                q.new_full(q.shape[:-1], -math.inf, dtype=torch.float32) if return_lse else None)
    out = sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, precision=precision,
               return_lse=return_lse, strict=strict)
    return out if return_lse else (out, None)


def _sdpa_jagged(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, precision,
                 return_lse, strict):
    """sdpa on nested tensors of torch.jagged layout (variable-length sequences, torch SDPA's
    form: a jagged [B, j, H, D] tensor transposed to [B, H, j, D]): each sequence as its own
    call, so the result is bit for bit the per-sequence calls' (quantization blocks never span two
    sequences, is_causal is top-left per sequence). The output (and lse) is jagged with query's
    offsets. One call per sequence, with the offsets read on the host."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or not t.is_nested:
            raise ValueError(f"query, key and value must all be nested tensors or none: {name} "
                             f"is not")
        if t.layout != torch.jagged:
            raise ValueError(f"{name}: nested tensors of layout {t.layout} are not supported "
                             f"(fp4attn takes layout=torch.jagged, as torch SDPA does)")
        if t.dim() != 4 or t._ragged_idx != 2:
            raise ValueError(f"{name} must be a jagged [batch, heads, seq, head_dim] tensor (a "
                             f"[batch, seq, heads, head_dim] one transposed: ragged dim 2), got "
                             f"shape {tuple(t.shape)} with ragged dim {t._ragged_idx}")
        if t.lengths() is not None:
            raise ValueError(f"{name}: jagged tensors with holes (lengths as well as offsets, "
                             f"e.g. from narrow) are not supported: pass a contiguous one")
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported with nested (jagged) query, key and value "
                         "(neither does torch SDPA support it there); is_causal is")
    batch = query.shape[0]
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(f"query, key and value must hold one batch of sequences, got "
                         f"{query.shape[0]}, {key.shape[0]} and {value.shape[0]}")
    if value.offsets() is not key.offsets() and not torch.equal(value.offsets(), key.offsets()):
        raise ValueError("key and value must have the same sequence lengths (offsets)")
    q_offsets, kv_offsets = query.offsets().tolist(), key.offsets().tolist()
    values = query.values()
    dtype = _autocast_dtype(values)  # of the outputs, as the calls give it
    outs = [values.new_empty((values.shape[0], 0, value.shape[-1]), dtype=dtype)]  # (B = 0)
    lses = [values.new_empty((values.shape[0], 0), dtype=torch.float32)]
    for q, k, v in zip(_sequences(query, q_offsets), _sequences(key, kv_offsets),
                       _sequences(value, kv_offsets)):
        out, lse = _sequence_call(q, k, v, None, dropout_p, is_causal, scale, enable_gqa,
                                  precision, return_lse, strict, dtype)
        outs.append(out[0])
        lses.append(None if lse is None else lse[0])
    out = torch.nested.nested_tensor_from_jagged(torch.cat(outs, dim=1), query.offsets(),
                                                 jagged_dim=2)
    if not return_lse:
        return out
    return out, torch.nested.nested_tensor_from_jagged(torch.cat(lses, dim=1), query.offsets(),
                                                       jagged_dim=2)
