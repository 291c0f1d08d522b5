"""Properties every method's NumPy reference must have, checked on one table of configurations.

- ``attend`` (scored from the codes) equals softmax attention over the decoded K/V, with GQA,
  token counts that are not multiples of any group size, and a single token;
- a packed block survives ``PackedKV.to_dict`` -> ``from_dict`` and decodes identically.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvq_core
from kvq_core.tools.metrics import attention, logits
from kvq_core.packed import PackedKV
from kvq_core.tools.synthetic import make_kv, make_queries

D = 128
CONFIGS = [
    ("fp16", {}),
    ("oscar", {"bits": 2}), ("oscar", {"bits": 4, "token_scaling": False}), ("oscar", {"bits": 3, "rotation": False}),
    ("octopus", {"bits": 3}), ("octopus", {"bits": 2, "rounding": "plain", "values": "fp16"}),
    ("turboquant", {"bits": 3}), ("turboquant", {"bits": 2, "rotation": "haar", "high_bits_coords": 48}),
    ("turboquant_prod", {"bits": 3}),
    ("qjl", {}),
    ("polarquant", {}), ("polarquant", {"level_bits": (3, 2, 2), "seed": 5}),
    ("kivi", {"bits": 4}), ("kivi", {"bits": 2, "group": 16}),
    ("quarot", {"bits": 4}), ("quarot", {"bits": 3, "rotation": False, "clip_ratio": 0.95}),
]
IDS = [m + "".join(f"-{k}={v}" for k, v in p.items()) for m, p in CONFIGS]


def _lse(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    lg = logits(q, k) * scale
    m = lg.max(-1, keepdims=True)
    return (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("method, params", CONFIGS, ids=IDS)
@pytest.mark.parametrize("tokens, q_heads, q_len", [(37, 4, 3), (1, 2, 1), (96, 6, 1)])
def test_attend_equals_softmax_over_decoded(method: str, params: dict, tokens: int, q_heads: int, q_len: int) -> None:
    qz = kvq_core.get_quantizer(method, backend="numpy", layer=2, **params)
    k, v = make_kv("llm", batch=2, kv_heads=2, tokens=tokens, head_dim=D, seed=tokens)
    q = make_queries(batch=2, q_heads=q_heads, q_len=q_len, head_dim=D)
    pk, pv = qz.encode_keys(k), qz.encode_values(v)
    out, lse = qz.attend(q, pk, pv, return_lse=True)
    kh, vh = qz.decode_keys(pk).astype(np.float64), qz.decode_values(pv).astype(np.float64)
    ref = attention(q, kh, vh, 1 / np.sqrt(D))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(lse, _lse(q, kh, 1 / np.sqrt(D)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method, params", CONFIGS, ids=IDS)
@pytest.mark.parametrize("kind", ["keys", "values"])
def test_packed_dict_round_trip(method: str, params: dict, kind: str) -> None:
    qz = kvq_core.get_quantizer(method, backend="numpy", layer=1, **params)
    x = make_kv("gaussian", kv_heads=2, tokens=21, head_dim=D, seed=3)[kind == "values"]
    packed = qz.encode_keys(x) if kind == "keys" else qz.encode_values(x)
    back = PackedKV.from_dict(packed.to_dict())
    assert back.spec == packed.spec and back.kind == kind and back.layer == 1
    decode = qz.decode_keys if kind == "keys" else qz.decode_values
    np.testing.assert_array_equal(decode(back), decode(packed))
