"""The Triton backend without a GPU: registration and ``supports`` reasons here, the
conformance suite under the interpreter in a child process (``TRITON_INTERPRET=1`` must be set
before the kernels are imported), and ``bench/gpu_check.py --dry-run``. The AOT compile gate is
``tests/test_triton_aot.py``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvq_core import registry

pytestmark = pytest.mark.slow  # slow tier: Triton-interpreter child runs and the GPU check's dry run

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def _child_env() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "backends"), env.get("PYTHONPATH", "")])
    return env


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_child_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_registered_with_reason() -> None:
    rec = {r.name: r for r in registry.list_backends()}["triton"]
    assert set(rec.detail) == {"kivi", "octopus", "oscar", "turboquant"}
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert rec.available
    else:
        import torch

        if not torch.cuda.is_available():
            assert not rec.available and "TRITON_INTERPRET" in rec.reason and "CUDA" in rec.reason


def test_supports_names_what_is_unsupported() -> None:
    from kvq_triton.plugin import supports

    ok, why = supports(registry.make_spec("qjl"), "cuda")
    assert not ok and "'qjl'" in why and "no Triton kernels" in why
    ok, why = supports(registry.make_spec("turboquant", high_bits_coords=16), "cuda")
    assert not ok and "high_bits_coords=16" in why
    ok, why = supports(registry.make_spec("oscar"), "mps")
    assert not ok and "'mps'" in why
    ok, why = supports(registry.make_spec("kivi", head_dim=80), "cuda")
    assert not ok and "head_dim=80" in why


def test_conformance_under_interpreter() -> None:
    proc = _run(["-m", "pytest", "-q", "-x", "-s", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
                 "tests/triton_interp/interp_conformance.py"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "13 passed" in proc.stdout, proc.stdout[-3000:]


def test_gpu_check_dry_run() -> None:
    proc = _run(["-W", "ignore::RuntimeWarning", "bench/gpu_check.py", "--dry-run", "--backends", "triton"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "conformance failures: 0" in out, out[-3000:]
    for method in ("kivi", "octopus", "oscar", "turboquant"):
        assert f"triton {method:<16} ok" in out, out[-3000:]
    assert "GOAL oscar INT2 attend" in out, out[-3000:]
    model = out.split("== 6. model decode", 1)[-1].split("== summary", 1)[0]
    for cache in ("fp ", "oscar-2 ", "octopus-3 "):  # KVQCache in a transformers model, beside DynamicCache
        assert any(line.startswith(cache) for line in model.splitlines()), out[-3000:]
