"""``kvq::attend_paged`` on backend="triton" under Triton's CPU interpreter, against the reference
(kvq_core.paged.attend_paged_reference), at small shapes: pages of 16 and 32 tokens, shuffled and
shared blocks, q_len 1 and > 1, GQA, tails. Run in a fresh process with ``TRITON_INTERPRET=1``
(``tests/test_paged.py`` launches it)."""
from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("TRITON_INTERPRET") != "1" or any(m.startswith("kvq_triton.") and m != "kvq_triton.plugin"
                                                     for m in sys.modules):
    pytest.skip("run me in a fresh process with TRITON_INTERPRET=1 (see tests/test_paged.py)", allow_module_level=True)
pytest.importorskip("triton")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvq_core  # noqa: E402
import kvq_core.torch_ops.ops  # noqa: E402,F401
from kvq_core.paged import attend_paged_reference  # noqa: E402
from kvq_core.testing.paged import paged_case  # noqa: E402

CASES = [
    ("oscar", dict(bits=2, key_group=16), 16, [16, 48, 32], [1, 1, 3], [0, 5, 15]),
    ("oscar", dict(bits=4, key_group=32), 32, [32, 64], [2, 5], [3, 0]),
    ("kivi", dict(bits=2), 32, [32, 96, 0], [1, 2, 4], [1, 0, 9]),
    ("octopus", dict(bits=3), 16, [1, 16, 37, 5], [1, 3, 2, 1], [0, 2, 0, 1]),
    ("octopus", dict(bits=2), 32, [40, 7], [1, 4], None),
]


@pytest.mark.parametrize(("method", "params", "block", "lens", "qlens", "tails"), CASES, ids=lambda x: str(x))
def test_triton_paged_matches_reference(method, params, block, lens, qlens, tails) -> None:
    from kvq_triton.paged import PagedTriton

    qz = kvq_core.get_quantizer(method, "torch", head_dim=32, **params)
    assert PagedTriton(qz.spec).fast
    case = paged_case(qz, block_size=block, kv_heads=2, q_heads=6, code_lens=lens, q_lens=qlens, tail_lens=tails,
                      share_prefix=1, seed=len(lens))
    want = attend_paged_reference(case.spec, 2, *case.args(), 0.2, *case.tails())
    got = torch.ops.kvq.attend_paged("triton", case.spec.to_json(), 2, *case.args(), 0.2, *case.tails())
    np.testing.assert_allclose(got[0].numpy(), want[0], atol=3e-5)
    np.testing.assert_allclose(got[1].numpy(), want[1], atol=3e-5)
