#!/usr/bin/env bash
# The exhaustive check of the KV-cache decode's E2M1 decoder (csrc/cuda/kv_cache/e2m1_pairs.cuh,
# tests/cuda_harness/check_e2m1_pairs.cu). The host emulation always runs (seconds);
# the device code too where a GPU is present. --device: the device only. Used by .ci/run and
# scripts/gpu_check.sh.
exec "$(dirname "$0")/run_harness.sh" check_e2m1_pairs "$@"
