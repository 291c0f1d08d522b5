"""TurboQuant (mse and prod): spec, layout and the NumPy reference against specs/baselines.md section 1
and the TurboQuant rows of specs/octopus.md sections 2-3."""
from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest

import kvq_core
from kvq_core.errors import SpecError
from kvq_core.layout import unpack_codes
from kvq_core.math.hadamard import fwht
from kvq_core.methods.turboquant import TurboQuantProdSpec, TurboQuantSpec
from kvq_core.packed import PackedKV
from kvq_numpy.attention import softmax_attend
from test_qjl import aligned_problem, sketch_estimates, unbiased_z

N_VECTORS = 20_000


def quantizer(method: str = "turboquant", **params) -> kvq_core.Quantizer:
    return kvq_core.get_quantizer(method, backend="numpy", **params)


@functools.lru_cache(maxsize=None)
def unit_vectors() -> np.ndarray:
    """20,000 seeded unit Gaussian directions at d = 128 as one [1, 4, 5000, 128] block."""
    x = np.random.default_rng(2024).standard_normal((1, 4, N_VECTORS // 4, 128))
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def decoded(method: str, **params) -> np.ndarray:
    q = quantizer(method, **params)
    return q.decode_keys(q.encode_keys(unit_vectors()))


def mse(method: str = "turboquant", **params) -> float:
    """mean ||u - u_hat||^2 over the 20,000 unit vectors, through encode_keys/decode_keys."""
    return float(((unit_vectors() - decoded(method, **params)) ** 2).sum(-1).mean())


# -- MSE (octopus.md section 3) ------------------------------------------------------------------
@pytest.mark.parametrize("bits, target", [(1, 0.3611), (2, 0.1162), (3, 0.0340), (4, 0.00932)])
def test_mse_matches_spec(bits: int, target: float) -> None:
    assert mse(bits=bits) == pytest.approx(target, rel=0.03)


def test_haar_rotation_mse() -> None:
    assert mse(bits=2, rotation="haar") == pytest.approx(0.1162, rel=0.03)


def test_rate_matched_split() -> None:
    """43 coordinates at 3 bits, 85 at 2: MSE (43 D3 + 85 D2) / 128 = 0.0886; two padded code rows."""
    assert mse(bits=2, high_bits_coords=43) == pytest.approx(0.0886, rel=0.03)
    q = quantizer(bits=2, high_bits_coords=43)
    packed = q.encode_keys(unit_vectors()[:, :, :3])
    assert packed.fields["codes"].shape[-1] == math.ceil(85 * 2 / 8) == 22
    assert packed.fields["codes_hi"].shape[-1] == math.ceil(43 * 3 / 8) == 17
    assert q.bits_per_element(packed) == (22 + 17 + 4) * 8 / 128 == 2.6875


@pytest.mark.parametrize("bits, target", [(2, 0.558), (3, 0.182), (4, 0.0517)])
def test_prod_mse_matches_spec(bits: int, target: float) -> None:
    """Theory: (pi/2 - 1/d) D_mse(b-1) = 0.5644 / 0.1816 / 0.0531 for a Gaussian S with m = d."""
    assert mse("turboquant_prod", bits=bits) == pytest.approx(target, rel=0.05)


def test_norm_correction_keeps_norms() -> None:
    u_hat = decoded("turboquant", bits=2, norm_correction=True)
    np.testing.assert_allclose(np.linalg.norm(u_hat, axis=-1), 1.0, rtol=1e-5)
    assert mse(bits=2, norm_correction=True) == pytest.approx(0.1162, rel=0.05)


# -- inner products: shrink (mse) and unbiasedness (prod) ----------------------------------------
@pytest.mark.parametrize("bits, shrink", [(2, 0.883), (3, 0.966)])
def test_mse_variant_shrinks_inner_products(bits: int, shrink: float) -> None:
    """E<y, x_hat> = (1 - D_b) <y, x>: the regression slope of estimated on true inner products."""
    u = unit_vectors().astype(np.float64)
    y = np.random.default_rng(3).standard_normal(u.shape)
    true, est = (u * y).sum(-1), (decoded("turboquant", bits=bits) * y).sum(-1)
    assert (est * true).sum() / (true * true).sum() == pytest.approx(shrink, abs=0.02)


@pytest.mark.parametrize("sketch", ["gaussian", "orthogonal"])
@pytest.mark.parametrize("bits", [2, 3])
def test_prod_inner_products_are_unbiased(bits: int, sketch: str) -> None:
    """64 kv heads = 64 independent (rotation, sketch) draws, 32 keys each, one query per head.

    The same statistic flags the MSE variant's shrink (power check).
    """
    query, keys, truth = aligned_problem(64, 32, seed=bits)
    est = sketch_estimates(quantizer("turboquant_prod", bits=bits, sketch=sketch), query, keys)
    assert abs(unbiased_z(est, truth)) < 3
    assert unbiased_z(sketch_estimates(quantizer(bits=bits), query, keys), truth) < -10


# -- attention from codes ------------------------------------------------------------------------
def attention_pair(spec, layer: int = 3, seed: int = 7):
    """(quantizer, query [2, 4, 3, d] (GQA group 2), packed keys, packed values) of random data."""
    q = kvq_core.get_quantizer(spec, backend="numpy", layer=layer)
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((2, 2, 37, spec.head_dim)).astype(np.float32) for _ in range(2))
    query = rng.standard_normal((2, 4, 3, spec.head_dim)).astype(np.float32)
    return q, query, q.encode_keys(k), q.encode_values(v)


def assert_attend_matches_decoded(q: kvq_core.Quantizer, query: np.ndarray, pk: PackedKV, pv: PackedKV) -> None:
    out, lse = q.attend(query, pk, pv, return_lse=True)
    ref_out, ref_lse = softmax_attend(query, q.decode_keys(pk), q.decode_values(pv), 1 / math.sqrt(q.spec.head_dim))
    assert np.abs(out - ref_out).max() <= 1e-5 * np.abs(ref_out).max()
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


@pytest.mark.parametrize(
    "params",
    [{"bits": 2}, {"bits": 3, "rotation": "haar"}, {"bits": 2, "high_bits_coords": 43, "norm_correction": True}],
)
def test_attend_equals_attention_over_decoded(params: dict) -> None:
    assert_attend_matches_decoded(*attention_pair(TurboQuantSpec(**params)))


def prod_score_by_hand(spec: TurboQuantProdSpec, query: np.ndarray, pk: PackedKV) -> np.ndarray:
    """n (<R q, c[idx]> + sqrt(pi/2)/d gamma <S R q, h>) from the constants and the packed fields."""
    b, hk, t, d = pk.shape
    consts = spec.constants(hk, pk.layer)
    q_rot = fwht(consts["signs"][:, None, :] * query.reshape(b, hk, -1, d).astype(np.float64))
    c = consts[f"codebook_b{spec.bits - 1}"][unpack_codes(pk.fields["codes"], spec.bits - 1, d)]
    h = 2.0 * unpack_codes(pk.fields["qjl"], 1, d) - 1
    s_q = np.einsum("hmd,bhqd->bhqm", consts["sketch"].astype(np.float64), q_rot)
    score = np.einsum("bhqd,bhtd->bhqt", q_rot, c) + math.sqrt(math.pi / 2) / d * np.einsum(
        "bhqm,bhtm->bhqt", s_q, h
    ) * pk.fields["residual_norm"][:, :, None, :]
    return score * pk.fields["norm"][:, :, None, :]


@pytest.mark.parametrize("values", ["prod", "mse"])
def test_prod_attend_uses_estimator_and_decode_is_consistent(values: str) -> None:
    spec = TurboQuantProdSpec(bits=3, values=values)
    q, query, pk, pv = attention_pair(spec)
    scores = prod_score_by_hand(spec, query, pk)
    via_decode = np.einsum("bhqd,bhtd->bhqt", query.reshape(2, 2, 6, 128).astype(np.float64), q.decode_keys(pk))
    np.testing.assert_allclose(via_decode, scores, rtol=1e-5, atol=1e-5 * np.abs(scores).max())
    assert_attend_matches_decoded(q, query, pk, pv)


def test_prod_mse_values_are_turboquant() -> None:
    v = unit_vectors()[:, :2, :5]
    packed = quantizer("turboquant_prod", bits=3, values="mse").encode_values(v)
    reference = quantizer(bits=3).encode_values(v)
    assert packed.fields.keys() == reference.fields.keys()
    for name, field in packed.fields.items():
        np.testing.assert_array_equal(field, reference.fields[name])


# -- codec invariants -----------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["turboquant", "turboquant_prod"])
def test_zero_vector_decodes_to_zero_and_codes_are_scale_free(method: str) -> None:
    q = quantizer(method, bits=3)
    k = np.random.default_rng(0).standard_normal((1, 2, 4, 128)).astype(np.float32)
    k[0, 1, 2] = 0.0
    base, scaled = q.encode_keys(k), q.encode_keys(np.float32(8) * k)
    assert np.all(q.decode_keys(base)[0, 1, 2] == 0.0)
    for name, field in base.fields.items():
        expected = 8 * field if name == "norm" else field
        np.testing.assert_array_equal(scaled.fields[name], expected)


def test_rotations_differ_per_head_layer_and_seed() -> None:
    for rotation, key in (("hadamard", "signs"), ("haar", "rotation")):
        r = TurboQuantSpec(rotation=rotation).constants(3, 0)[key]
        assert len({head.tobytes() for head in r}) == 3
        assert not np.array_equal(TurboQuantSpec(rotation=rotation).constants(3, 1)[key], r)
        assert not np.array_equal(TurboQuantSpec(rotation=rotation, seed=1).constants(3, 0)[key], r)
    haar = TurboQuantSpec(rotation="haar").constants(2, 0)["rotation"].astype(np.float64)
    np.testing.assert_allclose(haar @ np.swapaxes(haar, 1, 2), np.broadcast_to(np.eye(128), haar.shape), atol=1e-5)


# -- storage and spec -----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_bits_per_element(bits: int) -> None:
    kv = np.random.default_rng(0).standard_normal((1, 2, 5, 128)).astype(np.float32)
    q = quantizer(bits=bits)
    assert q.bits_per_element([q.encode_keys(kv), q.encode_values(kv)]) == bits + 32 / 128
    if bits >= 2:
        p = quantizer("turboquant_prod", bits=bits)
        assert p.bits_per_element([p.encode_keys(kv), p.encode_values(kv)]) == (bits - 1) + 1 + 64 / 128


def test_defaults_and_layouts() -> None:
    assert TurboQuantSpec.default_residual == TurboQuantProdSpec.default_residual == 0
    assert set(TurboQuantSpec().key_layout(1, 1, 1)) == {"codes", "norm"}
    assert set(TurboQuantSpec(high_bits_coords=128).key_layout(1, 1, 1)) == {"codes_hi", "norm"}
    assert set(TurboQuantProdSpec().key_layout(1, 1, 1)) == {"codes", "qjl", "norm", "residual_norm"}
    assert set(TurboQuantProdSpec(values="mse").value_layout(1, 1, 1)) == {"codes", "norm"}
    assert mse(bits=2, high_bits_coords=128) == pytest.approx(mse(bits=3), rel=1e-6)


@pytest.mark.parametrize(
    "method, param, value",
    [
        ("turboquant", "bits", 0),
        ("turboquant", "bits", 9),
        ("turboquant", "rotation", "x"),
        ("turboquant", "high_bits_coords", 200),
        ("turboquant", "high_bits_coords", -1),
        ("turboquant", "norm_correction", 1),
        ("turboquant", "seed", -1),
        ("turboquant_prod", "bits", 1),
        ("turboquant_prod", "sketch", "x"),
        ("turboquant_prod", "values", "fp16"),
        ("turboquant_prod", "rotation", "x"),
    ],
)
def test_spec_errors_name_the_parameter(method: str, param: str, value: object) -> None:
    with pytest.raises(SpecError) as info:
        quantizer(method, **{param: value})
    assert info.value.param == param and param in str(info.value)


def test_high_bits_need_a_wider_codebook() -> None:
    with pytest.raises(SpecError) as info:
        TurboQuantSpec(bits=8, high_bits_coords=1)
    assert info.value.param == "high_bits_coords"


@pytest.mark.parametrize(
    "spec",
    [
        TurboQuantSpec(bits=3, rotation="haar", norm_correction=True, seed=2**64 - 1, high_bits_coords=43),
        TurboQuantProdSpec(head_dim=64, bits=4, rotation="haar", sketch="orthogonal", seed=5, values="mse"),
    ],
)
def test_spec_and_packed_round_trip(spec) -> None:
    assert kvq_core.spec_from_dict(json.loads(spec.to_json())) == spec
    q = kvq_core.get_quantizer(spec, backend="numpy", layer=1)
    k, v = np.random.default_rng(3).standard_normal((2, 1, 2, 5, spec.head_dim)).astype(np.float32)
    for packed, decode in ((q.encode_keys(k), q.decode_keys), (q.encode_values(v), q.decode_values)):
        rebuilt = PackedKV.from_dict(packed.to_dict())
        np.testing.assert_array_equal(decode(rebuilt), decode(packed))
