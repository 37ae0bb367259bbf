#!/usr/bin/env python3
"""Compares the bench_attention.py CSVs of an A/B run (tools/perf/ab_bench.sh): for each variant the
mean over its rounds (OUTDIR/NAME_rK/bench_attention.csv) of end-to-end and kernel TFLOPS, and
each later variant's change against the first, as a markdown table.

    python3 tools/perf/ab_compare.py OUTDIR NAME [NAME ...]
"""
import csv
import glob
import os
import sys
from statistics import mean


def load(out: str, name: str) -> dict:
    """{(dtype, D, N, causal): {"e2e": [..], "kernel": [..]}} over the variant's rounds."""
    runs = sorted(glob.glob(os.path.join(out, f"{name}_r*", "bench_attention.csv")))
    if not runs:
        raise SystemExit(f"ab_compare: no rounds of {name} under {out}")
    table: dict = {}
    for path in runs:
        with open(path) as f:  # '#' lines: the run's command and hardware header
            for r in csv.DictReader(line for line in f if not line.startswith("#")):
                key = (r["dtype"], int(r["D"]), int(r["N"]), r["causal"] == "True")
                cell = table.setdefault(key, {"e2e": [], "kernel": []})
                cell["e2e"].append(float(r["fp4attn_tflops"]))
                cell["kernel"].append(float(r["fp4_kernel_tflops"]))
    return table


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    out, names = sys.argv[1], sys.argv[2:]
    data = [load(out, n) for n in names]
    base = names[0]
    head = "| dtype | D | N | causal | " + " | ".join(f"{n} e2e" for n in names)
    head += "".join(f" | {n} vs {base}" for n in names[1:]) + " | " + " | ".join(f"{n} kernel" for n in names)
    print(f"\nTFLOPS, mean of the rounds ({out})\n")
    print(head + " |")
    print("|" + "---|" * head.count("|"))
    for key in sorted(data[0]):
        if not all(key in d for d in data):
            continue
        e2e = [mean(d[key]["e2e"]) for d in data]
        ker = [mean(d[key]["kernel"]) for d in data]
        dtype, D, N, causal = key
        row = f"| {dtype} | {D} | {N} | {int(causal)} | " + " | ".join(f"{x:.1f}" for x in e2e)
        row += "".join(f" | {100 * (x / e2e[0] - 1):+.1f} %" for x in e2e[1:])
        row += " | " + " | ".join(f"{x:.1f}" for x in ker) + " |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
