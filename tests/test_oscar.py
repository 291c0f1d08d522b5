"""OScaR: spec validation, layout, the OTS invariants, exactness, attention and the error levels
of specs/oscar.md (sections 1.3, 1.4 and 6), on the NumPy reference backend."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvq_core
from kvq_core.math.hadamard import fwht, sylvester_hadamard
from kvq_core.methods.oscar import OscarSpec
from kvq_core.tools.synthetic import SINK_TOKENS, make_kv, make_queries, token_scales
from kvq_numpy.attention import softmax_attend
from kvq_numpy.intcodes import token_norms

D = 128
FEW = settings(max_examples=20, deadline=None)


def quantizer(**params: object) -> kvq_core.Quantizer:
    return kvq_core.get_quantizer("oscar", backend="numpy", **{"bits": 2, **params})


def roundtrip_keys(qz: kvq_core.Quantizer, k: np.ndarray) -> np.ndarray:
    return qz.decode_keys(qz.encode_keys(k))


def roundtrip_values(qz: kvq_core.Quantizer, v: np.ndarray) -> np.ndarray:
    return qz.decode_values(qz.encode_values(v))


def token_rel_error(approx: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Relative L2 error per token ``[tokens]`` of the key/value concatenated over all heads (batch 1)."""
    err = np.sqrt(np.square(approx - exact).sum(axis=(1, 3)))
    return (err / np.sqrt(np.square(exact).sum(axis=(1, 3))))[0]


def gaussian(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- spec -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, param",
    [
        ({"bits": 9}, "bits"),
        ({"bits": 1}, "bits"),
        ({"key_group": 0}, "key_group"),
        ({"value_group": 48}, "value_group"),
        ({"value_group": 256}, "value_group"),
        ({"head_dim": 72}, "head_dim"),
        ({"token_scaling": 1}, "token_scaling"),
        ({"rotation": "yes"}, "rotation"),
        ({"group": 32}, "group"),
    ],
)
def test_bad_parameters_name_the_parameter(params: dict, param: str) -> None:
    with pytest.raises(kvq_core.SpecError) as info:
        kvq_core.make_spec("oscar", **params)
    assert info.value.param == param


@pytest.mark.parametrize(
    "params, key_group, value_group",
    [({"bits": 2}, 32, 32), ({"bits": 3}, 32, 32), ({"bits": 4}, 128, 128), ({"bits": 8, "head_dim": 64}, 128, 64),
     ({"bits": 2, "head_dim": 16}, 32, 16), ({"bits": 4, "key_group": 64, "value_group": 16}, 64, 16)],
)
def test_group_defaults_resolve_from_bits(params: dict, key_group: int, value_group: int) -> None:
    spec = OscarSpec(**params)
    assert (spec.key_group, spec.value_group) == (key_group, value_group)


@pytest.mark.parametrize("params", [{}, {"bits": 4}, {"bits": 3, "key_group": 7, "token_scaling": False, "rotation": False}])
def test_spec_json_round_trip(params: dict) -> None:
    spec = kvq_core.make_spec("oscar", **params)
    back = kvq_core.spec_from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back == spec and type(back) is OscarSpec
    assert OscarSpec() == OscarSpec(key_group=32, value_group=32)


def test_constants_are_the_float32_hadamard_only_when_rotating() -> None:
    h = OscarSpec().constants(kv_heads=8, layer=0)["hadamard"]
    assert h.dtype == np.float32 and h.shape == (D, D)
    np.testing.assert_array_equal(h, sylvester_hadamard(D).astype(np.float32))
    assert OscarSpec(rotation=False).constants(8, 0) == {}


# -- layout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, tokens, groups", [(2, 100, 4), (2, 1, 1), (3, 64, 2), (4, 200, 2)])
def test_layout_fields_dtypes_and_shapes(bits: int, tokens: int, groups: int) -> None:
    b, h = 2, 3
    qz = quantizer(bits=bits)
    pk = qz.encode_keys(gaussian((b, h, tokens, D)))
    pv = qz.encode_values(gaussian((b, h, tokens, D), seed=1))
    row = D * bits // 8
    gv = D // qz.spec.value_group
    assert {k: (str(a.dtype), a.shape) for k, a in pk.fields.items()} == {
        "codes": ("uint8", (b, h, tokens, row)),
        "scale": ("float16", (b, h, groups, D)),
        "offset": ("float16", (b, h, groups, D)),
        "norm": ("float32", (b, tokens)),
    }
    assert {k: (str(a.dtype), a.shape) for k, a in pv.fields.items()} == {
        "codes": ("uint8", (b, h, tokens, row)),
        "scale": ("float16", (b, h, tokens, gv)),
        "offset": ("float16", (b, h, tokens, gv)),
    }


def test_no_norm_field_without_token_scaling() -> None:
    assert set(OscarSpec(token_scaling=False).key_layout(1, 8, 100)) == {"codes", "scale", "offset"}


def test_bits_per_element_counts_codes_stats_and_norm() -> None:
    k, v = make_kv("sinks", 1, 8, 256, D, seed=0)
    for bits, g in ((2, 32), (4, 128)):
        qz = quantizer(bits=bits)
        assert qz.bits_per_element(qz.encode_keys(k)) == bits + 32 / g + 32 / (8 * D)
        assert qz.bits_per_element(qz.encode_values(v)) == bits + 32 / g
    qz = quantizer()
    assert qz.bits_per_element(qz.encode_keys(k)) == 3.03125
    assert qz.bits_per_element([qz.encode_keys(k), qz.encode_values(v)]) == (3.03125 + 3.0) / 2


def test_packed_dict_round_trip_decodes_identically() -> None:
    qz = quantizer()
    k, v = make_kv("sinks", 1, 4, 100, D, seed=3)
    for packed, decode in ((qz.encode_keys(k), qz.decode_keys), (qz.encode_values(v), qz.decode_values)):
        back = kvq_core.PackedKV.from_dict(packed.to_dict())
        np.testing.assert_array_equal(decode(back), decode(packed))


# -- omni-token scaling -----------------------------------------------------------------------
def test_scaled_token_has_unit_concatenated_norm() -> None:
    kr = fwht(make_kv("sinks", 2, 8, 64, D, seed=0)[0])
    u = kr / token_norms(kr)[:, None, :, None]
    np.testing.assert_allclose(np.sqrt(np.square(u).sum(axis=(1, 3))), 1.0, rtol=1e-6)


def test_norm_is_the_same_before_and_after_rotation() -> None:
    k = make_kv("sinks", 2, 8, 64, D, seed=0)[0]
    stored = quantizer().encode_keys(k).fields["norm"]
    np.testing.assert_allclose(stored, np.sqrt(np.square(k.astype(np.float64)).sum(axis=(1, 3))), rtol=1e-6)
    np.testing.assert_allclose(token_norms(fwht(k)), token_norms(k), rtol=1e-6)


@FEW
@given(token=st.integers(0, 39), power=st.integers(-6, 6))
def test_token_scale_equivariance(token: int, power: int) -> None:
    """Scaling one token by c > 0 across all heads leaves every code and stat alone (spec 6.3)."""
    c = np.float32(2.0**power)  # a power of two: every step below is exact
    qz = quantizer()
    k = gaussian((1, 4, 40, D))
    scaled = k.copy()
    scaled[:, :, token] *= c
    base, moved = qz.encode_keys(k), qz.encode_keys(scaled)
    for name in ("codes", "scale", "offset"):
        np.testing.assert_array_equal(moved.fields[name], base.fields[name])
    assert moved.fields["norm"][0, token] == c * base.fields["norm"][0, token]
    expect = qz.decode_keys(base)
    expect[:, :, token] *= c
    np.testing.assert_array_equal(qz.decode_keys(moved), expect)


@FEW
@given(token=st.integers(0, 49), rotation=st.booleans())
def test_zero_token_gets_norm_one_and_finite_decode(token: int, rotation: bool) -> None:
    qz = quantizer(rotation=rotation)
    k = gaussian((1, 2, 50, D))
    k[:, :, token] = 0
    pk = qz.encode_keys(k)
    assert pk.fields["norm"][0, token] == 1.0
    assert np.isfinite(qz.decode_keys(pk)).all()


def test_all_zero_block_uses_range_minus_one_to_one_and_decodes_to_zero() -> None:
    qz = quantizer()
    z = np.zeros((1, 2, 33, D), np.float32)
    pk = qz.encode_keys(z)
    step = np.float32(2) / np.float32(3)  # (1 - (-1)) / L, zero point rint(1.5) = 2
    assert (pk.fields["scale"] == np.float16(step)).all()
    assert (pk.fields["offset"] == np.float16(-2 * step)).all()
    np.testing.assert_array_equal(qz.decode_keys(pk), z)
    np.testing.assert_array_equal(roundtrip_values(qz, z), z)


# -- exactness (rotation and OTS off, so the quantizer sees the data as given) ----------------
PLAIN = {"token_scaling": False, "rotation": False}
INT2_LEVELS = st.lists(st.integers(0, 3), min_size=32, max_size=32)


def with_extremes(levels: list[int]) -> np.ndarray:
    """A 32-group from {0,1,2,3} holding both 0 and 3, so its grid is exactly the integers."""
    return np.array([0, 3, *levels[2:]], np.float32)


@FEW
@given(levels=INT2_LEVELS, shift=st.integers(0, 127))
def test_int2_key_group_of_small_integers_is_exact(levels: list[int], shift: int) -> None:
    column = with_extremes(levels)  # one channel over 32 tokens; other channels are shifts of it
    k = np.stack([np.roll(column, shift + d) for d in range(D)], axis=-1)[None, None]
    np.testing.assert_array_equal(roundtrip_keys(quantizer(**PLAIN), k), k)


@FEW
@given(levels=INT2_LEVELS, shift=st.integers(0, 31))
def test_int2_value_group_of_small_integers_is_exact(levels: list[int], shift: int) -> None:
    row = np.tile(np.roll(with_extremes(levels), shift), D // 32)  # each 32-channel group holds 0..3
    v = np.broadcast_to(row, (1, 2, 5, D)).copy()
    np.testing.assert_array_equal(roundtrip_values(quantizer(**PLAIN), v), v)


def test_codes_and_zero_point_round_half_to_even() -> None:
    """Step 1 at INT2: range [0, 3] puts x = 0.5, 1.5, 2.5 on ties; range [-0.5, 2.5] puts the
    zero point rint(0.5) on one (0, so the offset is 0, not -1)."""
    qz = quantizer(**PLAIN)
    group = np.array([0, 3, 0.5, 1.5, 2.5] + [1] * 27, np.float32)
    decoded = roundtrip_keys(qz, np.broadcast_to(group[:, None], (1, 1, 32, D)).copy())
    np.testing.assert_array_equal(decoded[0, 0, :5, 0], [0, 3, 0, 2, 2])
    shifted = np.broadcast_to(np.array([-0.5, 2.5] + [1] * 30, np.float32)[:, None], (1, 1, 32, D))
    assert (qz.encode_keys(shifted.copy()).fields["offset"] == 0).all()


def test_partial_last_group_uses_only_its_real_tokens() -> None:
    """40 tokens at G = 32: the last group's 8 tokens span [10, 13], so its grid is exact."""
    column = np.concatenate([np.linspace(-5, 5, 32), [10, 13, 11, 12, 10, 11, 12, 13]]).astype(np.float32)
    k = np.broadcast_to(column[:, None], (1, 1, 40, D)).copy()
    np.testing.assert_array_equal(roundtrip_keys(quantizer(**PLAIN), k)[0, 0, 32:], k[0, 0, 32:])


@pytest.mark.parametrize("const", [0.0, 1.5, -3.25, 1024.0, 0.0999755859375])  # all exact in float16
def test_constant_group_reconstructs_its_constant(const: float) -> None:
    qz = quantizer(**PLAIN)
    x = np.full((1, 2, 32, D), const, np.float32)
    np.testing.assert_array_equal(roundtrip_keys(qz, x), x)
    np.testing.assert_array_equal(roundtrip_values(qz, x), x)
    assert (qz.encode_keys(x).fields["scale"] == 0).all() == (const != 0)


# -- attention --------------------------------------------------------------------------------
def test_zero_query_attends_to_the_mean_of_decoded_values() -> None:
    qz = quantizer()
    k, v = make_kv("sinks", 1, 2, 100, D, seed=2)
    pk, pv = qz.encode_keys(k), qz.encode_values(v)
    out = qz.attend(np.zeros((1, 8, 1, D), np.float32), pk, pv)
    expect = np.repeat(qz.decode_values(pv).mean(axis=2, keepdims=True), 4, axis=1)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("params", [{}, {"bits": 4}, {"token_scaling": False}, {"rotation": False}])
def test_attend_equals_softmax_over_decoded_kv(params: dict) -> None:
    """GQA 4 (8 query heads over 2 KV heads), T = 100, which is not a multiple of 32."""
    qz = quantizer(**params)
    k, v = make_kv("llm", 1, 2, 100, D, seed=4)
    q = make_queries(1, 8, 3, D, seed=5)
    pk, pv = qz.encode_keys(k), qz.encode_values(v)
    out, lse = qz.attend(q, pk, pv, return_lse=True)
    ref_out, ref_lse = softmax_attend(q, qz.decode_keys(pk), qz.decode_values(pv), 1 / np.sqrt(D))
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5 * np.abs(ref_out).max())
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


# -- error levels (spec 6.5) ------------------------------------------------------------------
# Measured on make_kv("sinks", 1, 8, 256, 128, seed=0) by this reference:
#   keys, OTS on:  INT2 (G=32) mean 0.406, sinks 0.411 / 0.406, max 0.421; INT4 G=32 0.081,
#                  INT4 at its default G=128 0.100
#   keys, OTS off: INT2 mean 0.543, sinks 1.000; INT4 (G=32) mean 0.116, sinks 0.73 / 0.69
#   values:        INT2 0.405, INT4 G=32 0.081 (G=128 0.101)
# Two differ from the spec's NumPy check (†), for reasons the tests below pin down:
# * keys with OTS: the spec says 0.37 / 0.073 but 0.41 / 0.081 for values. After OTS the
#   normalised keys of this regime are i.i.d. Gaussian (every token divided by its own norm), so
#   keys and values meet the same distribution and group size and must show the same error; the
#   spec's value numbers match ours, its key numbers are ~10% lower and cannot come from the
#   section 1.4 quantizer (a 2-bit min/max grid over 32 Gaussians leaves ~0.39 before the
#   zero-point rounding, 0.406 after). We assert equality with values and the spec's ±0.05 band.
# * keys without OTS: the spec's regime has "some tokens x3"; synthetic's puts one every 16
#   tokens, so every 32-token group holds two x3 tokens that widen its range: 0.543. With four x3
#   tokens (every 64th) the same code gives the spec's 0.44 (INT2) and 0.093 (INT4).
SINKS = list(SINK_TOKENS)


@pytest.fixture(scope="module")
def sinks_kv() -> tuple[np.ndarray, np.ndarray]:
    return make_kv("sinks", 1, 8, 256, D, seed=0)


def test_int2_ots_key_error_is_flat_across_tokens_including_sinks(sinks_kv) -> None:
    k, v = sinks_kv
    err = token_rel_error(roundtrip_keys(quantizer(), k), k)
    assert abs(err.mean() - 0.37) <= 0.05
    assert err[SINKS].max() < 0.45 and err.max() < 0.45
    v_err = token_rel_error(roundtrip_values(quantizer(), v), v).mean()
    assert err.mean() == pytest.approx(v_err, rel=0.03)  # same distribution after OTS


def test_int2_without_ots_wipes_out_sinks(sinks_kv) -> None:
    k, _ = sinks_kv
    err = token_rel_error(roundtrip_keys(quantizer(token_scaling=False), k), k)
    assert err[SINKS].min() > 0.8
    assert err.mean() == pytest.approx(0.543, abs=0.02)  # dense x3 tokens; see the note above


@pytest.mark.parametrize("bits, expect", [(2, 0.44), (4, 0.093)])
def test_without_ots_spec_levels_with_sparse_loud_tokens(bits: int, expect: float) -> None:
    scales = token_scales(256)
    scales[scales == 3.0] = 1.0
    scales[8::64] = 3.0  # four x3 tokens, the spec's "some tokens"
    k = make_kv("gaussian", 1, 8, 256, D, seed=0)[0] * scales[None, None, :, None]
    err = token_rel_error(roundtrip_keys(quantizer(bits=bits, key_group=32, token_scaling=False), k), k)
    assert err.mean() == pytest.approx(expect, rel=0.15)
    assert err[SINKS].min() > 0.5


def test_int4_errors_and_ratio_to_int2(sinks_kv) -> None:
    """At the spec's check setting (G = 32 for keys and values at both widths)."""
    k, v = sinks_kv
    int4 = quantizer(bits=4, key_group=32, value_group=32)
    k4 = token_rel_error(roundtrip_keys(int4, k), k)
    k2 = token_rel_error(roundtrip_keys(quantizer(), k), k)
    assert k4.mean() == pytest.approx(0.073, rel=0.15) and k4.max() < 0.1
    assert k2.mean() / k4.mean() == pytest.approx(5.0, rel=0.1)
    assert token_rel_error(roundtrip_values(int4, v), v).mean() == pytest.approx(0.081, rel=0.15)
    assert token_rel_error(roundtrip_values(quantizer(), v), v).mean() == pytest.approx(0.41, rel=0.15)
