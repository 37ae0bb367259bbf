#!/usr/bin/env bash
# compute-sanitizer over the Hopper (sm_90a) 8-bit kernels: memcheck (out-of-bounds and misaligned
# accesses), racecheck (shared-memory hazards: the stage rings, the dS and dQ tiles handed between
# warps) and synccheck (barrier misuse: named-barrier arrive / sync counts), on small calls that
# cover what the kernels branch on: head dims 64 and 128 (256 forward), causal and not, GQA, a
# padded last block, a ring that wraps, the backward's deterministic dQ order, and more forward
# items than SMs (the persistent blocks' hand-over of Q^ from one item to the next). Needs a GPU of
# compute capability 9.0 and fp4attn built with sm_90a; fails on any reported error or hazard.
#   bash scripts/check_cuda_sanitizers.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${1:-${OUT:-sanitizer_logs}}"
mkdir -p "$LOG"
calls=$(mktemp --suffix=.py)
trap 'rm -f "$calls"' EXIT
cat > "$calls" <<'PY'
import torch
import fp4attn  # noqa: F401

assert torch.cuda.get_device_capability() == (9, 0), "the sm90 kernels run on compute capability 9.0"
op, bwd = torch.ops.fp4attn.int8_attention, torch.ops.fp4attn.int8_attention_backward
for D, Nq, Nk, Hq, Hkv, causal, det in [(64, 300, 700, 4, 2, False, False),
                                        (128, 700, 300, 2, 1, True, False),
                                        (64, 700, 700, 2, 2, True, True),
                                        (128, 300, 700, 4, 2, False, True),
                                        (256, 300, 300, 2, 2, True, False),
                                        (64, 200, 300, 160, 40, False, False),
                                        (128, 400, 400, 140, 35, True, False)]:
    g = torch.Generator(device="cuda").manual_seed(D + Nq)
    q = torch.randn(1, Hq, Nq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, Hkv, Nk, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    out, lse = op(q, k, v, None, causal, D ** -0.5, "sm90")
    if D <= 128:
        torch.use_deterministic_algorithms(det)
        bwd(torch.randn_like(out), None, q, k, v, out, lse, None, causal, D ** -0.5, "sm90")
        torch.use_deterministic_algorithms(False)
torch.cuda.synchronize()
print("calls done")
PY
status=0
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 9 python "$calls" > "$LOG/sanitizer_$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG/sanitizer_$tool.log" | tail -1)"
  [ "$rc" -eq 0 ] || { status=1; grep -E "Error|Hazard|Barrier" "$LOG/sanitizer_$tool.log" | head -20; }
done
exit $status
