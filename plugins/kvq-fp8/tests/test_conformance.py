"""kvq's conformance suite against the plugin's kernels on every backend that serves them.

One call per backend (``kvq_core.testing.check_method``); the torch kernels promise the
reference's codes bit for bit (``exact_codes=True``): amax, a float32 division and a
round-half-even conversion give the same bits on every backend.
"""
from __future__ import annotations

import pytest

from kvq_core import registry, testing

SPEC_PARAMS = {"format": ("e4m3", "e5m2"), "scale": ("token", "head")}
SETTINGS = {
    "numpy": dict(max_examples=6),
    "torch": dict(max_examples=12),
    # inductor: one graph per kernel and spec, so fixed shapes and the default spec
    "torch-compiled": dict(max_examples=2, head_dims=(64,), batches=(1,), kv_heads=(2,), gqa=(2,), q_lens=(1,),
                           tokens=(45, 70), spec_params={}, errors=False),
}


def _serving() -> list[str]:
    return [b.name for b in registry.list_backends() if b.available and "fp8" in b.detail]


def test_the_reference_and_torch_serve_fp8() -> None:
    serving = _serving()
    assert "numpy" in serving
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    assert "torch" in serving


@pytest.mark.parametrize("backend", _serving())
def test_conformance(backend: str) -> None:
    kwargs = {"spec_params": SPEC_PARAMS, **SETTINGS.get(backend, dict(max_examples=12))}
    report = testing.check_method(backend, "fp8", exact_codes=True, **kwargs)
    assert report.examples > 0 and report.codes_compared > 0
