"""fork() after the Numba kernels ran: the child either attends like its parent (a fork-safe
threading layer: TBB from kvq's numba extra, or the workqueue) or gets a typed error naming the
fix (GNU OpenMP), never a killed process. Each case runs in a fresh interpreter that forks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # slow tier: fresh interpreters that fork after the kernels ran

pytest.importorskip("numba")
if not hasattr(os, "fork"):
    pytest.skip("no os.fork on this platform", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import os, sys
import numpy as np
import kvq_core
q = kvq_core.get_quantizer("oscar", backend="auto", device="cpu", head_dim=64)
assert q.backend == "numba", q.backend
rng = np.random.default_rng(0)
k = rng.standard_normal((1, 2, 2048, 64)).astype(np.float32)  # large enough for a parallel region
pk, pv = q.encode_keys(k), q.encode_values(k)
query = rng.standard_normal((1, 8, 4, 64)).astype(np.float32)
ref = q.attend(query, pk, pv)
from kvq_numba import threads
print("LAYER", threads.layer(), flush=True)
pid = os.fork()
if pid == 0:
    try:
        out = q.attend(query, pk, pv)
        print("CHILD", "same" if np.array_equal(out, ref) else "differs", flush=True)
        os._exit(0)
    except kvq_core.KVQError as exc:
        print("CHILD", type(exc).__name__, exc, flush=True)
        os._exit(3)
_, status = os.waitpid(pid, 0)
print("EXIT", os.waitstatus_to_exitcode(status), flush=True)
'''


def _run(layer: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")])}
    env.pop("NUMBA_THREADING_LAYER", None)
    if layer:
        env["NUMBA_THREADING_LAYER"] = layer
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        key, _, rest = line.partition(" ")
        if key in ("LAYER", "CHILD", "EXIT"):
            out[key] = rest
    return out


def _has_layer(name: str) -> bool:
    code = f"import numba\nnumba.config.THREADING_LAYER = {name!r}\n" \
           "from numba import njit, prange\n@njit(parallel=True)\ndef f(n):\n    s = 0\n" \
           "    for i in prange(n):\n        s += i\n    return s\nf(4)\n"
    if name == "tbb":
        code = "from kvq_numba import threads\nthreads.prefer_tbb()\n" + code
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=300).returncode == 0


def test_default_layer_child_works_or_names_the_fix() -> None:
    out = _run(None)
    if out["LAYER"] in ("tbb", "workqueue"):
        assert out == {"LAYER": out["LAYER"], "CHILD": "same", "EXIT": "0"}, out
    else:
        assert out["LAYER"] == "omp", out
        assert out["EXIT"] == "3", out
        assert out["CHILD"].startswith("BackendUnavailableError") and "pip install tbb" in out["CHILD"], out


@pytest.mark.parametrize("layer", ["workqueue", "tbb"])
def test_fork_safe_layers_attend_in_the_child(layer: str) -> None:
    if not _has_layer(layer):
        pytest.skip(f"numba's {layer} layer is not available here")
    out = _run(layer)
    assert out == {"LAYER": layer, "CHILD": "same", "EXIT": "0"}, out


def test_gnu_openmp_child_gets_a_typed_error_not_a_kill() -> None:
    if not _has_layer("omp"):
        pytest.skip("numba's omp layer is not available here")
    out = _run("omp")
    assert out["LAYER"] == "omp" and out["EXIT"] == "3", out
    assert "BackendUnavailableError" in out["CHILD"] and "NUMBA_THREADING_LAYER=workqueue" in out["CHILD"], out
