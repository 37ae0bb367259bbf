"""The loss-curve plot of the training examples (train_gpt_int8.py, finetune_smollm2_int8.py)."""

from __future__ import annotations

import math


def plot_loss_curves(rows: list[dict], runs: dict[str, str], path: str, title: str,
                     ylabel: str) -> bool:
    """Train (faint) and validation loss per step of each run (run key -> legend label), solid for
    the first run, dashed for the others; with several seeds per run (a "seed" column), the mean
    validation curve and the seeds' range instead. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, (run, label) in enumerate(runs.items()):
        style = "-" if n == 0 else "--"
        rr = [r for r in rows if r["run"] == run]
        seeds = sorted({r.get("seed", 0) for r in rr})
        if len(seeds) > 1:  # the mean validation curve over the seeds and their range
            steps = sorted({r["step"] for r in rr})
            vals = [[r["val_loss"] for r in rr if r["step"] == st] for st in steps]
            line, = ax.plot(steps, [sum(v) / len(v) for v in vals], style,
                            label=f"{label} val, mean of {len(seeds)} seeds")
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals],
                            color=line.get_color(), alpha=0.2)
            continue
        train = [r for r in rr if not math.isnan(float(r["train_loss"]))]
        ax.plot([r["step"] for r in train], [r["train_loss"] for r in train], style, alpha=0.5,
                label=f"{label} train")
        ax.plot([r["step"] for r in rr], [r["val_loss"] for r in rr], style, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
