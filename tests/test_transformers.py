"""The patch and attn_implementation="fp4attn" on a tiny randomly initialised Llama (no download)."""

import importlib

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
