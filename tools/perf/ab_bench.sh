#!/usr/bin/env bash
# A/B of builds in one run on a GPU machine: builds every source tree in place (in parallel,
# sm_90a only), then runs bench_attention.py on each in turn, ROUNDS times, and prints the mean
# TFLOPS per variant (tools/perf/ab_compare.py). Run-to-run spread between separate runs is
# 1-2 %, so compare builds only within one run.
#
#   tools/perf/ab_bench.sh OUTDIR ROUNDS "BENCH ARGS" NAME=TREE [NAME=TREE ...]
#
# TREE is a source tree (e.g. a copy made with `git archive REV | tar -x -C DIR`, or `.` for the
# working tree); the first variant is the baseline of the comparison.
# Example: tools/perf/ab_bench.sh $OUT/ab 2 "--quick --no-baselines" old=.ab_old new=.
set -uo pipefail
if [ $# -lt 5 ]; then
  sed -n 2,12p "$0"
  exit 2
fi
out="$1" rounds="$2" bench_args="$3"
shift 3
mkdir -p "$out"
export FP4ATTN_CUDA_ARCHS="${FP4ATTN_CUDA_ARCHS:-90a}" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
names=() trees=()
for v in "$@"; do
  names+=("${v%%=*}")
  trees+=("$(cd "${v#*=}" && pwd)")
done
echo "== build ${names[*]}"
pids=()
for i in "${!names[@]}"; do
  (cd "${trees[$i]}" && python3 setup.py build_ext --inplace > "$out/build_${names[$i]}.log" 2>&1) &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "build of ${names[$i]} failed:"
    tail -20 "$out/build_${names[$i]}.log"
    exit 1
  fi
done
for r in $(seq 1 "$rounds"); do
  for i in "${!names[@]}"; do
    echo "== round $r: ${names[$i]}"
    # shellcheck disable=SC2086  # bench_args holds several arguments
    (cd "${trees[$i]}" && PYTHONPATH="${trees[$i]}" python3 benchmarks/bench_attention.py $bench_args \
      --out "$out/${names[$i]}_r$r") > "$out/${names[$i]}_r$r.log" 2>&1 || {
      echo "bench failed:"
      tail -20 "$out/${names[$i]}_r$r.log"
      exit 1
    }
    rm -f "$out/${names[$i]}_r$r/bench_attention.png" # only the CSVs are compared
  done
done
python3 "$(dirname "$0")/ab_compare.py" "$out" "${names[@]}" | tee "$out/compare.md"
