"""Instruction counts of the sm90 attention kernel's loops, from SASS (no GPU needed): per
instantiation, the consumer's main loop without its attn_mask branch (the loop with the wait for
S_j alone, `WARPGROUP.DEPBAR.LE gsb0, 0x1`; the causal/padding mask block it contains runs only on
tiles that need it) and every producer loop (the loops that issue TMA loads), with their spills.
A proxy for issue cost per 128-key tile. --phases splits the consumer's hot path at its waits and
barriers and counts the instructions and MUFU (exp2/log2) in each part: the D=64 loop's speed
depends on how ptxas spreads its MUFU, so compare these between builds.

  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include -DFP4ATTN_CUDA_ARCHS=90a \\
       -gencode arch=compute_90a,code=sm_90a -cubin -o sm90.cubin csrc/cuda/sm90/attention_sm90.cu
  cuobjdump -sass sm90.cubin > sm90.sass
  python tools/perf/sass_loop_stats.py sm90.sass [--ops] [--phases] [--compare OTHER.sass]

cuobjdump comes with the CUDA toolkit; without one, `pip download --no-deps
nvidia-cuda-cuobjdump` and unzip the wheel.

--compare says, per instantiation, whether the consumer's main loop (attn_mask branch included) and
each producer loop (in address order) are the same in OTHER.sass up to branch addresses and
uniform-register names. ptxas allocates registers for the whole kernel at once, so a change outside
the loops (the prologue, say) can still reschedule them, and a loop's speed moves with its schedule
even at equal instruction counts: a change meant to leave the loops alone must leave every one of
them identical here.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

INSTR = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"BRA\s+(?:`\()?(0x[0-9a-f]+)")


def functions(text: str):
    for chunk in text.split("Function : ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        instrs = [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, chunk.split("\n")) if m]
        yield name, instrs


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loops(instrs):
    """(start, end) of every backward branch, smallest first."""
    found = []
    for addr, text in instrs:
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            found.append((int(m.group(1), 16), addr))
    return sorted(found, key=lambda se: se[1] - se[0])


def body(instrs, start, end):
    return [(a, t) for a, t in instrs if start <= a <= end]


def consumer_hot_path(instrs):
    """The consumer main loop minus its attn_mask branch: from the loop head to the first branch
    after the wgmma issue, then from that branch's target to the back edge."""
    for start, end in loops(instrs):
        seg = body(instrs, start, end)
        if any("DEPBAR.LE gsb0, 0x1" in t for _, t in seg) and sum("HGMMA" in t for _, t in seg) >= 8:
            head, target, seen = [], None, False
            for a, t in seg:
                head.append((a, t))
                seen = seen or "HGMMA" in t
                if seen and "BRA" in t:
                    target = int(BRANCH.search(t).group(1), 16)
                    break
            return start, end, head + [(a, t) for a, t in seg if target is not None and a >= target]
    return None


def canonical(seg):
    """The instruction texts with addresses dropped and uniform registers renamed in order of
    first use, so that two listings compare equal when only those differ."""
    names = {}

    def rename(m):
        return names.setdefault(m.group(0), f"UR<{len(names)}>")

    return [re.sub(r"\bUR\d+\b", rename, re.sub(r"0x[0-9a-f]+", "X", text)) for _, text in seg]


def producer_loops(instrs):
    """(start, end, instructions) of every producer loop (a loop that issues TMA loads), in
    address order."""
    found = []
    for start, end in loops(instrs):
        seg = body(instrs, start, end)
        if any("UTMALDG" in t for _, t in seg) and len(seg) < 3000:
            found.append((start, end, seg))
    return sorted(found, key=lambda x: x[0])


def kernel_loops(path):
    """{kernel name: (canonical consumer main loop or None, [canonical producer loops])}."""
    out = {}
    for name, instrs in functions(open(path).read()):
        if "attention_fwd_sm90_kernel" in name:
            hot = consumer_hot_path(instrs)
            consumer = canonical(body(instrs, hot[0], hot[1])) if hot else None
            out[name] = (consumer, [canonical(seg) for _, _, seg in producer_loops(instrs)])
    return out


def describe(label, seg, show_ops):
    ops = collections.Counter(opcode(t) for _, t in seg)
    spill_st = sum(v for k, v in ops.items() if k.startswith("STL"))
    spill_ld = sum(v for k, v in ops.items() if k.startswith("LDL"))
    mma = sum(v for k, v in ops.items() if k.startswith(("HGMMA", "HMMA")))
    print(f"  {label}: {len(seg)} instructions, {mma} MMA, local memory {spill_st} stores / {spill_ld} loads")
    if show_ops:
        for k, v in ops.most_common(25):
            print(f"      {k:32s}{v}")


SYNC_POINTS = ("WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "BAR.", "SYNCS.")


def describe_phases(seg):
    """The hot path as segments between its synchronisation points (wgmma waits and arrives,
    named barriers, mbarrier waits): instructions and MUFU per segment."""
    count = mufu = 0
    for _, text in seg:
        op = opcode(text)
        if op.startswith(SYNC_POINTS):
            if count:
                print(f"      {count:5d} instructions, {mufu:3d} MUFU")
            print(f"    {text}")
            count = mufu = 0
        else:
            count += 1
            mufu += op.startswith("MUFU")
    if count:
        print(f"      {count:5d} instructions, {mufu:3d} MUFU")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass")
    ap.add_argument("--ops", action="store_true", help="opcode histogram of the consumer hot path")
    ap.add_argument("--phases", action="store_true", help="instructions and MUFU between the hot path's waits")
    ap.add_argument("--compare", metavar="OTHER",
                    help="are the consumer and producer loops the same in OTHER.sass?")
    args = ap.parse_args()
    found = False
    for name, instrs in functions(open(args.sass).read()):
        if "attention_fwd_sm90_kernel" not in name:
            continue
        found = True
        print(name)
        hot = consumer_hot_path(instrs)
        if hot:
            describe(f"consumer loop {hot[0]:#x}-{hot[1]:#x} without the attn_mask branch", hot[2], args.ops)
            if args.phases:
                describe_phases(hot[2])
        for start, end, seg in producer_loops(instrs):
            describe(f"producer loop {start:#x}-{end:#x}", seg, False)
    if not found:
        print("no attention_fwd_sm90_kernel in", args.sass, file=sys.stderr)
        return 1
    if args.compare:
        mine, other = kernel_loops(args.sass), kernel_loops(args.compare)
        for name, (loop, prods) in mine.items():
            theirs, their_prods = other.get(name, (None, []))
            if loop is None or theirs is None:
                verdict = "no consumer main loop found in " + (args.sass if loop is None else args.compare)
            elif loop == theirs:
                verdict = "identical up to addresses and uniform-register names"
            else:
                verdict = f"differs ({len(loop)} against {len(theirs)} instructions)"
            print(f"consumer loop of {name} vs {args.compare}: {verdict}")
            if len(prods) != len(their_prods):
                print(f"producer loops of {name}: {len(prods)} against {len(their_prods)}")
                continue
            differ = [i for i, (p, q) in enumerate(zip(prods, their_prods)) if p != q]
            print(f"producer loops of {name}: {len(prods) - len(differ)} of {len(prods)} identical"
                  + (f" (differ: {differ})" if differ else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
