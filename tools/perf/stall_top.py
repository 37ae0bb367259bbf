"""Summarize an ncu source-page export of tools/perf/profile_sm90.sh: warp-stall samples by reason
over the whole kernel, the top instructions, and optional address ranges (offsets from the
kernel's first instruction, e.g. the consumer loop found with tools/perf/sass_loop_stats.py).

  python tools/perf/stall_top.py prof/source_d128.csv.gz [--top 30] [--range 0x18960:0x2b9f0:consumer_loop]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def load(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]  # row 0 names the kernel
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][col["Address"]], 16)
    recs = []
    for r in data:
        stalls = {h[len("stall_"):]: int(r[col[h]] or 0) for h in reasons}
        recs.append((int(r[col["Address"]], 16) - base, r[col["Source"]].strip(), int(r[col["# Samples"]] or 0), stalls))
    return recs


def summary(recs, label: str, total: int) -> None:
    n = sum(x[2] for x in recs)
    by_reason = collections.Counter()
    for x in recs:
        by_reason.update(x[3])
    print(f"{label}: {n} samples ({100 * n / max(total, 1):.1f} %)")
    for reason, v in by_reason.most_common(9):
        print(f"    {reason:20s}{v:9d} {100 * v / max(n, 1):5.1f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--range", action="append", default=[], help="LO:HI:LABEL (hex offsets)")
    args = ap.parse_args()
    recs = load(args.csv)
    total = sum(x[2] for x in recs)
    summary(recs, "kernel", total)
    for spec in args.range:
        lo, hi, label = spec.split(":")
        summary([x for x in recs if int(lo, 16) <= x[0] <= int(hi, 16)], label, total)
    print(f"\ntop {args.top} instructions (samples, share, main reasons):")
    for off, src, n, stalls in sorted(recs, key=lambda x: -x[2])[: args.top]:
        main_reasons = " ".join(f"{k}={v}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:2])
        print(f"{off:#8x} {n:7d} {100 * n / total:5.1f} %  {src[:60]:60s} {main_reasons}")


if __name__ == "__main__":
    main()
