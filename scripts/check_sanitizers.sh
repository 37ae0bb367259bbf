#!/usr/bin/env bash
# The CPU test suite against a build of the C backend and the bindings with AddressSanitizer and
# UBSan (FP4ATTN_SANITIZE=1): out-of-bounds accesses, use after free, undefined behaviour in the
# host code. Builds a copy of the working tree's tracked files in a temporary folder (CPU only,
# ~5 min on 2 cores), runs `pytest -m "not slow"` there (~5 min) and fails on any sanitizer
# report. Run inside the venv that has torch (and the test requirements). Maintainers' check, not
# part of CI (it would double CI's time).
#
#   bash scripts/check_sanitizers.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$work"
cd "$work"
echo "== build (FP4ATTN_SANITIZE=1, CPU only) in $work"
FP4ATTN_FORCE_CPU=1 FP4ATTN_SANITIZE=1 python setup.py -q build_ext --inplace > build.log 2>&1 ||
  { tail -30 build.log; exit 1; }
runtimes="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
echo "== tests under the sanitizers"
# any report ends the process (pytest's capture would hide a recovered one); leaks are not
# checked (Python's own allocations would drown the report)
status=0
LD_PRELOAD="$runtimes" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
  python -m pytest -q -p no:cacheprovider -m "not slow" "$@" tests/ 2>&1 | tee tests.log ||
  status=$?
if grep -qE "ERROR: AddressSanitizer|runtime error:" tests.log; then
  echo "sanitizer reports above"; exit 1
fi
[ "$status" -eq 0 ] || { echo "tests failed (exit $status)"; exit "$status"; }
echo "== no sanitizer reports"
