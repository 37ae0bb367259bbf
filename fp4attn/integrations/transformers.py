"""`attn_implementation="fp4attn"` (FP4) and `"fp4attn-int8"` (8-bit, trainable) for HuggingFace
transformers, and `FP4Cache`, a KV cache of 5-bit rotated keys and NVFP4 values (docs/SPEC.md
section 6).

register() adds an attention function and, under the same name, the SDPA mask function: without
a registered mask function transformers builds no causal mask for the new implementation.

    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fp4attn")
    model.generate(ids, past_key_values=FP4Cache(config=model.config), max_new_tokens=128)
    # the newer keyword (transformers 5.24 has it): model.generate(ids, cache=FP4Cache(...), ...)

With an FP4Cache, the prefill (the first update of a layer) runs the selected attention on the
full-precision states; every later step appends its tokens to the FP4 cache and decodes through
the fused kernel (`fp4attn.decode`): the layer's `update` returns the keys wrapped in
`FP4CacheKeys`, which the registered attention functions recognise. Until the keys' statistics
are fixed (SPEC 6: each sequence's first 128 tokens), those functions append the step's states
themselves, after `update`, since only they see the mask: a left-padded batch's pad tokens then
stay out of the statistics, and each sequence's cache is what it would be alone.

Any other attention implementation ("sdpa", "eager", ...) gets the whole cache dequantized from
`update` instead (correct, with a warning: every step then dequantizes the cache); one of your
own reads the cache as fp4attn's do if it calls `fp4cache_step` first and its name is given to
`register_cache_reader`. The dequantized cache takes
`FP4Cache(config=model.config)`, which tells the cache the model's implementation; without a
config the cache cannot know it, and FP4CacheKeys refuses every torch operation outside
fp4attn's attention functions with an error that says what to do: never a silent wrong answer.
"""

from __future__ import annotations

import operator
import warnings

import torch

from ..kv_cache import MAX_DECODE_QUERIES, FP4KVCache, decode
from ..policy import Policy, attention
from ..sdpa import ORIGINAL_SDPA

#: Largest number of new tokens per step that decodes through the kernel (speculative decoding);
#: longer chunks attend to the dequantized cache instead.
MAX_DECODE_TOKENS = MAX_DECODE_QUERIES

NAME = "fp4attn"
NAME_INT8 = "fp4attn-int8"
#: The attention implementations that read an FP4Cache through the decode kernel: fp4attn's and
#: those given to register_cache_reader.
FP4_IMPLEMENTATIONS = {NAME, NAME_INT8}

# Tensor metadata an attention implementation (or torch.compile's tracing, the methods on the
# second line) may read before it computes anything; every attribute read is let through too,
# a tensor it returns (.mT, .data) still marked.
_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.stride, torch.Tensor.is_contiguous,
             torch.Tensor._is_view, torch.Tensor.is_conj, torch.Tensor.is_neg,
             torch.Tensor.storage_offset}
# ... and while tracing only (the storage would let a tensor be rebuilt unmarked)
_TRACING_METADATA = {torch.Tensor.untyped_storage}


class FP4CacheKeys(torch.Tensor):
    """The keys an FP4Cache layer returns from an update for fp4attn's attention: the new tokens'
    keys, marked with the layer whose FP4 cache holds (or, once the attention appends them, will
    hold) every key (``.fp4_layer``). Only fp4attn's attention functions can attend with them:
    any other computation on them (another attention implementation) raises, since it would see
    only this step's keys, or keys not yet stored."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA or getattr(func, "__name__", None) == "__get__" or \
                (func in _TRACING_METADATA and torch.compiler.is_compiling()):
            out = torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
            if isinstance(out, torch.Tensor) and not isinstance(out, FP4CacheKeys):
                out = FP4CacheKeys.wrap(out, args[0].fp4_layer)  # .mT, .data: still marked
            return out
        raise RuntimeError(
            "FP4Cache: something other than fp4attn's attention computed with the keys an "
            "FP4Cache layer handed back (refused: "
            f"{getattr(func, '__name__', func)}); they are this step's keys only, marked for "
            "fp4attn's attention, which reads the rest from the FP4 cache. Either the model's "
            "attention implementation is not fp4attn's and the cache was made without the "
            f'model\'s config: load the model with attn_implementation="{NAME}" (or '
            f'"{NAME_INT8}") after fp4attn.integrations.transformers.register(), or create the '
            "cache as FP4Cache(config=model.config), which hands other implementations the whole "
            "cache dequantized; or the model uses cached keys outside its attention (layers that "
            "share another layer's keys, as Gemma 3n's do), which FP4Cache does not serve: use the "
            "model's own cache.")

    @staticmethod
    def wrap(key_states: torch.Tensor, layer) -> "FP4CacheKeys":
        t = torch.Tensor._make_subclass(FP4CacheKeys, key_states)
        t.fp4_layer = layer
        return t


def _window_mask(nq: int, L: int, window: int | None, device) -> torch.Tensor:
    """[nq, L] bool: the last nq positions, bottom-right causal, each seeing its last `window` keys."""
    mask = torch.ones(nq, L, dtype=torch.bool, device=device).tril(L - nq)
    if window is not None:
        mask &= ~torch.ones_like(mask).tril(L - nq - window)
    return mask


def _plain_window_start(attention_mask: torch.Tensor, nq: int, L: int,
                        window: int | None) -> list[int] | None:
    """Where a 4D mask (bool, True = attend) is the plain causal / sliding-window pattern for
    every sequence but for its left padding (leading keys no query sees): each sequence's first
    seen key, which the kernel takes as key_start; else None. transformers passes such masks to
    every layer of a left-padded batch, to sliding-window layers once the cache is longer than
    the window, and to every layer on steps of several tokens (speculative decoding). One
    comparison on the device (a host synchronisation) instead of attending to the whole
    dequantized cache; the answer is kept on the mask, which transformers passes to every layer
    of a type in a forward, so the step's other layers of that type reuse it."""
    if attention_mask.dim() != 4 or attention_mask.dtype != torch.bool or \
            attention_mask.shape[-2] != nq or attention_mask.shape[-1] < L:
        return None
    key = (nq, L, window)
    known = getattr(attention_mask, "_fp4attn_plain", None)
    if known is not None and known[0] == key:
        return known[1]
    mask = attention_mask[..., :L]
    start = _leading_hidden(mask)
    want = _window_mask(nq, L, window, mask.device) & \
        (torch.arange(L, device=mask.device)[None, :] >= start[:, None])[:, None, None, :]
    plain = start.tolist() if bool((mask == want).all()) else None
    attention_mask._fp4attn_plain = (key, plain)
    return plain


def _key_start_tensor(attention_mask: torch.Tensor, start: list[int], device) -> torch.Tensor:
    """`start` as the decode's int32 key_start on `device`, copied once per mask (every layer of a
    type in a forward gets the same mask) rather than once per layer."""
    known = getattr(attention_mask, "_fp4attn_key_start", None)
    if known is None or known[0] != start:
        known = (start, torch.tensor(start, dtype=torch.int32).to(device, non_blocking=True))
        attention_mask._fp4attn_key_start = known
    return known[1]


def attended(attention_mask: torch.Tensor) -> torch.Tensor:
    """A transformers attention mask (bool, True = attend, or additive) as bool, True = attend."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def _leading_hidden(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B or 1] int32: per sequence of a 4D mask (bool, True = attend, or additive), how many of
    its first keys no query sees (its left padding)."""
    hidden = (~attended(attention_mask)).all(dim=2).all(dim=1)  # [B or 1, L]
    return hidden.to(torch.int32).cumprod(dim=-1).sum(dim=-1)


def _leading_padding(attention_mask, batch: int) -> list[int] | None:
    """Per sequence, how many of its first keys no query of the step sees (its left padding, in
    a layer without a sliding window) from a 4D mask (bool, True = attend, or additive); None
    without one. Kept on the mask: transformers passes one mask to every layer of a forward."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    known = getattr(attention_mask, "_fp4attn_padding", None)
    if known is None:
        known = _leading_hidden(attention_mask).tolist()
        attention_mask._fp4attn_padding = known
    return known * batch if len(known) == 1 else list(known)


def _cached_attention(query, key: FP4CacheKeys, attention_mask, scaling):
    """Attention of this step's queries to everything in the layer's FP4 cache (to the last
    `sliding_window` keys of each query in a sliding-window layer)."""
    layer = key.fp4_layer
    layer.flush(attention_mask)  # this step's states, if the layer still holds them
    cache, window = layer.cache, layer.sliding_window
    nq = query.shape[2]
    if nq <= MAX_DECODE_TOKENS:
        start = None if attention_mask is None else \
            _plain_window_start(attention_mask, nq, len(cache), window)
        if attention_mask is None or start is not None:  # the kernel, the pads left unseen
            # only where the padding reaches past what the window hides from every query
            hidden = max(0, len(cache) - nq + 1 - window) if window is not None else 0
            if start is not None and max(start) <= hidden:
                start = None
            if start is not None:
                start = _key_start_tensor(attention_mask, start * (query.shape[0] // len(start)),
                                          query.device)
            return decode(query, cache, scale=scaling, window=window, key_start=start)
    # any other mask, or a long chunk: torch SDPA on the dequantized cache (the values the decode
    # kernel computes with, unquantized math like it), from position `start` on
    if layer.chunk_states is not None:  # a long chunk (see FP4Layer.update)
        k, v, start = layer.chunk_states
        layer.chunk_states = None  # used once: no full-precision copy kept past the step
    else:  # up to 16 queries: each one's own residual keys exact (and a few older ones for the
        # later queries)
        (k, v), start = cache.dequantize(position=len(cache) - nq), cache.start
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, start:start + k.shape[-2]]
    elif attention_mask is None:  # the last nq positions: bottom-right causal (and windowed); the
        # pattern depends on key - query - (L - nq) only, so the kept keys need no offset
        attention_mask = _window_mask(nq, k.shape[-2], window, query.device)
    return ORIGINAL_SDPA(query, k, v, attn_mask=attention_mask, scale=scaling,
                         enable_gqa=k.shape[1] != query.shape[1])


#: Keyword arguments of transformers' attention calls that change the scores or the softmax; the
#: kernels implement none of them, so a model that passes one gets an error, not an answer without
#: it (torch's "sdpa" drops softcap silently).
_UNSUPPORTED_KWARGS = {
    "position_bias": "a T5-style relative position bias",
    "softcap": "attention logit soft-capping (Gemma 2)",
    "s_aux": "attention sinks (gpt-oss)",
}


def fp4cache_step(query, key, value, attention_mask, scaling):
    """What an attention function that reads FP4Cache (fp4attn's, or one given to
    register_cache_reader) does first: ``(out, key, value)``. A decode step's FP4CacheKeys:
    ``out`` [B, N, Hq, D], the attention to the layer's whole FP4 cache. The prefill's (an empty
    layer): ``out`` None and the full-precision states to attend with, appended to the cache with
    the padding ``attention_mask`` shows. Any other key: ``(None, key, value)`` as given."""
    if not isinstance(key, FP4CacheKeys):
        return None, key, value
    layer = key.fp4_layer
    if not layer.holds_prefill():
        return _cached_attention(query, key, attention_mask, scaling).transpose(1, 2).contiguous(), \
            None, None
    key, value = layer.pending
    layer.flush(attention_mask)
    return None, key, value


def register_cache_reader(name: str) -> None:
    """Mark the attention implementation registered as ``name`` as one that reads FP4Cache itself
    (it calls fp4cache_step first): FP4Cache layers then hand it FP4CacheKeys, not the whole cache
    dequantized (what other implementations get)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be an attention implementation's name (a str), got {name!r}")
    FP4_IMPLEMENTATIONS.add(name)


def fp4attn_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                              scaling=None, is_causal=None, precision=None, **kwargs):
    """transformers attention function: q [B, Hq, N, D], k/v [B, Hkv, S, D] -> ([B, N, Hq, D], None).
    ``precision``: "fp4", "int8" or "bf16" (torch SDPA); None: the registered policy's precision
    for ``module.layer_idx`` (FP4 when register() got no policy)."""
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"fp4attn: {what} ({name}=) is not supported by its attention kernels; load this "
                f'model with attn_implementation="eager"')
    if kwargs.get("output_attentions"):  # as transformers' sdpa: the weights are never formed
        warnings.warn('fp4attn returns no attention weights (output_attentions=True gives None '
                      'per layer); load the model with attn_implementation="eager" for them',
                      stacklevel=2)
    out, key, value = fp4cache_step(query, key, value, attention_mask, scaling)
    if out is not None:
        return out, None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Same rule as transformers' sdpa integration: a causal flag only without an explicit mask and
    # outside single-token decoding (a single query attends to the whole cache).
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if precision is None:
        precision = _policy_precision(module)
    out = attention(precision, query, key, value, attn_mask=attention_mask,
                    dropout_p=dropout if module.training else 0.0, is_causal=is_causal,
                    scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def fp4attn_int8_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The same with the 8-bit attention (docs/SPEC_INT8.md), which trains: gradients flow to
    the projections."""
    kwargs.pop("precision", None)
    return fp4attn_attention_forward(module, query, key, value, attention_mask, precision="int8",
                                     **kwargs)


#: What attn_implementation="fp4attn" computes per layer (register(policy=...)); None: FP4.
_policy: Policy | None = None


def _policy_precision(module) -> str:
    if _policy is None:
        return "fp4"
    if _policy.is_uniform:
        return _policy.default
    _policy.check_fits(getattr(module, "config", None), by_layer_index=True)
    site = getattr(module, "layer_idx", None)
    if not isinstance(site, int):
        raise ValueError(
            f'attn_implementation="{NAME}" with a per-layer policy: the attention module '
            f"{type(module).__name__} has no integer layer_idx to look its precision up by; use "
            "fp4attn.patch(policy=..., model=...) (attention calls numbered per forward) instead")
    return _policy.precision(site)


def register(policy: Policy | None = None) -> None:
    """Register attn_implementation="fp4attn" and "fp4attn-int8" (idempotent). With `policy`,
    "fp4attn" computes each layer (the attention module's ``layer_idx``) in the precision the
    policy gives it; a later register() replaces it (without one: FP4 everywhere). The policy
    applies to every model that uses "fp4attn" in this process ("fp4attn-int8" is INT8 in every
    layer whatever it says); a per-layer policy refuses encoder-decoders and models with another
    layer count (Policy.check_fits). FP4Cache decode steps read the FP4 cache whatever the policy
    says (SPEC 6)."""
    global _policy
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be an fp4attn.Policy or None, got {type(policy).__name__}")
    _policy = policy
    AttentionInterface.register(NAME, fp4attn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    AttentionInterface.register(NAME_INT8, fp4attn_int8_attention_forward)
    AttentionMaskInterface.register(NAME_INT8, sdpa_mask)


_warned: set = set()


def _warn_once(impl: str) -> None:
    if impl not in _warned:
        _warned.add(impl)
        warnings.warn(
            f'FP4Cache with attn_implementation="{impl}": every step dequantizes the whole cache '
            f'for it. For the fused FP4 decode kernel, load the model with attn_implementation='
            f'"{NAME}" after fp4attn.integrations.transformers.register().', stacklevel=3)


#: Tokens an FP4Cache's sliding-window layers keep beyond their window for assisted generation's
#: crops (transformers drafts 20 candidates by default; a crop of rollback + 16 fits).
DEFAULT_ROLLBACK = 64


def _cache_classes():
    """FP4Layer and FP4Cache, built on the installed transformers' cache classes."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class FP4Layer(CacheLayerMixin):
        """A layer of an FP4Cache: an fp4attn.FP4KVCache that grows. With `sliding_window`, a
        sliding-window layer: each query attends to its last `sliding_window` keys (through the
        kernel when the mask transformers passes is the plain window pattern but for left
        padding),
        and the cache keeps only the tokens that can still be seen (a windowed FP4KVCache)."""

        is_croppable = True  # crop drops tokens (what differs from never appending them:
        # docs/limitations.md)

        def __init__(self, page_size: int | None = None, sliding_window: int | None = None,
                     attn_implementation=None, max_tokens: int | None = None,
                     rollback: int = DEFAULT_ROLLBACK):
            super().__init__()
            self.rollback = rollback if sliding_window is not None else 0
            self.max_tokens = max_tokens  # allocated at once, and the most it holds (None: grows)
            # () -> the model's attention implementation, or None where unknown (no config)
            self.attn_implementation = attn_implementation or (lambda: None)
            self.page_size = page_size
            self.sliding_window = sliding_window
            self.is_sliding = sliding_window is not None
            self.cache = None
            # a long chunk (more than MAX_DECODE_TOKENS new tokens after the prefill) attends to
            # (the kept tokens before it, dequantized with the newest 16 exact, + its own states)
            # and their first position: every query then has its newest 16 keys exact (the ring
            # holds the last 31 tokens only), and in a windowed layer the append may drop tokens
            # the chunk's first queries still see
            self.chunk_states = None
            # this step's (keys, values) while K's statistics are open: fp4attn's attention appends
            # them once it has the step's mask (flush), so that left padding stays out of them
            self.pending = None

        def _new_cache(self, B, H, D):
            return FP4KVCache(B, H, D, dtype=self.dtype, device=self.device,
                              page_size=self.page_size, max_tokens=self.max_tokens,
                              window=self.sliding_window, rollback=self.rollback)

        def lazy_initialization(self, key_states, value_states):
            B, H, _, D = key_states.shape
            self.dtype, self.device = key_states.dtype, key_states.device
            self.cache = self._new_cache(B, H, D)
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.flush()  # a step whose attention did not append its states
            first = len(self.cache) == 0
            self.chunk_states = None
            impl = self.attn_implementation()
            ours = impl is None or impl in FP4_IMPLEMENTATIONS  # None: unknown, assumed fp4attn's
            if not first and key_states.shape[2] > MAX_DECODE_TOKENS:
                k, v = self.cache.dequantize()
                self.chunk_states = (torch.cat([k, key_states], 2), torch.cat([v, value_states], 2),
                                     self.cache.start)
            if ours and self.sliding_window is None and not self.cache.statistics_fixed:
                self.pending = (key_states, value_states)  # appended by fp4attn's attention
                return FP4CacheKeys.wrap(key_states, self), value_states
            self.cache.append(key_states, value_states)  # any strides with a unit head-dim stride
            if first:  # prefill: the selected attention on the full-precision states
                return key_states, value_states
            if not ours:
                return self._dequantized(impl, key_states.shape[2])
            return FP4CacheKeys.wrap(key_states, self), value_states

        def holds_prefill(self) -> bool:
            """Whether the pending states are the prefill's (the cache holds nothing yet)."""
            return self.pending is not None and len(self.cache) == 0

        def flush(self, attention_mask=None) -> None:
            """Appends this step's pending states (if any), with the padding the step's mask shows
            (SPEC 6: it stays out of K's statistics)."""
            if self.pending is not None:
                (k, v), self.pending = self.pending, None
                self.cache.append(k, v, padding=_leading_padding(attention_mask, k.shape[0]))

        def _dequantized(self, impl, new_tokens: int):
            """For an attention implementation that is not fp4attn's: every key and value the
            cache holds, dequantized (what the kernel would read; the residual keys of this step's
            first query exact, which holds every query's own), at their positions (a
            sliding-window layer's dropped tokens as zeros, outside every window of transformers'
            mask; a long chunk's as for fp4attn's attention, see __init__)."""
            _warn_once(impl)
            if self.chunk_states is not None:
                k, v, start = self.chunk_states
                self.chunk_states = None
            else:
                k, v = self.cache.dequantize(position=len(self.cache) - new_tokens)
                start = self.cache.start
            if start:
                pad = k.new_zeros(*k.shape[:2], start, k.shape[3])
                k, v = torch.cat([pad, k], 2), torch.cat([pad, v], 2)
            return k, v

        def get_seq_length(self) -> int:
            if not self.is_initialized:
                return 0
            return len(self.cache) + (self.pending[0].shape[2] if self.pending is not None else 0)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            if self.is_initialized:
                self.cache = self._new_cache(self.cache.batch, self.cache.kv_heads,
                                             self.cache.head_dim)
                self.chunk_states = None
                self.pending = None

        def _select(self, indices) -> None:
            """Keeps the batch rows `indices` (FP4KVCache.select), this step's states too."""
            if not self.is_initialized:
                return
            self.flush()
            self.cache.select(indices)
            if self.chunk_states is not None:
                idx = torch.as_tensor(indices, device=self.device).long()
                k, v, start = self.chunk_states
                self.chunk_states = (k[idx], v[idx], start)

        def reorder_cache(self, beam_idx) -> None:  # beam search
            self._select(beam_idx)

        def batch_repeat_interleave(self, repeats) -> None:  # a batch expanded after the prefill
            if self.is_initialized:
                self._select(torch.arange(self.cache.batch, device=self.device)
                             .repeat_interleave(repeats))

        def batch_select_indices(self, indices) -> None:
            self._select(indices)

        def crop(self, tokens_to_remove: int) -> None:
            """Drops the newest ``-tokens_to_remove`` tokens (assisted and prompt-lookup
            generation's rejected candidates; FP4KVCache.crop); a positive value is the length
            to keep (transformers' older form), 0 keeps all."""
            try:  # an int, or (as assisted generation passes it) an integer 0-d tensor
                count = operator.index(tokens_to_remove)
            except TypeError:
                count = None
            if count is None or isinstance(tokens_to_remove, bool):
                raise ValueError(f"tokens_to_remove must be an int, got {tokens_to_remove!r}")
            if not self.is_initialized:
                return
            self.flush()
            self.chunk_states = None
            n = len(self.cache)
            keep = max(0, n + count) if count <= 0 else min(n, count)
            try:
                self.cache.crop(keep)
            except ValueError as e:  # a sliding-window layer's rollback was too short
                raise ValueError(f"FP4Cache: {e}; FP4Cache(..., rollback=N) keeps N tokens "
                                 f"beyond each sliding window (now {self.rollback})") from e

        # What transformers asks of a layer that the FP4 cache does not do: an error naming it
        # rather than the base class's AttributeError or a silent no-op on keys it does not have.
        def offload(self) -> None:
            raise NotImplementedError("FP4Cache: offloading layers to the CPU is not supported")

    class FP4Cache(Cache):
        """A transformers Cache whose layers store keys and values in SPEC 6's format (5-bit
        rotated keys, NVFP4 values) and decode through fp4attn's fused kernel (use with
        attn_implementation="fp4attn" or "fp4attn-int8"), the sliding-window layers with the
        config's `sliding_window`: those `config.layer_types` names, or every layer of a config
        with a `sliding_window` and no `layer_types` (Mistral, Phi-3), as transformers' own
        caches read it. `max_tokens`: the tokens per sequence each layer allocates for at once and
        the most it will hold (at least the prompt plus the new tokens; an append past it raises);
        without it each layer's pages double as they fill, up to twice what it holds.
        `rollback`: tokens each sliding-window layer keeps beyond its window, so that assisted
        generation can drop up to `rollback + 16` rejected candidates at once (full-attention
        layers drop any number). An encoder-decoder model takes `FP4Cache.encoder_decoder(config)`.
        """

        def __init__(self, config=None, page_size: int | None = None, max_tokens: int | None = None,
                     rollback: int = DEFAULT_ROLLBACK, *, _decoder_self_attention: bool = False):
            if getattr(config, "is_encoder_decoder", False) and not _decoder_self_attention:
                raise ValueError(
                    "FP4Cache: this is an encoder-decoder model's config, whose cross-attention "
                    "would append the encoder's keys to the cache as to any single cache (wrong "
                    "results, no error): use FP4Cache.encoder_decoder(config=model.config), an "
                    "EncoderDecoderCache with FP4Cache for the decoder's self-attention")
            if max_tokens is not None and (not isinstance(max_tokens, int) or
                                           isinstance(max_tokens, bool) or max_tokens < 1):
                raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
            if not isinstance(rollback, int) or isinstance(rollback, bool) or rollback < 0:
                raise ValueError(f"rollback must be an int >= 0, got {rollback!r}")
            if config is None:
                super().__init__(layer_class_to_replicate=lambda: FP4Layer(page_size,
                                                                           max_tokens=max_tokens))
                return
            text = config.get_text_config(decoder=True)
            window = getattr(text, "sliding_window", None)
            types = getattr(text, "layer_types", None) or \
                ["sliding_attention" if window is not None else "full_attention"] * text.num_hidden_layers
            other = sorted(set(types) - {"full_attention", "sliding_attention"})
            if other:  # chunked attention, linear-attention or state-space layers
                raise ValueError(f"FP4Cache serves full and sliding-window attention layers; this "
                                 f"model's config also has {other} layers: use its own cache")

            def implementation():  # read at every step: the model's may change after this
                return getattr(text, "_attn_implementation", None)

            super().__init__(layers=[FP4Layer(page_size, window if t == "sliding_attention" else
                                              None, implementation, max_tokens, rollback)
                                     for t in types])

        @classmethod
        def encoder_decoder(cls, config, page_size: int | None = None,
                            max_tokens: int | None = None):
            """An EncoderDecoderCache for an encoder-decoder model (BART, Whisper): an FP4Cache
            for the decoder's self-attention keys, a DynamicCache for the cross-attention's."""
            from transformers.cache_utils import DynamicCache, EncoderDecoderCache

            if not getattr(config, "is_encoder_decoder", False):
                raise ValueError("FP4Cache.encoder_decoder: config is not an encoder-decoder "
                                 "model's: use FP4Cache(config=...)")
            return EncoderDecoderCache(cls(config, page_size, max_tokens,
                                           _decoder_self_attention=True), DynamicCache())

    return FP4Layer, FP4Cache


def __getattr__(name):
    """FP4Cache / FP4Layer on first use (transformers is imported only then)."""
    if name in ("FP4Cache", "FP4Layer"):
        layer, cache = _cache_classes()
        globals().update(FP4Layer=layer, FP4Cache=cache)
        return globals()[name]
    raise AttributeError(name)
