"""OCTOPUS: spec, layout and the NumPy reference against the numbers of shared/specs/octopus.md."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvq_core
from kvq_core.errors import SpecError
from kvq_core.layout import unpack_codes
from kvq_core.math.hadamard import fwht
from kvq_core.math.octahedral import oct_decode
from kvq_core.methods.octopus import OctopusSpec
from kvq_core.packed import PackedKV
from kvq_numpy.attention import softmax_attend
from kvq_numpy.octopus import triplets
from kvq_numpy.rotation import signed_hadamard as rotate

N_VECTORS = 20_000
BITS = (2, 3, 4)


def quantizer(**params) -> kvq_core.Quantizer:
    return kvq_core.get_quantizer("octopus", backend="numpy", **params)


@functools.lru_cache(maxsize=None)
def unit_vectors(d: int) -> np.ndarray:
    """20,000 seeded unit Gaussian directions as one [1, 1, N, d] block."""
    x = np.random.default_rng(2024).standard_normal((1, 1, N_VECTORS, d))
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def codec_mse(d: int, rounding: str, bits: int, uniform: bool = False) -> float:
    """mean ||u - u_hat||^2 through encode_keys/decode_keys; ``uniform`` uses the (b, b, b) split."""
    split = {"xi_bits": bits, "eta_bits": bits, "rho_bits": bits} if uniform else {}
    q = quantizer(head_dim=d, bits=bits, rounding=rounding, **split)
    u = unit_vectors(d)
    return float(((u - q.decode_keys(q.encode_keys(u))) ** 2).sum(-1).mean())


# -- MSE against the spec's targets (section 5.7 and 2) -----------------------------------------
@pytest.mark.parametrize(
    "d, rounding, targets, rel",
    [
        (128, "plain", (0.0896, 0.0260, 0.00711), 0.03),
        (128, "joint", (0.0832, 0.0243, 0.00668), 0.03),
        (64, "plain", (0.0925, 0.0272, 0.0075), 0.03),
    ],
)
def test_mse_matches_spec(d: int, rounding: str, targets: tuple[float, ...], rel: float) -> None:
    for bits, target in zip(BITS, targets):
        assert codec_mse(d, rounding, bits) == pytest.approx(target, rel=rel), (d, rounding, bits)


@pytest.mark.parametrize("rounding", ["plain", "joint"])
def test_mse_strictly_falls_with_bits(rounding: str) -> None:
    mse = [codec_mse(128, rounding, b) for b in BITS]
    assert mse[0] > mse[1] > mse[2]


def test_joint_rounding_beats_plain() -> None:
    for bits in BITS:
        assert codec_mse(128, "joint", bits) < codec_mse(128, "plain", bits)


def test_uniform_split_is_worse_and_matches_spec() -> None:
    for bits, target in zip(BITS, (0.166, 0.0442, 0.0113)):
        uniform = codec_mse(128, "plain", bits, uniform=True)
        assert uniform > codec_mse(128, "plain", bits)
        assert uniform == pytest.approx(target, rel=0.05)


# -- invariants (section 5) ---------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), layer=st.integers(0, 31), d=st.sampled_from([16, 64, 128]))
def test_norm_energy_identity(seed: int, layer: int, d: int) -> None:
    spec = OctopusSpec(head_dim=d, seed=seed)
    signs = spec.constants(2, layer)["signs"]
    x = np.random.default_rng(seed).standard_normal((1, 2, 5, d))
    u = (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    t = triplets(rotate(u, signs[:, None, :]), spec.n_triplets)
    np.testing.assert_allclose((t.astype(np.float64) ** 2).sum(axis=(-2, -1)), 1.0, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    exponent=st.integers(-10, 10),
    seed=st.integers(0, 2**32 - 1),
    bits=st.sampled_from(BITS),
    rounding=st.sampled_from(["plain", "joint"]),
)
def test_scale_equivariance(exponent: int, seed: int, bits: int, rounding: str) -> None:
    q = quantizer(bits=bits, rounding=rounding)
    k = np.random.default_rng(seed).standard_normal((1, 2, 6, 128)).astype(np.float32)
    c = np.float32(2.0**exponent)
    base, scaled = q.encode_keys(k), q.encode_keys(c * k)
    np.testing.assert_array_equal(scaled.fields["codes"], base.fields["codes"])
    np.testing.assert_array_equal(scaled.fields["norm"], c * base.fields["norm"])


@pytest.mark.parametrize("rounding", ["plain", "joint"])
def test_zero_vector_decodes_to_exactly_zero(rounding: str) -> None:
    q = quantizer(bits=2, rounding=rounding)
    k = np.random.default_rng(0).standard_normal((1, 2, 4, 128)).astype(np.float32)
    k[0, 1, 2] = 0.0
    packed = q.encode_keys(k)
    assert packed.fields["norm"][0, 1, 2] == 0.0
    zero = q.encode_keys(np.zeros((1, 2, 1, 128), np.float32))  # the quantizer's bound kv_heads
    np.testing.assert_array_equal(packed.fields["codes"][0, 1, 2], zero.fields["codes"][0, 1, 0])
    decoded = q.decode_keys(packed)
    assert np.all(decoded[0, 1, 2] == 0.0)
    assert np.all(np.linalg.norm(np.delete(decoded[0, 1], 2, axis=0), axis=-1) > 0)


def test_signs_per_layer_and_head_differ_and_are_deterministic() -> None:
    spec = OctopusSpec()
    signs = spec.constants(4, 0)["signs"]
    assert signs.shape == (4, 128) and signs.dtype == np.float32
    assert set(np.unique(signs)) == {-1.0, 1.0}
    assert len({row.tobytes() for row in signs}) == 4
    assert not np.array_equal(spec.constants(4, 1)["signs"], signs)
    assert not np.array_equal(OctopusSpec(seed=1).constants(4, 0)["signs"], signs)
    np.testing.assert_array_equal(OctopusSpec().constants(4, 0)["signs"], signs)
    k = np.random.default_rng(0).standard_normal((1, 4, 3, 128)).astype(np.float32)
    codes = [kvq_core.get_quantizer("octopus", "numpy", layer=layer).encode_keys(k).fields["codes"] for layer in (0, 0, 1)]
    np.testing.assert_array_equal(codes[0], codes[1])
    assert not np.array_equal(codes[0], codes[2])


def test_codes_follow_documented_packing() -> None:
    """Rebuild K from the raw fields by the module docstring's rules; it must equal decode_keys."""
    spec = OctopusSpec(bits=3, rounding="plain")
    q = kvq_core.get_quantizer(spec, backend="numpy")
    k = np.random.default_rng(5).standard_normal((2, 2, 7, 128)).astype(np.float32)
    packed = q.encode_keys(k)
    c = spec.constants(2, 0)
    code = unpack_codes(packed.fields["codes"], spec.xi_bits + spec.eta_bits + spec.rho_bits, spec.n_triplets)
    i_xi = code >> (spec.eta_bits + spec.rho_bits)
    i_eta = (code >> spec.rho_bits) % 2**spec.eta_bits
    i_rho = code % 2**spec.rho_bits
    n = oct_decode(np.stack((c["xi_codebook"][i_xi], c["eta_codebook"][i_eta]), axis=-1).astype(np.float64))
    v = (c["rho_codebook"][i_rho][..., None] * n).reshape(2, 2, 7, 3 * spec.n_triplets)[..., :128]
    expected = packed.fields["norm"][..., None] * c["signs"][:, None, :] * fwht(v)
    np.testing.assert_allclose(q.decode_keys(packed), expected, rtol=1e-5, atol=1e-6)


# -- storage ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, expected", [(2, 2.625), (3, 3.625), (4, 4.625)])
def test_bits_per_element(bits: int, expected: float) -> None:
    # 43 triplets * (3b+1) bits, padded to whole bytes, + the fp32 norm, over 128 coordinates:
    # b=2: 301 bits -> 38 bytes = 304 bits; (304 + 32) / 128 = 2.625 (b=3: 344 + 32; b=4: 384 + 32).
    q = quantizer(bits=bits)
    kv = np.random.default_rng(0).standard_normal((1, 2, 5, 128)).astype(np.float32)
    pk, pv = q.encode_keys(kv), q.encode_values(kv)
    assert q.bits_per_element(pk) == expected
    assert q.bits_per_element([pk, pv]) == expected
    fp16_values = quantizer(bits=bits, values="fp16").encode_values(kv)
    assert q.bits_per_element(pk) < fp16_values.bits_per_element() == 16.0


# -- attention from codes -----------------------------------------------------------------------
@pytest.mark.parametrize("values", ["octopus", "fp16"])
@pytest.mark.parametrize("rounding", ["plain", "joint"])
def test_attend_equals_attention_over_decoded(values: str, rounding: str) -> None:
    q = quantizer(bits=2, rounding=rounding, values=values, layer=3)
    rng = np.random.default_rng(7)
    k, v = (rng.standard_normal((2, 2, 37, 128)).astype(np.float32) for _ in range(2))
    query = rng.standard_normal((2, 4, 3, 128)).astype(np.float32)  # GQA group of 2
    pk, pv = q.encode_keys(k), q.encode_values(v)
    out, lse = q.attend(query, pk, pv, return_lse=True)
    ref_out, ref_lse = softmax_attend(query, q.decode_keys(pk), q.decode_values(pv), 1 / np.sqrt(128))
    assert np.abs(out - ref_out).max() <= 1e-5 * np.abs(ref_out).max()
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


# -- spec ---------------------------------------------------------------------------------------
def test_spec_defaults_and_resolution() -> None:
    spec = OctopusSpec()
    assert (spec.bits, spec.rounding, spec.values, spec.seed) == (2, "joint", "octopus", 0)
    assert OctopusSpec.default_residual == 32
    assert (spec.xi_bits, spec.eta_bits, spec.rho_bits) == (3, 3, 1)
    assert (OctopusSpec(bits=4).xi_bits, OctopusSpec(bits=4).rho_bits) == (5, 3)
    assert OctopusSpec(bits=3, rho_bits=3).rho_bits == 3
    consts = OctopusSpec(bits=3, eta_bits=2).constants(1, 0)
    assert consts["xi_codebook"].size == 16 and consts["eta_codebook"].size == 4
    assert all(a.dtype == np.float32 for a in consts.values())


@pytest.mark.parametrize(
    "param, value",
    [("bits", 5), ("rounding", "foo"), ("rho_bits", 0), ("xi_bits", 9), ("head_dim", 72), ("values", "x"), ("seed", -1),
     ("tail", "zero")],
)
def test_spec_errors_name_the_parameter(param: str, value: object) -> None:
    with pytest.raises(SpecError) as info:
        quantizer(**{param: value})
    assert info.value.param == param and param in str(info.value)


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    rho_bits=st.none() | st.integers(1, 8),
    rounding=st.sampled_from(["plain", "joint"]),
    values=st.sampled_from(["octopus", "fp16"]),
    seed=st.integers(0, 2**64 - 1),
    head_dim=st.sampled_from([64, 128, 256]),
)
def test_spec_json_round_trip(bits: int, rho_bits: int | None, rounding: str, values: str, seed: int, head_dim: int) -> None:
    spec = OctopusSpec(head_dim=head_dim, bits=bits, rho_bits=rho_bits, rounding=rounding, values=values, seed=seed)
    assert kvq_core.spec_from_dict(json.loads(spec.to_json())) == spec


@pytest.mark.parametrize("values", ["octopus", "fp16"])
def test_packed_dict_round_trip_decodes_identically(values: str) -> None:
    q = quantizer(bits=3, values=values, layer=2)
    k, v = np.random.default_rng(3).standard_normal((2, 1, 2, 5, 128)).astype(np.float32)
    for packed, decode in ((q.encode_keys(k), q.decode_keys), (q.encode_values(v), q.decode_values)):
        rebuilt = PackedKV.from_dict(packed.to_dict())
        np.testing.assert_array_equal(decode(rebuilt), decode(packed))
