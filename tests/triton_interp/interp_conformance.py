"""The conformance suite for backend="triton" under Triton's CPU interpreter.

Run in its own process with ``TRITON_INTERPRET=1`` set before anything imports the kernels
(``tests/test_triton.py`` launches it); the file name keeps the main pytest run from
collecting it. Small shapes and few examples: the interpreter pays per program and per op.
"""
from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("TRITON_INTERPRET") != "1" or any(m.startswith("kvq_triton.") and m != "kvq_triton.plugin"
                                                     for m in sys.modules):
    pytest.skip("run me in a fresh process with TRITON_INTERPRET=1 (see tests/test_triton.py)", allow_module_level=True)
pytest.importorskip("triton")

from kvq_core import registry, testing  # noqa: E402
from kvq_core.testing import SPEC_PARAMS  # noqa: E402

#: Every drawn spec parameter, restricted where the Triton backend says it does not serve it.
PARAMS = {m: dict(SPEC_PARAMS[m]) for m in ("kivi", "octopus", "oscar", "turboquant")}
PARAMS["turboquant"]["high_bits_coords"] = (0,)
#: no rotation and no float reductions: the codes must match without any tie excuse
EXACT = {"kivi"}


def test_triton_available_under_interpreter() -> None:
    assert registry.backend_status("triton") == (True, None)
    assert sorted(testing.methods_for("triton")) == sorted(PARAMS)


@pytest.mark.parametrize("method", sorted(PARAMS))
def test_conformance(method: str) -> None:
    report = testing.check_method("triton", method, max_examples=3, max_tokens=96, kv_heads=(1, 2),
                                  spec_params=PARAMS[method], exact_codes=method in EXACT)
    print(report.line())
    assert report.examples >= 3 and report.codes_compared > 0
