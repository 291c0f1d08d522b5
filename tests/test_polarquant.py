"""PolarQuant (Han et al., 2502.02617): spec validation, layout and bits, exactness on codebook
points, the MSE levels of specs/octopus.md section 3, and attention from the codes."""
from __future__ import annotations

import json

import numpy as np
import pytest

import kvq_core
from kvq_core.layout import unpack_codes
from kvq_core.math.codebooks import polar_angle_codebook
from kvq_core.math.hadamard import sylvester_hadamard
from kvq_core.math.signs import random_signs
from kvq_core.methods.polarquant import PolarQuantSpec
from kvq_core.tools.synthetic import make_kv

D = 128


def quantizer(layer: int = 0, **params: object) -> kvq_core.Quantizer:
    return kvq_core.get_quantizer("polarquant", backend="numpy", layer=layer, **params)


def unit_gaussian(n: int, d: int = D, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((1, 1, n, d))
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def mse(qz: kvq_core.Quantizer, x: np.ndarray) -> float:
    return float(np.mean(np.sum((qz.decode_keys(qz.encode_keys(x)) - x) ** 2, axis=-1)))


# -- spec -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, param",
    [
        ({"level_bits": (4, 2, 2, 2, 2, 2, 2, 2), "head_dim": 64}, "level_bits"),  # block 256 > 64
        ({"level_bits": (2,) * 5, "head_dim": 16}, "level_bits"),  # block 32 does not divide 16
        ({"level_bits": ()}, "level_bits"),
        ({"level_bits": (4, 0, 2)}, "level_bits"),
        ({"level_bits": (4, 9)}, "level_bits"),
        ({"level_bits": (4, True)}, "level_bits"),
        ({"level_bits": 4}, "level_bits"),
        ({"radius_dtype": "bfloat16"}, "radius_dtype"),
        ({"rotation": "haar"}, "rotation"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_parameters_name_the_parameter(params: dict, param: str) -> None:
    with pytest.raises(kvq_core.SpecError) as info:
        kvq_core.make_spec("polarquant", **params)
    assert info.value.param == param


def test_full_depth_is_allowed() -> None:
    assert PolarQuantSpec(level_bits=(2,) * 4, head_dim=16).block == 16


@pytest.mark.parametrize("params", [{}, {"level_bits": [3] * 7, "radius_dtype": "float32", "seed": 7, "rotation": "none"}])
def test_spec_json_round_trip_keeps_tuples(params: dict) -> None:
    spec = kvq_core.make_spec("polarquant", **params)
    back = kvq_core.spec_from_dict(json.loads(spec.to_json()))
    assert back == spec and type(back) is PolarQuantSpec and isinstance(back.level_bits, tuple)


def test_layout_fields_and_bits_per_element() -> None:
    layout = PolarQuantSpec().key_layout(2, 3, 5)
    assert list(layout) == ["level1", "level2", "level3", "level4", "radius"]
    assert [(layout[f"level{l}"].count, layout[f"level{l}"].bits) for l in (1, 2, 3, 4)] == [(64, 4), (32, 2), (16, 2), (8, 2)]
    assert layout["radius"].shape == (2, 3, 5, 8) and layout["radius"].dtype == "float16"
    x = unit_gaussian(4)
    for radius_dtype, bits in (("float16", 3.875), ("float32", 4.875)):
        qz = quantizer(radius_dtype=radius_dtype)
        assert qz.bits_per_element(qz.encode_keys(x)) == bits
        assert qz.bits_per_element([qz.encode_keys(x), qz.encode_values(x)]) == bits


# -- exactness --------------------------------------------------------------------------------
def tree_down(radius: np.ndarray, idx: list[np.ndarray], level_bits: tuple[int, ...]) -> np.ndarray:
    """Rotated-domain vectors from block radii and per-level angle indices (the paper's decode)."""
    r = radius.astype(np.float64)
    for level in range(len(level_bits), 0, -1):
        psi = polar_angle_codebook(level, level_bits[level - 1]).centroids[idx[level - 1]]
        r = np.stack((r * np.cos(psi), r * np.sin(psi)), axis=-1).reshape(*r.shape[:-1], -1)
    return r


@pytest.mark.parametrize(
    "level_bits, radius_dtype, rel_tol",
    [((4, 2, 2, 2), "float32", 1e-5), ((4, 2, 2, 2), "float16", 1e-3), ((3, 1, 2, 3, 1, 2, 2), "float32", 1e-5)],
)
def test_decode_is_exact_on_codebook_points(level_bits: tuple[int, ...], radius_dtype: str, rel_tol: float) -> None:
    """Vectors whose polar angles are codebook centroids survive encode -> decode unchanged."""
    layer, kv_heads, tokens = 3, 2, 9
    rng = np.random.default_rng(1)
    lead = (1, kv_heads, tokens)
    idx = [rng.integers(0, 2**b, (*lead, D >> l)) for l, b in enumerate(level_bits, start=1)]
    radius = rng.uniform(0.5, 4.0, (*lead, D >> len(level_bits)))
    y = tree_down(radius, idx, level_bits)
    signs = random_signs(0, layer, kv_heads, D)[None, :, None, :]
    x = (signs * (y @ sylvester_hadamard(D))).astype(np.float32)  # x = R^T y, R = H diag(s)

    qz = quantizer(layer=layer, level_bits=level_bits, radius_dtype=radius_dtype)
    packed = qz.encode_keys(x)
    for l, b in enumerate(level_bits, start=1):
        np.testing.assert_array_equal(unpack_codes(packed.fields[f"level{l}"], b, D >> l), idx[l - 1])
    decoded = qz.decode_keys(packed)
    err = np.linalg.norm(decoded - x, axis=-1) / np.linalg.norm(x, axis=-1)
    assert err.max() < rel_tol


def test_zero_vector_and_scale_equivariance() -> None:
    qz = quantizer(radius_dtype="float32")
    x = unit_gaussian(8)
    x[..., 0, :] = 0
    packed, scaled = qz.encode_keys(x), qz.encode_keys(4 * x)
    assert np.all(qz.decode_keys(packed)[..., 0, :] == 0)
    for l in (1, 2, 3, 4):
        np.testing.assert_array_equal(packed.fields[f"level{l}"], scaled.fields[f"level{l}"])
    np.testing.assert_allclose(scaled.fields["radius"], 4 * packed.fields["radius"], rtol=1e-6)


# -- error levels (specs/octopus.md section 3; sim numbers, +-10%) -----------------------------
@pytest.mark.parametrize(
    "level_bits, expected",
    [((4, 2, 2, 2), 0.0320), ((2,) * 7, 0.220), ((3,) * 7, 0.0571), ((4,) * 7, 0.0145)],
)
def test_mse_on_unit_gaussian_vectors(level_bits: tuple[int, ...], expected: float) -> None:
    measured = mse(quantizer(level_bits=level_bits), unit_gaussian(20_000))
    assert measured == pytest.approx(expected, rel=0.10)


def test_rotation_spreads_outlier_channels() -> None:
    """The preconditioner is what makes the fixed angle codebooks fit: without it, outlier keys suffer."""
    k, _ = make_kv("outliers", kv_heads=2, tokens=256)
    assert mse(quantizer(), k) < 0.5 * mse(quantizer(rotation="none"), k)
