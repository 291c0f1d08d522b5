"""``Quantizer.fake_quant`` and the ``kvq::fake_quant`` op: decode(encode(x)) in one op, its
straight-through gradient (identity; QuaRot's clipping masked in the rotated domain), opcheck
with autograd, float32/bfloat16, the torch-compiled backend, and Triton under the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import kvq_core  # noqa: E402
from kvq_core import registry  # noqa: E402
from kvq_core.constants import constants  # noqa: E402
from kvq_core.errors import BackendUnavailableError, InputError  # noqa: E402
from kvq_core.tools.synthetic import make_kv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["fp16", "kivi", "octopus", "oscar", "polarquant", "qjl", "quarot", "turboquant", "turboquant_prod"]


def _kv(tokens: int = 40, kv_heads: int = 2, head_dim: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = make_kv("llm", 1, kv_heads, tokens, head_dim, seed=seed)
    return torch.from_numpy(k), torch.from_numpy(v)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_is_decode_of_encode_with_identity_gradient(method: str, dtype: torch.dtype) -> None:
    q = kvq_core.get_quantizer(method, backend="torch", head_dim=64, layer=3)
    k, v = (t.to(dtype) for t in _kv(37))
    for kind, x in (("keys", k), ("values", v)):
        x = x.clone().requires_grad_(True)
        y = q.fake_quant(x, kind)
        packed = q.encode_keys(x.detach()) if kind == "keys" else q.encode_values(x.detach())
        want = q.decode_keys(packed) if kind == "keys" else q.decode_values(packed)
        assert y.dtype == dtype and y.shape == x.shape
        assert torch.equal(y.detach(), want), (method, kind, (y.detach() - want).abs().max())
        assert not torch.equal(y.detach(), x.detach()) or method == "fp16"  # it really quantized
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        (y * g).sum().backward()
        assert torch.equal(x.grad, g), method  # no built-in codec clips at its defaults


@pytest.mark.parametrize("method", ["oscar", "octopus", "quarot"])
def test_opcheck_with_autograd(method: str) -> None:
    params = {"clip_ratio": 0.9} if method == "quarot" else {}
    sj = kvq_core.make_spec(method, head_dim=64, **params).to_json()
    k, v = _kv(33)
    for dtype in (torch.float32, torch.bfloat16):
        x = k.to(dtype).requires_grad_(True)
        torch.library.opcheck(torch.ops.kvq.fake_quant.default, ("torch", sj, 0, "keys", x))
        torch.library.opcheck(torch.ops.kvq.fake_quant.default, ("torch", sj, 1, "values", v.to(dtype).requires_grad_(True)))
    if method == "quarot":
        torch.library.opcheck(torch.ops.kvq.fake_quant_grad.default,
                              ("torch", sj, 0, "keys", k, torch.randn(k.shape).requires_grad_(True)))


def test_quarot_clipping_gradient_is_masked_in_the_rotated_domain() -> None:
    """clip_ratio < 1: the gradient is H (m * H g), m = 0 where a rotated coordinate lies outside
    its token's clipped range; computed here independently in NumPy."""
    rho = 0.7
    spec = kvq_core.make_spec("quarot", head_dim=64, bits=3, clip_ratio=rho)
    q = kvq_core.get_quantizer(spec, backend="torch")
    k, _ = _kv(24)
    x = k.clone().requires_grad_(True)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    (q.fake_quant(x, "keys") * g).sum().backward()
    h = constants(spec, 2, 0)["hadamard"].astype(np.float64)
    y = k.numpy().astype(np.float64) @ h
    mn = rho * np.minimum(y.min(-1, keepdims=True), 0)
    mx = rho * np.maximum(y.max(-1, keepdims=True), 0)
    m = (y >= mn) & (y <= mx)
    assert 0.02 < 1 - m.mean() < 0.5  # some coordinates clipped, most kept
    want = ((g.numpy().astype(np.float64) @ h) * m) @ h
    np.testing.assert_allclose(x.grad.numpy(), want, atol=1e-5)
    # unclipped coordinates pass straight through: the masked gradient differs from g
    assert not np.allclose(x.grad.numpy(), g.numpy(), atol=1e-3)


def test_numpy_backend_composes_and_refuses_grad() -> None:
    q = kvq_core.get_quantizer("oscar", backend="numpy", head_dim=64)
    k, _ = _kv(40)
    y = q.fake_quant(k.numpy(), "keys")
    assert isinstance(y, np.ndarray)
    np.testing.assert_array_equal(y, q.decode_keys(q.encode_keys(k.numpy())))
    t = kvq_core.get_quantizer("oscar", backend="torch", head_dim=64)
    np.testing.assert_allclose(t.fake_quant(k, "keys").numpy(), y, rtol=1e-5, atol=1e-5)
    if registry.backend_status("numba")[0]:
        nq = kvq_core.get_quantizer("oscar", backend="numba", head_dim=64)
        with pytest.raises(BackendUnavailableError, match="no differentiable fake_quant"):
            nq.fake_quant(k.clone().requires_grad_(True), "keys")


def test_typed_errors() -> None:
    q = kvq_core.get_quantizer("oscar", backend="torch", head_dim=64)
    k, _ = _kv(8)
    with pytest.raises(InputError, match="kind='key'"):
        q.fake_quant(k, "key")
    with pytest.raises(InputError, match="head_dim 64 does not match"):
        kvq_core.get_quantizer("oscar", backend="torch", head_dim=128).fake_quant(k, "keys")
    bad = k.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(InputError, match="NaN or Inf"):
        q.fake_quant(bad, "keys")
    with pytest.raises(InputError, match="overflow"):  # float16 storage past 65504
        kvq_core.get_quantizer("fp16", backend="torch", head_dim=64).fake_quant(k * 1e5, "values")


def test_head_dim_binds_from_the_first_block() -> None:
    q = kvq_core.get_quantizer("octopus", backend="torch", bits=3)
    k, _ = _kv(5, head_dim=64)
    q.fake_quant(k, "keys")
    assert q.spec.head_dim == 64


@pytest.mark.compile
def test_torch_compiled_backend_equals_eager() -> None:
    k, v = _kv(40)
    for method in ("oscar", "octopus"):
        eager = kvq_core.get_quantizer(method, backend="torch", head_dim=64)
        comp = kvq_core.get_quantizer(method, backend="torch-compiled", head_dim=64)
        for kind, x in (("keys", k), ("values", v.to(torch.bfloat16))):
            xg = x.clone().requires_grad_(True)
            y = comp.fake_quant(xg, kind)
            assert torch.equal(y.detach(), eager.fake_quant(x, kind)), (method, kind)
            y.sum().backward()
            assert torch.equal(xg.grad, torch.ones_like(x))


@pytest.mark.slow  # slow tier: a Triton-interpreter child run
def test_triton_fake_quant_under_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "backends"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W",
                           "ignore::RuntimeWarning", "tests/triton_interp/interp_fake_quant.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "4 passed" in proc.stdout, proc.stdout[-3000:]
