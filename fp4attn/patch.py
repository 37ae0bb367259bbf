"""Swap torch.nn.functional.scaled_dot_product_attention for fp4attn.sdpa, reversibly.

HuggingFace `attn_implementation="sdpa"` models and diffusers attention processors look the
function up on torch.nn.functional at call time, so they pick the swap up without changes.

With a per-layer fp4attn.Policy, a call's site is its position among the attention calls of one
forward of `model`: a forward pre-hook on `model` restarts the count, so every forward (each
step of generation included) numbers its calls 0, 1, ... as transformers numbers its layers.
Calls during the backward pass (activation checkpointing) have no such number: an error.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .policy import Policy, attention
from .sdpa import ORIGINAL_SDPA, PRECISIONS, sdpa

_saved = None  # the function patch() swapped out; None once unpatch() ran
_precision = "fp4"  # what patched_sdpa computes without a policy
_policy: Policy | None = None  # with one: the precision per call site
_model = None  # the module whose forward numbers the calls for the policy
_hook = None  # the forward hooks on _model: the pre-hook restarts the call count, the other checks it
_calls = 0  # attention calls so far in the current forward of that model
_inside = False  # whether a forward of that model is running (its hooks set and clear it)


def patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    """What torch.nn.functional.scaled_dot_product_attention is while patched."""
    global _calls
    kw = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
              enable_gqa=enable_gqa)
    if _saved is None:  # unpatched, but reached through a wrapper installed over it meanwhile
        return ORIGINAL_SDPA(query, key, value, **kw)
    if _policy is None:
        return sdpa(query, key, value, precision=_precision, **kw)
    site = None
    if _hook is not None:
        # in a backward (checkpointing recomputes in Python; a compiled graph's recompute does
        # not come back here, and tracing cannot call this)
        if not _policy.is_uniform and not torch.compiler.is_compiling() and \
                torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                "fp4attn.patch: an attention call during the backward pass (activation "
                "checkpointing recomputing a layer) has no site in the per-layer policy, whose "
                "sites count the calls of one forward of model; with transformers use "
                'attn_implementation="fp4attn" after fp4attn.integrations.transformers.'
                "register(policy=...) (sites from the layers' layer_idx), or patch with one "
                "precision")
        if not _policy.is_uniform and not _inside:
            raise RuntimeError(
                "fp4attn.patch: an attention call outside a forward of the policy's model (its "
                "sites count the calls of model(...); model.forward(...) called directly, or "
                "another module, skips the count's restart): call the model itself, or patch "
                "with model= the module that runs")
        site, _calls = _calls, _calls + 1
    return attention(_policy.precision(site), query, key, value, **kw)


def _restart_count(*_):
    global _calls, _inside
    _calls, _inside = 0, True


def _forward_ended(*_):
    global _inside
    _inside = False


def _check_count(*_):
    """After a forward of the policy's model: fewer attention calls than the policy's sites
    means the policy was made for another model (more raise at the call past the last site)."""
    n = _policy.num_layers if _policy is not None else None
    if n is not None and 0 < _calls < n:
        raise ValueError(f"fp4attn.patch: this forward made {_calls} attention calls, the policy "
                         f"has num_layers={n} sites: it was made for another model")
    layers = getattr(getattr(_model, "config", None), "num_hidden_layers", None)
    if n is None and _policy is not None and not _policy.is_uniform and isinstance(layers, int) \
            and _calls > layers:  # a per-layer policy without a size
        raise ValueError(f"fp4attn.patch: this forward made {_calls} attention calls for "
                         f"{layers} layers (config.num_hidden_layers): the calls are not one per "
                         "layer, so the policy's sites are not the layers")


def is_patched() -> bool:
    """Whether fp4attn's patch is in force: torch's SDPA is it, or something installed over it
    since (a profiler's or tracer's wrapper, which calls it); not where the function it replaced
    was put back (patch() then installs it again)."""
    f = F.scaled_dot_product_attention
    return f is patched_sdpa or (_saved is not None and f is not _saved)


def current() -> tuple[str | None, Policy | None]:
    """(precision, policy) in force while patched: one of them is None."""
    return (None, _policy) if _policy is not None else (_precision, None)


def patch(precision: str | None = None, *, policy: Policy | None = None, model=None) -> None:
    """Route torch.nn.functional.scaled_dot_product_attention through fp4attn: every call in
    `precision` ("fp4", the default, or "int8"), or each call in the precision `policy` gives
    its site (a per-layer policy needs `model`, the module whose forward numbers the calls).
    Idempotent; a second call replaces the first one's settings. Process-wide, like the torch
    function it replaces: every thread's calls take it, and patch / patched / unpatch from
    concurrent threads interfere (as does a per-layer policy's call count, one per process)."""
    global _saved
    if policy is not None:
        if precision is not None:
            raise ValueError("patch: pass precision or policy, not both")
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an fp4attn.Policy, got {type(policy).__name__}")
        if model is None and not policy.is_uniform:
            raise ValueError("patch: a per-layer policy needs model= (the module whose forward "
                             "numbers the attention calls: call i of a forward is site i)")
        if model is not None and not callable(getattr(model, "register_forward_pre_hook", None)):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if model is not None:
            policy.check_fits(getattr(model, "config", None))  # sites: the calls of one forward
    elif model is not None:
        raise ValueError("patch: model= only goes with policy= (it numbers the call sites)")
    else:
        precision = "fp4" if precision is None else precision
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    _set(precision or "fp4", policy, model)
    if not is_patched():  # (a wrapper installed over the patch stays: it calls the patch)
        _saved = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = patched_sdpa


def _set(precision: str, policy: Policy | None, model) -> None:
    global _precision, _policy, _model, _hook, _calls, _inside
    if _hook is not None:
        for h in _hook:
            h.remove()
        _hook = None
    _precision, _policy, _model, _calls, _inside = precision, policy, model, 0, False
    if model is not None:  # (the last hook runs after the check, and after an exception too)
        _hook = (model.register_forward_pre_hook(_restart_count),
                 model.register_forward_hook(_check_count),
                 model.register_forward_hook(_forward_ended, always_call=True))


def unpatch() -> None:
    """Restore the exact function that patch() replaced (no-op when not patched). A wrapper that
    something installed over the patch meanwhile stays, and reaches torch's own SDPA through it."""
    global _saved
    _set("fp4", None, None)
    if F.scaled_dot_product_attention is patched_sdpa:
        F.scaled_dot_product_attention = ORIGINAL_SDPA if _saved is None else _saved
    _saved = None


@contextlib.contextmanager
def patched(precision: str | None = None, *, policy: Policy | None = None, model=None):
    """`with fp4attn.patched():` low-bit attention inside, the previous state restored on exit
    (same arguments as patch): the settings, torch's function and what unpatch() restores."""
    global _saved
    function, saved, previous = F.scaled_dot_product_attention, _saved, (_precision, _policy, _model)
    patch(precision, policy=policy, model=model)
    try:
        yield
    finally:
        _set(*previous)
        F.scaled_dot_product_attention, _saved = function, saved

