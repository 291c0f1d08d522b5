"""``kvq::write_paged``: a step's rows written into vLLM-style pages at their slots (padding slots
skipped, every other byte untouched) are the encoded fields packed by ``PageLayout.pack``, bit for
bit: on the torch backend (the reference path) those of the torch encoders; on numba (its encoders
writing straight into the pages) those of the NumPy reference, which numba's encoders equal
bitwise; methods numba does not run go through the torch fallback."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import kvq_core
from kvq_core.api import Quantizer
from kvq_core.paged import PageLayout, step_blocks

torch = pytest.importorskip("torch")
import kvq_core.torch_ops.ops  # noqa: E402,F401

D, HEADS, LAYER = 64, 3, 5
NUMBA = importlib.util.find_spec("numba") is not None
CASES = [("octopus", {"bits": 3}, 16), ("octopus", {"bits": 3}, 32), ("octopus", {"bits": 2, "values": "fp16"}, 16),
         ("oscar", {"bits": 2}, 32), ("oscar", {"bits": 2, "key_group": 16}, 16), ("kivi", {"bits": 2}, 32),
         ("kivi", {"bits": 2, "group": 16}, 16), ("turboquant", {"bits": 3}, 16), ("fp16", {}, 32)]


def _case(spec, block_size: int, seed: int):
    """Random K/V of a step, its slots (some padding) and token-major pages of random bytes."""
    rng = np.random.default_rng(seed)
    layout = PageLayout(spec, block_size, HEADS)
    g, num_blocks = layout.group, 7
    if g == 1:  # tokens at random distinct slots, padding among them
        n = 2 * block_size + 5
        slots = rng.permutation(num_blocks * block_size)[:n]
        slots[rng.choice(n, 4, replace=False)] = -1
    else:  # whole groups at random distinct group starts, one padding group
        starts = rng.permutation(num_blocks * block_size // g)[:5] * g
        starts[2] = -1
        slots = np.concatenate([np.arange(s, s + g) if s >= 0 else np.full(g, -1) for s in starts])
        n = slots.size
    k = rng.standard_normal((n, HEADS, D)).astype(np.float32)
    v = rng.standard_normal((n, HEADS, D)).astype(np.float32) * 0.5
    physical = torch.from_numpy(rng.integers(0, 256, (num_blocks, block_size, HEADS, layout.row_bytes), np.uint8))
    return layout, k, v, slots, physical.permute(0, 2, 1, 3)


def _expected(layout: PageLayout, k: np.ndarray, v: np.ndarray, slots: np.ndarray, pages: np.ndarray,
              backend: str) -> np.ndarray:
    """The pages after the write, readably: ``backend``'s encode of the blocks, pack, a loop over tokens."""
    quant = Quantizer(layout.spec, backend, LAYER)
    kb, vb = (np.ascontiguousarray(step_blocks(x, layout.group)) for x in (k, v))
    rows = np.asarray(layout.pack(quant.encode_keys(kb).fields, quant.encode_values(vb).fields))  # [B, h, T, row]
    rows = rows.transpose(0, 2, 1, 3).reshape(k.shape[0], HEADS, layout.row_bytes)
    out = pages.copy()
    for i, s in enumerate(slots):
        if s >= 0:
            out[s // layout.block_size, :, s % layout.block_size] = rows[i]
    return out


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("method,params,block_size", CASES, ids=lambda x: str(x))
def test_rows_equal_the_reference(backend: str, method: str, params: dict, block_size: int) -> None:
    if backend == "numba" and not NUMBA:
        pytest.skip("numba is not installed")
    spec = kvq_core.make_spec(method, head_dim=D, **params)
    truth = "numpy" if backend == "numba" and method in ("octopus", "oscar", "kivi") else "torch"
    for seed in range(2):
        layout, k, v, slots, pages = _case(spec, block_size, seed)
        want = _expected(layout, k, v, slots, pages.numpy(), truth)
        for index in (torch.int32, torch.int64):
            got = pages.clone()  # contiguous clone: rows of another stride order
            torch.ops.kvq.write_paged(backend, spec.to_json(), LAYER, torch.from_numpy(k), torch.from_numpy(v), got,
                                      torch.from_numpy(slots).to(index))
            assert np.array_equal(got.numpy(), want), (method, seed, index)
        torch.ops.kvq.write_paged(backend, spec.to_json(), LAYER, torch.from_numpy(k), torch.from_numpy(v), pages,
                                  torch.from_numpy(slots))
        assert np.array_equal(pages.numpy(), want), (method, seed, "token-major")


@pytest.mark.skipif(not NUMBA, reason="numba is not installed")
def test_rows_that_are_not_contiguous() -> None:
    """Pages whose rows are strided (every other byte) get the same bytes."""
    spec = kvq_core.make_spec("octopus", head_dim=D, bits=3)
    layout, k, v, slots, pages = _case(spec, 16, 3)
    want = _expected(layout, k, v, slots, pages.numpy(), "numpy")
    wide = torch.zeros(*pages.shape[:3], 2 * layout.row_bytes, dtype=torch.uint8)
    strided = wide[..., ::2]
    strided.copy_(pages)
    torch.ops.kvq.write_paged("numba", spec.to_json(), LAYER, torch.from_numpy(k), torch.from_numpy(v), strided,
                              torch.from_numpy(slots))
    assert np.array_equal(strided.numpy(), want)


def test_no_tokens_and_fake() -> None:
    spec = kvq_core.make_spec("oscar", head_dim=D, bits=2)
    layout, k, v, slots, pages = _case(spec, 32, 0)
    before = pages.clone()
    empty = torch.zeros(0, HEADS, D)
    torch.ops.kvq.write_paged("torch", spec.to_json(), 0, empty, empty, pages, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(pages, before)
    args = ("torch", spec.to_json(), 0, torch.from_numpy(k), torch.from_numpy(v), pages, torch.from_numpy(slots))
    torch.library.opcheck(torch.ops.kvq.write_paged.default, args)
