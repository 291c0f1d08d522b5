"""The page layout alone (no vLLM): rows round-trip a block's fields, slots scatter and gather
a request's tokens in block-table order, and codecs with cross-token statistics are refused."""
from __future__ import annotations

import pytest
import torch

from kvq_core import get_quantizer, registry
from kvq_core.errors import SpecError
from kvq_vllm.paged import PageLayout, read_tokens, write_slots

CODECS = [("octopus", {"bits": 3}), ("turboquant", {"bits": 3}), ("quarot", {"bits": 4}),
          ("fp16", {"storage": "float32"}), ("turboquant_prod", {"bits": 3})]


@pytest.mark.parametrize("method,params", CODECS)
def test_rows_round_trip_fields(method: str, params: dict) -> None:
    q = get_quantizer(method, "torch", head_dim=64, **params)
    k, v = torch.randn(1, 3, 5, 64), torch.randn(1, 3, 5, 64)
    pk, pv = q.encode_keys(k), q.encode_values(v)
    layout = PageLayout(q.spec)
    rows = layout.pack(pk.fields, pv.fields)
    per_token = (pk.nbytes() + pv.nbytes()) // (3 * 5)
    assert rows.shape == (1, 3, 5, layout.row_bytes) and layout.row_bytes == per_token
    kf, vf = layout.unpack(rows)
    for mine, theirs in ((kf, pk.fields), (vf, pv.fields)):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert mine[name].dtype == theirs[name].dtype and torch.equal(mine[name], theirs[name]), name


def test_octopus_b3_row_is_one_eighth_of_fp32() -> None:
    layout = PageLayout(registry.make_spec("octopus", head_dim=64, bits=3))
    assert layout.row_bytes == 64 and 2 * 64 * 4 / layout.row_bytes == 8.0  # 28 code + 4 norm bytes, K and V


@pytest.mark.parametrize("token_major", [False, True])
def test_slots_scatter_and_gather_in_block_table_order(token_major: bool) -> None:
    # vLLM's logical page view [blocks, heads, block_size, row]; token-major storage (LBNHC) is a permuted view.
    store = torch.zeros(6, 4, 2, 3, dtype=torch.uint8) if token_major else torch.zeros(6, 2, 4, 3, dtype=torch.uint8)
    cache = store.permute(0, 2, 1, 3) if token_major else store
    rows = torch.arange(7 * 2 * 3, dtype=torch.uint8).reshape(7, 2, 3)  # 7 tokens, 2 heads, 3-byte rows
    blocks = torch.tensor([5, 1, 0])  # the request's block-table row (padded)
    slots = torch.tensor([5 * 4 + i for i in range(4)] + [1 * 4 + i for i in range(3)])
    write_slots(cache, rows, slots)
    got = read_tokens(cache, blocks, 7)
    assert got.shape == (1, 2, 7, 3) and torch.equal(got[0].permute(1, 0, 2), rows)
    assert torch.equal(cache[5, :, 2], rows[2]) and torch.equal(cache[1, :, 0], rows[4])
    assert int(cache[0].sum()) == 0 and int(cache[2:5].sum()) == 0 and int(cache[1, :, 3].sum()) == 0


def test_padding_slots_are_skipped() -> None:
    cache = torch.zeros(2, 1, 2, 1, dtype=torch.uint8)
    write_slots(cache, torch.tensor([[[7]], [[9]]], dtype=torch.uint8), torch.tensor([3, -1]))
    assert cache.flatten().tolist() == [0, 0, 0, 7]


@pytest.mark.parametrize("method", ["oscar", "kivi"])
def test_token_group_codecs_are_refused_by_name(method: str) -> None:
    with pytest.raises(SpecError, match="coded per token"):
        PageLayout(registry.make_spec(method, head_dim=64))
