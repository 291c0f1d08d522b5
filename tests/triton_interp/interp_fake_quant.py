"""``Quantizer.fake_quant`` on backend="triton" under Triton's CPU interpreter: the op composes
the Triton encode and decode kernels (no kernel of its own), so it must equal their
decode(encode(x)) exactly and the torch backend's within float tolerance, with the identity
gradient, float32 and bfloat16. Run in its own process with ``TRITON_INTERPRET=1`` (launched by
``tests/test_fake_quant.py``); tiny shapes, since the interpreter pays per program and op."""
from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("TRITON_INTERPRET") != "1" or any(m.startswith("kvq_triton.") and m != "kvq_triton.plugin"
                                                     for m in sys.modules):
    pytest.skip("run me in a fresh process with TRITON_INTERPRET=1 (see tests/test_fake_quant.py)", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

import kvq_core  # noqa: E402
from kvq_core.tools.synthetic import make_kv  # noqa: E402


@pytest.mark.parametrize("method", ["kivi", "octopus", "oscar", "turboquant"])
def test_fake_quant_on_triton(method: str) -> None:
    tri = kvq_core.get_quantizer(method, backend="triton", head_dim=64)
    ref = kvq_core.get_quantizer(method, backend="torch", head_dim=64)
    k, v = (torch.from_numpy(a) for a in make_kv("llm", 1, 2, 35, 64, seed=0))
    for dtype in (torch.float32, torch.bfloat16):
        for kind, x in (("keys", k.to(dtype)), ("values", v.to(dtype))):
            xg = x.clone().requires_grad_(True)
            y = tri.fake_quant(xg, kind)
            assert y.dtype == dtype and y.shape == x.shape
            packed = tri.encode_keys(x) if kind == "keys" else tri.encode_values(x)
            want = tri.decode_keys(packed) if kind == "keys" else tri.decode_values(packed)
            assert torch.equal(y.detach(), want), (method, kind, dtype)
            close = (y.detach().float() - ref.fake_quant(x, kind).float()).abs() <= 1e-4 + 1e-2 * x.float().abs()
            assert close.float().mean() > 0.99, (method, kind, dtype)  # equal but for rounding ties
            y.backward(torch.full_like(x, 2.0))
            assert torch.equal(xg.grad, torch.full_like(x, 2.0))
