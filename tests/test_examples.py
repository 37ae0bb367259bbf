"""Every example runs, offline, at a small size (subprocesses, as a user would run them)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4attn.eval import models as M

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, timeout: int = 300) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the network
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert p.returncode == 0, f"{name} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _smollm2_missing() -> str | None:
    try:
        M.smollm2_gguf()
    except M.MissingResourceError as exc:
        return str(exc)
    for mod, line in (("gguf", "pip install --no-deps gguf"), ("accelerate", "pip install accelerate")):
        if importlib.util.find_spec(mod) is None:
            return f"needs {mod}: {line}"
    return None


needs_smollm2 = pytest.mark.skipif(_smollm2_missing() is not None, reason=_smollm2_missing() or "")


def test_quantize_fp4mm_random():
    out = run_example("quantize_fp4mm.py", "--random")
    assert "random normal 1536 x 384" in out
    assert "4.50 bits per weight" in out
    line = next(l for l in out.splitlines() if "dequantize-then-matmul" in l)
    assert float(line.split("rel_l1")[1].split()[0]) < 1e-5


def test_quantize_fp4mm_real_weight():
    try:
        M.minilm_dir()
    except M.MissingResourceError as exc:
        pytest.skip(str(exc))
    out = run_example("quantize_fp4mm.py")
    assert "all-MiniLM-L6-v2 encoder.layer.0.intermediate.dense" in out
    cos = float(next(l for l in out.splitlines() if "fp4mm (NVFP4" in l).split("cos")[1])
    assert cos > 0.98


@pytest.mark.models
@needs_smollm2
def test_generate_patch():
    out = run_example("generate_patch.py", "--max-new-tokens", "6")
    assert "--- exact attention" in out and "--- fp4attn.patched()" in out
    exact, fp4 = out.split("--- fp4attn.patched()")
    assert len(exact.splitlines()) >= 2 and len(fp4.splitlines()) >= 2


@pytest.mark.models
@needs_smollm2
def test_generate_attn_implementation():
    out = run_example("generate_attn_implementation.py", "--max-new-tokens", "6")
    assert "attention implementation: fp4attn" in out
    assert "--- fp4attn" in out and "--- sdpa (exact)" in out


def test_train_gpt_int8_runs_both_attentions(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"It is a truth universally acknowledged. " * 400)
    run_example("train_gpt_int8.py", "--corpus", str(corpus), "--steps", "4", "--eval-every", "2",
                "--val-batches", "1", "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "32",
                "--batch", "2", "--probe-every", "2", "--probe-save-layer", "0", "--out", str(tmp_path))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from provenance import read_csv

    _, rows = read_csv(str(tmp_path / "train_gpt_int8.csv"))
    assert [(r["run"], r["step"]) for r in rows] == [("torch", "2"), ("torch", "4"), ("int8", "2"),
                                                     ("int8", "4")]
    # the int8 arm's weights are also evaluated with exact attention: close to int8, and not the
    # same number at every step (at 5 decimals the two can agree at one step of this tiny model)
    def column(run, name):
        return [float(r[name]) for r in rows if r["run"] == run]

    exact, val = ({run: column(run, c) for run in ("torch", "int8")}
                  for c in ("val_loss_exact_attention", "val_loss"))
    assert exact["torch"] == val["torch"] and exact["int8"] != val["int8"]
    assert all(abs(e / v - 1) < 0.05 for e, v in zip(exact["int8"], val["int8"]))
    # the gradient probe: one row per probed step and layer, the int8 op close to exact attention
    _, probe = read_csv(str(tmp_path / "train_gpt_int8_probe.csv"))
    assert [(r["step"], r["layer"]) for r in probe] == [("2", "0"), ("4", "0")]
    assert all(0.99 < float(r[c]) <= 1.0 + 1e-9 for r in probe
               for c in ("cos_out", "cos_dq", "cos_dk", "cos_dv"))
    saved = torch.load(tmp_path / "probe_tensors_seed0" / "step4_layer0.pt")
    assert saved["q"].shape == saved["dout"].shape == (1, 2, 32, 16)
    head, rows = read_csv(str(ROOT / "docs" / "results" / "train_gpt_int8.csv"))  # committed
    assert head["command"].startswith("python examples/train_gpt_int8.py")
    assert {r["run"] for r in rows} == {"torch", "int8"}
    # one arm again, the other reused from that result: the same torch rows, the reuse named
    again = tmp_path / "again"
    common = ["--corpus", str(corpus), "--steps", "4", "--eval-every", "2", "--val-batches", "1",
              "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "32", "--batch", "2"]
    run_example("train_gpt_int8.py", *common, "--arms", "int8", "--reuse",
                str(tmp_path / "train_gpt_int8.csv"), "--out", str(again))
    head2, rows2 = read_csv(str(again / "train_gpt_int8.csv"))
    assert "the torch arm from" in head2["reused"]
    first = [r for r in read_csv(str(tmp_path / "train_gpt_int8.csv"))[1] if r["run"] == "torch"]
    assert [(r["step"], float(r["val_loss"])) for r in rows2 if r["run"] == "torch"] == [
        (r["step"], float(r["val_loss"])) for r in first]
    assert [r["step"] for r in rows2 if r["run"] == "int8"] == ["2", "4"]
    with pytest.raises(AssertionError, match="--arms names both"):  # nothing to reuse
        run_example("train_gpt_int8.py", *common, "--reuse", str(tmp_path / "train_gpt_int8.csv"),
                    "--out", str(again))
    with pytest.raises(AssertionError, match="--reuse names"):  # an arm left out needs --reuse
        run_example("train_gpt_int8.py", *common, "--arms", "int8", "--out", str(again))
    reuse = ["--arms", "int8", "--reuse", str(tmp_path / "train_gpt_int8.csv"), "--out", str(again)]
    with pytest.raises(AssertionError, match="its runs used --steps 4, this one 6"):  # same protocol
        run_example("train_gpt_int8.py", *common[:2], "--steps", "6", *common[4:], *reuse)
    with pytest.raises(AssertionError, match="its runs used --dim 32, this one 48"):
        run_example("train_gpt_int8.py", *common[:10], "--dim", "48", *common[12:], *reuse)
    with pytest.raises(AssertionError, match="no torch run of seed 1 to step 4"):  # same seeds
        run_example("train_gpt_int8.py", *common, "--seeds", "1", *reuse)


@needs_smollm2
def test_finetune_smollm2_int8_runs(tmp_path):
    out = run_example("finetune_smollm2_int8.py", "--steps", "2", "--eval-every", "1", "--batch",
                      "1", "--seq", "32", "--val-tokens", "64", "--out", str(tmp_path), timeout=600)
    assert "int8 vs sdpa: final validation loss" in out
    assert (tmp_path / "finetune_smollm2_int8.csv").exists()
