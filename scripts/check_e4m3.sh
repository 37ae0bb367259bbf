#!/usr/bin/env bash
# The exhaustive check of the 8-bit attention's FP8 E4M3 helpers (csrc/cuda/common/e4m3.cuh,
# tests/cuda_harness/check_e4m3.cu). The host part always runs; the device code too where a GPU
# is present (sm_80: the encoder; sm_90: the conversion instruction). --device: the device only.
# Used by .ci/run and scripts/gpu_check.sh.
exec "$(dirname "$0")/run_harness.sh" check_e4m3 "$@"
