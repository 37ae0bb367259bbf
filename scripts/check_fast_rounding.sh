#!/usr/bin/env bash
# The exhaustive check of P's E2M1 rounding (e2m1_pair_sat6, tests/cuda_harness/
# check_fast_rounding.cu). The host emulation always runs; the device code too where a GPU is
# present, for its architecture (sm_80 and sm_90+ take different min/max instructions, so both are
# built). --device checks the device code only (and fails without a GPU). Used by .ci/run and
# scripts/gpu_check.sh.
exec "$(dirname "$0")/run_harness.sh" check_fast_rounding "$@"
