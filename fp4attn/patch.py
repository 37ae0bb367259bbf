"""Swap torch.nn.functional.scaled_dot_product_attention for fp4attn.sdpa, reversibly.

HuggingFace `attn_implementation="sdpa"` models and diffusers attention processors look the
function up on torch.nn.functional at call time, so they pick the swap up without changes.
"""

from __future__ import annotations

import contextlib
import functools

import torch.nn.functional as F

from .sdpa import sdpa

_saved = None  # the function that was in place when patch() swapped it out


@functools.wraps(sdpa)
def patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    """What torch.nn.functional.scaled_dot_product_attention is while patched."""
    return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa)


def is_patched() -> bool:
    return F.scaled_dot_product_attention is patched_sdpa


def patch() -> None:
    """Route torch.nn.functional.scaled_dot_product_attention through fp4attn (idempotent)."""
    global _saved
    if not is_patched():
        _saved = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = patched_sdpa


def unpatch() -> None:
    """Restore the exact function that patch() replaced (no-op when not patched)."""
    global _saved
    if is_patched():
        F.scaled_dot_product_attention = _saved
        _saved = None


@contextlib.contextmanager
def patched():
    """`with fp4attn.patched():` FP4 attention inside, the previous state restored on exit."""
    was_patched = is_patched()
    patch()
    try:
        yield
    finally:
        if not was_patched:
            unpatch()
