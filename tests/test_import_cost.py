"""Import cost: ``import kvq_core`` and NumPy / Numba quantizers load neither torch nor Triton.

Each probe runs in a fresh interpreter (what a user's process looks like) and reports which of
the heavy modules ended up in ``sys.modules``. The time itself is a benchmark figure
(``python -X importtime -c "import kvq_core"``), not asserted here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # slow tier: fresh interpreters

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "pluggy", "transformers")


def _loaded_after(code: str) -> dict:
    probe = textwrap.dedent(code) + textwrap.dedent(f'''
        import json, sys
        print("RESULT" + json.dumps({{m: m in sys.modules for m in {HEAVY!r} + ("numba",)}}))
    ''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")])}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1][len("RESULT"):])


def test_import_kvq_core_loads_no_heavy_module() -> None:
    loaded = _loaded_after("import kvq_core")
    assert not any(loaded[m] for m in HEAVY), loaded  # pluggy too: the registry loads on first use
    assert not loaded["numba"]


@pytest.mark.parametrize("backend", ["numpy", "auto"])
def test_a_numpy_quantizer_runs_without_torch_or_triton(backend: str) -> None:
    loaded = _loaded_after(f'''
        import numpy as np
        import kvq_core
        rng = np.random.default_rng(0)
        k = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
        q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
        for method in ("oscar", "octopus", "turboquant"):
            quant = kvq_core.get_quantizer(method, backend={backend!r})
            assert quant.backend == "numpy", quant.backend
            pk, pv = quant.encode_keys(k), quant.encode_values(k)
            quant.decode_keys(pk)
            quant.attend(q, pk, pv)
            kvq_core.PackedKV.from_dict(pk.to_dict())
    ''')
    assert not loaded["torch"] and not loaded["triton"], loaded


def test_a_numba_quantizer_runs_without_torch_or_triton() -> None:
    pytest.importorskip("numba")
    loaded = _loaded_after('''
        import numpy as np
        import kvq_core
        for method in ("oscar", "kivi", "octopus"):
            quant = kvq_core.get_quantizer(method, backend="numba", head_dim=64)
            assert type(quant.kernels).__module__.startswith("kvq_numba."), quant.kernels
        # one encode + attend (the kernels tests/test_numba.py compiles too: the disk cache is shared)
        rng = np.random.default_rng(0)
        k = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
        pk, pv = quant.encode_keys(k), quant.encode_values(k)
        quant.attend(rng.standard_normal((1, 4, 1, 64)).astype(np.float32), pk, pv)
    ''')
    assert loaded["numba"], loaded  # the kernel modules (and numba) were imported ...
    assert not loaded["torch"] and not loaded["triton"], loaded  # ... and nothing of torch


def test_importing_kvq_numba_has_no_side_effects(tmp_path: Path) -> None:
    """Importing the numba backend, and the registry listing and checking it (which imports its kernel classes),
    write no cache stamp, install no compile listener and register no fork hook; its first kernel object does all three."""
    pytest.importorskip("numba")
    probe = textwrap.dedent(f'''
        import os, sys
        os.environ["NUMBA_CACHE_DIR"] = {str(tmp_path)!r}
        import kvq_numba, kvq_numba.plugin
        from kvq_core import registry
        from kvq_numba import compile_notice, threads
        registry.list_backends()
        assert registry.supports("numba", registry.make_spec("oscar", head_dim=64), "cpu")[0]
        stamps = lambda: sorted(p for p in os.listdir({str(tmp_path)!r}) if os.path.isfile(
            os.path.join({str(tmp_path)!r}, p, "kvq_numba_sources.sha256")))
        before = (stamps(), compile_notice._installed is not None, threads._watching)
        import kvq_core
        kvq_core.get_quantizer("oscar", backend="numba", head_dim=64)
        after = (len(stamps()) > 0, compile_notice._installed is not None, threads._watching)
        print("RESULT", before, after)
    ''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")])}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    assert line == "RESULT ([], False, False) (True, True, True)", line
