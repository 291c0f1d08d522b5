"""KIVI: spec validation, layout and bits, exactness on the INT-b grid and on constant groups,
why keys go per channel, and attention over the packed cache (specs/baselines.md section 4)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import kvq_core
from kvq_core.methods.kivi import KiviSpec
from kvq_core.tools.synthetic import make_kv

D, G = 128, 32


def quantizer(**params: object) -> kvq_core.Quantizer:
    return kvq_core.get_quantizer("kivi", backend="numpy", **params)


def grid_groups(bits: int, shape: tuple[int, ...], axis: int, seed: int = 0) -> np.ndarray:
    """Integers on {0..2^b-1} where every group of G along ``axis`` holds both 0 and 2^b-1."""
    top = 2**bits - 1
    x = np.random.default_rng(seed).integers(0, top + 1, shape)
    x = np.moveaxis(x, axis, -1).copy()
    x[..., 0::G], x[..., 1::G] = 0, top
    return np.moveaxis(x, -1, axis).astype(np.float32)


# -- spec -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, param",
    [({"group": 0}, "group"), ({"group": 48}, "group"), ({"group": 256}, "group"), ({"bits": 0}, "bits"),
     ({"bits": 9}, "bits"), ({"bits": 2.0}, "bits"), ({"residual": 128}, "residual")],
)
def test_bad_parameters_name_the_parameter(params: dict, param: str) -> None:
    with pytest.raises(kvq_core.SpecError) as info:
        kvq_core.make_spec("kivi", **params)
    assert info.value.param == param


def test_defaults_follow_the_paper() -> None:
    spec = KiviSpec()
    assert (spec.bits, spec.group, KiviSpec.default_residual) == (2, 32, 128)


def test_spec_json_round_trip() -> None:
    spec = kvq_core.make_spec("kivi", bits=4, group=16, head_dim=64)
    assert kvq_core.spec_from_dict(json.loads(spec.to_json())) == spec


def test_layout_shapes() -> None:
    spec = KiviSpec(bits=4)
    keys, values = spec.key_layout(2, 3, 70), spec.value_layout(2, 3, 70)
    assert keys["scale"].shape == keys["offset"].shape == (2, 3, 3, D)
    assert values["scale"].shape == values["offset"].shape == (2, 3, 70, D // G)
    assert keys["codes"].shape == values["codes"].shape == (2, 3, 70, D * 4 // 8)


@pytest.mark.parametrize("bits, expected", [(2, 3.0), (4, 5.0), (8, 9.0)])
def test_bits_per_element(bits: int, expected: float) -> None:
    k, v = make_kv(kv_heads=2, tokens=64)
    qz = quantizer(bits=bits)
    assert qz.bits_per_element(qz.encode_keys(k)) == expected
    assert qz.bits_per_element(qz.encode_values(v)) == expected


# -- exactness --------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_exact_on_the_integer_grid(bits: int) -> None:
    """Key channels (over 32-token groups) and value tokens (over 32-channel groups) on the grid."""
    shape = (1, 2, 64, D)
    k, v = grid_groups(bits, shape, axis=2), grid_groups(bits, shape, axis=3, seed=1)
    qz = quantizer(bits=bits)
    np.testing.assert_array_equal(qz.decode_keys(qz.encode_keys(k)), k)
    np.testing.assert_array_equal(qz.decode_values(qz.encode_values(v)), v)
    shifted = 0.5 * (k - 1)  # step 0.5, minimum -0.5: the zero-point stays an integer
    np.testing.assert_array_equal(qz.decode_keys(qz.encode_keys(shifted)), shifted)


def test_constant_and_zero_groups_are_exact() -> None:
    k, v = make_kv(kv_heads=2, tokens=45)  # the last key group is partial (13 tokens)
    k[:, 0, :32, 5], k[:, 0, 32:, 6] = 1.25, -3.5
    k[:, 1, :, 7] = 0
    v[:, 0, 3, :32], v[:, 1, 4, 64:96] = 0.75, 0
    qz = quantizer(bits=2)
    k_hat, v_hat = qz.decode_keys(qz.encode_keys(k)), qz.decode_values(qz.encode_values(v))
    assert np.isfinite(k_hat).all() and np.isfinite(v_hat).all()
    np.testing.assert_array_equal(k_hat[:, 0, :32, 5], 1.25)
    np.testing.assert_array_equal(k_hat[:, 0, 32:, 6], -3.5)
    np.testing.assert_array_equal(k_hat[:, 1, :, 7], 0)
    np.testing.assert_array_equal(v_hat[:, 0, 3, :32], 0.75)
    np.testing.assert_array_equal(v_hat[:, 1, 4, 64:96], 0)
    zeros = np.zeros((1, 2, 5, D), np.float32)  # the quantizer's bound kv_heads
    np.testing.assert_array_equal(qz.decode_keys(qz.encode_keys(zeros)), zeros)


# -- the point of per-channel keys ------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_per_channel_keys_beat_per_token_on_outlier_channels(bits: int) -> None:
    """Outlier channels inflate every per-token range; per-channel groups keep them apart."""
    k, _ = make_kv("outliers", kv_heads=4, tokens=256)
    kivi = quantizer(bits=bits)
    per_token = kvq_core.get_quantizer("quarot", backend="numpy", bits=bits, rotation=False)
    kivi_err = np.mean((kivi.decode_keys(kivi.encode_keys(k)) - k) ** 2)
    token_err = np.mean((per_token.decode_keys(per_token.encode_keys(k)) - k) ** 2)
    assert kivi_err < 0.5 * token_err
