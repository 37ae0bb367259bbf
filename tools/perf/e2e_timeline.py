"""Where the end-to-end time of one fp4attn.sdpa call (FP4, or --precision int8) goes on the GPU,
beyond its kernels' own times (bench_attention.py's end-to-end column against its kernel and
pre-pass columns): a torch.profiler trace of calls made as the benchmark makes them (L2 flushed
by a 256 MB write before each), with every GPU operation's start relative to the end of the
flush, its duration and the idle gap before it; the host time of one call; and the same call
timed eagerly and replayed from a CUDA graph.

  python tools/perf/e2e_timeline.py --dim 128 --seq 4096 --causal [--dtype bfloat16]
  python tools/perf/e2e_timeline.py --precision int8 --dim 128 --seq 512 --tokens 512 --heads 32/8 \
      --causal --dtype bfloat16     # a short call of bench_attention.py --short
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fp4attn  # noqa: E402
from bench_attention import Timer  # noqa: E402  (the benchmark's flush and CUDA-event timing)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=16384, help="B*N, as in bench_attention.py")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--precision", default="fp4", choices=["fp4", "int8"])
    ap.add_argument("--heads", default=None, metavar="HQ/HKV",
                    help="query / key-value heads (default: 2048 / dim both, as bench_attention.py)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("e2e_timeline: needs a CUDA GPU")
        return 1
    from torch.profiler import ProfilerActivity, profile

    dtype = getattr(torch, args.dtype)
    D, N = args.dim, args.seq
    B = max(1, args.tokens // N)
    H, Hkv = (int(x) for x in args.heads.split("/")) if args.heads else (2048 // D, 2048 // D)
    g = torch.Generator(device="cuda").manual_seed(N + D)
    q = torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    timer = Timer()
    flush_buf = timer.flush_buf

    def call():
        return fp4attn.sdpa(q, k, v, is_causal=args.causal, enable_gqa=H != Hkv,
                            precision=args.precision)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print(f"{args.precision} B={B} H={H}/{Hkv} N={N} D={D} causal={args.causal} {args.dtype}")

    host = []
    for _ in range(20):
        flush_buf.zero_()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    print(f"host time of one call (after a flush is queued): median {statistics.median(host):.1f} us")

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            flush_buf.zero_()
            call()
        torch.cuda.synchronize()
    ops = []
    for ev in prof.events():
        if ev.device_type is None or "cuda" not in str(ev.device_type).lower():
            continue
        start = ev.time_range.start
        ops.append((start, start + (ev.device_time if hasattr(ev, "device_time") else ev.cuda_time), ev.name))
    ops.sort()
    # split into calls at the flush (the only op that writes flush_buf: the biggest fill)
    calls, cur = [], None
    for op in ops:
        if "fill" in op[2].lower() or "zero" in op[2].lower():
            if op[1] - op[0] > 20:  # the 256 MB flush, not a small memset
                cur = {"flush_end": op[1], "ops": []}
                calls.append(cur)
                continue
        if cur is not None:
            cur["ops"].append(op)
    spans = []
    for i, c in enumerate(calls):
        prev = c["flush_end"]
        lines = []
        for s, e, name in c["ops"]:
            lines.append(f"    +{s - c['flush_end']:8.1f} us  {e - s:8.1f} us  gap {s - prev:6.1f}  {name[:70]}")
            prev = e
        span = prev - c["flush_end"]
        busy = sum(e - s for s, e, _ in c["ops"])
        spans.append((span, busy))
        if i == len(calls) - 1:
            print(f"last profiled call ({len(c['ops'])} GPU operations):")
            print("\n".join(lines))
    if spans:
        print(f"per call, flush end -> last op end: median {statistics.median(s for s, _ in spans):.1f} us, "
              f"of which ops busy {statistics.median(b for _, b in spans):.1f} us")

    eager = timer.time(call, reps=30)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replay = timer.time(graph.replay, reps=30)
    print(f"CUDA events, L2 flushed: eager {eager * 1e3:.1f} us, CUDA-graph replay {replay * 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
