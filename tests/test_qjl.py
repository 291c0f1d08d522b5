"""QJL: spec, layout and the NumPy reference against specs/baselines.md section 3."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import kvq_core
from kvq_core.errors import SpecError
from kvq_core.layout import unpack_codes
from kvq_core.math.sketch import gaussian_row_norm
from kvq_core.methods.qjl import QJLSpec
from kvq_core.packed import PackedKV
from kvq_numpy.attention import softmax_attend


def quantizer(**params) -> kvq_core.Quantizer:
    return kvq_core.get_quantizer("qjl", backend="numpy", **params)


def unbiased_z(estimate: np.ndarray, truth: np.ndarray) -> float:
    """z-score of the mean error, [heads, tokens] arrays: rows (one sketch each) are the independent samples."""
    per_head = (estimate - truth).mean(axis=-1)
    return float(per_head.mean() / (per_head.std(ddof=1) / math.sqrt(per_head.size)))


def aligned_problem(heads: int, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query [1, H, 1, 128], keys [1, H, T, 128], true <q, k> [H, T]) with k = q + noise.

    The true inner products are large and positive (about 128), so a multiplicative bias shows
    in the mean error (with independent q and k it would average out).
    """
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((1, heads, 1, 128))
    keys = query + rng.standard_normal((1, heads, tokens, 128))
    query, keys = query.astype(np.float32), keys.astype(np.float32)
    truth = np.einsum("hd,htd->ht", query[0, :, 0].astype(np.float64), keys[0].astype(np.float64))
    return query, keys, truth


def sketch_estimates(q: kvq_core.Quantizer, query: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """<q_h, k_hat> for keys [1, H, T, d] and one query per head [1, H, 1, d]: [H, T]."""
    k_hat = q.decode_keys(q.encode_keys(keys)).astype(np.float64)
    return np.einsum("hd,htd->ht", query[0, :, 0], k_hat[0])


def qjl_score_by_hand(spec: QJLSpec, query: np.ndarray, packed: PackedKV) -> np.ndarray:
    """sqrt(pi/2)/m ||k|| <S q, h> straight from the constants and the packed bits: [b, hk, g*lq, t]."""
    s = spec.constants(packed.shape[1], packed.layer)["sketch"].astype(np.float64)
    h = 2.0 * unpack_codes(packed.fields["qjl"], 1, spec.sketch_dim) - 1
    b, hk = packed.shape[:2]
    sq = np.einsum("hmd,bhqd->bhqm", s, query.reshape(b, hk, -1, spec.head_dim).astype(np.float64))
    dots = np.einsum("bhqm,bhtm->bhqt", sq, h)
    return math.sqrt(math.pi / 2) / spec.sketch_dim * dots * packed.fields["norm"][:, :, None, :]


# -- the estimator --------------------------------------------------------------------------------
@pytest.mark.parametrize("sketch", ["gaussian", "orthogonal"])
def test_inner_products_are_unbiased(sketch: str) -> None:
    """64 kv heads = 64 independent sketches, 32 keys each, one query per head."""
    query, keys, truth = aligned_problem(64, 32, seed=11)
    z = unbiased_z(sketch_estimates(quantizer(sketch=sketch), query, keys), truth)
    assert abs(z) < 3, z


@pytest.mark.parametrize("sketch", ["gaussian", "orthogonal"])
def test_variance_bound(sketch: str) -> None:
    """One (q, k) pair, <q, k>/(|q||k|) = 0.5, scored by 2,000 independent sketches (m = 64, d = 32).

    Var <= pi/(2m) |q|^2 |k|^2; a Gaussian sketch attains ((pi/2)|q|^2|k|^2 - <q,k>^2)/m exactly.
    """
    m, d, heads = 64, 32, 2000
    rng = np.random.default_rng(5)
    k = rng.standard_normal(d)
    w = rng.standard_normal(d)
    w -= (w @ k) / (k @ k) * k
    query = 2.0 * (0.5 * k / np.linalg.norm(k) + math.sqrt(0.75) * w / np.linalg.norm(w))
    keys = np.broadcast_to(k, (1, heads, 1, d)).astype(np.float32)
    queries = np.broadcast_to(query, (1, heads, 1, d))
    est = sketch_estimates(quantizer(head_dim=d, sketch_dim=m, sketch=sketch), queries, keys)[:, 0]
    qq, kk, qk = query @ query, float(keys[0, 0, 0] @ keys[0, 0, 0]), float(query @ keys[0, 0, 0])
    bound = math.pi / (2 * m) * qq * kk
    assert est.var(ddof=1) <= bound
    if sketch == "gaussian":
        assert est.var(ddof=1) == pytest.approx((math.pi / 2 * qq * kk - qk**2) / m, rel=0.1)


def test_orthogonal_rows_have_gaussian_mean_length() -> None:
    s = QJLSpec(sketch="orthogonal", sketch_dim=300).constants(2, 0)["sketch"].astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(s, axis=-1), gaussian_row_norm(128), rtol=1e-5)
    block = s[0, :128] @ s[0, :128].T
    np.testing.assert_allclose(block, gaussian_row_norm(128) ** 2 * np.eye(128), atol=1e-3)
    assert gaussian_row_norm(128) == pytest.approx(math.sqrt(128) * (1 - 1 / 512), rel=1e-4)


# -- attention and decoding ----------------------------------------------------------------------
def test_attend_uses_estimator_logits_and_decode_is_consistent() -> None:
    spec = QJLSpec(sketch_dim=192, value_bits=3, value_group=16)
    q = kvq_core.get_quantizer(spec, backend="numpy", layer=2)
    rng = np.random.default_rng(8)
    k, v = (rng.standard_normal((2, 2, 29, 128)).astype(np.float32) for _ in range(2))
    query = rng.standard_normal((2, 6, 3, 128)).astype(np.float32)  # GQA group of 3
    pk, pv = q.encode_keys(k), q.encode_values(v)
    scores = qjl_score_by_hand(spec, query, pk)
    decoded = q.decode_keys(pk).astype(np.float64)
    via_decode = np.einsum("bhqd,bhtd->bhqt", query.reshape(2, 2, 9, 128).astype(np.float64), decoded)
    np.testing.assert_allclose(via_decode, scores, rtol=1e-5, atol=1e-5 * np.abs(scores).max())
    out, lse = q.attend(query, pk, pv, return_lse=True)
    ref_out, ref_lse = softmax_attend(query, q.decode_keys(pk), q.decode_values(pv), 1 / math.sqrt(128))
    assert np.abs(out - ref_out).max() <= 1e-5 * np.abs(ref_out).max()
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


def test_values_are_kivi_per_token_groups() -> None:
    v = np.random.default_rng(4).standard_normal((1, 2, 9, 128)).astype(np.float32)
    packed = quantizer(value_bits=4, value_group=64).encode_values(v)
    kivi = kvq_core.get_quantizer("kivi", backend="numpy", bits=4, group=64).encode_values(v)
    assert packed.fields.keys() == kivi.fields.keys()
    for name, field in packed.fields.items():
        np.testing.assert_array_equal(field, kivi.fields[name])


def test_zero_key_decodes_to_zero() -> None:
    q = quantizer()
    k = np.random.default_rng(0).standard_normal((1, 1, 3, 128)).astype(np.float32)
    k[0, 0, 1] = 0
    decoded = q.decode_keys(q.encode_keys(k))
    assert np.all(decoded[0, 0, 1] == 0) and np.all(decoded[0, 0, ::2] != 0)


# -- storage and spec -----------------------------------------------------------------------------
@pytest.mark.parametrize("m, value_bits, group", [(256, 2, 32), (128, 4, 128), (100, 1, 16)])
def test_bits_per_element(m: int, value_bits: int, group: int) -> None:
    q = quantizer(sketch_dim=m, value_bits=value_bits, value_group=group)
    kv = np.random.default_rng(0).standard_normal((1, 2, 5, 128)).astype(np.float32)
    assert q.bits_per_element(q.encode_keys(kv)) == 8 * math.ceil(m / 8) / 128 + 32 / 128
    assert q.bits_per_element(q.encode_values(kv)) == value_bits + 32 / group


def test_defaults() -> None:
    spec = QJLSpec()
    assert (spec.sketch_dim, spec.sketch, spec.value_bits, spec.value_group) == (256, "gaussian", 2, 32)
    assert QJLSpec.default_residual == 128
    assert QJLSpec(head_dim=16).value_group == 16
    assert spec.constants(3, 1)["sketch"].shape == (3, 256, 128)


@pytest.mark.parametrize(
    "param, value",
    [("sketch_dim", 0), ("sketch_dim", -4), ("sketch", "x"), ("value_bits", 0), ("value_group", 48), ("seed", -1)],
)
def test_spec_errors_name_the_parameter(param: str, value: object) -> None:
    with pytest.raises(SpecError) as info:
        quantizer(**{param: value})
    assert info.value.param == param and param in str(info.value)


def test_sketches_differ_per_head_layer_and_seed_and_are_deterministic() -> None:
    s = QJLSpec().constants(3, 0)["sketch"]
    assert len({head.tobytes() for head in s}) == 3
    assert not np.array_equal(QJLSpec().constants(3, 1)["sketch"], s)
    assert not np.array_equal(QJLSpec(seed=7).constants(3, 0)["sketch"], s)
    np.testing.assert_array_equal(QJLSpec().constants(2, 0)["sketch"], s[:2])


def test_spec_and_packed_round_trip() -> None:
    spec = QJLSpec(sketch_dim=96, sketch="orthogonal", seed=2**64 - 1, value_bits=3, value_group=8)
    assert kvq_core.spec_from_dict(json.loads(spec.to_json())) == spec
    q = kvq_core.get_quantizer(spec, backend="numpy", layer=1)
    k, v = np.random.default_rng(3).standard_normal((2, 1, 2, 5, 128)).astype(np.float32)
    for packed, decode in ((q.encode_keys(k), q.decode_keys), (q.encode_values(v), q.decode_values)):
        rebuilt = PackedKV.from_dict(packed.to_dict())
        np.testing.assert_array_equal(decode(rebuilt), decode(packed))
