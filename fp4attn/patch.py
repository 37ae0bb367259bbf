"""Swap torch.nn.functional.scaled_dot_product_attention for fp4attn.sdpa, reversibly.

HuggingFace `attn_implementation="sdpa"` models and diffusers attention processors look the
function up on torch.nn.functional at call time, so they pick the swap up without changes.
"""

from __future__ import annotations

import contextlib
import functools

import torch.nn.functional as F

from .sdpa import PRECISIONS, sdpa

_saved = None  # the function that was in place when patch() swapped it out
_precision = "fp4"  # what patched_sdpa computes


@functools.wraps(sdpa)
def patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    """What torch.nn.functional.scaled_dot_product_attention is while patched."""
    return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa, precision=_precision)


def is_patched() -> bool:
    return F.scaled_dot_product_attention is patched_sdpa


def patch(precision: str = "fp4") -> None:
    """Route torch.nn.functional.scaled_dot_product_attention through fp4attn in `precision`
    ("fp4" or "int8"; idempotent, a second call changes the precision)."""
    global _saved, _precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    _precision = precision
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
def patched(precision: str = "fp4"):
    """`with fp4attn.patched():` low-bit attention inside, the previous state restored on exit."""
    was_patched, previous = is_patched(), _precision
    patch(precision)
    try:
        yield
    finally:
        if was_patched:
            patch(previous)
        else:
            unpatch()
