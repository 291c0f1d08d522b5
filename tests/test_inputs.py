"""Bad input gets a typed error at the API boundary, naming the value and what was expected.

Parametrised over every registered method on the NumPy reference, and over the host backends for
input of a wrong dtype (object, str, bool, a ragged list). Decision: NaN/Inf input is
rejected (InputError) rather than encoded, since no codec can store it meaningfully.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import kvq_core
from kvq_core.errors import InputError, LayoutError, SpecError

METHODS = [m.name for m in kvq_core.list_methods() if "numpy" in m.detail]


@pytest.fixture(params=METHODS)
def q(request):
    return kvq_core.get_quantizer(request.param, backend="numpy", head_dim=64)


def _kv(shape=(1, 2, 40, 64), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_wrong_rank(q) -> None:
    with pytest.raises(InputError, match=r"rank 3 shape \[2, 40, 64\].*expected rank 4"):
        q.encode_keys(_kv()[0])


def test_head_dim_mismatch(q) -> None:
    with pytest.raises(InputError, match="head_dim 128 does not match the spec's head_dim=64"):
        q.encode_values(_kv((1, 2, 4, 128)))


def test_empty_array(q) -> None:
    with pytest.raises(InputError, match=r"empty shape \[1, 2, 0, 64\]"):
        q.encode_keys(np.zeros((1, 2, 0, 64), np.float32))


def test_integer_dtype(q) -> None:
    with pytest.raises(InputError, match="dtype int32 is not supported"):
        q.encode_keys(np.ones((1, 2, 4, 64), np.int32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected(q, bad: float) -> None:
    k = _kv()
    k[0, 1, 3, 5] = bad
    with pytest.raises(InputError, match="NaN or Inf"):
        q.encode_keys(k)


def test_overflowing_storage_is_rejected_not_stored(q) -> None:
    """Input past a stored float16 field's range raises, naming the field; otherwise it decodes finite."""
    k = _kv() * 1e6
    try:
        packed = q.encode_keys(k)
    except InputError as err:
        assert "overflows for this input" in str(err) and "largest |value|" in str(err)
        return
    assert np.isfinite(q.decode_keys(packed)).all()


@pytest.mark.parametrize("kind", ["keys", "values"])
def test_underflowing_storage_is_rejected_not_stored_as_zeros(q, kind: str) -> None:
    """Nonzero input so small that its stored fields underflow (1e-30: float16 scales and
    float32 sums of squares become 0) raises InputError naming a stored field, for every
    method; it never decodes to all zeros without a word."""
    encode = q.encode_keys if kind == "keys" else q.encode_values
    with pytest.raises(InputError, match=r"stores '\w+' \(float(16|32)\).* underflow for this input.*decode to all zeros"):
        encode(_kv() * np.float32(1e-30))


@pytest.mark.parametrize("scale", [1e-3, 1e-5, 1e-8])
def test_small_input_decodes_as_well_as_scaled_up_or_is_rejected(q, scale: float) -> None:
    """Below float16's normal range a block either raises, or decodes within the underflow
    rule (relative error <= 1.5x that of the same block at magnitude ~1, + 0.01); an all-zero
    block is stored as zeros."""
    k = _kv() * np.float32(scale)
    lift = np.float32(4.0 ** 10)
    try:
        got = q.decode_keys(q.encode_keys(k))
    except InputError as err:
        assert scale < 2.0**-14 and "underflow for this input" in str(err)
        return
    err = np.linalg.norm(got.astype(np.float64) - k) / np.linalg.norm(k.astype(np.float64))
    up = q.decode_keys(q.encode_keys(k * lift)) / lift
    err_up = np.linalg.norm(up.astype(np.float64) - k) / np.linalg.norm(k.astype(np.float64))
    assert err <= 1.5 * err_up + 0.01
    assert not q.decode_keys(q.encode_keys(np.zeros((1, 2, 3, 64), np.float32))).any()


def test_not_an_array(q) -> None:
    with pytest.raises(InputError, match="got list"):
        q.encode_keys([[1.0, 2.0]])


def test_query_checks(q) -> None:
    k = _kv()
    pk, pv = q.encode_keys(k), q.encode_values(k)
    with pytest.raises(InputError, match="query heads 3 is not a multiple of kv_heads 2"):
        q.attend(_kv((1, 3, 1, 64)), pk, pv)
    with pytest.raises(InputError, match="query head_dim 32 does not match"):
        q.attend(_kv((1, 2, 1, 32)), pk, pv)
    with pytest.raises(InputError, match="query batch 2 does not match the cache batch 1"):
        q.attend(_kv((2, 2, 1, 64)), pk, pv)
    with pytest.raises(InputError, match="expected packed keys; got packed values"):
        q.attend(_kv((1, 2, 1, 64)), pv, pk)
    with pytest.raises(InputError, match="scale"):
        q.attend(_kv((1, 2, 1, 64)), pk, pv, scale=-1.0)
    q2 = np.where(np.ones((1, 4, 1, 64), bool), np.nan, 0).astype(np.float32)
    with pytest.raises(InputError, match="query: contains NaN"):
        q.attend(q2, pk, pv)


def test_packed_from_another_spec_rejected(q) -> None:
    other = kvq_core.get_quantizer("fp16", backend="numpy", head_dim=64, storage="float32")
    pk = other.encode_keys(_kv())
    if q.spec == other.spec:
        pytest.skip("same spec")
    with pytest.raises(LayoutError, match="packed block was made with fp16"):
        q.decode_keys(pk)


def test_head_dim_not_a_multiple_of_16_rejected() -> None:
    for method in METHODS:
        if method == "fp16":  # the identity codec takes any head_dim
            assert kvq_core.get_quantizer(method, backend="numpy", head_dim=72).spec.head_dim == 72
            continue
        with pytest.raises(SpecError, match="head_dim=72.*multiple of 16"):
            kvq_core.get_quantizer(method, backend="numpy", head_dim=72)


def test_attend_output_shapes_and_gqa(q) -> None:
    k = _kv((2, 2, 33, 64))
    pk, pv = q.encode_keys(k), q.encode_values(k)
    out, lse = q.attend(_kv((2, 6, 3, 64), seed=1), pk, pv, return_lse=True)
    assert out.shape == (2, 6, 3, 64) and lse.shape == (2, 6, 3)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


# Bad input on every host backend: an array of the wrong dtype, or a ragged list, is named before any
# backend converts it (torch.as_tensor of an object array raised its own TypeError).
BACKENDS = [b.name for b in kvq_core.list_backends() if b.available and b.name in ("numpy", "torch", "numba")]
_BAD = np.random.default_rng(2).standard_normal((1, 2, 8, 64))
BAD_INPUTS = {
    "object": (_BAD.astype(object), "dtype object"),
    "str": (_BAD.astype(str), "dtype <U"),
    "bytes": (_BAD.astype(bytes), "dtype |S"),
    "ragged-object": (np.array([np.ones((4, 64)), np.ones((3, 64))], dtype=object)[None], "dtype object"),
    "ragged-list": ([[np.ones((4, 64)).tolist(), np.ones((3, 64)).tolist()]], "got list"),
    "bool": (_BAD > 0, "dtype bool"),
}


@pytest.fixture(scope="module", params=BACKENDS)
def typed(request):
    """An OScaR quantizer on a host backend, and a packed key/value pair in its arrays."""
    quant = kvq_core.get_quantizer("oscar", backend=request.param, head_dim=64)
    good = quant.arrays.asarray(_kv((1, 2, 8, 64)))
    return quant, good, quant.encode_keys(good), quant.encode_values(good)


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_kv_is_an_input_error_naming_its_dtype(typed, bad: str) -> None:
    quant, _, _, _ = typed
    x, named = BAD_INPUTS[bad]
    for kind, call in (("keys", quant.encode_keys), ("values", quant.encode_values),
                       ("keys", lambda a: quant.fake_quant(a, "keys"))):
        with pytest.raises(InputError, match=rf"^{kind}: .*{re.escape(named)}"):
            call(x)


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_query_or_window_is_an_input_error_naming_its_dtype(typed, bad: str) -> None:
    quant, good, pk, pv = typed
    x, named = BAD_INPUTS[bad]
    with pytest.raises(InputError, match=rf"^query: .*{re.escape(named)}"):
        quant.attend(x, pk, pv)
    if not quant.fuses_window(good):
        return
    for what, args in (("query", (x, good, good)), ("window keys", (good, x, good)), ("window values", (good, good, x))):
        with pytest.raises(InputError, match=rf"^{what}: .*{re.escape(named)}"):
            quant.attend_window(args[0], [(pk, pv)], args[1], args[2])


def test_a_packed_field_of_dtype_object_is_a_layout_error_naming_it(typed) -> None:
    quant, _, pk, _ = typed
    bad = pk.map_fields(lambda f: np.asarray(quant.arrays.to_numpy(f)).astype(object))
    with pytest.raises(LayoutError, match=r"field '\w+': got object\["):
        quant.decode_keys(bad)
