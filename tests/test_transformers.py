"""The patch and attn_implementation="fp4attn" on a tiny randomly initialised Llama (no download)."""

import importlib
import warnings

import pytest
import torch

import fp4attn

patch_module = importlib.import_module("fp4attn.patch")  # the module, not the function

transformers = pytest.importorskip("transformers")


def tiny_llama(attn_implementation):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = attn_implementation  # same weights, other attention
    return model.eval()


@pytest.fixture
def ids():
    return torch.randint(0, 256, (2, 150))


def count_calls(monkeypatch):
    calls = []
    original = patch_module.sdpa

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(patch_module, "sdpa", counting)
    return calls


def test_patch_routes_llama_attention_through_fp4attn(ids, monkeypatch):
    model = tiny_llama("sdpa")
    with torch.no_grad():
        exact = model(ids).logits
        calls = count_calls(monkeypatch)
        with fp4attn.patched():
            fp4 = model(ids).logits
    assert len(calls) == 2  # one call per layer
    assert not torch.equal(fp4, exact)
    cos = torch.nn.functional.cosine_similarity(fp4.flatten(), exact.flatten(), dim=0)
    assert cos > 0.995, cos


def test_attn_implementation_fp4attn_with_padding_mask(ids):
    from fp4attn.integrations import transformers as integration

    integration.register()
    exact_model = tiny_llama("sdpa")
    fp4_model = tiny_llama("fp4attn")
    mask = torch.ones_like(ids)
    mask[1, :20] = 0  # left padding in the second sequence
    with torch.no_grad():
        exact = exact_model(ids, attention_mask=mask).logits
        fp4 = fp4_model(ids, attention_mask=mask).logits
    keep = mask.bool()
    cos = torch.nn.functional.cosine_similarity(fp4[keep].flatten(), exact[keep].flatten(), dim=0)
    assert cos > 0.995, cos
    assert torch.isfinite(fp4).all()


def test_generate_with_kv_cache(ids):
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    with torch.no_grad():
        out = model.generate(ids[:1, :30], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 35)


def test_attn_implementation_fp4attn_int8_trains_with_padding(ids):
    """attn_implementation="fp4attn-int8": gradients reach the projections (no fallback), with a
    padding mask, and the loss is close to SDPA's."""
    import warnings

    from fp4attn.integrations import transformers as integration

    integration.register()
    exact_model = tiny_llama("sdpa").train()
    int8_model = tiny_llama("fp4attn-int8").train()
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    labels = ids.masked_fill(mask == 0, -100)
    exact = exact_model(ids, attention_mask=mask, labels=labels).loss
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to torch SDPA would warn
        loss = int8_model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    q_proj = int8_model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.grad is not None and torch.isfinite(q_proj.grad).all()
    assert abs(loss.item() - exact.item()) < 1e-2 * abs(exact.item())


def cache_keyword(model) -> str:
    """generate's cache argument: `cache` in newer transformers, `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def test_fp4cache_generate_decodes_through_the_fp4_cache(ids, monkeypatch):
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    decodes = []
    original = integration.decode

    def counting(q, cache, **kwargs):
        decodes.append(q.shape)
        return original(q, cache, **kwargs)

    monkeypatch.setattr(integration, "decode", counting)
    cache = integration.FP4Cache(config=model.config)
    with torch.no_grad():  # the newer `cache=` keyword where this transformers has it (5.24 does)
        out = model.generate(ids[:1, :40], max_new_tokens=6, do_sample=False,
                             **{cache_keyword(model): cache})
    assert out.shape == (1, 46)
    assert len(decodes) == 2 * 5  # every step after the prefill, in both layers, through the kernel
    layer = cache.layers[0]
    assert type(layer).__name__ == "FP4Layer" and len(layer.cache) == 45
    assert cache.get_seq_length() == 45


def step_against_the_dequantized_cache(model, prompt, nxt) -> float:
    """Cosine similarity of the logits of the step `nxt` after `prompt` with an FP4Cache, and of
    the same step with torch SDPA on an ordinary cache holding the FP4 cache's dequantized prompt."""
    from fp4attn.integrations import transformers as integration

    fp4 = integration.FP4Cache(config=model.config)
    n = prompt.shape[1]
    with torch.no_grad():
        kw = cache_keyword(model)
        model(prompt, **{kw: fp4})
        got = model(nxt, **{kw: fp4}).logits
        ref_cache = transformers.DynamicCache()
        for i, layer in enumerate(fp4.layers):  # the prompt's tokens, as the FP4 cache stores them
            k, v = layer.cache.dequantize(torch.float32)
            ref_cache.update(k[:, :, :n], v[:, :, :n], i)
        model.config._attn_implementation = "sdpa"
        want = model(nxt, **{kw: ref_cache}).logits
    return torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()


def test_fp4cache_step_matches_attention_on_the_dequantized_cache(ids):
    """One decode step with an FP4Cache gives the logits of the same step computed with an
    ordinary cache holding the FP4 cache's dequantized keys and values."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    assert step_against_the_dequantized_cache(model, ids[:1, :60], ids[:1, 60:61]) > 0.9999


def test_output_attentions_warns_that_no_weights_are_returned():
    """output_attentions=True: no weights exist in a fused kernel; say so (transformers' own sdpa
    logs the same) instead of handing back Nones unannounced. The output is unchanged."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), pytest.warns(UserWarning, match="returns no attention weights"):
        out = model(ids, output_attentions=True)
    with torch.no_grad():
        assert torch.equal(out.logits, model(ids).logits)


def test_fp4cache_decodes_a_padded_batch_through_the_kernel(monkeypatch):
    """A left-padded batch's decode steps run the kernel with each sequence's padding as its
    key_start (the mask is the causal pattern but for the padding), not torch SDPA on the whole
    dequantized cache; the logits are that path's."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :7] = 0  # the second sequence is left-padded

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                  return_dict_in_generate=True, output_logits=True,
                                  **{cache_keyword(model): integration.FP4Cache(config=model.config)})

    starts, sdpa_steps = [], []
    decode, sdpa = integration.decode, integration.ORIGINAL_SDPA
    monkeypatch.setattr(integration, "decode", lambda q, c, **kw: (
        starts.append(kw.get("key_start")), decode(q, c, **kw))[1])
    monkeypatch.setattr(integration, "ORIGINAL_SDPA", lambda *a, **kw: (
        sdpa_steps.append(1), sdpa(*a, **kw))[1])
    kernel = generate()
    # both layers, every step after prefill; one device copy per step's mask, not one per layer
    assert [s.tolist() for s in starts] == [[0, 7]] * 2 * 3 and not sdpa_steps
    assert all(starts[i] is starts[i + 1] for i in range(0, 6, 2))
    monkeypatch.setattr(integration, "_plain_window_start", lambda *a: None)  # the old path
    dequantized = generate()
    assert len(sdpa_steps) == 2 * 3
    assert torch.equal(kernel.sequences[:, :31], dequantized.sequences[:, :31])
    cos = torch.nn.functional.cosine_similarity(kernel.logits[1].flatten(),
                                                dequantized.logits[1].flatten(), dim=0)
    assert cos > 0.9999  # the first decode step: the same dequantized keys and values


def test_fp4cache_leaves_a_padded_batchs_pad_tokens_out_of_the_key_statistics():
    """A left-padded sequence's FP4 cache is what it would be alone: fp4attn's attention appends
    the states with the padding its mask shows (SPEC 6), so the pad tokens do not set the key
    mean and channel scales (they shifted a padded SmolLM2 sequence's decode logits to cos 0.97
    when they did). Prompts of 30 and 150 tokens: statistics still open, and fixed at prefill."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    for n, pad in ((30, 7), (150, 9)):
        ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(n))
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, :pad] = 0

        def generate(ids, mask):
            cache = integration.FP4Cache(config=model.config)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                               **{cache_keyword(model): cache})
            return [layer.cache for layer in cache.layers]

        caches, alone = generate(ids, mask), generate(ids[1:, pad:], mask[1:, pad:])
        for c in caches:
            assert c.padding == (0, pad) and c.statistics_fixed == (n - pad >= 128)
        # the first layer's keys are the same numbers in both runs (later layers' differ by the
        # FP4 prefill attention's quantization, which sees the pad keys)
        assert torch.allclose(caches[0].kmean[1], alone[0].kmean[0], rtol=0, atol=1e-6)
        assert torch.allclose(caches[0].kscale[1], alone[0].kscale[0], rtol=1e-6, atol=0)


def test_a_registered_cache_reader_decodes_through_the_kernel(monkeypatch):
    """An attention function of one's own that reads FP4Cache (fp4cache_step first, the name
    given to register_cache_reader) gets the kernel decode on its steps and the full-precision
    states at the prefill, with no dequantized-cache warning."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from fp4attn.integrations import transformers as integration

    integration.register()
    windows = decode_windows(monkeypatch, integration)
    prefill_lengths = []

    def mine(module, query, key, value, attention_mask, scaling=None, **kw):
        out, key, value = integration.fp4cache_step(query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
        prefill_lengths.append(key.shape[2])
        o = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return o.transpose(1, 2).contiguous(), None

    AttentionInterface.register("test-cache-reader", mine)
    AttentionMaskInterface.register("test-cache-reader", sdpa_mask)
    monkeypatch.setattr(integration, "FP4_IMPLEMENTATIONS", set(integration.FP4_IMPLEMENTATIONS))
    integration.register_cache_reader("test-cache-reader")
    model = tiny_llama("test-cache-reader")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        out = model.generate(ids, max_new_tokens=4, do_sample=False,
                             **{cache_keyword(model): integration.FP4Cache(config=model.config)})
    assert out.shape == (1, 24) and prefill_lengths == [20, 20]
    assert windows == [None] * 2 * 3  # both layers, every step after the prefill
    with pytest.raises(ValueError, match="name must be"):
        integration.register_cache_reader(None)


def tiny_sliding_qwen2():
    """A 2-layer Qwen2 whose first layer is a sliding-window layer (window 8)."""
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=8, max_window_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    model.config._attn_implementation = "fp4attn"
    return model.eval()


def decode_windows(monkeypatch, integration) -> list:
    """The `window` of every kernel decode the integration makes from now on."""
    windows = []
    original = integration.decode

    def counting(q, cache, **kwargs):
        windows.append(kwargs.get("window"))
        return original(q, cache, **kwargs)

    monkeypatch.setattr(integration, "decode", counting)
    return windows


def test_fp4cache_with_a_sliding_window_layer_matches_the_dequantized_cache(monkeypatch):
    """A decode step in a model with a sliding-window layer runs both layers through the kernel
    (transformers' window mask of the sliding layer is recognised as the plain pattern) and gives
    the logits of transformers' own sliding-window mask on an ordinary cache holding the FP4
    cache's dequantized first 40 tokens (the step's own keys and values are quantized in the FP4
    cache only: cos, not equality)."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    windows = decode_windows(monkeypatch, integration)
    model = tiny_sliding_qwen2()
    ids = torch.randint(0, 256, (1, 41), generator=torch.Generator().manual_seed(1))
    fp4 = integration.FP4Cache(config=model.config, rollback=0)  # drops as it goes
    assert [layer.sliding_window for layer in fp4.layers] == [8, None]
    with torch.no_grad():
        kw = cache_keyword(model)
        model(ids[:, :40], **{kw: fp4})
        got = model(ids[:, 40:], **{kw: fp4}).logits
        assert windows == [8, None]
        assert fp4.layers[0].cache.start == 41 - 23 and fp4.layers[1].cache.start == 0
        ref_cache = transformers.DynamicCache()
        for i, layer in enumerate(fp4.layers):  # the sliding layer kept its last 8 + 15 tokens only:
            k, v = layer.cache.dequantize(torch.float32)  # zeros before (outside every window)
            pad = torch.zeros(*k.shape[:2], layer.cache.start, k.shape[3])
            ref_cache.update(torch.cat([pad, k], 2)[:, :, :40], torch.cat([pad, v], 2)[:, :, :40], i)
        model.config._attn_implementation = "sdpa"
        want = model(ids[:, 40:], **{kw: ref_cache}).logits
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.9995


def test_fp4cache_max_tokens_allocates_once(ids):
    """FP4Cache(max_tokens=) sizes every layer's pages for the prompt and the new tokens at once:
    no doubling (which can leave up to half the pages empty), the same tokens generated."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    kw = cache_keyword(model)
    runs = {}
    for max_tokens in (None, ids.shape[1] + 8):
        cache = integration.FP4Cache(config=model.config, max_tokens=max_tokens)
        with torch.no_grad():
            runs[max_tokens] = model.generate(ids, max_new_tokens=8, do_sample=False, **{kw: cache})
        caps = [layer.cache.capacity for layer in cache.layers]
        if max_tokens is not None:
            assert all(ids.shape[1] + 8 <= c < ids.shape[1] + 8 + layer.cache.page_size
                       for c, layer in zip(caps, cache.layers))
    assert torch.equal(runs[None], runs[ids.shape[1] + 8])
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="max_tokens must be a positive int"):
            integration.FP4Cache(config=model.config, max_tokens=bad)


def test_fp4cache_reads_a_sliding_window_without_layer_types(monkeypatch):
    """Mistral and Phi-3 configs give a sliding_window and no layer_types: every layer is a
    sliding-window layer (as transformers' DynamicCache reads them), decoded through the kernel
    with the window, its cache keeping the window's tokens only."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    windows = decode_windows(monkeypatch, integration)
    config = transformers.MistralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=24)
    assert getattr(config, "layer_types", None) is None
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    model.config._attn_implementation = "fp4attn"
    fp4 = integration.FP4Cache(config=model.config, rollback=0)  # drops as it goes
    assert [layer.sliding_window for layer in fp4.layers] == [24, 24]
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        kw = cache_keyword(model)
        model(ids[:, :40], **{kw: fp4})
        for t in range(40, 50):
            model(ids[:, t:t + 1], **{kw: fp4})
    assert windows == [24] * 2 * 10  # every decode step of both layers through the kernel
    assert all(layer.cache.padding == (0,) and layer.cache.start == 50 - (24 + 15)
               for layer in fp4.layers)


@pytest.mark.parametrize("window", [8, None])
@pytest.mark.parametrize("nq", [1, 3])
def test_fp4cache_kernel_path_matches_sdpa_on_the_dequantized_cache(nq, window, monkeypatch):
    """A step given transformers' plain causal (or sliding-window) mask runs the decode kernel
    without the mask, and attends like torch SDPA with that mask on the dequantized cache."""
    from fp4attn.integrations import transformers as integration

    windows = decode_windows(monkeypatch, integration)
    layer = integration.FP4Layer(sliding_window=window)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g)
    layer.update(k, v)
    keys, _ = layer.update(torch.randn(1, 2, nq, 32, generator=g), torch.randn(1, 2, nq, 32, generator=g))
    q = torch.randn(1, 4, nq, 32, generator=g)
    L = 40 + nq
    pos = torch.arange(L)[None, :]
    last = (L - nq + torch.arange(nq))[:, None]
    mask = ((pos <= last) & (pos > last - (window or L)))[None, None]
    got = integration._cached_attention(q, keys, None, 32 ** -0.5)
    got_masked = integration._cached_attention(q, keys, mask, 32 ** -0.5)
    assert windows == [window, window]  # both through the kernel
    start = layer.cache.start
    for t in range(nq):  # each query with the keys it computes with (its own residual)
        kd, vd = layer.cache.dequantize(position=L - nq + t)
        want = integration.ORIGINAL_SDPA(q[:, :, t:t + 1], kd, vd, attn_mask=mask[:, :, t:t + 1, start:],
                                         scale=32 ** -0.5, enable_gqa=True)
        assert (got[:, :, t:t + 1] - want).abs().max() < 1e-5
    assert torch.equal(got, got_masked)
    holed = mask.clone()
    holed[..., L - 3] = False  # a hole after keys some query sees: not the pattern, SDPA
    integration._cached_attention(q, keys, holed, 32 ** -0.5)
    assert len(windows) == 2
    padded = mask.clone()
    padded[..., : L - 6] = False  # leading keys no query sees (padding): the kernel, key_start
    got = integration._cached_attention(q, keys, padded, 32 ** -0.5)
    assert len(windows) == 3
    for t in range(nq):
        kd, vd = layer.cache.dequantize(position=L - nq + t)
        want = integration.ORIGINAL_SDPA(q[:, :, t:t + 1], kd, vd, attn_mask=padded[:, :, t:t + 1, start:],
                                         scale=32 ** -0.5, enable_gqa=True)
        assert (got[:, :, t:t + 1] - want).abs().max() < 1e-5


def test_fp4cache_multi_token_step_decodes_through_the_kernel(ids, monkeypatch):
    """A step of several new tokens (speculative decoding) on full-attention layers gets
    transformers' causal 4D mask, recognised as the plain pattern: the kernel decodes it, and the
    logits match an ordinary cache holding the FP4 cache's dequantized prompt."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    windows = decode_windows(monkeypatch, integration)
    model = tiny_llama("fp4attn")
    assert step_against_the_dequantized_cache(model, ids[:1, :50], ids[:1, 50:54]) > 0.9999
    assert windows == [None, None]  # the 4-token step, both layers through the kernel


def test_fp4cache_sliding_window_layer_with_padding_decodes_through_the_kernel(monkeypatch):
    """With a left-padded batch whose padding lies inside the window, the sliding layer's mask is
    the window pattern but for the padding: the kernel takes every step, with the window and the
    padding as key_start while it lies inside the window."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_sliding_qwen2()
    windows = decode_windows(monkeypatch, integration)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # keys 0, 1 of the second sequence: inside the window of 8 below length 10
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             **{cache_keyword(model): integration.FP4Cache(config=model.config)})
    assert out.shape == (2, 14)
    assert windows == [8, None] * 7  # both layers, every step after the prefill


def test_fp4cache_refuses_layer_types_it_does_not_serve():
    """Chunked or linear-attention layers (Llama 4, Qwen3-Next): a clear error at construction
    (a chunked layer read as full attention would see keys outside its chunk)."""
    from fp4attn.integrations.transformers import FP4Cache

    cfg = transformers.LlamaConfig(num_hidden_layers=2)
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"also has \['chunked_attention'\] layers"):
        FP4Cache(config=cfg)


def test_fp4cache_long_chunk_keeps_each_querys_newest_keys_exact(monkeypatch):
    """A chunk of more than 16 tokens after the prefill (a second chat turn): every query reads
    its newest 16 keys exact, as in token-by-token decoding. The ring holds only the last 31
    tokens, so the chunk attends to the cache before it (its newest 16 exact) and its own states;
    it read the chunk's first 29 queries' own keys quantized. Layer 0's keys are the embeddings'
    projections whatever the attention, so they must equal an exact cache's, bit for bit."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    kw = cache_keyword(model)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(9))
    exact = transformers.DynamicCache()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        model(ids, **{kw: exact})
        model.set_attn_implementation("fp4attn")
        keys, sdpa = [], integration.ORIGINAL_SDPA
        monkeypatch.setattr(integration, "ORIGINAL_SDPA",
                            lambda q, k, v, **a: (keys.append(k), sdpa(q, k, v, **a))[1])
        cache = integration.FP4Cache(config=model.config)
        model(ids[:, :140], **{kw: cache})
        keys.clear()
        model(ids[:, 140:], **{kw: cache})
    want = exact.layers[0].keys[:, :, 124:200]
    assert keys[0].shape[-2] == 200 and torch.equal(keys[0][:, :, 124:200], want)
    assert not torch.equal(keys[0][:, :, :124], exact.layers[0].keys[:, :, :124])  # quantized


def test_fp4cache_sliding_window_layer_long_chunk():
    """A chunk of 20 new tokens after the prefill (more than the kernel serves): the sliding layer
    attends to its kept tokens and the chunk's own states although its ring then drops tokens the
    chunk's first queries see, like an ordinary cache holding the dequantized tokens."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_sliding_qwen2()
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(4))
    fp4 = integration.FP4Cache(config=model.config, rollback=0)  # drops as it goes
    with torch.no_grad():
        kw = cache_keyword(model)
        model(ids[:, :40], **{kw: fp4})
        ref_cache = transformers.DynamicCache()
        for i, layer in enumerate(fp4.layers):  # zeros before the sliding layer's kept tokens
            k, v = layer.cache.dequantize(torch.float32)
            pad = torch.zeros(*k.shape[:2], layer.cache.start, k.shape[3])
            ref_cache.update(torch.cat([pad, k], 2), torch.cat([pad, v], 2), i)
        got = model(ids[:, 40:], **{kw: fp4}).logits
        assert fp4.layers[0].cache.start == 60 - 23
        model.config._attn_implementation = "sdpa"
        want = model(ids[:, 40:], **{kw: ref_cache}).logits
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.999  # the full layer attends to the chunk's quantized states, the reference not


def chunked_logits(model, ids, cache, chunk: int):
    """The logits of `ids` fed to the model in chunks of `chunk` tokens with `cache`."""
    kw = cache_keyword(model)
    with torch.no_grad():
        return torch.cat([model(ids[:, i:i + chunk], **{kw: cache}).logits
                          for i in range(0, ids.shape[1], chunk)], 1)


@pytest.mark.parametrize("chunk", [1, 16, 20])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_sliding_qwen2], ids=["llama", "qwen2-window"])
def test_fp4cache_with_another_attention_implementation_attends_to_the_whole_cache(
        make_model, impl, chunk):
    """FP4Cache(config=...) with an attention implementation that is not fp4attn's (the default
    "sdpa", or "eager") hands it the whole cache dequantized, with a warning: the logits are those
    of attn_implementation="fp4attn" on the same cache (which decodes through the kernel), in
    single-token steps, 16-token chunks (the kernel's most) and 20-token chunks alike, sliding-window
    layers included. (Both
    prefills use `impl`: the cache stores the prefill's states unchanged.)"""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = make_model(impl) if make_model is tiny_llama else make_model()
    model.config._attn_implementation = impl
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(5))
    prompt, rest = ids[:, :16], ids[:, 16:]
    kw = cache_keyword(model)
    with torch.no_grad():
        fp4 = integration.FP4Cache(config=model.config)
        model(prompt, **{kw: fp4})
        model.config._attn_implementation = "fp4attn"
        want = chunked_logits(model, rest, fp4, chunk)
        model.config._attn_implementation = impl
        other = integration.FP4Cache(config=model.config)
        model(prompt, **{kw: other})
        integration._warned.discard(impl)
        with pytest.warns(UserWarning, match="dequantizes the whole cache"):
            got = chunked_logits(model, rest, other, chunk)
    assert len(other.layers[1].cache) == 48
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    # a 16-token chunk through the kernel reads each query's own residual keys exact; the other
    # implementation gets one tensor, exact from the first query's residual on (a few more exact
    # keys for the later queries): 0.9998 here, where the other steps agree to 0.9999
    assert cos > (0.9995 if chunk == 16 else 0.9999), cos


def test_fp4cache_without_config_refuses_another_attention_implementation():
    """Without the model's config the cache cannot tell which attention reads it: an
    implementation that is not fp4attn's gets an error naming the fix, not this step's keys."""
    from fp4attn.integrations import transformers as integration

    model = tiny_llama("sdpa")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"FP4Cache\(config=model.config\)"):
        model.generate(ids, max_new_tokens=3, do_sample=False,
                       **{cache_keyword(model): integration.FP4Cache()})


@pytest.mark.parametrize("name,value", [("softcap", 50.0), ("s_aux", torch.zeros(4)),
                                        ("position_bias", torch.zeros(1, 4, 8, 8))])
@pytest.mark.parametrize("impl", ["fp4attn", "fp4attn-int8"])
def test_attention_kwargs_that_change_the_softmax_are_refused(name, value, impl):
    """softcap (Gemma 2), s_aux (gpt-oss sinks) and position_bias (T5) change the scores or the
    softmax, which the kernels do not implement: an error naming the argument, not an answer
    computed without it. None (the models' value when the feature is off) passes."""
    from fp4attn.integrations import transformers as fpt

    fn = fpt.fp4attn_attention_forward if impl == "fp4attn" else fpt.fp4attn_int8_attention_forward
    module = torch.nn.Module()
    q, k, v = (torch.randn(1, 4, 8, 32) for _ in range(3))
    with pytest.raises(NotImplementedError, match=f"{name}="):
        fn(module, q, k, v, None, **{name: value})
    out, _ = fn(module, q, k, v, None, **{name: None})
    assert out.shape == (1, 8, 4, 32)


def test_gemma2_softcap_model_is_refused_not_answered_without_it():
    cfg = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=100, max_position_embeddings=64,
        attn_logit_softcapping=30.0, query_pre_attn_scalar=32)
    from fp4attn.integrations import transformers as fpt

    fpt.register()
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    model.set_attn_implementation("fp4attn")
    with torch.no_grad(), pytest.raises(NotImplementedError, match="softcap="):
        model(input_ids=torch.randint(0, 100, (1, 16)))


def test_fp4cache_refuses_offloading():
    """Offloading: a NotImplementedError naming it, not an AttributeError from the base class."""
    from fp4attn.integrations.transformers import FP4Cache

    cache = FP4Cache()
    g = torch.Generator().manual_seed(0)
    cache.update(torch.randn(1, 2, 20, 32, generator=g), torch.randn(1, 2, 20, 32, generator=g), 0)
    with pytest.raises(NotImplementedError, match="offload"):
        cache.layers[0].offload()


@pytest.mark.parametrize("candidates", [5, 25])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_fp4cache_assisted_generation(arch, candidates):
    """Assisted generation (a draft model proposes `candidates` tokens, the model checks them in
    one call, the cache drops the rejected ones by crop) after a 150-token prompt (K's statistics
    fixed): every generated token's logits are those of one-token steps on an FP4Cache fed the
    same tokens, within the cache's noise (a crop that left cropped tokens in the exact ring gives
    0.16-0.6), also where 26-token checks take the long-chunk path, crops exceed the ring, and
    (Mistral, window 48) sliding-window layers drop more than 16 tokens (their rollback). The
    prefill runs the 8-bit attention, so that the comparison is of the cache, not of FP4
    prefills of other lengths. crop's transformers forms: a negative count, a length, 0."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                       {"sliding_window": 48})}

    def tiny(config, model, seed, **kw):
        torch.manual_seed(seed)
        m = model(config(vocab_size=256, max_position_embeddings=512, **kw)).eval()
        m.config._attn_implementation = "fp4attn-int8"
        return m

    config, model_cls, extra = cls[arch]
    model = tiny(config, model_cls, 0, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **extra)
    draft = tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, 1, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)  # (not sliding: transformers' own draft caches of
    # sliding-window layers fail on drafts longer than the window)
    draft.generation_config.num_assistant_tokens = candidates
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # whole drafts, mostly rejected
    P = 150
    ids = torch.randint(0, 256, (1, P), generator=torch.Generator().manual_seed(3))
    key = cache_keyword(model)
    cache = integration.FP4Cache(model.config)
    with torch.no_grad():
        out = model.generate(ids, **{key: cache}, assistant_model=draft, max_new_tokens=40,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        seq, got = out.sequences, torch.cat(out.logits)
        steps = integration.FP4Cache(model.config)
        want = [model(seq[:, :P], **{key: steps}).logits[:, -1]]
        for t in range(P, seq.shape[1] - 1):
            want.append(model(seq[:, t:t + 1], **{key: steps}).logits[:, -1])
    want = torch.cat(want)
    assert got.shape == want.shape
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 5e-2
    n = cache.get_seq_length()
    cache.crop(-3)
    assert cache.get_seq_length() == n - 3
    cache.crop(n - 10)
    cache.crop(0)
    assert cache.get_seq_length() == n - 10 and cache.is_croppable


def test_fp4cache_rollback_too_short_says_so():
    """A sliding-window layer asked to drop more than its rollback + 16 tokens: an error naming
    FP4Cache's rollback, the cache left as it was."""
    from fp4attn.integrations import transformers as integration

    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, sliding_window=20)
    cache = integration.FP4Cache(config, rollback=4)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, 200, 32, generator=g), torch.randn(1, 1, 200, 32, generator=g)
    cache.update(k, v, 0)
    with pytest.raises(ValueError, match=r"rollback=N\) keeps N tokens"):
        cache.crop(-21)
    assert cache.get_seq_length() == 200
    cache.crop(-20)
    assert cache.get_seq_length() == 180
    with pytest.raises(ValueError, match="rollback must be an int >= 0"):
        integration.FP4Cache(config, rollback=-1)


def test_fp4cache_batch_selection_moves_each_sequence_whole():
    """reorder_cache (beam search), batch_repeat_interleave and batch_select_indices: the next
    decode step gives, bit for bit, the logits of a cache filled with the selected prompts."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(6))
    nxt = torch.randint(0, 256, (3, 1), generator=torch.Generator().manual_seed(7))
    kw = cache_keyword(model)
    with torch.no_grad():
        for op, rows in (("reorder_cache", [2, 0, 0]), ("batch_select_indices", [1]),
                         ("batch_repeat_interleave", [0, 0, 1, 1, 2, 2])):
            cache = integration.FP4Cache(config=model.config)
            model(ids, **{kw: cache})
            if op == "reorder_cache":
                cache.reorder_cache(torch.tensor(rows))
            elif op == "batch_select_indices":
                cache.batch_select_indices(torch.tensor(rows))
            else:
                cache.batch_repeat_interleave(2)
            got = model(nxt[rows], **{kw: cache}).logits
            plain = integration.FP4Cache(config=model.config)
            model(ids[rows], **{kw: plain})
            assert torch.equal(got, model(nxt[rows], **{kw: plain}).logits), op


def test_fp4cache_beam_search():
    """generate with num_beams: each beam's cache follows its beam (reorder_cache), so the score
    beam search reports for each returned sequence (its mean log-probability of the new tokens)
    is the one a fresh FP4Cache gives that sequence alone, token by token."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    model = tiny_llama("fp4attn")
    kw = cache_keyword(model)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             num_beams=3, num_return_sequences=3, do_sample=False,
                             return_dict_in_generate=True, output_scores=True,
                             **{kw: integration.FP4Cache(config=model.config)})
        assert out.sequences.shape == (6, 36)
        for seq, score in zip(out.sequences, out.sequences_scores):
            cache = integration.FP4Cache(config=model.config)
            logits = model(seq[None, :30], **{kw: cache}).logits[0, -1:]
            for t in range(31, 36):  # the decode steps, one token each
                logits = torch.cat([logits, model(seq[None, t - 1:t], **{kw: cache}).logits[0]])
            logp = torch.log_softmax(logits.float(), -1)[torch.arange(6), seq[30:]]
            assert abs(logp.mean().item() - score.item()) < 1e-4


def test_fp4cache_under_torch_compile():
    """torch.compile of a model that reads an FP4Cache: its tracing reads the marked keys'
    metadata (it was refused), logits equal eager's over a prefill and decode steps; and a model
    whose attention is not fp4attn's still gets the cache's refusal, compiled or not."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(9))

    def steps(forward, model):
        cache = integration.FP4Cache(config=model.config)
        logits, x = [], ids
        with torch.no_grad():
            for _ in range(3):
                out = forward(input_ids=x, use_cache=True, **{cache_keyword(model): cache})
                logits.append(out.logits[:, -1])
                x = out.logits[:, -1:].argmax(-1)
        return logits

    torch._dynamo.reset()
    model = tiny_llama("fp4attn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph breaks' warnings
        for want, got in zip(steps(model, model),
                             steps(torch.compile(model, backend="eager"), model)):
            assert torch.equal(want, got)
    other = tiny_llama("sdpa")
    with torch.no_grad(), pytest.raises(RuntimeError, match="FP4Cache"):
        torch.compile(other, backend="eager")(input_ids=ids, use_cache=True,
                                              **{cache_keyword(other): integration.FP4Cache()})
    torch._dynamo.reset()


def test_marked_keys_refuse_computation_through_attributes():
    """The keys an FP4Cache layer hands fp4attn's attention refuse any computation, also through
    attributes that return tensors (.mT, .data: they stay marked); metadata reads pass."""
    from fp4attn.integrations.transformers import FP4CacheKeys

    k = FP4CacheKeys.wrap(torch.randn(1, 2, 5, 8), layer=None)
    q = torch.randn(1, 2, 3, 8)
    assert k.shape == (1, 2, 5, 8) and k.stride() == (80, 40, 8, 1) and k.dtype == torch.float32
    for attend in (lambda: q @ k.mT, lambda: q @ k.mH, lambda: torch.matmul(q, k.transpose(2, 3)),
                   lambda: torch.nn.functional.scaled_dot_product_attention(q, k.data, k.data),
                   lambda: torch.einsum("bhqd,bhkd->bhqk", q, k), lambda: k.untyped_storage()):
        with pytest.raises(RuntimeError, match="FP4Cache: something other than fp4attn"):
            attend()


def test_fp4cache_of_an_encoder_decoder_model():
    """An encoder-decoder model (BART, decoder deeper than its encoder):
    FP4Cache.encoder_decoder(config) keeps the decoder's self-attention keys in FP4 and the
    scores are the model's own cache's; FP4Cache(config) alone, which the cross-attention would
    fill with the encoder's keys (wrong scores, no error, as with transformers' DynamicCache), is
    refused with the fix."""
    from fp4attn.integrations import transformers as integration

    integration.register()
    config = transformers.BartConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).eval()
    model.config._attn_implementation = "fp4attn-int8"
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    with pytest.raises(ValueError, match=r"FP4Cache.encoder_decoder\(config=model.config\)"):
        integration.FP4Cache(config=model.config)
    with pytest.raises(ValueError, match="not an encoder-decoder"):
        integration.FP4Cache.encoder_decoder(tiny_llama("sdpa").config)
    with torch.no_grad():
        own = torch.stack(model.generate(ids, **kw).scores)
        cache = integration.FP4Cache.encoder_decoder(model.config)
        fp4 = torch.stack(model.generate(ids, **{cache_keyword(model): cache}, **kw).scores)
    finite = torch.isfinite(own)  # (min_new_tokens masks the end token)
    assert torch.equal(finite, torch.isfinite(fp4))
    assert (fp4[finite] - own[finite]).norm() / own[finite].norm() < 1e-3
    layers = cache.self_attention_cache.layers
    assert len(layers) == 3 and all(type(layer).__name__ == "FP4Layer" for layer in layers)
    assert cache.self_attention_cache.get_seq_length() == 10  # decoder tokens only


# Tests from a mutation run of the integration (each pins a behaviour a plausible bug would
# break), on its attention function and layer directly.

class _Attention(torch.nn.Module):
    is_causal = True
    layer_idx = 0


def attention_module(training=False):
    return _Attention().train(training)


def offset_kv(B, H, n, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g) * 2 + 1.5, torch.randn(B, H, n, D, generator=g)


def prefilled_layer(n=130, B=1, H=2, D=64, **kw):
    from fp4attn.integrations import transformers as integration

    layer = integration.FP4Layer(**kw)
    key, value = layer.update(*offset_kv(B, H, n, D, 0))
    integration.fp4attn_attention_forward(attention_module(), torch.randn(B, 2 * H, n, D), key,
                                          value, None)  # the prefill: appends
    assert len(layer.cache) == n and layer.cache.statistics_fixed
    return layer


def test_leading_padding_counts_only_leading_keys_and_repeats_a_batch_one_mask():
    from fp4attn.integrations import transformers as integration

    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    mask[..., 0] = False  # left padding
    mask[..., 3] = False  # a hole later on: not padding
    assert integration._leading_hidden(mask).tolist() == [1]
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    mask[..., :2] = False
    assert integration._leading_padding(mask, 3) == [2, 2, 2]


def test_a_16_token_step_decodes_through_the_kernel(monkeypatch):
    from fp4attn.integrations import transformers as integration

    layer = prefilled_layer()
    calls = []
    real = integration.decode
    monkeypatch.setattr(integration, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    key, value = layer.update(*offset_kv(1, 2, 16, 64, 1))
    integration.fp4attn_attention_forward(attention_module(), torch.randn(1, 4, 16, 64), key,
                                          value, None)
    assert calls == [1]


def test_a_long_chunk_attends_with_the_given_scaling():
    from fp4attn.integrations import transformers as integration

    layer = prefilled_layer()
    key, value = layer.update(*offset_kv(1, 2, 20, 64, 1))
    k_chunk, v_chunk, _ = layer.chunk_states
    q = torch.randn(1, 4, 20, 64)
    out, _ = integration.fp4attn_attention_forward(attention_module(), q, key, value, None,
                                                   scaling=0.02)
    mask = integration._window_mask(20, k_chunk.shape[-2], None, q.device)
    original = importlib.import_module("fp4attn.sdpa").ORIGINAL_SDPA  # torch's own
    want = original(q, k_chunk, v_chunk, attn_mask=mask, scale=0.02, enable_gqa=True)
    assert torch.equal(out, want.transpose(1, 2))


def test_attention_forward_slices_a_wider_mask_forwards_scaling_and_drops_dropout_in_eval():
    from fp4attn.integrations import transformers as integration

    q, k, v = (torch.randn(1, 2, 8, 32) for _ in range(3))
    mask = torch.rand(1, 1, 8, 12) > 0.3  # wider than the keys, as a static cache's
    mask[..., 0] = True
    out, _ = integration.fp4attn_attention_forward(attention_module(), q, k, v, mask, dropout=0.5,
                                                   scaling=0.05)
    want = fp4attn.sdpa(q, k, v, attn_mask=mask[..., :8], scale=0.05).transpose(1, 2)
    assert torch.equal(out, want)


def test_a_uniform_registered_policy_sets_the_precision():
    from fp4attn.integrations import transformers as integration

    q, k, v = (torch.randn(1, 2, 8, 32) for _ in range(3))
    integration.register(fp4attn.Policy(default="int8"))
    try:
        out, _ = integration.fp4attn_attention_forward(attention_module(), q, k, v, None)
    finally:
        integration.register()
    assert torch.equal(out, fp4attn.sdpa(q, k, v, is_causal=True, precision="int8").transpose(1, 2))


def test_a_sliding_layer_hands_other_implementations_keys_at_their_positions():
    from fp4attn.integrations import transformers as integration

    layer = integration.FP4Layer(page_size=16, sliding_window=8,
                                 attn_implementation=lambda: "sdpa", rollback=0)  # keeps 23
    layer.update(*offset_kv(1, 2, 40, 64, 0))  # the prefill
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k, v = layer.update(*offset_kv(1, 2, 1, 64, 1))
    assert k.shape[2] == v.shape[2] == 41  # dropped tokens as zeros: positions line up
    assert not k[:, :, :18].any() and k[:, :, 18:].abs().sum() > 0
