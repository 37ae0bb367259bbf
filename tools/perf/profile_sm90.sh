#!/usr/bin/env bash
# Where the sm90 attention kernel's warps stall, per SASS instruction (after the build, on a GPU
# machine): ncu warp-state sampling of one launch per head dim, exported as CSV (source page,
# SASS view) plus the details page. Output into $1 (or $OUT).
#   tools/perf/profile_sm90.sh prof/            (PROFILE_N=16384 PROFILE_DIMS="64 128")
set -uo pipefail
LOG="${1:-${OUT:-prof_out}}"; mkdir -p "$LOG"
cd "$(dirname "$0")/../.."
for D in ${PROFILE_DIMS:-64 128}; do
  H=$((2048 / D))
  ncu --clock-control none -k regex:attention_fwd_sm90 -c 1 --import-source no \
    --section WarpStateStats --section SourceCounters --section SchedulerStats --section SpeedOfLight \
    -f -o "$LOG/sm90_d$D" python3 tools/perf/profile_attention.py "$D" "${PROFILE_N:-16384}" 1 "$H" 0 \
    > "$LOG/ncu_d$D.log" 2>&1
  ncu -i "$LOG/sm90_d$D.ncu-rep" --page details > "$LOG/details_d$D.txt" 2>&1
  ncu -i "$LOG/sm90_d$D.ncu-rep" --page raw --csv 2>&1 | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
for name, unit, value in zip(rows[0], rows[1], rows[2]):
    if "pcsamp" in name or "warp_issue_stalled" in name or "inst_executed_pipe" in name:
        print(name, unit, value)' >> "$LOG/details_d$D.txt"
  ncu -i "$LOG/sm90_d$D.ncu-rep" --page source --print-source sass --csv > "$LOG/source_d$D.csv" 2>&1
  gzip -f "$LOG/source_d$D.csv"
  rm -f "$LOG/sm90_d$D.ncu-rep"
  grep -E "Duration|Issued Ipc|Eligible Warps|No Eligible|Warp Cycles Per Issued" "$LOG/details_d$D.txt" | head -8
done
