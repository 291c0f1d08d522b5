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

# The GPU machine's stack, in ONE place: bench/gpu_stack.txt (one pin per line, # comments)
PYTHON_VERSION=3.12
mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' bench/gpu_stack.txt | grep -v '^$')

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
  local t0=$SECONDS
  PIP_CONSTRAINT="" "$py" -m pip install "${PINS[@]}" >>"$log" 2>&1 || { tail -n 30 "$log"; exit 3; }
  touch "$venv/.built"
  echo "gpu_twin: built in $((SECONDS - t0)) s ($(du -sh "$venv" | cut -f1))"
}

build
if [ "${1:-}" = "--build" ]; then exit 0; fi

logs="$twin_dir/logs-$key"
mkdir -p "$logs"
started=$SECONDS
status=PASS
summary=()

step() {  # step NAME COMMAND...: runs it with the twin first on PATH, its output in $logs/NAME.log
  local name=$1; shift
  local t0=$SECONDS rc=0
  PATH="$venv/bin:$PATH" "$@" >"$logs/$name.log" 2>&1 || rc=$?
  local said
  said=$(grep -E '[0-9]+ (passed|failed)|^gpu_twin:|PTX gate:|^conformance failures:|^paged decode step:' "$logs/$name.log" \
    | tail -n 2 | sed 's/^gpu_twin: //; s/^[.]*numba CUDA PTX gate: //; s/^paged decode step: /paged step /; s/=//g; s/ in [0-9.]*s.*//' \
    | paste -sd ',' -) || true  # a log with none of those lines says nothing, it does not end the run
  if [ "$rc" -ne 0 ]; then
    status=FAIL
    summary+=("$name FAIL rc=$rc ${said}")
    echo "---- $name failed (rc=$rc), last lines of $logs/$name.log:"; tail -n 25 "$logs/$name.log"
  else
    summary+=("$name ${said:-ok}")
  fi
  echo "gpu_twin: $name done in $((SECONDS - t0)) s"
}

versions=$("$py" - <<'PY'
import importlib.metadata as md, platform
names = ("torch", "triton", "numpy", "numba", "numba-cuda", "transformers", "onnx", "onnxruntime")
print("python " + platform.python_version() + " " + " ".join(f"{n} {md.version(n)}" for n in names))
PY
)
echo "gpu_twin: $versions"

# 1. kvq installed as bench/gpu_check.sh installs it (no dependencies pulled), then its dry run
#    (the CPU interpreter, tiny shapes; the paged step too when the checkout has it)
step gpu-check-dry-run bash bench/gpu_check.sh --dry-run --backends triton
# 2. every module of the GPU backends imports on this stack (no interpreter, no GPU)
step imports python - <<'PY'
import importlib, pathlib, sys, traceback
mods = sorted(".".join(p.relative_to("backends").with_suffix("").parts) for d in ("kvq_triton", "kvq_numba")
              for p in pathlib.Path("backends", d).rglob("*.py") if p.stem != "__init__")
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception:
        bad.append(m)
        traceback.print_exc()
print(f"gpu_twin: {len(mods) - len(bad)}/{len(mods)} modules" + (f" (failed: {', '.join(bad)})" if bad else ""))
sys.exit(1 if bad else 0)
PY
# 3. the Triton interpreter conformance, each file in its own process (as tests/test_triton.py and
#    tests/test_paged.py run them)
for file in tests/triton_interp/interp_*.py; do
  step "triton-$(basename "$file" .py)" env TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1 \
    python -m pytest -q -s -p no:cacheprovider -W ignore::RuntimeWarning "$file"
done
# 4. both compile gates: Triton AOT (cubins for sm_80/sm_90), numba CUDA PTX (sm_80/sm_90)
#    (slow-tier tests: the -m replaces pyproject's default "not slow", which would deselect them all)
step triton-aot python -m pytest -q -p no:cacheprovider -m slow tests/test_triton_aot.py
step numba-ptx python -m pytest -q -s -p no:cacheprovider -m slow tests/test_numba_ptx.py

line="gpu_twin: $status | $versions"
for part in "${summary[@]}"; do line+=" | $part"; done
echo "$line | $((SECONDS - started)) s (logs: $logs)"
[ "$status" = PASS ]
