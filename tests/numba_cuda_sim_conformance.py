"""Conformance of the Numba backend's CUDA kernels under the numba CUDA simulator.

Run by tests/test_numba.py in its own pytest process with NUMBA_ENABLE_CUDASIM=1 (the variable
must be set before numba is imported); the file name keeps default collection from picking it up.
The simulator runs each GPU thread as a Python thread, so shapes are tiny.
"""
from __future__ import annotations

import os

import pytest

from kvq_core import registry, testing

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs NUMBA_ENABLE_CUDASIM=1")

#: random cases only (no fixed edge cases or constructed tie blocks: each simulated case costs
#: tens of seconds); the CPU kernels share the scalar coding rules and get the full draw.
TINY = dict(max_examples=2, head_dims=(64,), batches=(1,), kv_heads=(2,), gqa=(2,), q_lens=(1,), tokens=(5, 33),
            regimes=("gaussian", "integers", "zeros"), dtypes=("float32", "float16"), errors=False,
            edge_cases=False, ties=False)


@pytest.mark.parametrize(("method", "spec_params"), [("oscar", {"bits": (2, 4)}), ("octopus", {"values": ("octopus", "fp16")})])
def test_cuda_kernels_match_the_reference(method: str, spec_params: dict) -> None:
    from numba import cuda

    from kvq_numba.plugin import supports

    assert cuda.is_available()  # the simulator counts as a device
    report = testing.check_method("numba", method, to_backend=lambda a: cuda.to_device(a), spec_params=spec_params,
                                  **TINY)
    assert report.examples > 0 and report.codes_compared > 0
    assert supports(registry.make_spec(method), "cuda") == (True, None)


def test_cuda_codes_round_half_to_even() -> None:
    """The fixed tie block (half the codes exact .5 ties) gives exactly the reference's codes: the
    CUDA kernels' rounding is half-to-even (on a GPU, libdevice rintf; tests/test_numba_ptx.py
    checks its cvt.rni in the PTX)."""
    from numba import cuda

    report = testing.check_ties("numba", "oscar", to_backend=lambda a: cuda.to_device(a), head_dim=16, kv_heads=1,
                                gqa=1)
    assert report.codes_compared > 0 and report.tie_mismatches == 0
