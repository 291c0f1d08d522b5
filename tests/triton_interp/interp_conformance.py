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


@pytest.mark.parametrize(("method", "params"), [
    ("oscar", dict(bits=2, key_group=16, value_group=16)),   # whole bytes, one key-stats row per tile
    ("oscar", dict(bits=4, key_group=32, value_group=64)),
    ("oscar", dict(bits=8, key_group=128, value_group=128)),
    ("oscar", dict(bits=3, key_group=16, value_group=16)),   # codes straddle bytes: gathered path
    ("kivi", dict(bits=2, group=8)),                         # groups below 16 tokens: stats gathered
], ids=lambda x: str(x))
def test_tile_paths(method: str, params: dict) -> None:
    """Fixed cases through each tile-decoding path (the drawn examples may miss some)."""
    spec = registry.make_spec(method, head_dim=128, **params)
    case = testing.Case(spec, batch=1, kv_heads=2, tokens=70, gqa=4, q_len=2, dtype="float32",
                        regime="outliers", seed=70)
    assert testing.check_case("triton", case).codes_compared >= 2 * (1 * 2 * 70 * 128)  # keys and values, at least


def test_many_query_rows() -> None:
    """GQA 4 x q_len 20 = 80 query rows per KV head: two row blocks of the attention grid."""
    spec = registry.make_spec("octopus", head_dim=64, bits=3)
    case = testing.Case(spec, batch=1, kv_heads=1, tokens=50, gqa=4, q_len=20, dtype="float16", regime="sinks", seed=5)
    assert testing.check_case("triton", case).examples == 1


@pytest.mark.parametrize("method", ["oscar", "octopus"])
def test_tampered_blocks(method: str) -> None:
    """The report's crafted block (head_dim 128 declared over head_dim-64 fields: the attend and
    decode kernels read past their buffers) and the other tampered blocks raise typed errors before
    a kernel launches (also part of every check_method above, through check_errors)."""
    testing.check_tampered("triton", method)
