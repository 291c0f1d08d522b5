"""Errors carry the fix: misspelt names get a "did you mean", ``backend="cuda"`` is
told that CUDA is a ``device=``, an unavailable backend names the backends that can serve the
spec there, ``device="cuda"`` without CUDA is refused, a block whose KV heads disagree with the
quantizer's (a transposed one above all) is an InputError naming the order, and
``repr(PackedKV)`` is one line."""
from __future__ import annotations

import numpy as np
import pytest

import kvq_core
from kvq_core import registry
from kvq_core.errors import BackendUnavailableError, InputError, SpecError, UnknownBackendError, UnknownMethodError


def test_misspelt_names_get_did_you_mean() -> None:
    with pytest.raises(UnknownMethodError, match=r"unknown method 'oscr'; did you mean 'oscar'\? registered: "):
        kvq_core.get_quantizer("oscr")
    with pytest.raises(UnknownBackendError, match=r"unknown backend 'nunpy'; did you mean 'numpy'\?"):
        kvq_core.get_quantizer("oscar", backend="nunpy")
    with pytest.raises(UnknownMethodError) as info:  # nothing close: no guess
        kvq_core.get_quantizer("zzzz")
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cpu"])
def test_a_device_passed_as_backend_is_told_to_use_device(name: str) -> None:
    with pytest.raises(UnknownBackendError, match=rf"'{name}' is a device, not a backend: pass device='{name}'"):
        kvq_core.get_quantizer("oscar", backend=name)


def test_an_unavailable_backend_names_the_ones_that_can_serve() -> None:
    spec = kvq_core.make_spec("qjl")
    can = registry.serving(spec, None)
    assert "numpy" in can and "numba" not in can
    if "numba" in {b.name for b in kvq_core.list_backends()}:
        with pytest.raises(BackendUnavailableError, match=r"backend 'numba' has no kernels for method 'qjl'.*"
                                                          r"backends that can serve qjl\(.*\) on NumPy arrays here: "
                                                          + r", ".join(can) + r" \(backend='auto' picks among them\)"):
            kvq_core.get_quantizer("qjl", backend="numba")
    triton = {b.name: b for b in kvq_core.list_backends()}.get("triton")
    if triton is not None and not triton.available:  # a CPU machine without TRITON_INTERPRET
        with pytest.raises(BackendUnavailableError, match=r"backend 'triton' is unavailable here: .*backends that "
                                                          r"can serve oscar\(.*\) on cpu here: .*numpy"):
            kvq_core.get_quantizer("oscar", backend="triton", device="cpu")


def test_cuda_device_without_cuda_is_an_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for device in ("cuda", "cuda:0"):
        with pytest.raises(BackendUnavailableError, match=rf"device='{device}', but CUDA is not available here.*"
                                                          r"device='cpu'"):
            kvq_core.get_quantizer("oscar", device=device)
    assert kvq_core.get_quantizer("oscar", device="cpu").backend in registry.serving(kvq_core.make_spec("oscar"), "cpu")


def test_kv_heads_bind_on_first_use_and_a_transposed_block_is_named() -> None:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 8, 40, 64)).astype(np.float32)
    q = kvq_core.get_quantizer("oscar", backend="numpy")
    assert q.kv_heads is None
    with pytest.raises(InputError):  # a rejected first block binds nothing
        q.encode_keys(np.full_like(k[:, :3], np.nan))
    assert q.kv_heads is None
    pk = q.encode_keys(k)
    assert q.kv_heads == 8 and "kv_heads=8" in repr(q)
    with pytest.raises(InputError, match=r"values: shape \[1, 40, 8, 64\] has 40 KV heads where this quantizer has "
                                         r"kv_heads=8 \(bound by the first block\); expected the order \[batch, "
                                         r"kv_heads, tokens, head_dim\]; it looks transposed.*transpose\(1, 2\)"):
        q.encode_values(k.swapaxes(1, 2).copy())
    with pytest.raises(InputError, match=r"has 4 KV heads where this quantizer has kv_heads=8") as info:
        q.encode_values(k[:, :4])
    assert "transposed" not in str(info.value)
    other = kvq_core.get_quantizer("oscar", backend="numpy").encode_keys(k[:, :2])
    with pytest.raises(InputError, match=r"packed keys: shape \[1, 2, 40, 64\] has 2 KV heads"):
        q.decode_keys(other)
    assert q.decode_keys(pk).shape == k.shape
    given = kvq_core.get_quantizer("oscar", backend="numpy", kv_heads=8)
    with pytest.raises(InputError, match=r"kv_heads=8 \(given as kv_heads=\).*looks transposed"):
        given.encode_keys(k.swapaxes(1, 2).copy())  # the very first block is checked
    with pytest.raises(SpecError, match="kv_heads"):
        kvq_core.get_quantizer("oscar", kv_heads=0)


def test_packed_repr_is_one_short_line() -> None:
    q = kvq_core.get_quantizer("octopus", backend="numpy", bits=3)
    pk = q.encode_keys(np.ones((1, 2, 5, 64), np.float32))
    text = repr(pk)
    assert "\n" not in text and len(text) < 250
    assert text.startswith("PackedKV(keys octopus(head_dim=64, bits=3") and "shape=[1, 2, 5, 64]" in text
    assert f"{pk.nbytes():,} bytes" in text and f"{pk.bits_per_element():.3f} bits/elt" in text


def test_attend_over_blocks_encoded_transposed_says_so() -> None:
    """The first block binds kv_heads, so a transposed first block is only caught at attend: the
    error there names the likely cause (e.g. [1, 1000, 8, 128] coded as 1000 heads)."""
    q = kvq_core.get_quantizer("oscar", backend="numpy")
    k = np.random.default_rng(1).standard_normal((1, 100, 8, 64)).astype(np.float32)
    pk, pv = q.encode_keys(k), q.encode_values(k)
    with pytest.raises(InputError, match=r"query heads 32 is not a multiple of kv_heads 100.*100 KV heads of 8 tokens.*"
                                         r"\[batch, tokens, kv_heads, head_dim\]\?"):
        q.attend(np.ones((1, 32, 1, 64), np.float32), pk, pv)
