"""The packed layout: the bit-packing rule, bits accounting and the PackedKV round trip."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvq_core
from kvq_core.errors import LayoutError
from kvq_core.layout import codes_field, pack_codes, packed_row_bytes, unpack_codes
from kvq_core.packed import PackedKV


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), count=st.integers(1, 70), rows=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(bits: int, count: int, rows: int, seed: int) -> None:
    codes = np.random.default_rng(seed).integers(0, 2**bits, (rows, count))
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (rows, packed_row_bytes(count, bits))
    np.testing.assert_array_equal(unpack_codes(packed, bits, count), codes)


def test_bit_order_is_little_endian_stream() -> None:
    # codes 1, 2, 3 at 2 bits -> stream 10 01 11 (LSB first) -> byte 0b00111001
    assert pack_codes(np.array([[1, 2, 3]]), 2).tolist() == [[0b00111001]]
    # a 3-bit code straddles bytes: codes 5, 6, 7 -> bits 101 011 111 (LSB first)
    assert pack_codes(np.array([[5, 6, 7]]), 3).tolist() == [[0b11110101, 0b1]]
    # 4 bits: the first code sits in the low nibble
    assert pack_codes(np.array([[0xA, 0x3]]), 4).tolist() == [[0x3A]]


def test_codes_field_shape_and_bad_bits() -> None:
    f = codes_field("codes", (2, 3), 43, 7)
    assert f.shape == (2, 3, 38) and f.dtype == "uint8" and f.nbytes == 2 * 3 * 38
    with pytest.raises(LayoutError, match="bits=0"):
        codes_field("codes", (1,), 4, 0)


def test_bits_per_element_fp16_is_16() -> None:
    q = kvq_core.get_quantizer("fp16", backend="numpy")
    k = np.ones((2, 3, 5, 128), np.float32)
    pk, pv = q.encode_keys(k), q.encode_values(k)
    assert q.bits_per_element(pk) == 16.0
    assert kvq_core.bits_per_element(pk, pv) == 16.0
    assert kvq_core.get_quantizer("fp16", backend="numpy", storage="float32").bits_per_element(
        kvq_core.get_quantizer("fp16", backend="numpy", storage="float32").encode_keys(k)) == 32.0


def test_packed_dict_round_trip_and_validation() -> None:
    q = kvq_core.get_quantizer("fp16", backend="numpy")
    k = np.random.default_rng(0).standard_normal((1, 2, 7, 64)).astype(np.float32)
    q = kvq_core.get_quantizer("fp16", backend="numpy", head_dim=64)
    pk = q.encode_keys(k)
    again = PackedKV.from_dict(pk.to_dict())
    np.testing.assert_array_equal(q.decode_keys(again), q.decode_keys(pk))
    bad = pk.to_dict()
    bad["fields"]["data"] = bad["fields"]["data"][:, :, :3]
    with pytest.raises(LayoutError, match="field 'data'"):
        PackedKV.from_dict(bad)
    bad = pk.to_dict()
    bad["kind"] = "queries"
    with pytest.raises(LayoutError, match="kind"):
        PackedKV.from_dict(bad)


def test_token_separable_follows_the_layouts() -> None:
    from kvq_core.tokens import token_separable

    sep = {m: (token_separable(kvq_core.make_spec(m, head_dim=64), "keys"),
               token_separable(kvq_core.make_spec(m, head_dim=64), "values"))
           for m in ("octopus", "turboquant", "polarquant", "fp16", "quarot", "oscar", "kivi")}
    assert sep["octopus"] == sep["turboquant"] == sep["polarquant"] == sep["fp16"] == sep["quarot"] == (True, True)
    assert sep["oscar"] == (False, True)  # keys: per-channel stats over token groups, one norm per token row
    assert sep["kivi"] == (False, True)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_concat_and_slice_tokens_move_codes_exactly(backend: str) -> None:
    from kvq_core.tokens import concat_tokens, slice_tokens

    q = kvq_core.get_quantizer("octopus", backend=backend, bits=3, head_dim=64)
    k = np.random.default_rng(3).standard_normal((2, 3, 9, 64)).astype(np.float32)
    parts = [q.encode_keys(k[:, :, :4]), q.encode_keys(k[:, :, 4:5]), q.encode_keys(k[:, :, 5:])]
    joined = concat_tokens(parts, q.arrays)
    assert joined.shape == (2, 3, 9, 64) and joined.nbytes() == sum(p.nbytes() for p in parts)
    np.testing.assert_array_equal(q.arrays.to_numpy(q.decode_keys(joined)),
                                  np.concatenate([q.arrays.to_numpy(q.decode_keys(p)) for p in parts], axis=2))
    assert np.array_equal(q.arrays.to_numpy(joined.fields["codes"]),
                          q.arrays.to_numpy(concat_tokens(parts).fields["codes"]))  # the NumPy fallback
    mid = slice_tokens(joined, 3, 6)
    np.testing.assert_array_equal(q.arrays.to_numpy(q.decode_keys(mid)),
                                  q.arrays.to_numpy(q.decode_keys(joined))[:, :, 3:6])
    with pytest.raises(LayoutError, match="non-empty range"):
        slice_tokens(joined, 5, 5)
    other = kvq_core.get_quantizer("octopus", backend=backend, bits=2, head_dim=64)
    with pytest.raises(LayoutError, match="does not match"):
        concat_tokens([parts[0], other.encode_keys(k[:, :, :2])], q.arrays)
    oscar = kvq_core.get_quantizer("oscar", backend=backend, bits=2, head_dim=64)
    with pytest.raises(LayoutError, match="whole number of oscar's 32-token groups"):
        concat_tokens([oscar.encode_keys(k[:, :, :4]), oscar.encode_keys(k[:, :, 4:])])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("method", ["oscar", "kivi"])
def test_token_group_blocks_join_and_split_on_group_boundaries(backend: str, method: str) -> None:
    """Keys with statistics per 32-token group: blocks of whole groups join into exactly the
    fields one encode of all the tokens gives (OScaR's per-token norm runs along axis 1), and a
    block splits at group boundaries into exactly the fields of encoding that range."""
    from kvq_core.tokens import concat_tokens, slice_tokens, token_granule

    q = kvq_core.get_quantizer(method, backend=backend, bits=2, head_dim=64)
    assert token_granule(q.spec, "keys")[0] == 32 and token_granule(q.spec, "values")[0] == 1
    k = np.random.default_rng(5).standard_normal((2, 3, 100, 64)).astype(np.float32)
    fields = lambda p: {n: q.arrays.to_numpy(a) for n, a in p.fields.items()}  # noqa: E731
    parts = [q.encode_keys(k[:, :, :64]), q.encode_keys(k[:, :, 64:96]), q.encode_keys(k[:, :, 96:])]
    joined, whole = fields(concat_tokens(parts, q.arrays)), fields(q.encode_keys(k))
    assert joined.keys() == whole.keys()
    for name in whole:
        np.testing.assert_array_equal(joined[name], whole[name], err_msg=name)
    middle, direct = fields(slice_tokens(concat_tokens(parts, q.arrays), 32, 96)), fields(q.encode_keys(k[:, :, 32:96]))
    for name in direct:
        np.testing.assert_array_equal(middle[name], direct[name], err_msg=name)
    assert slice_tokens(q.encode_keys(k), 96, 100).shape[2] == 4  # a partial last group, to the end
    with pytest.raises(LayoutError, match="cuts inside"):
        slice_tokens(q.encode_keys(k), 0, 40)
