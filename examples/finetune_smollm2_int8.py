"""Fine-tuning side by side on the CPU: SmolLM2-135M (the packaged model) on Jane Austen's text,
once with `attn_implementation="fp4attn-int8"` (the 8-bit trainable attention,
docs/SPEC_INT8.md) and once with torch SDPA, same seed, same batches. Prints a table and writes
finetune_smollm2_int8.csv (headed by the command, hardware and software: see provenance.py) and
finetune_smollm2_int8.png into --out (default: docs/results/, where the committed plot lives).

    python examples/finetune_smollm2_int8.py [--steps 100] [--out DIR]

Needs the packaged model and corpus: `bash scripts/install_models.sh`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))  # provenance: the result header
from fp4attn.eval.models import austen_text, load_smollm2  # noqa: E402
from fp4attn.integrations import transformers as fp4_transformers  # noqa: E402
from loss_curves import plot_loss_curves  # noqa: E402
from provenance import ROOT, cpu_description, header, write_csv  # noqa: E402

RESULTS = os.path.join(ROOT, "docs", "results")


def run(impl: str, ids: torch.Tensor, val: torch.Tensor, args) -> tuple[list[dict], float]:
    torch.manual_seed(args.seed)
    model, _ = load_smollm2(attn_implementation=impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)  # the same batches for both runs
    rows, secs = [], 0.0

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = []
            for s in range(0, val.numel() - args.seq, args.seq):  # every whole window
                x = val[s:s + args.seq + 1][None]
                logits = model(x[:, :-1]).logits
                losses.append(F.cross_entropy(logits.flatten(0, 1), x[0, 1:]))
        model.train()
        return torch.stack(losses).mean().item()

    rows.append({"run": impl, "step": 0, "train_loss": float("nan"), "val_loss": round(val_loss(), 5)})
    print(f"  {impl:13s} step     0  val {rows[-1]['val_loss']:.4f}", flush=True)
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, ids.numel() - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([ids[s:s + args.seq + 1] for s in starts.tolist()])
        t0 = time.perf_counter()
        logits = model(x[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        secs += time.perf_counter() - t0
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{impl}: loss {loss.item()} at step {step}")
        if step % args.eval_every == 0 or step == args.steps:
            rows.append({"run": impl, "step": step, "train_loss": round(loss.item(), 5),
                         "val_loss": round(val_loss(), 5)})
            print(f"  {impl:13s} step {step:5d}  train {rows[-1]['train_loss']:.4f}  "
                  f"val {rows[-1]['val_loss']:.4f}", flush=True)
    return rows, args.steps * args.batch * args.seq / secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--val-tokens", type=int, default=2048)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    for name in ("steps", "batch", "seq", "eval_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.val_tokens < args.seq:
        ap.error(f"--val-tokens ({args.val_tokens}) must be at least --seq ({args.seq}): one window")
    fp4_transformers.register()
    _, tok = load_smollm2()
    train_ids = torch.tensor(tok(austen_text("emma"))["input_ids"])
    val_ids = torch.tensor(tok(austen_text("persuasion"))["input_ids"][: args.val_tokens + 1])
    print(f"SmolLM2-135M, {args.steps} steps of {args.batch} x {args.seq} tokens of Emma, "
          f"validation: {(val_ids.numel() - 1) // args.seq * args.seq} tokens of Persuasion "
          f"(whole windows of {args.seq}); {cpu_description()}")
    results, speed = [], {}
    for impl in ("sdpa", fp4_transformers.NAME_INT8):
        rows, speed[impl] = run(impl, train_ids, val_ids, args)
        results += rows
    final = {k: [r for r in results if r["run"] == k][-1]["val_loss"] for k in speed}
    first = results[0]["val_loss"]
    print(f"\nvalidation loss before fine-tuning {first:.4f} (perplexity {math.exp(first):.2f})")
    print("| attention | final val loss | perplexity | tokens/s |\n|---|---|---|---|")
    for k in speed:
        print(f"| {k} | {final[k]:.4f} | {math.exp(final[k]):.2f} | {speed[k]:,.0f} |")
    rel = final[fp4_transformers.NAME_INT8] / final["sdpa"] - 1
    print(f"\nint8 vs sdpa: final validation loss {100 * rel:+.2f}%")
    for r in results:
        r["tokens_per_s"] = round(speed[r["run"]])
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "finetune_smollm2_int8.csv"), header(cpu_description()), results)
    png = os.path.join(args.out, "finetune_smollm2_int8.png")
    if not plot_loss_curves(results, {"sdpa": "torch SDPA", fp4_transformers.NAME_INT8: "fp4attn-int8"},
                            png, f"SmolLM2-135M fine-tune on Austen (CPU): val {100 * rel:+.2f}%",
                            "cross-entropy (nats / token)"):
        print("matplotlib missing: no plot")
    print(f"wrote {args.out}/finetune_smollm2_int8.csv and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
