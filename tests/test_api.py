"""Front-end semantics: errors, explicit fallbacks, strict mode, the monkey-patch, op schemas."""

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import fp4attn

sdpa_module = importlib.import_module("fp4attn.sdpa")  # the module, not the function
ORIGINAL = sdpa_module.ORIGINAL_SDPA  # torch's own


def qkv(*shape, dtype=torch.float32, requires_grad=False):
    return [torch.randn(*shape, dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(sdpa_module, "_warned", set())
    monkeypatch.delenv("FP4ATTN_STRICT", raising=False)
    yield
    fp4attn.unpatch()


def test_errors_name_the_argument():
    q, k, v = qkv(1, 2, 16, 32)
    with pytest.raises(ValueError, match="attn_mask must be on the device of query"):
        fp4attn.sdpa(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        fp4attn.sdpa(q.numpy(), k, v)
    with pytest.raises(ValueError, match="key must have at least 3 dims"):
        fp4attn.sdpa(q, k[0, 0], v)
    with pytest.raises(TypeError, match="one dtype"):
        fp4attn.sdpa(q, k.half(), v)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fp4attn.sdpa(torch.randn(1, 4, 16, 32), k, v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fp4attn.sdpa(torch.randn(1, 3, 16, 32), k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="key head dim"):
        fp4attn.sdpa(q, torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16))
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        fp4attn.sdpa(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="attn_mask of shape"):
        fp4attn.sdpa(q, k, v, attn_mask=torch.ones(3, 16, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool or floating"):
        fp4attn.sdpa(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.int64))
    # a mask with dims beyond the scores' broadcasts with them but not to them
    with pytest.raises(ValueError, match="attn_mask of shape"):
        fp4attn.sdpa(q[0], k[0], v[0], attn_mask=torch.ones(1, 2, 16, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask of shape"):
        fp4attn.sdpa(q, k, v, attn_mask=torch.ones(2, 1, 2, 16, 16, dtype=torch.bool))


@pytest.mark.parametrize("precision", ["fp4", "int8"])
def test_flags_must_be_bool_as_in_torch(precision):
    """A truthy non-bool (the string "False") must not silently mean True."""
    q, k, v = qkv(1, 2, 16, 32)
    for name, value in (("is_causal", "False"), ("is_causal", 1), ("enable_gqa", None),
                        ("enable_gqa", torch.tensor(True))):
        with pytest.raises(TypeError, match=f"{name} must be bool"):
            fp4attn.sdpa(q, k, v, precision=precision, **{name: value})
        with pytest.raises(TypeError):  # torch refuses them too
            ORIGINAL(q, k, v, **{name: value})


def test_head_dim_zero_is_torchs_empty_result():
    q = torch.randn(1, 2, 8, 0)
    with pytest.warns(UserWarning, match="head dim 0"):
        out = fp4attn.sdpa(q, q, q)
    assert out.shape == (1, 2, 8, 0)


def test_plain_call_shortcut_implies_every_check_passes():
    """sdpa skips _check_args and _fallback_reason for what _plain_call accepts: over calls that
    vary one thing each, whatever it accepts must pass both, and the common call is accepted."""
    from fp4attn.sdpa import _check_args, _fallback_reason, _plain_call

    def t(*shape, dtype=torch.float16, device="cpu", grad=False):
        return torch.zeros(shape, dtype=dtype, device=device, requires_grad=grad)

    q, kv = t(2, 4, 5, 16), t(2, 2, 7, 16)
    calls = [((q, kv, kv), {})]
    calls += [((q, t(2, 2, 7, 16, dtype=d), kv), {}) for d in (torch.float32, torch.bfloat16)]
    calls += [((t(2, 4, 5, 16, dtype=d), t(2, 2, 7, 16, dtype=d), t(2, 2, 7, 16, dtype=d)), {})
              for d in (torch.float64, torch.int8, torch.bfloat16, torch.float32)]
    calls += [((t(*qs), t(*ks), t(*vs)), {}) for qs, ks, vs in [
        ((2, 4, 5, 16), (2, 3, 7, 16), (2, 3, 7, 16)),  # heads not a multiple
        ((2, 4, 5, 16), (2, 2, 7, 16), (2, 2, 7, 8)),  # value head dim
        ((2, 4, 5, 16), (2, 2, 7, 16), (2, 2, 6, 16)),  # key / value lengths
        ((2, 4, 5, 16), (1, 2, 7, 16), (1, 2, 7, 16)),  # batch
        ((2, 4, 5, 16), (2, 2, 7, 8), (2, 2, 7, 8)),  # key head dim
        ((2, 4, 5, 0), (2, 2, 7, 0), (2, 2, 7, 0)),  # head dim 0
        ((2, 4, 5, 264), (2, 2, 7, 264), (2, 2, 7, 264)),  # head dim > 256
        ((2, 4, 5, 16), (2, 2, 0, 16), (2, 2, 0, 16)),  # no keys
        ((2, 4, 5, 16), (2, 0, 7, 16), (2, 0, 7, 16)),  # no KV heads
        ((4, 5, 16), (2, 7, 16), (2, 7, 16)),  # 3-D
        ((1, 2, 4, 5, 16), (1, 2, 2, 7, 16), (1, 2, 2, 7, 16))]]  # 5-D
    calls += [((q, kv, t(2, 2, 7, 16, device="meta")), {}),
              ((t(2, 4, 5, 16, grad=True), kv, kv), {})]
    calls += [((q, kv, kv), kw) for kw in (
        {"attn_mask": t(5, 7, dtype=torch.bool)}, {"dropout_p": 0.1}, {"is_causal": 1},
        {"enable_gqa": 1}, {"enable_gqa": False})]
    accepted = 0
    for args, changed in calls:
        a = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "enable_gqa": True, **changed}
        for precision in ("fp4", "int8"):
            if not _plain_call(*args, a["attn_mask"], a["dropout_p"], a["is_causal"],
                               a["enable_gqa"], precision):
                continue
            accepted += 1
            _check_args(*args, a["attn_mask"], a["is_causal"], a["enable_gqa"])
            assert _fallback_reason(*args, a["attn_mask"], a["dropout_p"], precision) is None
    assert _plain_call(q, kv, kv, None, 0.0, True, True, "fp4")
    assert accepted == 2 + 2 * 2 + 1  # the common call, BF16 and FP32 alike, int8 with grad


def test_op_level_errors_from_the_binding():
    q, k, v = qkv(1, 2, 16, 32)
    with pytest.raises(RuntimeError, match="query must be 4-D"):
        torch.ops.fp4attn.attention(q[0], k, v, None, False, 1.0, False, "auto")
    with pytest.raises(RuntimeError, match="cuda_kernel must be one of auto, sm80, sm120, sm90, decode, got 'hopper'"):
        torch.ops.fp4attn.attention(q, k, v, None, False, 1.0, False, "hopper")
    for gpu_kernel in ("sm80", "sm90", "sm120", "decode"):
        with pytest.raises(RuntimeError, match="needs CUDA tensors"):
            torch.ops.fp4attn.attention(q, k, v, None, False, 1.0, False, gpu_kernel)


def test_ops_check_heads_and_head_dim_even_with_nothing_to_compute():
    """No keys (zeros and -inf) or no KV heads: the same shape errors as a call with work."""
    q = torch.randn(1, 3, 4, 8)
    empty = torch.randn(1, 2, 0, 8)
    for op in (torch.ops.fp4attn.int8_attention, torch.ops.fp4attn.attention):
        extra = () if op is torch.ops.fp4attn.int8_attention else (False,)
        with pytest.raises(RuntimeError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
            op(q, empty, empty, None, False, 1.0, *extra)
        with pytest.raises(RuntimeError, match=r"key/value heads \(0\)"):
            op(q, torch.randn(1, 0, 4, 8), torch.randn(1, 0, 4, 8), None, False, 1.0, *extra)
        wide = torch.randn(1, 1, 0, 300)
        with pytest.raises(RuntimeError, match="head_dim must be in"):
            op(torch.randn(1, 1, 4, 300), wide, wide, None, False, 1.0, *extra)
        flat = torch.randn(1, 1, 4, 0)  # rows but no head dim: its lse would be garbage
        with pytest.raises(RuntimeError, match="head_dim must be in"):
            op(flat, flat, flat, None, False, 1.0, *extra)


def test_ops_without_a_derivative_refuse_backward():
    """The FP4 ops have no backward: differentiating through one raises (it left q, k, v without
    a gradient, with only a deprecation warning); int8_attention refuses a mask that requires
    grad (SPEC_INT8 3: it gets none), as fp4attn.sdpa does."""
    q, k, v = qkv(1, 2, 16, 32, requires_grad=True)
    out, _ = torch.ops.fp4attn.attention(q, k, v, None, False, 0.2, False, "auto")
    with pytest.raises(RuntimeError, match="derivative for fp4attn::attention is not implemented"):
        out.sum().backward()
    x = torch.randn(4, 32, requires_grad=True)
    codes, scales, dec = torch.ops.fp4attn.quantize(x)
    with pytest.raises(RuntimeError, match="derivative for fp4attn::quantize is not implemented"):
        dec.sum().backward()
    bias = torch.zeros(16, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask must not require grad"):
        torch.ops.fp4attn.int8_attention(q, k, v, bias, False, 0.2)
    torch.ops.fp4attn.int8_attention(q, k, v, bias.detach(), False, 0.2)  # a constant mask is fine


def test_a_fallback_warns_under_non_strict_export():
    """torch.export (non-strict: plain Python) of an FP4 module whose inputs require grad exports
    torch's SDPA; it says so, as an eager call does (only dynamo's tracing stays silent)."""

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(32, 32))

        def forward(self, x):
            q = (x @ self.w).unflatten(-1, (2, 16)).transpose(1, 2)
            return fp4attn.sdpa(q, q, q)

    with pytest.warns(UserWarning, match="falling back to torch SDPA: an input requires grad"):
        torch.export.export(Attn(), (torch.randn(1, 8, 32),), strict=False)


def test_sizes_past_int64_offsets_are_refused():
    """Stride-0 views can describe 2^60 keys in no memory; the backends' padded buffer sizes
    would wrap around int64 (a zero-byte allocation, then writes past it)."""
    q = torch.randn(1, 1, 1, 1)
    k = torch.randn(1, 1, 1, 1).expand(1, 1, 2**60, 1)
    for op, extra in ((torch.ops.fp4attn.attention, (False,)), (torch.ops.fp4attn.int8_attention, ())):
        with pytest.raises((RuntimeError, NotImplementedError), match="sizes too large"):
            op(q, k, k, None, False, 1.0, *extra)


def test_kernel_env_names(monkeypatch):
    import importlib

    front = importlib.import_module("fp4attn.sdpa")  # the module (fp4attn.sdpa is the function)

    for name in ("auto", "sm80", "sm90", "sm120", "decode", "SM90"):
        monkeypatch.setenv("FP4ATTN_KERNEL", name)
        assert front._kernel_from_env() == name.lower()
    monkeypatch.setenv("FP4ATTN_KERNEL", "hopper")
    with pytest.raises(ValueError, match="FP4ATTN_KERNEL must be one of"):
        front._kernel_from_env()


@pytest.mark.parametrize("case", ["dropout", "grad", "dtype", "value_dim"])
def test_fallbacks_warn_once_and_match_torch(case):
    q, k, v = qkv(1, 2, 16, 32)
    kwargs = {}
    if case == "dropout":
        kwargs = {"dropout_p": 0.5}
    elif case == "grad":
        q.requires_grad_(True)
    elif case == "dtype":
        q, k, v = (t.double() for t in (q, k, v))
    elif case == "value_dim":
        v = torch.randn(1, 2, 16, 48)
    with pytest.warns(UserWarning, match="falling back to torch SDPA"):
        out = fp4attn.sdpa(q, k, v, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        out2 = fp4attn.sdpa(q, k, v, **kwargs)
    if case != "dropout":
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
        torch.testing.assert_close(out2, out)
    if case == "grad":
        out.sum().backward()  # the fallback keeps autograd working
        assert q.grad is not None


def test_strict_mode_keyword_and_env(monkeypatch):
    q, k, v = qkv(1, 2, 16, 32)
    with pytest.raises(fp4attn.FP4AttnFallbackError, match="dropout"):
        fp4attn.sdpa(q, k, v, dropout_p=0.1, strict=True)
    monkeypatch.setenv("FP4ATTN_STRICT", "1")
    with pytest.raises(fp4attn.FP4AttnFallbackError, match="dtype"):
        fp4attn.sdpa(*(t.double() for t in (q, k, v)))
    fp4attn.sdpa(q, k, v)  # the FP4 path is fine in strict mode
    with pytest.raises(fp4attn.FP4AttnFallbackError):
        fp4attn.sdpa(q, k, v, return_lse=True, dropout_p=0.1, strict=False)


def test_no_grad_inputs_with_requires_grad_use_fp4():
    q, k, v = qkv(1, 2, 16, 32, requires_grad=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fp4attn.sdpa(q, k, v)
    assert not out.requires_grad


def test_patch_is_idempotent_and_reversible():
    original = F.scaled_dot_product_attention
    fp4attn.patch()
    fp4attn.patch()
    assert fp4attn.is_patched() and F.scaled_dot_product_attention is not original
    fp4attn.unpatch()
    assert F.scaled_dot_product_attention is original
    fp4attn.unpatch()
    assert F.scaled_dot_product_attention is original
    with fp4attn.patched():
        assert fp4attn.is_patched()
        with fp4attn.patched():
            pass
        assert fp4attn.is_patched()  # inner exit keeps the outer state
    assert F.scaled_dot_product_attention is original


def test_patched_function_computes_fp4():
    q, k, v = qkv(1, 2, 64, 32)
    with fp4attn.patched():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, fp4attn.sdpa(q, k, v, is_causal=True), rtol=0, atol=0)
    assert not torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_patch_preserves_the_function_in_place_before():
    calls = []
    prior = F.scaled_dot_product_attention

    def wrapper(*a, **kw):
        calls.append(1)
        return prior(*a, **kw)

    F.scaled_dot_product_attention = wrapper
    try:
        fp4attn.patch()
        fp4attn.unpatch()
        assert F.scaled_dot_product_attention is wrapper
    finally:
        F.scaled_dot_product_attention = prior


def test_build_info():
    info = fp4attn.build_info()
    assert set(info) >= {"cuda", "cuda_archs", "openmp"}


@pytest.mark.parametrize("op", ["quantize", "dequantize", "fp4mm", "attention", "kv_append",
                                "decode"])
def test_opcheck(op):
    x = torch.randn(2, 20, 40)
    if op in ("kv_append", "decode"):  # the tensors as an FP4KVCache holds them
        cache = fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32)
        k, v = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64)
        if op == "decode":
            cache.append(k, v)
            args = (torch.randn(1, 4, 1, 64), *cache.storage(), cache.seq_lens, 0.125)
        else:
            args = (k, v, *cache.storage(), 0, True, None, 128)
    elif op == "quantize":
        args = (x,)
    elif op == "dequantize":
        codes, scales, dec = torch.ops.fp4attn.quantize(x)
        args = (codes, scales, dec, 40)
    elif op == "fp4mm":
        a = torch.ops.fp4attn.quantize(x)
        b = torch.ops.fp4attn.quantize(torch.randn(2, 12, 40))
        args = (*a, *b, 40, torch.float16)
    else:
        q, k, v = qkv(1, 2, 20, 32)
        args = (q, k, v, torch.rand(20, 20) > 0.2, False, 0.2, True, "auto")
    torch.library.opcheck(getattr(torch.ops.fp4attn, op).default, args)


def test_torch_compile_fullgraph_cpu():
    q, k, v = qkv(1, 2, 40, 32)

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v):
        return torch.ops.fp4attn.attention(q, k, v, None, True, 0.125, False, "auto")[0] * 2

    @torch.compile(fullgraph=True, backend="eager")
    def g(q, k, v):  # the public front end traces without graph breaks too
        return fp4attn.sdpa(q, k, v, is_causal=True, scale=0.125) * 2

    expected = 2 * fp4attn.sdpa(q, k, v, is_causal=True, scale=0.125)
    torch.testing.assert_close(f(q, k, v), expected)
    torch.testing.assert_close(g(q, k, v), expected)


@pytest.mark.parametrize("precision", ["fp4", "int8"])
@pytest.mark.parametrize("where", ["q", "k"])
def test_a_nan_input_gives_nan_rows_not_zeros(precision, where):
    """A NaN in Q or K reaches the output as NaN (through the smoothing means and scales, every row
    of its head), never as the 0 of a row without visible keys; other heads are unchanged."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 150, 64, generator=g) for _ in range(3))
    clean = fp4attn.sdpa(q, k, v, precision=precision)
    (q if where == "q" else k)[0, 0, 3, 5] = float("nan")
    out = fp4attn.sdpa(q, k, v, precision=precision)
    assert out[0, 0, 3].isnan().all()
    assert not (out[0, 0] == 0).all(dim=-1).any()
    assert torch.equal(out[0, 1], clean[0, 1])


def test_quantize_and_fp4mm_say_that_no_gradient_flows():
    """NVFP4 quantization has no gradient: where one is asked for, a warning names the input
    (fp4mm's result would otherwise silently stop it); none under no_grad or for detached input."""
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(8, 32)
    with pytest.warns(UserWarning, match="fp4mm: a requires grad"):
        fp4attn.fp4mm(x, w)
    with pytest.warns(UserWarning, match="quantize: x requires grad"):
        fp4attn.quantize(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            fp4attn.fp4mm(x, w)
        fp4attn.fp4mm(x.detach(), w)
        fp4attn.quantize(x.detach())


def test_unpatch_under_a_later_wrapper_reaches_torch():
    """A wrapper installed over the patch keeps calling patched_sdpa after unpatch(): torch's own
    SDPA answers then, not FP4."""
    q, k, v = qkv(1, 2, 32, 64)
    fp4attn.patch("int8")
    inner = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *a, **kw: inner(*a, **kw)
    try:
        fp4attn.unpatch()
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), ORIGINAL(q, k, v))
    finally:
        F.scaled_dot_product_attention = ORIGINAL


def test_five_d_query_with_a_four_d_mask_broadcasts_as_torch():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 2, 16, 64, generator=g) for _ in range(3))
    mask = torch.randn(3, 1, 16, 16, generator=g)
    ref = ORIGINAL(q.double(), k.double(), v.double(), attn_mask=mask.double())
    for precision, tol in (("fp4", 0.97), ("int8", 0.9999)):
        out = fp4attn.sdpa(q, k, v, attn_mask=mask, precision=precision)
        assert F.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0) > tol


@pytest.mark.parametrize("precision", ["fp4", "int8"])
def test_autocast_casts_like_torch_sdpa(precision):
    """Under autocast torch's SDPA runs in the autocast dtype (and takes mixed input dtypes)."""
    q, k, v = qkv(1, 2, 32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ORIGINAL(q, k, v).dtype == torch.bfloat16
        assert fp4attn.sdpa(q, k, v, precision=precision).dtype == torch.bfloat16
        assert fp4attn.sdpa(q, k.bfloat16(), v, precision=precision).dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["fp4", "int8"])
def test_autocast_leaves_float64_alone_like_torch_sdpa(precision):
    """Autocast does not cast float64 tensors: torch's SDPA runs them in float64, so must we."""
    q, k, v = (t.double() for t in qkv(1, 2, 32, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float64 falls back to torch SDPA
        out = fp4attn.sdpa(q, k, v, precision=precision)
        want = ORIGINAL(q, k, v)
    assert out.dtype == want.dtype == torch.float64 and torch.equal(out, want)


def test_a_fallback_compiles_with_fullgraph(monkeypatch):
    """A call that falls back to torch SDPA traces with fullgraph=True also before its one-time
    warning has been given (the warning is an eager-mode message)."""
    monkeypatch.setattr(importlib.import_module("fp4attn.sdpa"), "_warned", set())
    q, k, v = (t.double() for t in qkv(1, 2, 16, 32))
    f = torch.compile(lambda q, k, v: fp4attn.sdpa(q, k, v, precision="int8"), fullgraph=True,
                      backend="eager")
    assert torch.equal(f(q, k, v), ORIGINAL(q, k, v))
    with pytest.warns(UserWarning, match="falling back"):
        fp4attn.sdpa(q, k, v, precision="int8")


def test_cli_info_rejects_unknown_arguments(capsys):
    from fp4attn.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["info", "--bogus"])
    assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_meta_tensors_fall_back_with_a_warning():
    """Devices fp4attn does not compute on fall back (autocast, which knows no "meta", is not
    asked about them)."""
    q = torch.randn(1, 1, 4, 8, device="meta")
    with pytest.warns(UserWarning, match="device meta"):
        assert fp4attn.sdpa(q, q, q).shape == (1, 1, 4, 8)


def jagged(lengths, heads, dim=32, device="cpu", requires_grad=False):
    """A jagged [B, heads, j, dim] tensor (torch SDPA's varlen form) and its leaf values."""
    leaf = torch.randn(sum(lengths), heads, dim, device=device, requires_grad=requires_grad)
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
    return leaf, torch.nested.nested_tensor_from_jagged(leaf, offsets).transpose(1, 2)


def per_sequence(t):
    """The [1, H, n, D] dense copies of a jagged tensor's sequences."""
    o = t.offsets().tolist()
    return [t.values()[None, :, a:b].contiguous() for a, b in zip(o, o[1:])]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("precision", ["fp4", "int8"])
@pytest.mark.parametrize("causal", [False, True])
def test_jagged_inputs_are_per_sequence_calls(device, precision, causal):
    """Variable-length sequences as jagged nested tensors: bit for bit each sequence's own call
    (incl. cross-attention lengths, GQA and one-token sequences); out and lse jagged like q."""
    _, q = jagged([20, 1, 150, 33], 4, device=device)
    _, k = jagged([40, 7, 150, 1], 2, device=device)
    _, v = jagged([40, 7, 150, 1], 2, device=device)
    out, lse = fp4attn.sdpa(q, k, v, is_causal=causal, enable_gqa=True, precision=precision,
                            return_lse=True)
    assert out.is_nested and out.shape[2] == q.shape[2] and lse.shape[2] == q.shape[2]
    assert (out + q).shape == q.shape  # the same ragged structure
    assert out.values().shape == q.values().shape and out.dtype == q.dtype
    at = q.offsets().tolist()
    for i, (qi, ki, vi) in enumerate(zip(per_sequence(q), per_sequence(k), per_sequence(v))):
        o, l = fp4attn.sdpa(qi, ki, vi, is_causal=causal, enable_gqa=True, precision=precision,
                            return_lse=True)
        assert torch.equal(out.values()[:, at[i]:at[i + 1]], o[0])
        assert torch.equal(lse.values()[:, at[i]:at[i + 1]], l[0])
        exact = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, enable_gqa=True)
        assert (o - exact).abs().max() < (0.5 if precision == "fp4" else 0.1)
    with fp4attn.patched(precision=precision):  # models calling F.sdpa on jagged tensors
        patched = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert torch.equal(patched.values(), out.values())


def test_jagged_int8_gradients_are_the_per_sequence_ones():
    leaves, inputs = zip(*(jagged([24, 3, 70], h, requires_grad=True) for h in (4, 2, 2)))
    out = fp4attn.sdpa(*inputs, is_causal=True, enable_gqa=True, precision="int8")
    grad_out = torch.randn_like(out.values())
    out.values().backward(grad_out)
    dense = [[t.detach().requires_grad_() for t in per_sequence(x)] for x in inputs]
    at = inputs[0].offsets().tolist()
    for i, (qi, ki, vi) in enumerate(zip(*dense)):
        o = fp4attn.sdpa(qi, ki, vi, is_causal=True, enable_gqa=True, precision="int8")
        o.backward(grad_out[None, :, at[i]:at[i + 1]])
    for leaf, parts in zip(leaves, dense):  # leaf [total, H, D]; parts [1, H, n, D]
        want = torch.cat([p.grad[0].transpose(0, 1) for p in parts])
        assert torch.equal(leaf.grad, want)


@pytest.mark.parametrize("precision", ["fp4", "int8"])
def test_jagged_sequences_without_keys_and_empty_batches(precision):
    """A sequence with no keys gives the rows that see none (0, lse -inf) without a fallback, so
    strict and return_lse hold for the others; a batch of no sequences gives an empty result."""
    _, q = jagged([5, 2, 7], 2)
    _, k = jagged([5, 0, 7], 2)
    out, lse = fp4attn.sdpa(q, k, k, precision=precision, strict=True, return_lse=True)
    assert torch.equal(out.values()[:, 5:7], torch.zeros(2, 2, 32))
    assert torch.equal(lse.values()[:, 5:7], torch.full((2, 2), -float("inf")))
    alone = fp4attn.sdpa(*per_sequence(q)[2:], *per_sequence(k)[2:] * 2, precision=precision)
    assert torch.equal(out.values()[:, 7:], alone[0])
    _, none = jagged([], 2)
    empty, empty_lse = fp4attn.sdpa(none, none, none, precision=precision, return_lse=True)
    assert empty.shape[0] == 0 and empty.values().shape == (2, 0, 32) and empty_lse.shape[0] == 0


def test_jagged_inputs_refused_with_reasons():
    _, q = jagged([5, 9], 2)
    _, k = jagged([5, 9], 2)
    _, other = jagged([5, 8], 2)
    dense = torch.randn(2, 2, 9, 32)
    with pytest.raises(ValueError, match="all be nested tensors or none: key"):
        fp4attn.sdpa(q, dense, dense)
    with pytest.raises(ValueError, match="attn_mask is not supported"):
        fp4attn.sdpa(q, k, k, attn_mask=torch.ones(9, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="same sequence lengths"):
        fp4attn.sdpa(q, k, other)
    with pytest.raises(ValueError, match="ragged dim 2"):
        fp4attn.sdpa(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
    with pytest.raises(ValueError, match="one batch"):
        fp4attn.sdpa(q, *[jagged([5, 9, 3], 2)[1]] * 2)
    strided = torch.nested.nested_tensor([torch.randn(2, 5, 32), torch.randn(2, 9, 32)])
    with pytest.raises(ValueError, match="layout torch.strided"):
        fp4attn.sdpa(strided, strided, strided)
    holes = torch.nested.narrow(torch.randn(2, 9, 2 * 32), 1, torch.tensor([0, 2]),
                                torch.tensor([5, 6]), layout=torch.jagged)
    holes = holes.unflatten(-1, (2, 32)).transpose(1, 2)
    with pytest.raises(ValueError, match="holes"):
        fp4attn.sdpa(holes, holes, holes)


@pytest.mark.parametrize("precision", ["fp4", "int8"])
def test_three_d_inputs_take_gqa_as_torch(precision):
    """3-D inputs [H, L, E]: dim -3 is the heads, GQA included, as torch SDPA reads them."""
    q, k, v = torch.randn(4, 40, 32), torch.randn(2, 50, 32), torch.randn(2, 50, 32)
    out = fp4attn.sdpa(q, k, v, is_causal=True, enable_gqa=True, precision=precision)
    four_d = fp4attn.sdpa(q[None], k[None], v[None], is_causal=True, enable_gqa=True,
                          precision=precision)
    assert torch.equal(out, four_d[0])
    exact = ORIGINAL(q, k, v, is_causal=True, enable_gqa=True)
    assert (out - exact).norm() / exact.norm() < (0.3 if precision == "fp4" else 0.03)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fp4attn.sdpa(q, k, v, precision=precision)


@pytest.mark.parametrize("precision", ["fp4", "int8"])
@pytest.mark.parametrize("lengths", [(5, 40), (40, 40), (130, 300)])
def test_torch_causal_bias_masks(precision, lengths):
    """torch's causal_lower_right / causal_upper_left masks (a CausalBias, whose tensor is
    uninitialized memory: it was read as an additive mask, silently wrong) are the causal
    patterns they name, as an explicit mask or is_causal gives them, patched too."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    L, S = lengths
    q, k, v = torch.randn(1, 4, L, 32), torch.randn(1, 2, S, 32), torch.randn(1, 2, S, 32)
    lower_right = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    for bias, same in ((causal_lower_right(L, S), dict(attn_mask=lower_right)),
                       (causal_upper_left(L, S), dict(is_causal=True))):
        out = fp4attn.sdpa(q, k, v, attn_mask=bias, enable_gqa=True, precision=precision)
        assert torch.equal(out, fp4attn.sdpa(q, k, v, enable_gqa=True, precision=precision,
                                             **same))
        with fp4attn.patched(precision=precision):
            assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                              enable_gqa=True), out)
        exact = ORIGINAL(q, k, v, attn_mask=bias, enable_gqa=True)
        assert (out - exact).norm() / exact.norm() < (0.3 if precision == "fp4" else 0.03)
    with pytest.raises(ValueError, match="CausalBias for 5 queries"):
        fp4attn.sdpa(q, k, v, attn_mask=causal_lower_right(5, S + 1), enable_gqa=True,
                     precision=precision)
    with pytest.raises(ValueError, match="cannot be used together"):
        fp4attn.sdpa(q, k, v, attn_mask=causal_lower_right(L, S), is_causal=True,
                     enable_gqa=True, precision=precision)


def test_a_meta_tensor_among_real_ones_is_refused():
    """One meta argument sends an op to its fake kernel, whose result is uninitialized memory:
    the fakes check the devices as the real kernels do (a silently wrong decode before)."""
    cache = fp4attn.FP4KVCache(1, 2, 64, dtype=torch.float32)
    cache.append(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64))
    storage = list(cache.storage())
    storage[3] = storage[3].to("meta")
    with pytest.raises(RuntimeError, match="v_codes is on meta but q on cpu"):
        fp4attn.decode_paged(torch.randn(1, 4, 1, 64), *storage, cache.seq_lens,
                             **cache.residual())
    with pytest.raises(RuntimeError, match="kv_append: k_codes is on meta"):
        torch.ops.fp4attn.kv_append(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64),
                                    storage[0].to("meta"), *storage[1:], 40, False)
    a = fp4attn.quantize(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="b_codes is on meta"):
        torch.ops.fp4attn.fp4mm(a.codes, a.scales, a.dec, a.codes.to("meta"), a.scales, a.dec,
                                64, torch.float32)
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(RuntimeError, match="k is on meta"):
        torch.ops.fp4attn.int8_attention(q, q.to("meta"), q, None, False, 0.2)


# Tests from a mutation run of the front end (each pins a behaviour a plausible bug would break).

def test_head_dim_256_is_computed_257_falls_back():
    q, k, v = qkv(1, 2, 8, 256)
    fp4attn.sdpa(q, k, v, strict=True)
    q, k, v = qkv(1, 2, 8, 257)
    with pytest.raises(fp4attn.FP4AttnFallbackError, match="> 256"):
        fp4attn.sdpa(q, k, v, strict=True)


def test_empty_key_sequence_falls_back_to_torch():
    q, k = torch.randn(1, 2, 4, 32), torch.randn(1, 2, 0, 32)
    with pytest.warns(UserWarning, match="empty key sequence"):
        out = fp4attn.sdpa(q, k, k)
    torch.testing.assert_close(out, ORIGINAL(q, k, k))
    with pytest.raises(fp4attn.FP4AttnFallbackError, match="empty key"):
        fp4attn.sdpa(q, k, k, strict=True)


def test_a_fallback_forwards_enable_gqa_and_scale():
    q = torch.randn(1, 4, 8, 32, dtype=torch.float64)  # float64: torch's
    k, v = (torch.randn(1, 2, 8, 32, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fp4attn.sdpa(q, k, v, enable_gqa=True, scale=0.05, is_causal=True)
    torch.testing.assert_close(out, ORIGINAL(q, k, v, enable_gqa=True, scale=0.05,
                                             is_causal=True))


@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_lse_has_the_callers_leading_dims(lead):
    q, k, v = qkv(*lead, 2, 8, 32)
    out, lse = fp4attn.sdpa(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    _, four_d = fp4attn.sdpa(*(t.reshape(-1, 2, 8, 32) for t in (q, k, v)), return_lse=True)
    assert torch.equal(lse, four_d.reshape(q.shape[:-1]))


def test_jagged_forwards_scale_and_takes_the_autocast_dtype():
    q, k, v = jagged([5, 9], 2)[1], jagged([6, 3], 2)[1], jagged([6, 3], 2)[1]
    out = fp4attn.sdpa(q, k, v, scale=0.05)
    for got, qi, ki, vi in zip(out.unbind(), q.unbind(), k.unbind(), v.unbind()):
        assert torch.equal(got, fp4attn.sdpa(qi[None], ki[None], vi[None], scale=0.05)[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp4attn.sdpa(q, k, v)
    assert out.dtype == torch.bfloat16 and out.values().dtype == torch.bfloat16


def test_patched_restores_what_unpatch_restores():
    original = F.scaled_dot_product_attention
    with fp4attn.patched():
        pass
    assert F.scaled_dot_product_attention is original

    def wrapper(*a, **kw):  # e.g. a profiler's, installed after the with block
        return original(*a, **kw)

    F.scaled_dot_product_attention = wrapper
    try:
        assert not fp4attn.is_patched()
    finally:
        F.scaled_dot_product_attention = original


def test_opcheck_attention_without_lse_and_fp4mm_broadcasting_b():
    q, k, v = qkv(1, 2, 20, 32)
    torch.library.opcheck(torch.ops.fp4attn.attention.default,
                          (q, k, v, None, False, 0.2, False, "auto"))
    a = torch.ops.fp4attn.quantize(torch.randn(12, 40))
    b = torch.ops.fp4attn.quantize(torch.randn(3, 2, 10, 40))
    torch.library.opcheck(torch.ops.fp4attn.fp4mm.default, (*a, *b, 40, torch.float16))


def test_fake_attention_refuses_a_mask_on_another_device():
    q = torch.randn(1, 2, 8, 32, device="meta")
    with pytest.raises(RuntimeError, match="attn_mask is on cpu"):
        torch.ops.fp4attn.attention.default(q, q, q, torch.ones(8, 8, dtype=torch.bool), False,
                                            0.2, False, "auto")
