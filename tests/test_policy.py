"""fp4attn.Policy, patch(policy=...), register(policy=...) and fp4attn.calibrate on tiny randomly
initialised transformers models (no download)."""

import importlib
import json
import math

import pytest
import torch

import fp4attn
from fp4attn import Policy
from fp4attn import calibration as C

patch_module = importlib.import_module("fp4attn.patch")
transformers = pytest.importorskip("transformers")


def tiny_llama(layers=3, attn_implementation="sdpa"):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = attn_implementation
    return model.eval()


def tiny_bert():
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=128)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    model.config._attn_implementation = "sdpa"
    return model.eval()


@pytest.fixture(autouse=True)
def _unpatched():
    yield
    fp4attn.unpatch()


# ---------------------------------------------------------------------------------------------
# Policy
# ---------------------------------------------------------------------------------------------


def test_policy_lookup_and_forms():
    p = Policy(["fp4", "int8", "bf16"])
    assert [p.precision(i) for i in range(3)] == ["fp4", "int8", "bf16"]
    assert p.num_layers == 3 and not p.is_uniform and p.code() == "48b"
    q = Policy({1: "bf16"}, default="int8")
    assert q.precision(0) == "int8" and q.precision(1) == "bf16" and q.precision(7) == "int8"
    u = Policy.uniform("int8")
    assert u.is_uniform and u.precision(None) == "int8" and u.precision(99) == "int8"
    assert Policy({2: "fp4"}).is_uniform  # every listed site has the default precision
    assert Policy.from_code("48b") == Policy(["fp4", "int8", "bf16"])
    assert p.fp4_share([1.0, 1.0, 2.0]) == 0.25


def test_policy_errors_name_the_argument():
    with pytest.raises(ValueError, match="default"):
        Policy(default="fp8")
    with pytest.raises(ValueError, match=r"layers\[1\]"):
        Policy(["fp4", "FP4"])
    with pytest.raises(ValueError, match="layers key"):
        Policy({-1: "fp4"})
    with pytest.raises(ValueError, match="layers key"):
        Policy({True: "fp4"})
    with pytest.raises(TypeError, match="layers must be"):
        Policy("fp4")
    with pytest.raises(ValueError, match="num_layers"):
        Policy({5: "int8"}, num_layers=3)
    with pytest.raises(ValueError, match="num_layers=2"):
        Policy(["fp4", "int8"]).precision(2)
    with pytest.raises(ValueError, match="call site"):
        Policy(["fp4", "int8"]).precision(None)
    with pytest.raises(TypeError):
        Policy(meta={"x": object()})  # meta must be JSON data
    with pytest.raises(ValueError, match="code"):
        Policy.from_code("44x")
    with pytest.raises(ValueError, match="num_layers"):
        Policy({1: "int8"}).code()


def test_policy_json_round_trip(tmp_path):
    p = Policy({0: "bf16", 2: "int8"}, default="fp4", num_layers=4, meta={"model": "m", "x": [1]})
    q = Policy.from_json(p.to_json())
    assert q == p and q.precision(2) == "int8" and q.meta == {"model": "m", "x": [1]}
    p.save(tmp_path / "p.json")
    assert Policy.load(tmp_path / "p.json") == p
    d = json.loads(p.to_json())
    assert d["format"] == "fp4attn.Policy" and d["layers"] == {"0": "bf16", "2": "int8"}
    with pytest.raises(ValueError, match="format"):
        Policy.from_dict({"layers": {}})
    with pytest.raises(ValueError, match="version"):
        Policy.from_dict({**d, "version": 99})
    with pytest.raises(ValueError, match="layer indices"):
        Policy.from_dict({**d, "layers": {"a": "fp4"}})
    for key in (" 1", "1_0", "01", "\u0663"):  # int() reads them all ("1_0" as 10; "01" and "1" merged)
        with pytest.raises(ValueError, match="decimal integers"):
            Policy.from_dict({**d, "layers": {key: "fp4"}})
    assert Policy.from_dict({**d, "layers": {0: "bf16", "2": "int8"}}) == p  # int keys as given
    with pytest.raises(ValueError, match=r"layers\[0\]"):
        Policy.from_dict({**d, "layers": {"0": "fp2"}})


# ---------------------------------------------------------------------------------------------
# patch(policy=...) and the transformers integration
# ---------------------------------------------------------------------------------------------


def _record_precisions(monkeypatch):
    seen = []
    original = patch_module.attention

    def recording(precision, *args, **kwargs):
        seen.append(precision)
        return original(precision, *args, **kwargs)

    monkeypatch.setattr(patch_module, "attention", recording)
    return seen


def test_patch_policy_numbers_calls_per_forward(monkeypatch):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40))
    seen = _record_precisions(monkeypatch)
    with torch.no_grad():
        exact = model(ids).logits
        with fp4attn.patched(policy=Policy(["bf16", "fp4", "int8"]), model=model):
            a = model(ids).logits
            b = model(ids).logits  # a second forward starts counting at 0 again
        with fp4attn.patched(policy=Policy.uniform("bf16"), model=model):
            same = model(ids).logits
    assert seen == ["bf16", "fp4", "int8"] * 2 + ["bf16"] * 3
    assert torch.equal(a, b) and not torch.equal(a, exact)
    assert torch.equal(same, exact)  # bf16 = torch SDPA in the input dtype: the model as is
    assert not fp4attn.is_patched()


def test_patch_policy_under_torch_compile_fullgraph(monkeypatch):
    """A per-layer policy inside torch.compile(fullgraph=True) (tracing refused the backward
    check's call before): each layer gets its precision, and the logits are close to eager's
    (compiled, transformers repeats the KV heads where eager passes enable_gqa, and the spec's
    statistics per KV head then differ: close, not equal)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40))
    seen = _record_precisions(monkeypatch)
    torch._dynamo.reset()
    with torch.no_grad(), fp4attn.patched(policy=Policy(["bf16", "fp4", "int8"]), model=model):
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        first, again = compiled(ids).logits, compiled(ids).logits
    torch._dynamo.reset()
    assert seen[:3] == ["bf16", "fp4", "int8"] and seen[3:6] == seen[:3]
    assert torch.equal(first, again)
    assert (first - eager).norm() / eager.norm() < 0.02


def test_patch_policy_generation_restarts_count(monkeypatch):
    model = tiny_llama(layers=2)
    seen = _record_precisions(monkeypatch)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad(), fp4attn.patched(policy=Policy(["int8", "fp4"]), model=model):
        model.generate(ids, max_new_tokens=3, do_sample=False,
                       attention_mask=torch.ones_like(ids))
    assert seen == ["int8", "fp4"] * 3  # prefill and two decode steps


def test_patch_policy_too_many_calls():
    """A model without a transformers config (here a plain wrapper) is checked per call: the
    call past the policy's num_layers raises."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(ids)

    model = Wrapper(tiny_llama(layers=3))
    with fp4attn.patched(policy=Policy(["fp4", "bf16"]), model=model), \
            pytest.raises(ValueError, match="num_layers=2"), torch.no_grad():
        model(torch.randint(0, 128, (1, 10)))


def test_patch_policy_refuses_calls_recomputed_in_backward():
    """Activation checkpointing recomputes a layer's attention during the backward pass, where
    the per-forward call count has no site for it: an error, not the default precision."""
    model = tiny_llama(layers=2)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 128, (1, 10))
    with fp4attn.patched(policy=Policy({0: "bf16"}, default="int8"), model=model):
        loss = model(ids, labels=ids).loss
        with pytest.raises(RuntimeError, match="during the backward pass"):
            loss.backward()
    with fp4attn.patched(policy=Policy.uniform("int8"), model=model):  # no sites needed
        model(ids, labels=ids).loss.backward()


def test_patch_argument_errors():
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="not both"):
        fp4attn.patch("fp4", policy=Policy.uniform("int8"))
    with pytest.raises(ValueError, match="model="):
        fp4attn.patch(policy=Policy(["fp4", "int8"]))
    with pytest.raises(ValueError, match="model= only"):
        fp4attn.patch(model=model)
    with pytest.raises(TypeError, match="fp4attn.Policy"):
        fp4attn.patch(policy=["fp4", "int8"], model=model)
    with pytest.raises(TypeError, match="nn.Module"):
        fp4attn.patch(policy=Policy(["fp4", "int8"]), model=object())
    assert not fp4attn.is_patched()
    fp4attn.patch(policy=Policy.uniform("int8"))  # uniform: no model needed
    assert patch_module.current() == (None, Policy.uniform("int8"))


def test_patched_restores_previous_state():
    model = tiny_llama(layers=2)
    fp4attn.patch("int8")
    with fp4attn.patched(policy=Policy(["fp4", "bf16"]), model=model):
        assert patch_module.current()[1] == Policy(["fp4", "bf16"])
        assert len(model._forward_pre_hooks) == 1
    assert patch_module.current() == ("int8", None) and fp4attn.is_patched()
    assert len(model._forward_pre_hooks) == 0  # the counting hook is gone
    fp4attn.unpatch()
    assert not fp4attn.is_patched()


def test_a_wrapper_over_the_patch_keeps_it(monkeypatch):
    """Something (a profiler, a tracer) wraps torch's SDPA after patch(): patched() inside and
    after keeps the patch in force through the wrapper, and calibrate refuses the patched state
    (its reference would not be exact attention)."""
    import torch.nn.functional as F

    seen = []
    real = patch_module.sdpa
    monkeypatch.setattr(patch_module, "sdpa", lambda *a, precision, **kw: (
        seen.append(precision), real(*a, precision=precision, **kw))[1])
    fp4attn.patch("int8")
    inner = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: inner(*a, **kw))
    assert fp4attn.is_patched()
    q = torch.randn(1, 2, 8, 16)
    with fp4attn.patched("fp4"):
        F.scaled_dot_product_attention(q, q, q)
    F.scaled_dot_product_attention(q, q, q)
    assert seen[-1] == "int8" and fp4attn.is_patched()
    with pytest.raises(RuntimeError, match="fp4attn.patch\\(\\) is active"):
        fp4attn.calibrate(tiny_llama(layers=2), [torch.randint(0, 128, (1, 16))], verbose=False)
    monkeypatch.setattr(F, "scaled_dot_product_attention", inner)  # the wrapper removed
    fp4attn.unpatch()
    assert F.scaled_dot_product_attention is patch_module.ORIGINAL_SDPA
    fp4attn.patch("int8")  # something puts torch's function back: not patched, patch() reinstalls
    monkeypatch.setattr(F, "scaled_dot_product_attention", patch_module.ORIGINAL_SDPA)
    assert not fp4attn.is_patched()
    fp4attn.patch("int8")
    assert F.scaled_dot_product_attention is patch_module.patched_sdpa


def test_register_policy_matches_patch():
    from fp4attn.integrations import transformers as integration

    policy = Policy(["fp4", "bf16", "int8"])
    ids = torch.randint(0, 128, (2, 40))
    model = tiny_llama()
    with torch.no_grad(), fp4attn.patched(policy=policy, model=model):
        patched_logits = model(ids).logits
    try:
        integration.register(policy=policy)
        model.config._attn_implementation = "fp4attn"
        with torch.no_grad():
            registered = model(ids).logits
        integration.register()  # back to FP4 everywhere
        with torch.no_grad():
            fp4 = model(ids).logits
    finally:
        integration.register()
    assert torch.equal(registered, patched_logits)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad(), fp4attn.patched("fp4"):
        assert torch.equal(fp4, model(ids).logits)
    with pytest.raises(TypeError, match="fp4attn.Policy"):
        integration.register(policy="fp4")


def tiny_bart():
    cfg = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    return transformers.BartForConditionalGeneration(cfg).eval()


def test_a_per_layer_policy_refuses_models_it_would_number_wrongly():
    """An encoder-decoder's encoder, decoder and cross-attention calls share layer indices (and
    generate runs decoder steps without the model's forward); a policy made for another model
    would silently cover some other set of layers. Both raise: patch() when a forward makes
    fewer attention calls than the policy has sites, register() when num_hidden_layers differs
    from them (its sites are layer_idx). Uniform policies fit any model."""
    from fp4attn.integrations import transformers as integration

    with pytest.raises(ValueError, match="encoder-decoder"):
        fp4attn.patch(policy=Policy(["bf16", "fp4", "int8", "int8", "fp4", "bf16"]),
                      model=tiny_bart())
    assert not patch_module.is_patched()
    longer = Policy(["fp4", "bf16", "int8", "int8"])  # 4 sites for a 3-layer model
    llama = tiny_llama()
    with fp4attn.patched(policy=longer, model=llama), torch.no_grad(), \
            pytest.raises(ValueError, match="made 3 attention calls, the policy has num_layers=4"):
        llama(torch.randint(0, 128, (1, 16)))
    model, ids = tiny_llama(attn_implementation="fp4attn"), torch.randint(0, 128, (1, 16))
    try:
        integration.register(policy=longer)
        with torch.no_grad(), pytest.raises(ValueError, match="num_layers=4, the model 3 layers"):
            model(ids)
        integration.register(policy=Policy(default="int8", num_layers=4))  # uniform: fits
        with torch.no_grad():
            model(ids)
    finally:
        integration.register()
    fp4attn.patch(policy=Policy(default="int8"), model=tiny_bart())  # uniform: fits
    fp4attn.unpatch()


def test_cross_attention_and_extra_calls_are_refused_a_per_layer_policy():
    """A decoder with cross-attention (GPT-2's add_cross_attention; an EncoderDecoderModel's
    decoder, whose own config is not is_encoder_decoder) calls attention twice per layer: its
    layer indices cover both. A policy without a size through patch() on a model calling
    attention more often than it has layers: the sites are not the layers. Both raise."""
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                     add_cross_attention=True)
    for policy in (Policy(["bf16", "fp4"]), Policy({1: "bf16"}, default="int8")):
        with pytest.raises(ValueError, match="has cross-attention"):
            policy.check_fits(config)
        with pytest.raises(ValueError, match="has cross-attention"):
            fp4attn.patch(policy=policy, model=transformers.GPT2LMHeadModel(config).eval())
        assert not patch_module.is_patched()

    class TwoCalls(torch.nn.Module):  # a 2-layer "model" calling attention twice per layer
        def __init__(self):
            super().__init__()
            self.config = transformers.PretrainedConfig(num_hidden_layers=2)

        def forward(self, x):
            for _ in range(4):
                x = torch.nn.functional.scaled_dot_product_attention(x, x, x)
            return x

    model = TwoCalls()
    with fp4attn.patched(policy=Policy({1: "bf16"}, default="int8"), model=model), \
            pytest.raises(ValueError, match="made 4 attention calls for 2 layers"):
        model(torch.randn(1, 2, 8, 16))
    with fp4attn.patched(policy=Policy(default="int8"), model=model):  # uniform: fits any model
        model(torch.randn(1, 2, 8, 16))


def test_a_per_layer_policy_refuses_calls_outside_the_models_forward():
    """model.forward(...) skips the hooks that restart the count: its calls would take the sites
    after the previous forward's (a dict policy: other layers' precisions, silently)."""
    model, ids = tiny_llama(layers=3), torch.randint(0, 128, (1, 16))
    with fp4attn.patched(policy=Policy({2: "int8"}, default="bf16"), model=model), torch.no_grad():
        model(ids)
        with pytest.raises(RuntimeError, match="outside a forward of the policy's model"):
            model.forward(ids)
        model(ids)  # the model itself still works afterwards


# ---------------------------------------------------------------------------------------------
# calibrate
# ---------------------------------------------------------------------------------------------


def _ppl(model, batches, policy):
    nll, n = 0.0, 0
    with torch.no_grad(), fp4attn.patched(policy=policy, model=model):
        for ids in batches:
            lp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
            nll -= lp.gather(-1, ids[:, 1:, None]).sum().item()
            n += ids[:, 1:].numel()
    return math.exp(nll / n)


def test_upgrade_moves_order_and_hull():
    costs = {"fp4": 1.0, "int8": 2.0, "bf16": 4.0}
    cands = ["fp4", "int8", "bf16"]
    # site 0: int8 as good as fp4 (dominated: never a move); site 1: int8 above the fp4-bf16
    # chord (skipped: fp4 -> bf16 directly); site 2: convex, both moves, int8 first
    sens = {0: {"fp4": 1.0, "int8": 1.0, "bf16": 0.0}, 1: {"fp4": 1.0, "int8": 0.9, "bf16": 0.0},
            2: {"fp4": 3.0, "int8": 0.5, "bf16": 0.0}}
    moves = C.upgrade_moves(sens, [1.0, 1.0, 1.0], costs, cands)
    assert moves == [(2, "int8"), (0, "bf16"), (1, "bf16"), (2, "bf16")]
    assert C.assignment(3, "fp4", moves, 2) == ["bf16", "fp4", "int8"]
    # a site with twice the FLOPs costs twice as much to upgrade
    assert C.upgrade_moves(sens, [1.0, 1.0, 10.0], costs, cands)[0] == (0, "bf16")
    assert C.candidates(C.cost_table("hopper")) == ["int8", "bf16"]  # FP4 is dearer than exact


def test_calibrate_causal_lm_meets_budget_measured():
    model = tiny_llama()
    torch.manual_seed(1)
    batches = [torch.randint(0, 128, (2, 64)), torch.randint(0, 128, (1, 48))]
    exact = _ppl(model, batches, Policy.uniform("bf16"))
    budget = 2e-4
    p = fp4attn.calibrate(model, batches, budget=budget, device_kind="blackwell", verbose=False)
    cal = p.meta["calibration"]
    assert p.num_layers == 3 and cal["metric"] == "perplexity"
    # the promised loss is a measurement: recomputing it independently gives the same number
    ppl = _ppl(model, batches, p)
    assert ppl / exact - 1 <= budget
    assert math.isclose(ppl, cal["measured"], rel_tol=1e-9)
    assert math.isclose(exact, cal["exact"], rel_tol=1e-9)
    assert cal["kl_loss"] <= budget and 0 <= cal["kl"]
    for pr in cal["probes"]:  # bisection: every probe below the chosen m failed, at or above passed
        ok = max(pr["loss"], pr["kl_loss"]) <= budget
        assert ok == (pr["m"] >= cal["m"]), pr
    # deterministic
    again = fp4attn.calibrate(model, batches, budget=budget, verbose=False)
    assert again.code() == p.code()
    assert again.meta["calibration"]["order"] == cal["order"]
    # the ladder runs from all FP4 to all BF16 through the chosen policy
    steps = C.ladder(p)
    assert steps[0].code() == "444" and steps[-1].code() == "bbb" and steps[cal["m"]] == Policy(
        p.as_list())


def test_calibrate_budget_and_device_kinds(capsys):
    model = tiny_llama(layers=2)
    batches = [torch.randint(0, 128, (1, 40))]
    loose = fp4attn.calibrate(model, batches, budget=10.0, verbose=False)
    assert loose.code() == "44"  # everything passes: the cheapest policy
    assert "100.0 % of attention FLOPs in FP4" in capsys.readouterr().out
    hopper = fp4attn.calibrate(model, batches, budget=10.0, device_kind="hopper", verbose=False)
    assert hopper.code() == "88"
    custom = fp4attn.calibrate(model, batches, budget=0.0,
                               device_kind={"int8": 1.0, "bf16": 3.0}, verbose=False)
    assert "4" not in custom.code() and custom.meta["calibration"]["loss"] <= 0.0
    exact_only = fp4attn.calibrate(model, batches, budget=0.0, device_kind={"bf16": 1.0},
                                   sensitivity="model", verbose=False)
    assert exact_only.code() == "bb"
    with pytest.raises(ValueError, match="cannot be met"):
        fp4attn.calibrate(model, [torch.randint(0, 128, (1, 40))], budget=0.0,
                          device_kind={"fp4": 1.0}, verbose=False)


def test_calibrate_sensitivity_model():
    model = tiny_llama(layers=2)
    batches = [torch.randint(0, 128, (1, 40))]
    p = fp4attn.calibrate(model, batches, budget=1e-4, sensitivity="model", verbose=False)
    rows = p.meta["calibration"]["layers"]
    assert all(r["sens_fp4"] > r["sens_int8"] >= 0 for r in rows)  # KL per token
    for r in rows:  # int8: the FP4 KL scaled by the attention errors
        ratio = (1 - r["cos_int8"]) / (1 - r["cos_fp4"])
        assert math.isclose(r["sens_int8"] / r["sens_fp4"], ratio)


def test_calibrate_encoder_embedding_cos():
    model = tiny_bert()
    batch = {"input_ids": torch.randint(0, 100, (3, 30)),
             "attention_mask": torch.ones(3, 30, dtype=torch.long)}
    batch["attention_mask"][1, 20:] = 0  # padding
    p = fp4attn.calibrate(model, [batch], budget=1e-5, verbose=False)
    cal = p.meta["calibration"]
    assert cal["metric"] == "embedding_cos" and 1 - cal["measured"] <= 1e-5
    assert p.num_layers == 2


def test_calibrate_argument_errors():
    model = tiny_llama(layers=2)
    b = [torch.randint(0, 128, (1, 20))]
    with pytest.raises(ValueError, match="budget"):
        fp4attn.calibrate(model, b, budget=-0.1)
    with pytest.raises(ValueError, match='metric="embedding_cos" needs an encoder'):
        fp4attn.calibrate(model, b, metric="embedding_cos", verbose=False)
    with pytest.raises(ValueError, match="device_kind"):
        fp4attn.calibrate(model, b, device_kind="ampere")
    with pytest.raises(ValueError, match=r"device_kind\['int8'\]"):
        fp4attn.calibrate(model, b, device_kind={"int8": 0})
    with pytest.raises(ValueError, match="device_kind: precision"):
        fp4attn.calibrate(model, b, device_kind={"fp8": 1.0})
    with pytest.raises(ValueError, match="metric"):
        fp4attn.calibrate(model, b, metric="accuracy")
    with pytest.raises(ValueError, match="sensitivity"):
        fp4attn.calibrate(model, b, sensitivity="hessian")
    with pytest.raises(ValueError, match="at least one"):
        fp4attn.calibrate(model, [])
    with pytest.raises(TypeError, match="wrap it in a list"):
        fp4attn.calibrate(model, b[0])
    with pytest.raises(TypeError, match="batches must hold"):
        fp4attn.calibrate(model, ["text"])
    model.train()
    with pytest.raises(ValueError, match="eval mode"):
        fp4attn.calibrate(model, b)
    model.eval()
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match='attn_implementation="eager"'):
        fp4attn.calibrate(model, b)
    model.config._attn_implementation = "sdpa"
    with fp4attn.patched(), pytest.raises(RuntimeError, match="unpatch"):
        fp4attn.calibrate(model, b)


def test_kl_top_tokens_and_tail_bucket():
    torch.manual_seed(3)
    p = torch.log_softmax(3 * torch.randn(5, 50, dtype=torch.float64), -1)
    q = torch.log_softmax(p + 0.3 * torch.randn(5, 50, dtype=torch.float64), -1)
    full = float((p.exp() * (p - q)).sum())
    top, idx = p.topk(50, -1)
    assert math.isclose(C._kl_sum(q, idx, top), full, rel_tol=1e-9)
    top, idx = p.topk(10, -1)
    part = C._kl_sum(q, idx, top)
    assert 0.5 * full < part <= full  # the tail as one bucket: a lower bound, close here
    # tokens the exact model rules out (-inf logits, fewer tokens than KL_TOP) add nothing: they
    # made the KL NaN, and a NaN passed calibrate's budget
    p[:, 40:] = -math.inf
    p = torch.log_softmax(p, -1)
    top, idx = p.topk(50, -1)
    got = C._kl_sum(q, idx, top)
    assert math.isfinite(got) and math.isclose(
        got, float(torch.where(p > -math.inf, p.exp() * (p - q), 0.0).sum()), rel_tol=1e-9)


def test_smallest_passing_probes_the_ends_then_bisects():
    """calibrate's search (and the fp4pv study's): m = 0 first, then the most accurate end, then
    bisection to the smallest passing m; None when even the most accurate end fails."""
    from fp4attn.calibration import smallest_passing

    for n, first_pass in ((10, 0), (10, 1), (10, 7), (10, 10), (1, 1), (0, 0)):
        probed = []

        def passes(m):
            probed.append(m)
            return m >= first_pass

        assert smallest_passing(passes, n) == first_pass
        assert probed[0] == 0 and (first_pass == 0 or probed[1] == n)
        assert len(probed) <= 2 + max(1, n).bit_length()
    assert smallest_passing(lambda m: False, 5) is None
