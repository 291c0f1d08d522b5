"""The numba CUDA compile gate: every CUDA kernel of the numba backend, at every signature the
backend launches, compiles to PTX for sm_80 and sm_90 with ``numba.cuda.compile_ptx``, no GPU
needed (Triton's counterpart: tests/test_triton_aot.py).

The signatures are recorded, not listed by hand: tests/numba_cuda_launches.py drives every CUDA
path of the backend under the simulator and prints each launch's argument types. A kernel that
no path launches fails the gate too. Rounding stays half-to-even: each kernel that makes integer
codes rounds with a ``cvt.rni`` conversion (the simulator conformance checks ties in Python).

libNVVM and NVRTC come with numba-cuda's ``cu13`` extra (kvq's ``numba`` extra, so CI's
quick-start venv has them). Without them the gate skips with a loud reason; in CI (``CI`` set)
it fails instead: CI must run it.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # slow tier: compiles every numba CUDA kernel to PTX

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = ((8, 0), (9, 0))
#: kernels that make integer codes, so must round half to even (cvt.rni)
ROUNDING = ("kvq_numba.gpu.intcodes_cuda:_quant_token_groups", "kvq_numba.gpu.intcodes_cuda:_quant_channel_groups")
GPU_MODULES = ("kvq_numba.gpu.common", "kvq_numba.gpu.intcodes_cuda", "kvq_numba.gpu.octopus_cuda")

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("the PTX gate compiles for real: run it without NUMBA_ENABLE_CUDASIM", allow_module_level=True)
pytest.importorskip("numba.cuda")


def _toolchain_missing() -> str | None:
    """Why numba-cuda cannot compile here (no libNVVM / NVRTC found), or None when it can."""
    from numba import cuda, types

    import kvq_numba.gpu.common  # noqa: F401 - applies the NumPy 2.5 shim (kvq_numba.gpu.compat) first

    def probe(a):
        a[0] = 1.0

    try:
        cuda.compile_ptx(probe, (types.float32[::1],), cc=TARGETS[0])
    except Exception as exc:  # noqa: BLE001 - only a missing library counts as missing; see below
        name = type(exc).__name__
        if name in ("NvvmSupportError", "NvrtcSupportError", "DynamicLibNotFoundError") or "cannot be found" in str(exc):
            return f"{name}: {str(exc).splitlines()[0][:300]}"
        raise
    return None


@pytest.fixture(scope="module")
def toolchain() -> None:
    missing = _toolchain_missing()
    if missing is None:
        return
    msg = ("NUMBA CUDA COMPILE GATE NOT RUN: numba-cuda finds no libNVVM/NVRTC "
           f"({missing}); install kvq's numba extra (numba-cuda[cu13]) or a CUDA toolkit")
    if os.environ.get("CI"):
        pytest.fail(msg)
    warnings.warn(msg, stacklevel=1)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def launches() -> dict[str, list]:
    """``"module:kernel"`` -> the argument-type lists of its launches, recorded under the simulator."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "numba_cuda_launches.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kernels() -> dict[str, object]:
    """Every ``@cuda.jit`` kernel (not device function) defined in the numba backend's GPU modules."""
    import importlib

    from numba.cuda.dispatcher import CUDADispatcher

    found = {}
    for name in GPU_MODULES:
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device")
                    and obj.py_func.__module__ == name):
                found[f"{name}:{attr}"] = obj
    return found


def _argtypes(signature: list) -> tuple:
    import numba
    from numba import types

    out = []
    for dtype, ndim, layout in signature:
        scalar = numba.from_dtype(np.dtype(dtype))
        out.append(types.Array(scalar, ndim, layout) if ndim else scalar)
    return tuple(out)


def test_every_kernel_is_launched_by_some_path(toolchain: None, launches: dict[str, list]) -> None:
    kernels = _kernels()
    assert len(kernels) >= 12, sorted(kernels)
    assert sorted(kernels) == sorted(launches), "kernels no recorded path launches (or gone): " + str(
        sorted(set(kernels) ^ set(launches)))


def test_every_launch_compiles_to_ptx_for_sm80_and_sm90(toolchain: None, launches: dict[str, list]) -> None:
    from numba import cuda

    kernels = _kernels()
    failures, compiled = [], 0
    for key, signatures in sorted(launches.items()):
        for signature in signatures:
            for cc in TARGETS:
                try:
                    ptx, _ = cuda.compile_ptx(kernels[key].py_func, _argtypes(signature), cc=cc)
                except Exception as exc:  # noqa: BLE001 - every failure is listed, not just the first
                    failures.append(f"{key} sm_{cc[0]}{cc[1]}: {type(exc).__name__}: {str(exc)[:400]}")
                    continue
                compiled += 1
                assert f".target sm_{cc[0]}{cc[1]}" in ptx
                if key in ROUNDING:
                    assert "cvt.rni.f32.f32" in ptx, f"{key}: codes not rounded half to even (no cvt.rni.f32.f32)"
    total = sum(len(s) for s in launches.values()) * len(TARGETS)
    print(f"numba CUDA PTX gate: {compiled}/{total} kernel signatures compiled (sm_80, sm_90)")
    assert not failures, f"{len(failures)} of {total} failed:\n" + "\n".join(failures)
