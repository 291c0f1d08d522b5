"""Per-head constants indexed by the global kv head: a tensor-parallel rank holding heads
[offset, offset + n) encodes exactly the single-rank codes of those heads (no engine needed)."""
from __future__ import annotations

import numpy as np
import pytest

from kvq_core import registry
from kvq_core.constants import PER_HEAD, constants
from kvq_core.errors import SpecError
from kvq_core.contract import KernelContext

PER_HEAD_CODECS = [("octopus", {"bits": 3}), ("turboquant", {"bits": 3}), ("turboquant", {"bits": 2, "rotation": "haar"}),
                   ("polarquant", {}), ("qjl", {}), ("turboquant_prod", {"bits": 3}), ("quarot", {"bits": 4})]


def _encode(spec, x: np.ndarray, layer: int, head_offset: int) -> tuple[dict, dict]:
    kernels = registry.kernel_factory("numpy", spec.method)(spec)
    ctx = KernelContext(spec, layer, x.shape, constants(spec, x.shape[1], layer, head_offset))
    return kernels.encode_keys(x, ctx), kernels.encode_values(x, ctx)


@pytest.mark.parametrize("method,params", PER_HEAD_CODECS)
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_codes_equal_single_rank_codes_of_its_heads(method: str, params: dict, tp: int) -> None:
    spec = registry.make_spec(method, head_dim=64, **params)
    heads, layer = 4, 3
    x = np.random.default_rng(0).standard_normal((1, heads, 5, 64)).astype(np.float32)
    whole_k, whole_v = _encode(spec, x, layer, 0)
    per_rank = heads // tp
    for rank in range(tp):
        lo = rank * per_rank
        k, v = _encode(spec, x[:, lo:lo + per_rank], layer, lo)
        for mine, theirs in ((k, whole_k), (v, whole_v)):
            for name, field in mine.items():
                np.testing.assert_array_equal(field, theirs[name][:, lo:lo + per_rank], err_msg=f"rank {rank} {name}")
    if any(name in PER_HEAD for name in spec.constants(2, layer)):  # without the offset, rank 1 would code differently
        k, _ = _encode(spec, x[:, per_rank:2 * per_rank], layer, 0)
        assert any(not np.array_equal(f, whole_k[n][:, per_rank:2 * per_rank]) for n, f in k.items())


@pytest.mark.parametrize("method", [r.name for r in registry.list_methods() if r.available])
def test_per_head_names_are_exactly_the_arrays_with_a_head_axis(method: str) -> None:
    spec = registry.make_spec(method, head_dim=64)
    two, three = spec.constants(2, 0), spec.constants(3, 0)
    assert {n for n in two if two[n].shape != three[n].shape} == {n for n in two if n in PER_HEAD}
    for name in two:
        if name in PER_HEAD:
            assert two[name].shape[0] == 2 and three[name].shape[0] == 3
            np.testing.assert_array_equal(constants(spec, 2, 0, 1)[name], three[name][1:])


def test_negative_offset_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="head_offset"):
        constants(registry.make_spec("octopus", head_dim=64), 2, 0, -1)


# -- through the kvq:: ops: a TP=2 rank's encode and paged attention vs TP=1's, no engine ----------

#: OScaR is absent: its token norm spans every kv head of a token (docs/methods.md). The numba cases compile the
#: paged kernels' head-offset variants (~5 minutes here): slow tier.
TP_CODECS = [pytest.param("octopus", {"bits": 3}, "numba", marks=pytest.mark.slow), ("octopus", {"bits": 3}, "torch"),
             ("turboquant", {"bits": 3}, "torch"), pytest.param("kivi", {"bits": 2}, "numba", marks=pytest.mark.slow)]


@pytest.mark.parametrize("method,params,backend", TP_CODECS, ids=lambda x: str(x))
def test_tp_rank_ops_equal_single_rank_slice(method: str, params: dict, backend: str) -> None:
    """``kvq::encode(..., head_offset)`` of a rank's heads gives the single-rank fields of those heads,
    bit for bit; ``kvq::attend_paged(..., head_offset)`` over the rank's pages (the single-rank pages'
    head slice) gives the single-rank output of the rank's query heads (decode and a prefill chunk)."""
    torch = pytest.importorskip("torch")
    if backend == "numba":
        pytest.importorskip("numba")
    import kvq_core.torch_ops.ops  # noqa: F401
    from kvq_core.torch_ops.torch_kernels import field_names
    from kvq_core.paged import PageLayout

    spec = registry.make_spec(method, head_dim=64, **params)
    sj, layer, heads, group, bs, tp = spec.to_json(), 5, 4, 3, 32, 2
    t = 64
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, heads, t, 64, generator=gen), torch.randn(1, heads, t, 64, generator=gen)

    def fields(kind: str, x: torch.Tensor, offset: int) -> dict:
        return dict(zip(field_names(spec, kind), torch.ops.kvq.encode("torch", sj, layer, kind, x, offset)))

    whole = PageLayout(spec, bs, heads)
    rows = whole.pack(fields("keys", k, 0), fields("values", v, 0))  # [1, heads, t, row_bytes]
    pages = rows[0].reshape(heads, t // bs, bs, -1).permute(1, 0, 2, 3).contiguous()
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    pages = pages[[1, 0]]  # block 1 holds the first tokens (a non-trivial table)
    q = torch.randn(t, heads * group, 64, generator=gen)
    lens = torch.tensor([t], dtype=torch.int32)
    per = heads // tp
    for q_len in (1, t):
        qsl = torch.tensor([0, q_len], dtype=torch.int32)
        want = torch.ops.kvq.attend_paged(backend, sj, layer, q[:q_len], pages, table, lens, qsl, 0.125,
                                          None, None, None, None)
        for rank in range(tp):
            lo = rank * per
            mine_k, mine_v = fields("keys", k[:, lo:lo + per], lo), fields("values", v[:, lo:lo + per], lo)
            for mine, theirs in ((mine_k, fields("keys", k, 0)), (mine_v, fields("values", v, 0))):
                for name, f in mine.items():
                    assert torch.equal(f, theirs[name][:, lo:lo + per]), f"rank {rank} {name}"
            mine_pages = pages[:, lo:lo + per]
            assert torch.equal(PageLayout(spec, bs, per).pack(mine_k, mine_v)[0],
                               rows[0, lo:lo + per])
            qh = slice(lo * group, (lo + per) * group)
            got = torch.ops.kvq.attend_paged(backend, sj, layer, q[:q_len, qh], mine_pages, table, lens, qsl, 0.125,
                                             None, None, None, None, lo)
            torch.testing.assert_close(got[0], want[0][:, qh], atol=2e-5, rtol=0)
            torch.testing.assert_close(got[1], want[1][:, qh], atol=2e-5, rtol=0)
            if rank and any(name in PER_HEAD for name in spec.constants(heads, layer)):
                wrong = torch.ops.kvq.attend_paged(backend, sj, layer, q[:q_len, qh], mine_pages, table, lens, qsl,
                                                   0.125, None, None, None, None)
                assert not torch.allclose(wrong[0], want[0][:, qh], atol=1e-3)
