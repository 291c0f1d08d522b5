"""The torch backends: kvq:: custom ops (opcheck), torch.compile(fullgraph=True) and torch.export
over kvq calls, and the inductor-compiled backend's codes against eager, bit for bit."""
from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import kvq_core  # noqa: E402
from kvq_core.tools.synthetic import make_kv, make_queries  # noqa: E402
from kvq_core.torch_ops import ops  # noqa: E402
from kvq_core.torch_ops.arrays import TorchArrays  # noqa: E402

OPCHECK_METHODS = ["fp16", "oscar", "kivi", "quarot"]


def _kv(tokens: int = 40, kv_heads: int = 2, head_dim: int = 64, regime: str = "llm", seed: int = 0):
    k, v = make_kv(regime, 1, kv_heads, tokens, head_dim, seed=seed)
    return torch.from_numpy(k), torch.from_numpy(v)


def _q(q_heads: int = 4, head_dim: int = 64, q_len: int = 1):
    return torch.from_numpy(make_queries(1, q_heads, q_len, head_dim))


# ------------------------------------------------------------------------------------------------
# custom ops
# ------------------------------------------------------------------------------------------------
def test_ops_are_in_one_namespace() -> None:
    for name in ("encode", "decode", "attend", "materialize"):
        assert hasattr(torch.ops.kvq, name)
    assert set(ops.OPS) == {"encode", "decode", "attend", "materialize", "attend_paged", "attend_window", "write_paged",
                            "fake_quant", "fake_quant_grad"}
    torch.library.opcheck(torch.ops.kvq.materialize.default, (torch.randn(3, 4).t(),))
    assert str(torch.ops.kvq.encode.default._schema) == ("kvq::encode(str backend, str spec_json, int layer, str kind, Tensor x, "
                                                         "int head_offset=0) -> Tensor[]")


@pytest.mark.parametrize("method", OPCHECK_METHODS)
def test_opcheck(method: str) -> None:
    spec = kvq_core.make_spec(method, head_dim=64)
    sj = spec.to_json()
    k, v = _kv(37)
    shape = list(k.shape)
    kf = torch.ops.kvq.encode("torch", sj, 0, "keys", k)
    vf = torch.ops.kvq.encode("torch", sj, 0, "values", v)
    torch.library.opcheck(torch.ops.kvq.encode.default, ("torch", sj, 0, "keys", k))
    torch.library.opcheck(torch.ops.kvq.encode.default, ("torch", sj, 0, "values", v.to(torch.float16)))
    torch.library.opcheck(torch.ops.kvq.decode.default, ("torch", sj, 0, "keys", kf, shape))
    torch.library.opcheck(torch.ops.kvq.decode.default, ("torch", sj, 0, "values", vf, shape))
    torch.library.opcheck(torch.ops.kvq.attend.default, ("torch", sj, 0, _q(), kf, vf, shape, 0.125))


def test_fake_kernels_follow_the_layout() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    for method in OPCHECK_METHODS:
        spec = kvq_core.make_spec(method, head_dim=64)
        with FakeTensorMode():
            x = torch.empty(2, 3, 45, 64)
            outs = torch.ops.kvq.encode("torch", spec.to_json(), 0, "keys", x)
        layout = spec.key_layout(2, 3, 45)
        assert [(tuple(t.shape), str(t.dtype)) for t in outs] == [
            (f.shape, f"torch.{f.dtype}") for f in layout.values()]


# ------------------------------------------------------------------------------------------------
# the array adapter and backend selection
# ------------------------------------------------------------------------------------------------
def test_arrays_adapter() -> None:
    a = TorchArrays()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = a.asarray(x)
    assert isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float32
    ro = x.copy()
    ro.flags.writeable = False
    assert torch.equal(a.asarray(ro), t)
    b = torch.ones(2, dtype=torch.bfloat16)
    assert a.asarray(b) is b
    assert a.to_numpy(b).dtype == np.float32
    assert a.cast(t, "float16").dtype == torch.float16
    assert a.all_finite(t) and not a.all_finite(torch.tensor([1.0, float("nan")]))


def test_auto_selects_torch_for_a_device() -> None:
    # the fastest CPU backend that serves the spec: numba for oscar where installed, torch for the rest
    cpu = {b for b in ("numba", "torch") if b in {r.name for r in kvq_core.list_backends() if r.available}}
    assert kvq_core.get_quantizer("oscar", device="cpu").backend == ("numba" if "numba" in cpu else "torch")
    assert kvq_core.get_quantizer("quarot", device="cpu").backend == "torch"
    assert kvq_core.get_quantizer("oscar", head_dim=96, device="cpu").backend == "torch"
    assert kvq_core.get_quantizer("oscar").backend == "numpy"


def test_numpy_in_tensor_out_and_dtypes() -> None:
    q = kvq_core.get_quantizer("oscar", backend="torch", head_dim=64)
    k, _ = _kv()
    pk = q.encode_keys(k.numpy())
    assert isinstance(pk.fields["codes"], torch.Tensor)
    for dt in (torch.float16, torch.bfloat16):
        assert q.decode_keys(q.encode_keys(k.to(dt))).dtype == dt


# ------------------------------------------------------------------------------------------------
# torch.compile / torch.export over kvq calls (eager "torch" backend = custom ops)
# ------------------------------------------------------------------------------------------------
@pytest.mark.compile
def test_compile_fullgraph_no_graph_break() -> None:
    qt = kvq_core.get_quantizer("oscar", backend="torch", head_dim=64)

    def step(k, v, q):
        pk, pv = qt.encode_keys(k), qt.encode_values(v)
        return qt.attend(q, pk, pv), pk.fields["codes"]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)  # fullgraph: a graph break raises
    for tokens in (40, 77):
        k, v = _kv(tokens)
        q = _q()
        out_c, codes_c = compiled(k, v, q)
        out_e, codes_e = step(k, v, q)
        assert torch.equal(codes_c, codes_e)
        torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a third size reuses the dynamic graph
        k, v = _kv(91)
        compiled(k, v, _q())


@pytest.mark.compile
def test_export_with_dynamic_tokens() -> None:
    class Attend(torch.nn.Module):
        def __init__(self, method: str) -> None:
            super().__init__()
            self.kvq = kvq_core.get_quantizer(method, backend="torch", head_dim=64)

        def forward(self, k, v, q):
            pk, pv = self.kvq.encode_keys(k), self.kvq.encode_values(v)
            return self.kvq.attend(q, pk, pv), self.kvq.decode_keys(pk)

    # OScaR keys keep one stats row per 32 tokens: torch 2.13 specialises a size that may be 1,
    # so the token Dim starts above one group; QuaRot has no token groups, any count >= 2 works.
    for method, lo in (("oscar", 33), ("quarot", 2)):
        m = Attend(method)
        k, v = _kv(70)
        tokens = torch.export.Dim("tokens", min=lo, max=1 << 20)
        ep = torch.export.export(m, (k, v, _q()), dynamic_shapes={"k": {2: tokens}, "v": {2: tokens}, "q": None})
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert {"kvq.encode.default", "kvq.attend.default", "kvq.decode.default"} <= targets
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        buf.seek(0)
        loaded = torch.export.load(buf).module()
        for t in (lo + 1, 333):
            k2, v2 = _kv(t, seed=t)
            got, want = loaded(k2, v2, _q()), m(k2, v2, _q())
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# the compiled backend
# ------------------------------------------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("method", ["oscar", "kivi", "quarot", "fp16"])
def test_compiled_backend_codes_bit_identical(method: str) -> None:
    """Same shapes as the compiled conformance cases (batch 1, 2 KV heads, head_dim 64, default
    spec), so in one pytest run these reuse its compiled graphs."""
    eager = kvq_core.get_quantizer(method, backend="torch", head_dim=64)
    comp = kvq_core.get_quantizer(method, backend="torch-compiled", head_dim=64)
    for tokens, dtype in ((1000, torch.float32), (333, torch.bfloat16)):
        k, v = (x.to(dtype) for x in _kv(tokens, regime="llm", seed=tokens))
        for enc in ("encode_keys", "encode_values"):
            pe, pc = getattr(eager, enc)(k if enc == "encode_keys" else v), getattr(comp, enc)(k if enc == "encode_keys" else v)
            for name, f in pe.fields.items():
                assert torch.equal(f, pc.fields[name]), f"{method} {enc} field {name} differs compiled vs eager"
            dec = "decode_keys" if enc == "encode_keys" else "decode_values"
            torch.testing.assert_close(getattr(comp, dec)(pe), getattr(eager, dec)(pe), rtol=1e-6, atol=1e-6)
        pk, pv = eager.encode_keys(k), eager.encode_values(v)
        q = _q().to(dtype)
        torch.testing.assert_close(comp.attend(q, pk, pv), eager.attend(q, pk, pv), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_conformance() -> None:
    from kvq_core import testing

    for method in ("oscar", "kivi", "quarot", "fp16"):
        testing.check_method("torch", method, max_examples=5, to_backend=lambda a: torch.from_numpy(a).cuda())
