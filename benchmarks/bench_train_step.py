"""Training-step throughput: the GPT of examples/train_gpt_int8.py (forward, backward, AdamW step,
bf16 autocast on the GPU) with fp4attn's 8-bit attention against torch SDPA, same weights, same
batches, in one process.

Arms: int8 (`fp4attn.sdpa(..., precision="int8")`), torch (torch SDPA as it picks its backend) and
torch pinned to flash and to cuDNN where they run. Each round times every arm for --steps steps
after a warm-up (CUDA events around the loop, synchronised), arms in turn, so slow drifts of the
machine (clocks, other tenants) fall on all of them; the result is the median over --rounds
rounds of ms per step and tokens/s, with the rounds' range. Single training runs vary more than
the difference between the arms (docs/performance.md); this is the number the training example's
"tokens/s" stands for. Writes bench_train_step.csv (and .png) into --out.

    python benchmarks/bench_train_step.py                      # seq 1K / 2K / 4K, 8K tokens a step
    python benchmarks/bench_train_step.py --seqs 1024 --rounds 9
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import fp4attn  # noqa: E402
from fp4attn.sdpa import ORIGINAL_SDPA  # noqa: E402
from provenance import announce, cpu_description, gpu_description, print_table, write_csv  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def example_gpt():
    """The GPT class of examples/train_gpt_int8.py (one model definition for both scripts)."""
    examples = os.path.join(HERE, "..", "examples")
    sys.path.insert(0, examples)  # its own imports (loss_curves)
    path = os.path.join(examples, "train_gpt_int8.py")
    spec = importlib.util.spec_from_file_location("train_gpt_int8", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.GPT


def attention(arm: str):
    if arm == "int8":  # strict: a fallback to torch SDPA raises (the arm is then not run)
        return lambda q, k, v: fp4attn.sdpa(q, k, v, is_causal=True, precision="int8", strict=True)
    backends = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION]}
    if arm in backends:
        def pinned(q, k, v):
            with sdpa_kernel(backends[arm]):
                return ORIGINAL_SDPA(q, k, v, is_causal=True)
        return pinned
    return lambda q, k, v: ORIGINAL_SDPA(q, k, v, is_causal=True)


class Arm:
    """One model and optimizer with one attention; step() trains on a batch."""

    def __init__(self, name, GPT, args, seq, device):
        torch.manual_seed(0)  # the same initial weights in every arm
        self.name = name
        self.model = GPT(args.layers, args.dim, args.heads, seq, attention(name)).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
        self.amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                    else torch.autocast("cpu", enabled=False))
        self.ms: list[float] = []

    def step(self, b):
        with self.amp:
            loss = F.cross_entropy(self.model(b[:, :-1]).float().flatten(0, 1), b[:, 1:].flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def runs(arm: Arm, b) -> bool:
    """Whether the arm trains at all here (a pinned torch backend may not take the shape; the
    int8 arm may not run in INT8)."""
    try:
        arm.step(b)
        return True
    except (RuntimeError, fp4attn.FP4AttnFallbackError) as exc:
        print(f"  {arm.name}: not run ({str(exc).splitlines()[0][:100]})")
        return False


def timed(arm: Arm, batches, device) -> float:
    """ms per step over the batches."""
    if device.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        for b in batches:
            arm.step(b)
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / len(batches)
    t0 = time.perf_counter()
    for b in batches:
        arm.step(b)
    return (time.perf_counter() - t0) * 1e3 / len(batches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="1024,2048,4096", help="comma-separated sequence lengths")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch = tokens / seq)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per arm and round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per arm before round 1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arms", default="int8,torch,flash,cudnn")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    for name in ("tokens", "layers", "dim", "heads", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        raise SystemExit(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    arms = args.arms.split(",")
    known = ("int8", "torch", "flash", "cudnn")
    if not arms or any(a not in known for a in arms) or len(set(arms)) != len(arms):
        raise SystemExit(f"--arms must name some of {', '.join(known)} once each, got {args.arms!r}")
    seqs = [int(s) for s in args.seqs.split(",")]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    head = announce(gpu_description() if device.type == "cuda" else cpu_description())
    GPT = example_gpt()
    rows = []
    for seq in seqs:
        batch = max(1, args.tokens // seq)
        g = torch.Generator().manual_seed(seq)
        data = [torch.randint(0, 256, (batch, seq + 1), generator=g).to(device)
                for _ in range(args.steps)]
        present = [Arm(a, GPT, args, seq, device) for a in arms]
        present = [a for a in present if runs(a, data[0])]
        for a in present:
            for i in range(args.warmup):
                a.step(data[i % len(data)])
        for r in range(args.rounds):  # the arms' order rotates from round to round
            for a in present[r % len(present):] + present[:r % len(present)]:
                a.ms.append(timed(a, data, device))
        base = next((a for a in present if a.name == "torch"), None)
        for a in present:
            ms = statistics.median(a.ms)
            row = {"seq": seq, "batch": batch, "arm": a.name, "ms_per_step": round(ms, 4),
                   "ms_min": round(min(a.ms), 4), "ms_max": round(max(a.ms), 4),
                   "tokens_per_s": round(batch * seq / ms * 1e3),
                   "vs_torch": round(statistics.median(base.ms) / ms, 4) if base else ""}
            rows.append(row)
        present = base = a = None  # the models go before the next sequence length
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print()
    print_table(["seq", "batch", "arm", "ms / step (median, range)", "tokens/s", "vs torch"],
                [[str(r["seq"]), str(r["batch"]), r["arm"],
                  f"{r['ms_per_step']:.2f} ({r['ms_min']:.2f}-{r['ms_max']:.2f})",
                  f"{r['tokens_per_s']:,}", f"{r['vs_torch']:.3f}x" if r["vs_torch"] != "" else "-"]
                 for r in rows])
    if not rows:
        raise SystemExit("no arm ran")
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "bench_train_step.csv"), head, rows)
    plot(rows, os.path.join(args.out, "bench_train_step.png"), head["hardware"])
    return 0


def plot(rows, path, hardware):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    seqs = sorted({r["seq"] for r in rows})
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs = [j + i * width for j, s in enumerate(seqs) if any(r["seq"] == s and r["arm"] == arm for r in rows)]
        ys = [r["tokens_per_s"] / 1e3 for s in seqs for r in rows if r["seq"] == s and r["arm"] == arm]
        ax.bar(xs, ys, width, label=arm)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqs))], [str(s) for s in seqs])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("thousand tokens / s (median)")
    ax.set_title(f"GPT training step, {hardware}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
