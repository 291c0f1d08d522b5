"""ONNX export (kvq_core.integrations.onnx): onnxruntime (CPU) against the NumPy reference.

Graphs are exported at batch 2 and a token count above two groups (131 or 259) and run at
batch 3, tokens 45 and 301 and q_len 1 (a decode step), GQA 4 (kv_heads 2, q_heads 8). Every
method runs its five graphs at one head dim and encode_keys + attend at the other, so 28
exports in all (each takes seconds). Codes must equal the reference's up to genuine ties
(kvq_core.testing's rule: a differing code is accepted iff the reference produces it for an
input perturbed by TIE_RTOL); side fields, decode and attend within the suite's tolerances.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from kvq_core import get_quantizer  # noqa: E402
from kvq_core.tools.cli import main as kvq_main  # noqa: E402
from kvq_core.errors import ExportError  # noqa: E402
from kvq_core.layout import unpack_codes  # noqa: E402
from kvq_core.integrations.onnx import GRAPHS, MIN_OPSET, export  # noqa: E402
from kvq_core.integrations.onnx.exporter import to_onnx  # noqa: E402
from kvq_core.integrations.onnx.graphs import GraphIO, example_tokens  # noqa: E402
from kvq_core.packed import PackedKV  # noqa: E402
from kvq_core.testing import FIELD_RTOL, TIE_RTOL, TIE_RUNS, attend_tolerance, decode_tolerance  # noqa: E402

KV_HEADS, Q_HEADS, BATCH = 2, 8, 3
TOKENS = (45, 301)
#: (method, head_dim, graphs): all five graphs at one head dim, encode_keys + attend at the other.
CASES = [
    *((m, d, GRAPHS) for m, d in (("oscar", 128), ("octopus", 64), ("turboquant", 128), ("kivi", 64))),
    *((m, d, ("encode_keys", "attend")) for m, d in (("oscar", 64), ("octopus", 128), ("turboquant", 64), ("kivi", 128))),
]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """``get(method, head_dim, graph)``: an onnxruntime session of that export (made once)."""
    made: dict[tuple[str, int, str], ort.InferenceSession] = {}
    folder = tmp_path_factory.mktemp("onnx")

    def get(method: str, d: int, graph: str) -> ort.InferenceSession:
        key = (method, d, graph)
        if key not in made:
            q = get_quantizer(method, "numpy", head_dim=d)
            path = export(q, folder / f"{method}-{d}-{graph}.onnx", graph, kv_heads=KV_HEADS, q_heads=Q_HEADS)
            made[key] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return made[key]

    return get


def _perturbed(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    r = rng.uniform(-1.0, 1.0, x.shape).astype(np.float32)
    return (x * (np.float32(1) + np.float32(TIE_RTOL) * r)).astype(np.float32)


def check_fields(q, kind: str, x: np.ndarray, got: dict[str, np.ndarray]) -> int:
    """The ONNX encoding ``got`` against the reference's of ``x`` (codes up to ties); returns the tie count."""
    encode = q.encode_keys if kind == "keys" else q.encode_values
    ref = encode(x)
    runs: list[PackedKV] = []
    rng = np.random.default_rng(7)
    ties = 0
    for name, field in ref.layout.items():
        b, r = got[name], np.asarray(ref.fields[name])
        assert b.dtype == r.dtype and b.shape == r.shape, (name, b.dtype, b.shape, r.dtype, r.shape)
        if field.is_codes:
            cb, cr = unpack_codes(b, field.bits, field.count), unpack_codes(r, field.bits, field.count)
            diff = cb != cr
            if diff.any():
                runs = runs or [encode(_perturbed(x, rng)) for _ in range(TIE_RUNS)]
                allowed = np.zeros_like(diff)
                for run in runs:
                    allowed |= unpack_codes(np.asarray(run.fields[name]), field.bits, field.count) == cb
                assert not (diff & ~allowed).any(), f"{kind} {name}: {int((diff & ~allowed).sum())} codes differ, not ties"
                ties += int(diff.sum())
        else:
            bf, rf = b.astype(np.float32), r.astype(np.float32)
            rtol = FIELD_RTOL[field.dtype]
            tol = rtol * np.abs(rf) + rtol * 1e-3 * float(np.abs(rf).max()) + 1e-30
            assert (np.abs(bf - rf) <= tol).all(), f"{kind} {name}: max |diff| {np.abs(bf - rf).max():.3g}"
    return ties


def run(session, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feed)))


@pytest.mark.slow
@pytest.mark.parametrize(("method", "d", "graphs"), CASES, ids=[f"{m}-{d}-{len(g)}graphs" for m, d, g in CASES])
def test_onnxruntime_matches_reference(sessions, method, d, graphs):
    q = get_quantizer(method, "numpy", head_dim=d)
    assert example_tokens(q.spec) not in TOKENS
    rng = np.random.default_rng(d)
    for t in TOKENS:
        k, v = (rng.standard_normal((BATCH, KV_HEADS, t, d)).astype(np.float32) for _ in range(2))
        pk, pv = q.encode_keys(k), q.encode_values(v)
        for kind, x, ref in (("keys", k, pk), ("values", v, pv)):
            if f"encode_{kind}" in graphs:
                got = run(sessions(method, d, f"encode_{kind}"), {"x": x})
                ties = check_fields(q, kind, x, got)
                # an ONNX-encoded block is a kvq block: layout-exact, and the reference decodes it
                block = PackedKV(q.spec, kind, x.shape, got, 0, "float32")
                block.validate()
                decode = q.decode_keys if kind == "keys" else q.decode_values
                if ties == 0:  # equal codes; float16 side fields may differ by their rounding (an ulp)
                    want = decode(ref)
                    tol = decode_tolerance(want, "float32") + 2 * FIELD_RTOL["float16"] * np.abs(want).max()
                    assert (np.abs(decode(block) - want) <= tol).all(), np.abs(decode(block) - want).max()
            if f"decode_{kind}" in graphs:
                want = (q.decode_keys if kind == "keys" else q.decode_values)(ref)
                got = run(sessions(method, d, f"decode_{kind}"), {n: np.asarray(a) for n, a in ref.fields.items()})["x"]
                assert got.shape == want.shape and got.dtype == np.float32
                assert (np.abs(got - want) <= decode_tolerance(want, "float32")).all(), np.abs(got - want).max()
        query = rng.standard_normal((BATCH, Q_HEADS, 1, d)).astype(np.float32)
        feed = {"q": query, **{f"keys_{n}": np.asarray(a) for n, a in pk.fields.items()},
                **{f"values_{n}": np.asarray(a) for n, a in pv.fields.items()}}
        got = run(sessions(method, d, "attend"), feed)
        out, lse = q.attend(query, pk, pv, return_lse=True)
        out_tol, lse_tol = attend_tolerance(query, q.decode_keys(pk), q.decode_values(pv), 1 / np.sqrt(d), "float32")
        assert got["out"].shape == out.shape and np.abs(got["out"] - out).max() <= out_tol
        assert got["lse"].shape == lse.shape and np.abs(got["lse"] - lse).max() <= lse_tol


def test_no_kvq_node_and_constants_are_initializers(sessions, tmp_path):
    """The attend graph holds only standard ONNX ops, its codebooks (as one decode table) and signs as initializers."""
    q = get_quantizer("octopus", "numpy", head_dim=64)
    path = export(q, tmp_path / "a.onnx", "attend", kv_heads=KV_HEADS, q_heads=Q_HEADS)
    model = onnx.load(str(path))
    assert model.opset_import[0].version >= MIN_OPSET
    domains = {n.domain for n in model.graph.node} | {n.domain for f in model.functions for n in f.node}
    assert domains <= {"", "ai.onnx"}, domains
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    consts = q.spec.constants(KV_HEADS, 0)  # the codebooks, as the decode table of every triplet code
    table = (consts["directions"][:, None, :] * consts["rho_codebook"][None, :, None]).reshape(-1, 3)
    assert any(a.shape == table.shape and np.array_equal(a, table) for a in inits.values())
    assert any(a.size == KV_HEADS * 64 and set(np.unique(a)) == {-1.0, 1.0} for a in inits.values())  # the signs
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == ["q", "keys_codes", "keys_norm", "values_codes", "values_norm"]
    assert inputs["keys_codes"].type.tensor_type.elem_type == onnx.TensorProto.UINT8
    dims = [d.dim_param or d.dim_value for d in inputs["keys_codes"].type.tensor_type.shape.dim]
    assert dims[0] == "batch" and dims[1] == KV_HEADS and dims[2] == "tokens"


class _Unpack(torch.nn.Module):
    """kvq's uint8 code-row unpacking in miniature: both nibbles by shifts, recombined by shifts."""

    def forward(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = packed & 15, packed >> 4
        shifts = torch.arange(0, 8, 4, dtype=torch.uint8)
        nibbles = (packed.unsqueeze(-1) >> shifts) & 15
        return torch.stack((low, high), -1) | nibbles, (high << 4) | low


def test_unsigned_shift_workaround(tmp_path):
    """torchlib types ``uint8 >> n`` / ``<<`` as int8 and the graph fails to load in onnxruntime;
    kvq's translations (used by every export through ``to_onnx``) keep them uint8."""
    x = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    io = GraphIO(_Unpack(), (x,), ("packed",), ("nibbles", "same"), ({0: torch.export.Dim("rows", min=1)},))
    to_onnx(io, tmp_path / "shift.onnx")
    session = ort.InferenceSession(str(tmp_path / "shift.onnx"), providers=["CPUExecutionProvider"])
    y = np.random.default_rng(0).integers(0, 256, (7, 64), dtype=np.uint8)
    nibbles, same = session.run(None, {"packed": y})
    want_n, want_s = _Unpack()(torch.from_numpy(y))
    assert nibbles.dtype == np.uint8 and same.dtype == np.uint8
    np.testing.assert_array_equal(nibbles, want_n.numpy())
    np.testing.assert_array_equal(same, y)


class _OpaqueOp(torch.nn.Module):
    """A module that calls a ``kvq::`` op itself (as a user's model would) instead of its kernel."""

    def __init__(self, spec_json: str) -> None:
        super().__init__()
        self.spec_json = spec_json

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.ops.kvq.encode("torch", self.spec_json, 0, "values", x))


def test_opaque_kvq_op_is_an_export_error(tmp_path):
    """A ``kvq::`` op never reaches an ONNX file as an opaque node: export stops with ExportError."""
    spec = get_quantizer("kivi", "torch", head_dim=64).spec
    io = GraphIO(_OpaqueOp(spec.to_json()), (torch.randn(2, 2, 40, 64),), ("x",), ("codes", "scale", "offset"),
                 ({0: torch.export.Dim("batch")},))
    with pytest.raises(ExportError, match="kvq.encode"):
        to_onnx(io, tmp_path / "opaque.onnx")
    assert not (tmp_path / "opaque.onnx").exists()


@pytest.mark.parametrize(("method", "graph", "opset", "match"), [
    ("qjl", "attend", MIN_OPSET, "no checked export path"),
    ("kivi", "attend", MIN_OPSET - 1, "opset=22"),
    ("kivi", "attend", 10_000, "opset=10000"),
    ("kivi", "prefill", MIN_OPSET, "graph='prefill'"),
])
def test_unsupported_raise_export_error(tmp_path, method, graph, opset, match):
    q = get_quantizer(method, "numpy", head_dim=64)
    with pytest.raises(ExportError, match=match):
        export(q, tmp_path / "x.onnx", graph, kv_heads=2, opset=opset)
    assert not (tmp_path / "x.onnx").exists()


def test_gqa_mismatch_raises(tmp_path):
    with pytest.raises(ExportError, match="q_heads=6 is not a multiple of kv_heads=4"):
        export(get_quantizer("kivi", "numpy", head_dim=64), tmp_path / "x.onnx", "attend", kv_heads=4, q_heads=6)


def test_cli_export(tmp_path, capsys):
    out = tmp_path / "kivi.onnx"
    rc = kvq_main(["export", "onnx", "kivi", "--graph", "decode_values", "-o", str(out), "--head-dim", "64",
                   "--kv-heads", "2", "--param", "bits=4"])
    assert rc == 0 and "wrote" in capsys.readouterr().out
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    q = get_quantizer("kivi", "numpy", head_dim=64, bits=4)
    v = np.random.default_rng(1).standard_normal((1, 2, 9, 64)).astype(np.float32)
    pv = q.encode_values(v)
    got = session.run(None, {n: np.asarray(a) for n, a in pv.fields.items()})[0]
    want = q.decode_values(pv)
    assert (np.abs(got - want) <= decode_tolerance(want, "float32")).all()
    rc = kvq_main(["export", "onnx", "qjl", "--graph", "attend", "-o", str(tmp_path / "q.onnx"), "--kv-heads", "2"])
    assert rc == 2 and "no checked export path" in capsys.readouterr().err


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_cli_names_the_missing_extra(tmp_path):
    """Without onnxscript, ``kvq export onnx`` exits 2 naming the extra to install."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'onnxscript':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from kvq_core.tools.cli import main\n"
        f"sys.exit(main(['export', 'onnx', 'kivi', '--graph', 'attend', '-o', {str(tmp_path / 'x.onnx')!r}, '--kv-heads', '2']))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "backends")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'kvq-core[onnx,torch]'" in proc.stderr and "onnxscript" in proc.stderr
