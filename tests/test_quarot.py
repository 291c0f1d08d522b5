"""QuaRot-KV: spec validation, layout and bits, what the Hadamard rotation buys, clipping, and
attention over the packed cache (specs/baselines.md section 5)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import kvq_core
from kvq_core.methods.quarot import QuaRotSpec
from kvq_core.tools.synthetic import make_kv

D = 128


def quantizer(**params: object) -> kvq_core.Quantizer:
    return kvq_core.get_quantizer("quarot", backend="numpy", **params)


def key_mse(qz: kvq_core.Quantizer, k: np.ndarray) -> float:
    return float(np.mean((qz.decode_keys(qz.encode_keys(k)) - k) ** 2))


# -- spec -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, param",
    [({"clip_ratio": 0}, "clip_ratio"), ({"clip_ratio": 1.5}, "clip_ratio"), ({"clip_ratio": float("nan")}, "clip_ratio"),
     ({"clip_ratio": "0.9"}, "clip_ratio"), ({"clip_ratio": True}, "clip_ratio"), ({"bits": 0}, "bits"),
     ({"bits": 9}, "bits"), ({"rotation": 1}, "rotation"), ({"group": 32}, "group")],
)
def test_bad_parameters_name_the_parameter(params: dict, param: str) -> None:
    with pytest.raises(kvq_core.SpecError) as info:
        kvq_core.make_spec("quarot", **params)
    assert info.value.param == param


def test_spec_json_round_trip() -> None:
    spec = kvq_core.make_spec("quarot", bits=3, rotation=False, clip_ratio=0.9, head_dim=64)
    assert kvq_core.spec_from_dict(json.loads(spec.to_json())) == spec


@pytest.mark.parametrize("bits, head_dim, expected", [(4, 128, 4.25), (2, 128, 2.25), (4, 64, 4.5)])
def test_bits_per_element(bits: int, head_dim: int, expected: float) -> None:
    k, v = make_kv(kv_heads=2, tokens=7, head_dim=head_dim)
    qz = quantizer(bits=bits, head_dim=head_dim)
    assert qz.bits_per_element([qz.encode_keys(k), qz.encode_values(v)]) == expected
    assert QuaRotSpec(bits=bits, head_dim=head_dim).key_layout(1, 2, 7)["scale"].shape == (1, 2, 7, 1)


# -- behaviour --------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_rotation_lowers_per_token_error_on_outlier_channels(bits: int) -> None:
    k, _ = make_kv("outliers", kv_heads=4, tokens=256)
    assert key_mse(quantizer(bits=bits), k) < 0.7 * key_mse(quantizer(bits=bits, rotation=False), k)


def test_exact_on_the_integer_grid_without_rotation() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (1, 2, 9, D)).astype(np.float32) - 5  # min -5 -> integer zero-point 5
    x[..., 0], x[..., 1] = -5, 10
    qz = quantizer(bits=4, rotation=False)
    np.testing.assert_array_equal(qz.decode_keys(qz.encode_keys(x)), x)
    np.testing.assert_array_equal(qz.decode_values(qz.encode_values(x)), x)


def test_values_are_rotated_and_rotated_back() -> None:
    _, v = make_kv("gaussian", kv_heads=2, tokens=16)
    qz = quantizer(bits=8)
    v_hat = qz.decode_values(qz.encode_values(v))
    assert np.mean((v_hat - v) ** 2) < 1e-4


def test_clip_ratio_saturates_each_token_range() -> None:
    k, _ = make_kv("gaussian", kv_heads=2, tokens=16)
    qz = quantizer(bits=8, rotation=False, clip_ratio=0.5)
    k_hat = qz.decode_keys(qz.encode_keys(k))
    step = (k.max(-1) - k.min(-1)) * 0.5 / 255
    assert np.all(k_hat.max(-1) <= 0.5 * k.max(-1) + step)
    assert np.all(k_hat.min(-1) >= 0.5 * k.min(-1) - step)
