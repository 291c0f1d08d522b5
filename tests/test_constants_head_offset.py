"""Per-head constants indexed by the global kv head: a tensor-parallel rank holding heads
[offset, offset + n) encodes exactly the single-rank codes of those heads (no engine needed)."""
from __future__ import annotations

import numpy as np
import pytest

from kvq_core import registry
from kvq_core.constants import PER_HEAD, constants
from kvq_core.errors import SpecError
from kvq_core.kernels import KernelContext

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
