"""`attn_implementation="fp4attn"` (FP4) and `"fp4attn-int8"` (8-bit, trainable) for HuggingFace
transformers.

register() adds an attention function and, under the same name, the SDPA mask function: without
a registered mask function transformers builds no causal mask for the new implementation.
"""

from __future__ import annotations

from ..sdpa import sdpa

NAME = "fp4attn"
NAME_INT8 = "fp4attn-int8"


def fp4attn_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                              scaling=None, is_causal=None, precision="fp4", **kwargs):
    """transformers attention function: q [B, Hq, N, D], k/v [B, Hkv, S, D] -> ([B, N, Hq, D], None)."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("fp4attn: position_bias (T5-style relative bias) is not supported")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Same rule as transformers' sdpa integration: a causal flag only without an explicit mask and
    # outside single-token decoding (a single query attends to the whole cache).
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = sdpa(query, key, value, attn_mask=attention_mask,
               dropout_p=dropout if module.training else 0.0, is_causal=is_causal, scale=scaling,
               enable_gqa=key.shape[1] != query.shape[1], precision=precision)
    return out.transpose(1, 2).contiguous(), None


def fp4attn_int8_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The same with the 8-bit attention (docs/SPEC_INT8.md), which trains: gradients flow to
    the projections."""
    kwargs.pop("precision", None)
    return fp4attn_attention_forward(module, query, key, value, attention_mask, precision="int8",
                                     **kwargs)


def register() -> None:
    """Register attn_implementation="fp4attn" and "fp4attn-int8" (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, fp4attn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    AttentionInterface.register(NAME_INT8, fp4attn_int8_attention_forward)
    AttentionMaskInterface.register(NAME_INT8, sdpa_mask)
