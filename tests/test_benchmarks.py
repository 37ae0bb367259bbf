"""The benchmark scripts write their result set with the provenance header (CPU benchmark only:
the GPU benchmark needs a GPU and minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from provenance import read_csv  # noqa: E402


def test_bench_cpu_writes_csv_with_header(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_cpu.py"), "--quick", "--repeats", "1",
           "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    head, rows = read_csv(str(tmp_path / "bench_cpu.csv"))
    assert list(head) == ["command", "hardware", "software", "date"]
    assert head["command"].endswith(
        f"python benchmarks/bench_cpu.py --quick --repeats 1 --out {tmp_path}")
    assert "logical CPUs" in head["hardware"]
    assert "torch " in head["software"] and "fp4attn " in head["software"]
    assert [(r["N"], r["D"], r["causal"]) for r in rows] == [("1024", "64", "False"),
                                                             ("1024", "64", "True")]
    assert all(float(r["fp4attn_ms"]) > 0 and float(r["ratio"]) > 0 for r in rows)


def test_committed_results_have_headers():
    for name in ("bench_cpu.csv", "bench_attention.csv"):
        head, rows = read_csv(str(ROOT / "benchmarks" / "results" / name))
        assert {"command", "hardware", "software"} <= set(head), name
        assert head["command"].startswith("python benchmarks/"), name
        assert rows, name


def test_bench_generate_smoke_runs_on_the_cpu(tmp_path):
    """The generation benchmark's code path (a toy model on the CPU; the numbers come from a GPU)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_generate.py"), "--tiny", "--device", "cpu",
           "--batches", "1", "--prompts", "2000", "--new", "3", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    head, rows = read_csv(str(tmp_path / "bench_generate.csv"))
    assert "python benchmarks/bench_generate.py --tiny" in head["command"]  # (after the environment that matters)
    # head dim 32: 64 bytes against 22, plus the residual ring of 31 tokens (2 B per token here)
    assert len(rows) == 1 and float(rows[0]["kv_ratio"]) > 2.5


def test_bench_train_step_smoke_runs_on_the_cpu(tmp_path):
    """The training-step benchmark's code path (a one-layer GPT on the CPU; the numbers come from
    a GPU): every arm asked for gets a row, with tokens/s and its ratio to torch's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train_step.py"), "--device", "cpu",
           "--seqs", "32,64", "--tokens", "64", "--layers", "1", "--dim", "32", "--heads", "2",
           "--steps", "1", "--warmup", "1", "--rounds", "2", "--arms", "int8,torch",
           "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    head, rows = read_csv(str(tmp_path / "bench_train_step.csv"))
    assert "python benchmarks/bench_train_step.py --device cpu" in head["command"]  # (after the environment that matters)
    assert [(r["seq"], r["batch"], r["arm"]) for r in rows] == [
        ("32", "2", "int8"), ("32", "2", "torch"), ("64", "1", "int8"), ("64", "1", "torch")]
    assert all(float(r["tokens_per_s"]) > 0 and float(r["vs_torch"]) > 0 for r in rows)
    assert all(float(r["vs_torch"]) == 1.0 for r in rows if r["arm"] == "torch")
