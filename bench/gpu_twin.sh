#!/usr/bin/env bash
# kvq GPU twin: the GPU machine's Python stack rebuilt on a CPU machine, to check GPU code before
# it meets a GPU. Builds (once, cached outside the checkout) a venv with the GPU machine's pins,
# installs kvq as bench/gpu_check.sh does, then runs there: imports of every GPU module, the
# gpu_check dry run, the Triton interpreter conformance, the Triton AOT and numba CUDA PTX
# compile gates. Prints one summary line; exit 0 only when every step passed.
#
#   bash bench/gpu_twin.sh            # build if needed, then check
#   bash bench/gpu_twin.sh --build    # only build the venv (e.g. in the background, early)
#
# KVQ_TWIN_DIR (default ~/.cache/kvq-gpu-twin) holds the venvs, one per pin set; KVQ_TWIN_PYTHON
# names a Python 3.12 (default: python3.12 on PATH, else pyenv's, else `uv python find 3.12`).
# The first build downloads about 5 GB (torch 2.11.0 from PyPI is a CUDA build; it runs on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

# The GPU machine's stack, in ONE place (the device tool's KINDS.md, as seen there 2026-11).
# numba-cuda's cu13 extra brings libNVVM (nvidia-nvvm) for the PTX gate; the GPU machine has it
# from its CUDA 13 toolkit instead.
PYTHON_VERSION=3.12
PINS=(
  torch==2.11.0
  triton==3.6.0
  numpy==2.5.2
  numba==0.68.1
  "numba-cuda[cu13]==0.30.4"
  transformers==5.17.0
  onnx==1.23.1
  onnxruntime==1.30.0
  pluggy pytest hypothesis setuptools
)

twin_dir="${KVQ_TWIN_DIR:-$HOME/.cache/kvq-gpu-twin}"
key=$(printf '%s\n' "$PYTHON_VERSION" "${PINS[@]}" | sha1sum | cut -c1-12)
venv="$twin_dir/venv-$key"
py="$venv/bin/python"
log="$twin_dir/build-$key.log"

find_python() {
  if [ -n "${KVQ_TWIN_PYTHON:-}" ]; then echo "$KVQ_TWIN_PYTHON"; return; fi
  local c
  for c in "$(command -v "python$PYTHON_VERSION" || true)" \
           "$(pyenv prefix "$PYTHON_VERSION" 2>/dev/null | head -n1)/bin/python$PYTHON_VERSION" \
           "$(uv python find "$PYTHON_VERSION" 2>/dev/null || true)"; do
    if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$c"; return
    fi
  done
  echo "gpu_twin: no Python $PYTHON_VERSION found (set KVQ_TWIN_PYTHON; or pyenv install / uv python install $PYTHON_VERSION)" >&2
  exit 2
}

build() {
  if [ -f "$venv/.built" ]; then return; fi
  mkdir -p "$twin_dir"
  rm -rf "$venv"
  local base
  base=$(find_python)
  echo "gpu_twin: building $venv with $base (log: $log)"
  "$base" -m venv "$venv"
  "$py" -m pip install -q --upgrade pip >"$log" 2>&1
  # The GPU machine's pins win over any machine-wide constraint file.
  PIP_CONSTRAINT="" "$py" -m pip install "${PINS[@]}" >>"$log" 2>&1 || { tail -n 30 "$log"; exit 3; }
  touch "$venv/.built"
  echo "gpu_twin: built ($(du -sh "$venv" | cut -f1))"
}

build
if [ "${1:-}" = "--build" ]; then exit 0; fi
