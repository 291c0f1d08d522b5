#!/usr/bin/env bash
# kvq GPU check: install from this checkout (offline, no dependencies pulled), then run
# bench/gpu_check.py: conformance on CUDA for every GPU backend, encode throughput, fused
# attend vs torch SDPA. Needs python3 with torch (CUDA), triton, pluggy, pytest, hypothesis
# (numba-cuda for the numba backend). Extra arguments go to gpu_check.py (e.g. --dry-run).
# Under 8 minutes on one H200: the script keeps to its --budget (400 s, printing what it skipped);
# `timeout 460` is the backstop. The real run compiles every kernel (never Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
export KVQ_DISABLE_PLUGINS="${KVQ_DISABLE_PLUGINS:-0}"
python3 -m pip install --no-deps --no-build-isolation -e . >/tmp/kvq-gpu-check-install.log 2>&1 \
  || { tail -n 30 /tmp/kvq-gpu-check-install.log; exit 3; }
exec timeout 460 python3 bench/gpu_check.py "$@"
