"""The Numba backend: its ``supports`` answers, CPU auto-selection, that kernels compile once per
signature (not per example), and its CUDA kernels under the simulator. The conformance of its CPU
kernels runs with every backend's in tests/test_conformance.py (exact codes)."""
from __future__ import annotations

import importlib.util

import pytest

from kvq_core import registry, testing

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")

@pytest.mark.parametrize("method", ["oscar", "kivi"])
def test_the_vector_attend_kernel_conforms_too(monkeypatch, method) -> None:
    """Blocks shorter than PLANES_MIN_TOKENS attend with the general kernel; with the threshold at one
    token the conformance suite's blocks take the vector kernel, proven equal to the reference too."""
    from kvq_numba import intcodes

    monkeypatch.setattr(intcodes, "PLANES_MIN_TOKENS", 1)
    report = testing.check_method("numba", method, max_examples=12, errors=False)
    assert report.ok and report.examples > 0, report.failure


def test_kernels_compile_once_per_signature(monkeypatch) -> None:
    """Many conformance shapes/dtypes reuse one compiled specialisation per kernel (fixed dtypes)."""
    from kvq_numba import intcodes
    from kvq_numba.cpu import attend, attend_planes, intquant, page_table

    monkeypatch.setattr(intcodes, "PLANES_MIN_TOKENS", 1)  # the vector kernel's path too
    testing.check_method("numba", "oscar", max_examples=4, errors=False)
    for kernel in (attend.attend_int_codes, attend_planes.jobs_kernel(attend_planes.WIDE), page_table.plan, page_table.combine,
                   intquant.encode_token_groups,
                   intquant.decode_channel_groups):
        assert 1 <= len(kernel.signatures) <= 2, (kernel, kernel.signatures)


def test_vector_float16_widening_is_exact() -> None:
    """cpu.simd.halves (8 lanes, integer ops, scalar tail) equals NumPy's float16 -> float32 for all
    65,536 bit patterns: finite ones bit for bit, subnormals and signed zeros included; Inf as Inf."""
    import numpy as np
    from numba import njit

    from kvq_numba.cpu.simd import halves

    @njit
    def widen(src, n, dst):
        halves(src, 0, n, dst)

    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    for n in (bits.size, bits.size - 5):  # whole vectors, and a scalar tail
        got = np.full(bits.size, -7.0, np.float32)
        widen(bits, n, got)
        finite = np.isfinite(want[:n])
        assert np.array_equal(got[:n][finite].view(np.uint32), want[:n][finite].view(np.uint32))
        assert np.array_equal(np.isfinite(got[:n]), finite)  # Inf stays Inf; NaN stays non-finite
        assert np.array_equal(got[:n][np.isinf(want[:n])], want[:n][np.isinf(want[:n])])
        assert (got[n:] == -7.0).all()


def test_supports_names_what_is_missing() -> None:
    from kvq_numba.plugin import supports

    assert supports(registry.make_spec("oscar"), "cpu") == (True, None)
    assert supports(registry.make_spec("kivi"), None) == (True, None)
    ok, why = supports(registry.make_spec("quarot"), "cpu")
    assert not ok and "quarot" in why
    ok, why = supports(registry.make_spec("kivi"), "cuda")
    assert not ok and "kivi" in why
    ok, why = supports(registry.make_spec("oscar", bits=3), "cuda:0")
    assert not ok and "bits" in why
    ok, why = supports(registry.make_spec("octopus", xi_bits=8, eta_bits=8, rho_bits=4), "cpu")
    assert not ok and "20" in why
    ok, why = supports(registry.make_spec("oscar", head_dim=512), "cuda")
    assert not ok and "head_dim" in why
    ok, why = supports(registry.make_spec("oscar"), "mps")
    assert not ok and "mps" in why
    ok, why = supports(registry.make_spec("oscar", head_dim=96), "cpu")
    assert not ok and "head_dim=96" in why  # block-diagonal rotations: the reference/torch serve them
    ok, why = supports(registry.make_spec("octopus", tail="scalar"), "cpu")
    assert not ok and "tail='scalar'" in why
    assert registry.select_backend(registry.make_spec("oscar", head_dim=96), "cpu") != "numba"


def test_auto_picks_numba_on_cpu_only_where_supported() -> None:
    assert registry.select_backend("oscar", "cpu") == "numba"
    assert registry.select_backend("octopus", None) == "numpy"  # NumPy arrays keep the reference
    assert registry.select_backend("quarot", "cpu") != "numba"


@pytest.mark.slow
def test_cuda_kernels_under_the_simulator() -> None:
    """The CUDA kernels pass the conformance suite in a separate process with NUMBA_ENABLE_CUDASIM=1
    (each simulated GPU thread is a Python thread: ~13 min on a loaded 2-core machine)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "backends"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(root / "tests" / "numba_cuda_sim_conformance.py")],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_first_compile_is_announced_and_cached(tmp_path) -> None:
    """A kernel's first compile prints a start line and its duration on stderr; a second process
    with the same disk cache loads it silently."""
    import subprocess
    import sys

    code = ("import numpy as np; from kvq_core import get_quantizer; "
            "q = get_quantizer('kivi', 'numba', bits=4, head_dim=16); "
            "q.decode_values(q.encode_values(np.ones((1, 1, 3, 16), np.float32)))")
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    first, second = runs[0].stderr, runs[1].stderr
    assert "kvq numba: compiling cpu.intquant.encode_channel_groups" in first
    assert "kvq numba: compiled cpu.intquant.encode_channel_groups in" in first
    assert "kvq numba:" not in second


def test_all_finite_agrees_with_numpy() -> None:
    """The numba adapter's compiled finiteness test (kvq_numba.cpu.finite) answers as NumPy's isfinite(x).all()
    for float32/float64/float16, contiguous or strided, with one NaN/+Inf/-Inf anywhere (first, inside a
    vector, in the scalar tail, last), for every float16 bit pattern, and through NumPy for other dtypes."""
    import numpy as np

    from kvq_numba.arrays import NumbaArrays

    arrays = NumbaArrays()
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64, np.float16):
        base = rng.standard_normal((3, 5, 37)).astype(dtype)
        base[0, 0, 0] = np.finfo(dtype).max  # the largest finite values are finite
        base[0, 0, 1] = -np.finfo(dtype).max
        for view in (base, base[:, ::2], base.transpose(2, 0, 1), base[..., ::-1]):
            assert arrays.all_finite(view)
            for bad in (np.nan, np.inf, -np.inf):
                for index in ((0, 0, 0), (1, 2, 17), (2, 4, 36), (2, 4, 33)):
                    x = base.copy()
                    x[index] = bad
                    for v in (x, x[:, ::2], x.transpose(2, 0, 1), x[..., ::-1]):
                        assert arrays.all_finite(v) == bool(np.isfinite(v).all()), (dtype, index, bad)
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    row = np.ones(19, np.float16)
    for h in halves:
        row[11] = h
        assert arrays.all_finite(row) == bool(np.isfinite(h)), h.view(np.uint16)
    assert arrays.all_finite(np.arange(6)) and arrays.all_finite(np.zeros((2, 0), np.float32))


def test_max_abs_agrees_with_numpy() -> None:
    """The numba adapter's max_abs (the core's underflow check on every encode) is NumPy's largest |x| for
    float32/float64 (compiled) and float16 (NumPy), contiguous or strided, CPU torch tensors included, and
    0 for an empty array; its peak decides the underflow path, so a wrong one would skip or force it."""
    import numpy as np
    import torch

    from kvq_numba.arrays import NumbaArrays

    arrays = NumbaArrays()
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float64, np.float16):
        base = (rng.standard_normal((3, 5, 37)) * 1e-3).astype(dtype)
        for index in ((0, 0, 0), (1, 2, 17), (2, 4, 36)):
            for sign in (1, -1):
                x = base.copy()
                x[index] = sign * 7.5
                for v in (x, x[:, ::2], x.transpose(2, 0, 1)):
                    assert arrays.max_abs(v) == float(np.abs(v).max()) == 7.5, (dtype, index, sign)
    t = torch.tensor([[-3.25, 2.0], [1.0, 0.5]])
    assert arrays.max_abs(t) == 3.25 and arrays.max_abs(t[:, 1]) == 2.0
    assert arrays.max_abs(np.zeros((2, 0), np.float32)) == 0.0


def test_numba_rejects_non_finite_queries_and_blocks() -> None:
    """The compiled finiteness test still rejects NaN/Inf anywhere in a query or a K/V block, naming the input."""
    import numpy as np

    from kvq_core import get_quantizer
    from kvq_core.errors import InputError

    q = get_quantizer("oscar", "numba", head_dim=64, bits=2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 5, 64)).astype(np.float32)
    pk, pv = q.encode_keys(x), q.encode_values(x)
    for bad in (np.nan, np.inf, -np.inf):
        query = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
        query[0, 8, 0, 63] = bad
        with pytest.raises(InputError, match="query: contains NaN or Inf"):
            q.attend(query, pk, pv)
        with pytest.raises(InputError, match="query: contains NaN or Inf"):
            q.attend(query.astype(np.float16), pk, pv)
        k = x.copy()
        k[0, 1, 2, 3] = bad
        with pytest.raises(InputError, match="keys: contains NaN or Inf"):
            q.encode_keys(k)
