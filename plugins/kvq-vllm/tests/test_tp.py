"""Tensor parallelism without an engine: the plugin's numba encoder codes a rank's kv heads with the
constants of their global indices (``head_offset``), as the TP=1 engine codes them."""
from __future__ import annotations

import pytest
import torch

import kvq_core
import kvq_core.dispatch.ops  # noqa: F401
from kvq_vllm import numba_encode


@pytest.mark.parametrize("method,params", [("octopus", {"bits": 3}), ("kivi", {"bits": 2})])
def test_numba_encode_of_a_rank_equals_the_single_rank_slice(method: str, params: dict) -> None:
    pytest.importorskip("numba")
    numba_encode.register()
    sj = kvq_core.make_spec(method, head_dim=64, **params).to_json()
    x = torch.randn(1, 4, 32, 64, generator=torch.Generator().manual_seed(0))
    for kind in ("keys", "values"):
        whole = torch.ops.kvq.encode("numba", sj, 2, kind, x)
        for lo in (0, 2):
            mine = torch.ops.kvq.encode("numba", sj, 2, kind, x[:, lo:lo + 2], lo)
            for a, b in zip(mine, whole):
                assert torch.equal(a, b[:, lo:lo + 2]), (kind, lo)
    if method == "octopus":  # per-head signs: without the offset rank 1 codes differently
        rank1 = torch.ops.kvq.encode("numba", sj, 2, "keys", x[:, 2:])
        assert not torch.equal(rank1[0], torch.ops.kvq.encode("numba", sj, 2, "keys", x)[0][:, 2:])
