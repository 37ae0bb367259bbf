"""Training side by side: a small GPT trained from scratch on Jane Austen's novels (byte tokens),
once with fp4attn's 8-bit attention (`precision="int8"`, docs/SPEC_INT8.md) and once with torch
SDPA, same seed, same initial weights, same batches, bf16 autocast on the GPU. Prints a table and
writes train_gpt_int8.csv (loss curves, headed by the command, hardware and software: see
benchmarks/provenance.py) and train_gpt_int8.png into --out (default: docs/results/, where the
committed result lives; it was made on an H200).

    python examples/train_gpt_int8.py [--steps 1500] [--corpus austen.txt] [--out DIR]

The parity protocol (one run says nothing about training): several seeds per arm (--seeds 0,1,2;
each seed gives both arms the same initial weights and batches), long enough sequences
(--seq 1024) and steps for the validation curve to flatten. It reports per arm the mean +- std
(sample std, n - 1; and range) of the final validation loss and the step at which the validation loss first reaches
--target-loss (default: 1.02 x the torch arm's mean final loss), and whether the int8 arm is at
parity (judged from 3 seeds on): mean within 0.5 % of torch's, inside torch's seed range, and no
later to the target. The plot shows each arm's mean validation curve with its seed range.

    python examples/train_gpt_int8.py --seq 1024 --batch 8 --steps 6000 --seeds 0,1,2 --jobs 6

--jobs N trains N runs at once in separate processes on the same GPU (a small model leaves most of
it idle); the losses do not depend on it, the tokens/s columns do (they are then shared-GPU rates:
measure speed with --jobs 1).

--arms int8 --reuse FILE trains one arm only and takes the other's rows (and tokens/s) from an
earlier result of the same protocol, e.g. after a change to fp4attn, which leaves the torch arm as
it was: `--arms int8 --reuse docs/results/train_gpt_int8.csv` (the CSV's header says so). A result
whose command differs in steps, batch, sequence, model size, learning rate, evaluation or corpus
file is refused.

--probe-every N checks the int8 arm's gradients while it trains: every N steps each layer's live
q, k, v and upstream gradient dO go through the int8 op and through exact FP32 attention with
autograd, and the cos of out, dQ, dK and dV between the two are written to
train_gpt_int8_probe.csv (the worst layer printed). Training itself is unchanged.
--probe-save-layer L also saves layer L's live tensors at each probed step (for offline study).

The corpus: --corpus FILE, else Jane Austen's six novels from the janeaustenr package
(`bash scripts/install_models.sh`); `--write-corpus FILE` saves them as text for a machine
without the package. The last 5% of the bytes are the validation set.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))  # provenance: the result header
import fp4attn  # noqa: E402
from fp4attn.sdpa import ORIGINAL_SDPA  # noqa: E402
from loss_curves import plot_loss_curves  # noqa: E402
from provenance import ROOT, cpu_description, gpu_description, header, read_csv, write_csv  # noqa: E402

RESULTS = os.path.join(ROOT, "docs", "results")


def austen_bytes() -> bytes:
    from fp4attn.eval.models import austen_books

    return "\n\n".join("\n".join(lines) for lines in austen_books().values()).encode("utf-8")


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        B, N, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = self.attention(q, k, v).transpose(1, 2).reshape(B, N, d)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, layers: int, d: int, heads: int, seq: int, attention):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(256, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads, attention) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def attention_fn(kind: str, probe: "GradientProbe | None" = None):
    if kind == "int8":
        def int8(q, k, v):
            out = fp4attn.sdpa(q, k, v, is_causal=True, precision="int8")
            return probe.watch(q, k, v, out) if probe is not None else out
        return int8
    return lambda q, k, v: ORIGINAL_SDPA(q, k, v, is_causal=True)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-300)).item()


class GradientProbe:
    """While armed (one training step), keeps each attention call's q, k, v and, through a hook on
    its output, the dO that reaches it; measure() then runs them through the int8 op and through
    exact FP32 attention with autograd and returns one row per layer: cos of out, dQ, dK, dV."""

    def __init__(self, save_layer: int = -1, save_dir: str = ""):
        self.armed, self.calls = False, []
        self.save_layer, self.save_dir = save_layer, save_dir

    def watch(self, q, k, v, out):
        if self.armed and out.requires_grad:
            call = {"qkv": [t.detach() for t in (q, k, v)]}
            self.calls.append(call)
            out.register_hook(lambda g: call.__setitem__("dout", g.detach()))
        return out

    def measure(self, step: int) -> list[dict]:
        rows = []
        for layer, c in enumerate(self.calls):
            q, k, v = c["qkv"]
            dout = c["dout"].contiguous()
            if layer == self.save_layer:  # the first sequence's tensors, for offline study
                os.makedirs(self.save_dir, exist_ok=True)
                torch.save({n: t[:1].cpu() for n, t in zip(("q", "k", "v", "dout"), (q, k, v, dout))},
                           os.path.join(self.save_dir, f"step{step}_layer{layer}.pt"))
            scale = 1.0 / math.sqrt(q.shape[-1])
            out8, lse8 = torch.ops.fp4attn.int8_attention(q, k, v, None, True, scale)
            grads8 = torch.ops.fp4attn.int8_attention_backward(dout, None, q, k, v, out8, lse8, None,
                                                               True, scale)
            x = [t.float().requires_grad_() for t in (q, k, v)]
            with torch.autocast(q.device.type, enabled=False):
                ref = ORIGINAL_SDPA(*x, is_causal=True)
                grads = torch.autograd.grad(ref, x, dout.float())
            rows.append({"step": step, "layer": layer, "cos_out": round(_cos(out8, ref.detach()), 6),
                         **{f"cos_d{n}": round(_cos(a, b), 6) for n, a, b in zip("qkv", grads8, grads)}})
        self.armed, self.calls = False, []
        return rows


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([data[s:s + seq + 1] for s in starts.tolist()])


def train(kind, data, val, args, device, seed):
    """One run: its validation rows, tokens/s and (int8 with --probe-every) the probe's rows."""
    torch.manual_seed(seed)  # same initial weights for both arms of a seed
    probe = (GradientProbe(args.probe_save_layer, os.path.join(args.out, f"probe_tensors_seed{seed}"))
             if kind == "int8" and args.probe_every > 0 else None)
    model = GPT(args.layers, args.dim, args.heads, args.seq, attention_fn(kind, probe)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    # warm-up over 5 % of the steps, at least two (OneCycleLR divides by the warm-up's length - 1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.steps,
                                                pct_start=max(0.05, 2 / args.steps))
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    val_batches = list(batches(val, args.val_batches, args.batch, args.seq, seed=1))
    rows, probed, tokens, t_train = [], [], 0, 0.0

    def evaluate(attention=None):
        """Validation loss; with `attention`, of the same weights with that attention in every layer."""
        trained_with = model.blocks[0].attention
        for blk in model.blocks:
            blk.attention = attention or trained_with
        model.eval()
        with torch.no_grad(), amp:
            losses = [F.cross_entropy(model(b[:, :-1].to(device)).float().flatten(0, 1), b[:, 1:].to(device).flatten())
                      for b in val_batches]
        model.train()
        for blk in model.blocks:
            blk.attention = trained_with
        return torch.stack(losses).mean().item()

    for step, b in enumerate(batches(data, args.steps, args.batch, args.seq, seed=seed), 1):
        b = b.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if probe is not None:
            probe.armed = step % args.probe_every == 0
        with amp:
            loss = F.cross_entropy(model(b[:, :-1]).float().flatten(0, 1), b[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 10 and not (probe and probe.armed):  # after warm-up, probes not timed
            t_train += time.perf_counter() - t0
            tokens += b.shape[0] * args.seq
        if probe is not None and probe.armed:
            probed += [{"seed": seed, **r} for r in probe.measure(step)]
            worst = {n: min(probed[-args.layers:], key=lambda r: r[n]) for n in ("cos_dq", "cos_dk", "cos_dv")}
            print(f"  probe seed {seed} step {step:5d}  worst layer: " + "  ".join(
                f"{n[4:]} {r[n]:.4f} (layer {r['layer']})" for n, r in worst.items()), flush=True)
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{kind}: loss {loss.item()} at step {step}")
        if step % args.eval_every == 0 or step == args.steps:
            row = {"run": kind, "seed": seed, "step": step,
                   "train_loss": round(loss.item(), 5), "val_loss": round(evaluate(), 5)}
            # the int8 arm's weights also with exact attention: learned worse, or inferred worse?
            row["val_loss_exact_attention"] = (round(evaluate(attention_fn("torch")), 5)
                                               if kind == "int8" else row["val_loss"])
            rows.append(row)
            print(f"  {kind:5s} seed {seed} step {step:5d}  train {row['train_loss']:.4f}  "
                  f"val {row['val_loss']:.4f}  (exact attention {row['val_loss_exact_attention']:.4f})",
                  flush=True)
    # no timed step (runs of at most the 10 warm-up steps): no rate, not 0
    return rows, tokens / t_train if t_train > 0 else math.nan, probed


def _corpus_name(path: str | None) -> str | None:
    """A --corpus file by its name (runs on two machines read copies); None: the janeaustenr
    package."""
    return os.path.basename(path) if path else None


def reused_rows(args: argparse.Namespace, seeds: list[int], arms: list[str]) -> tuple[list[dict], dict]:
    """The rows of `arms` for `seeds` from --reuse, typed, each run complete to --steps; and the
    file's header."""
    if not arms:
        return [], {}
    if not args.reuse:
        raise SystemExit(f"--arms {args.arms} leaves the {' and '.join(arms)} arm out: --reuse names "
                         f"the earlier result to take it from")
    head, raw = read_csv(args.reuse)
    for command in head.get("command", "").split(";"):  # "python ... ; then python ..."
        words = shlex.split(command)
        script = next((i for i, w in enumerate(words) if w.endswith("train_gpt_int8.py")), None)
        if script is None:
            continue
        earlier, _ = build_parser().parse_known_args(words[script + 1:])
        for name in PROTOCOL:
            if getattr(earlier, name) != getattr(args, name):
                raise SystemExit(f"--reuse {args.reuse}: its runs used --{name.replace('_', '-')} "
                                 f"{getattr(earlier, name)}, this one {getattr(args, name)}")
        if _corpus_name(earlier.corpus) != _corpus_name(args.corpus):
            raise SystemExit(f"--reuse {args.reuse}: its runs trained on "
                             f"{earlier.corpus or 'the janeaustenr package'}, this one on "
                             f"{args.corpus or 'the janeaustenr package'}")
    rows = [{"run": r["run"], "seed": int(r["seed"]), "step": int(r["step"]),
             **{k: float(r[k]) if r[k] != "" else math.nan  # "": a run with no timed step
                for k in ("train_loss", "val_loss", "val_loss_exact_attention", "tokens_per_s")}}
            for r in raw if r["run"] in arms and int(r["seed"]) in seeds]
    for arm in arms:
        for seed in seeds:
            if not any(r["run"] == arm and r["seed"] == seed and r["step"] == args.steps for r in rows):
                raise SystemExit(f"--reuse {args.reuse}: no {arm} run of seed {seed} to step {args.steps}")
    return rows, head


def load_corpus(path: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus as byte tokens, split 95 % train / 5 % validation."""
    raw = open(path, "rb").read() if path else austen_bytes()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    split = int(0.95 * data.numel())
    return data[:split], data[split:]


def train_in_process(kind: str, seed: int, args: argparse.Namespace):
    """One run in a worker process (--jobs): it loads the corpus itself."""
    train_data, val = load_corpus(args.corpus)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return train(kind, train_data, val, args, device, seed)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0


def summarise(rows: list[dict], seeds: list[int], target: float | None) -> dict:
    """Per arm: final validation loss (mean, std, min, max over seeds) and the first step whose
    validation loss is <= target (mean, std over the seeds that reach it; None if one does not);
    and the parity verdict of the protocol (module docstring)."""
    def curve(kind, seed):
        return [r for r in rows if r["run"] == kind and r["seed"] == seed]

    finals = {k: [curve(k, s)[-1]["val_loss"] for s in seeds] for k in ("torch", "int8")}
    if target is None:
        target = 1.02 * sum(finals["torch"]) / len(seeds)
    out = {"target": target}
    for k in ("torch", "int8"):
        reach = [next((r["step"] for r in curve(k, s) if r["val_loss"] <= target), None) for s in seeds]
        out[k] = {"final": (*_mean_std(finals[k]), min(finals[k]), max(finals[k])),
                  "reach": None if None in reach else _mean_std([float(x) for x in reach])}
    t, i = out["torch"], out["int8"]
    within = abs(i["final"][0] / t["final"][0] - 1) <= 0.005
    inside = t["final"][2] <= i["final"][0] <= t["final"][3]
    faster = i["reach"] is not None and (t["reach"] is None or i["reach"][0] <= t["reach"][0])
    out["parity"] = within and inside and faster
    out["why"] = (f"mean within 0.5 %: {'yes' if within else 'no'}, inside torch's seed range: "
                  f"{'yes' if inside else 'no'}, no later to the target: {'yes' if faster else 'no'}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", help="a UTF-8 text file (default: the janeaustenr package)")
    ap.add_argument("--write-corpus", metavar="FILE", help="write the Austen corpus as text and exit")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, each run for both arms")
    ap.add_argument("--target-loss", type=float, default=None,
                    help="validation loss whose first crossing measures learning speed "
                         "(default: 1.02 x the torch arm's mean final validation loss)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs trained at once, each in its own process on the same device")
    ap.add_argument("--probe-every", type=int, default=0, metavar="N",
                    help="check the int8 arm's gradients against exact attention every N steps")
    ap.add_argument("--probe-save-layer", type=int, default=-1, metavar="L",
                    help="with --probe-every: also save layer L's q, k, v and dO (first sequence of "
                         "the batch) at each probed step into --out/probe_tensors_seed<S>/")
    ap.add_argument("--arms", default="torch,int8", help="the arms to train (comma-separated)")
    ap.add_argument("--reuse", metavar="CSV",
                    help="an earlier train_gpt_int8.csv of the same protocol: the arms not trained "
                         "now come from it")
    ap.add_argument("--out", default=RESULTS)
    return ap


#: The options that make two runs' rows comparable (--reuse refuses a result that differs in one).
PROTOCOL = ("steps", "batch", "seq", "layers", "dim", "heads", "lr", "eval_every", "val_batches")


def main() -> int:
    args = build_parser().parse_args()
    if args.steps < 3:  # the learning-rate schedule's warm-up and decay need a step each
        raise SystemExit(f"--steps must be >= 3, got {args.steps}")
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    if args.probe_every < 0:
        raise SystemExit(f"--probe-every must be >= 0, got {args.probe_every}")
    if args.probe_save_layer >= args.layers or (args.probe_save_layer >= 0 and not args.probe_every):
        raise SystemExit(f"--probe-save-layer {args.probe_save_layer} needs --probe-every and a "
                         f"layer below --layers {args.layers}")
    if args.write_corpus:
        with open(args.write_corpus, "wb") as f:
            f.write(austen_bytes())
        return 0
    train_data, val = load_corpus(args.corpus)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"corpus {(train_data.numel() + val.numel()) / 1e6:.2f} MB, {args.layers} layers x "
          f"{args.dim} dims x {args.heads} heads, seq {args.seq}, batch {args.batch}, {args.steps} "
          f"steps on {device}, {args.jobs} run(s) at once")
    seeds = [int(x) for x in args.seeds.split(",")]
    arms = args.arms.split(",")
    if not arms or any(a not in ("torch", "int8") for a in arms) or len(set(arms)) != len(arms):
        raise SystemExit(f"--arms must name torch and / or int8 once each, got {args.arms!r}")
    if args.reuse and len(arms) == 2:
        raise SystemExit("--reuse takes the arm that --arms leaves out, but --arms names both")
    reused, reused_head = reused_rows(args, seeds, [a for a in ("torch", "int8") if a not in arms])
    runs = [(kind, seed) for seed in seeds for kind in arms]
    if args.jobs == 1:
        done = [train(kind, train_data, val, args, device, seed) for kind, seed in runs]
    else:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(
                args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(train_in_process, *zip(*runs), [args] * len(runs)))
    results, speed, probed = [], {"torch": {}, "int8": {}}, []
    for (kind, seed), (rows, tps, probe_rows) in zip(runs, done):
        results += rows
        speed[kind][seed] = tps
        probed += probe_rows
    for r in reused:
        results.append({k: r[k] for k in ("run", "seed", "step", "train_loss", "val_loss",
                                          "val_loss_exact_attention")})
        speed[r["run"]][r["seed"]] = r["tokens_per_s"]
    results.sort(key=lambda r: (r["run"] != "torch", r["seed"], r["step"]))
    summary = summarise(results, seeds, args.target_loss)
    label = {"torch": "torch SDPA (bf16)" if device.type == "cuda" else "torch SDPA",
             "int8": "fp4attn int8"}
    print(f"\n{len(seeds)} seed(s); steps to val loss {summary['target']:.4f}\n")
    shared = f" ({args.jobs} runs at once)" if args.jobs > 1 else ""
    print(f"| attention | final val loss, mean +- std (range) | steps to target, mean +- std | tokens/s{shared} |")
    print("|---|---|---|---|")
    for k in ("torch", "int8"):
        f, t = summary[k]["final"], summary[k]["reach"]
        reach = f"{t[0]:.0f} +- {t[1]:.0f}" if t else "not reached"
        rate = sum(speed[k].values()) / len(speed[k])
        rate = f"{rate:,.0f}" if math.isfinite(rate) else "n/a (no step past the 10 warm-up steps)"
        print(f"| {label[k]} | {f[0]:.4f} +- {f[1]:.4f} ({f[2]:.4f}..{f[3]:.4f}) | {reach} | {rate} |")
    rel = summary["int8"]["final"][0] / summary["torch"]["final"][0] - 1
    verdict = ("yes" if summary["parity"] else "no") if len(seeds) >= 3 else \
        f"not judged ({len(seeds)} seed(s); the protocol needs >= 3)"
    print(f"\nint8 vs torch: mean final validation loss {100 * rel:+.2f}%; parity: {verdict} "
          f"({summary['why']})")
    exact = _mean_std([[r for r in results if r["run"] == "int8" and r["seed"] == s][-1]
                       ["val_loss_exact_attention"] for s in seeds])
    print(f"the int8 arm's final weights with exact attention: {exact[0]:.4f} +- {exact[1]:.4f} "
          f"({100 * (exact[0] / summary['torch']['final'][0] - 1):+.2f}% vs torch)")
    os.makedirs(args.out, exist_ok=True)
    hw = gpu_description() if device.type == "cuda" else cpu_description()
    for r in results:
        s = speed[r["run"]][r["seed"]]
        r["tokens_per_s"] = round(s) if math.isfinite(s) else ""
    head = header(hw)
    if reused:
        head["reused"] = (f"the {' and '.join(sorted({r['run'] for r in reused}))} arm from "
                          f"{args.reuse}: " + "; ".join(f"{k} {v}" for k, v in reused_head.items()))
    write_csv(os.path.join(args.out, "train_gpt_int8.csv"), head, results)
    if probed:
        write_csv(os.path.join(args.out, "train_gpt_int8_probe.csv"), header(hw), probed)
    png = os.path.join(args.out, "train_gpt_int8.png")
    if not plot_loss_curves(results, {"torch": "torch SDPA", "int8": "fp4attn int8"}, png,
                            f"GPT on Austen, {len(seeds)} seed(s): int8 attention vs torch SDPA "
                            f"(val {100 * rel:+.2f}%)", "cross-entropy (nats / byte)"):
        print("matplotlib missing: no plot")
    print(f"wrote {args.out}/train_gpt_int8.csv and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
