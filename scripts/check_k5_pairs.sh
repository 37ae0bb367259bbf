#!/usr/bin/env bash
# The exhaustive check of the KV-cache decode's K5 key decoder (csrc/cuda/kv_cache/k5_pairs.cuh,
# tests/cuda_harness/check_k5_pairs.cu). The host part always runs; the device code too where a
# GPU is present. --device: the device only. Used by scripts/gpu_check.sh.
exec "$(dirname "$0")/run_harness.sh" check_k5_pairs "$@"
