"""Tensor parallelism without an engine: ``kvq::write_paged`` (what ``do_kv_cache_update`` calls)
codes a rank's kv heads with the constants of their global indices (``head_offset``), so a TP=2
rank's pages hold the TP=1 engine's rows for its heads."""
from __future__ import annotations

import pytest
import torch

import kvq_core
import kvq_core.torch_ops.ops  # noqa: F401
from kvq_core import registry
from kvq_core.paged import PageLayout

HEADS, D, PAGE, BLOCKS = 4, 64, 32, 4


def _pages(spec: kvq_core.MethodSpec, heads: int) -> torch.Tensor:
    return torch.zeros(BLOCKS, heads, PAGE, PageLayout(spec, PAGE, heads).row_bytes, dtype=torch.uint8)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("method,params", [("octopus", {"bits": 3}), ("kivi", {"bits": 2})])
def test_a_ranks_pages_equal_the_single_rank_slice(backend: str, method: str, params: dict) -> None:
    if not registry.backend_status(backend)[0]:
        pytest.skip(f"{backend}: {registry.backend_status(backend)[1]}")
    spec = kvq_core.make_spec(method, head_dim=D, **params)
    sj, n = spec.to_json(), 64
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(n, HEADS, D, generator=gen) for _ in range(2))
    slots = torch.arange(PAGE, PAGE + n, dtype=torch.int64)  # blocks 1 and 2, whole key groups
    whole = _pages(spec, HEADS)
    torch.ops.kvq.write_paged(backend, sj, 2, k, v, whole, slots)
    for lo in (0, 2):
        mine = _pages(spec, 2)
        torch.ops.kvq.write_paged(backend, sj, 2, k[:, lo:lo + 2], v[:, lo:lo + 2], mine, slots, lo)
        assert torch.equal(mine, whole[:, lo:lo + 2]), (backend, method, lo)
    if method == "octopus":  # per-head signs: without the offset rank 1 codes differently
        rank1 = _pages(spec, 2)
        torch.ops.kvq.write_paged(backend, sj, 2, k[:, 2:], v[:, 2:], rank1, slots)
        assert not torch.equal(rank1, whole[:, 2:])
