"""Untrusted and odd input: a block from anywhere is validated once, in core, before any
kernel reads it; sizes a spec sets are bounded; the head_dim binding is thread safe; a KVQCache step
is all or nothing."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
import threading

import numpy as np
import pytest

import kvq_core
from kvq_core import registry, testing
from kvq_core.errors import InputError, KVQError, LayoutError, SpecError
from kvq_core.math.hadamard import fwht
from kvq_core.packed import PackedKV
from kvq_core.spec import MAX_DENSE_DIM, MAX_DENSE_ENTRIES, MAX_HEAD_DIM

HAS_NUMBA = importlib.util.find_spec("numba") is not None


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# tampered blocks, through the public conformance check, per backend
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_tampered_blocks_raise_typed_errors(backend: str) -> None:
    for method in testing.methods_for(backend):
        testing.check_tampered(backend, method)


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
@pytest.mark.parametrize("method", ["oscar", "octopus"])
def test_tampered_blocks_numba_cpu(method: str) -> None:
    """The blocks of the report (a declared head_dim 128 over head_dim-64 fields read past the
    plane kernel's buffers; zero tokens gave NaN) raise before numba's kernels run."""
    testing.check_tampered("numba", method)


def test_check_tampered_catches_a_backend_that_lets_a_bad_block_through(monkeypatch) -> None:
    """The conformance check fails when validation is skipped (so it can fail at all)."""
    monkeypatch.setattr(PackedKV, "validate", lambda self, all_finite=None: None)
    with pytest.raises(testing.ConformanceError, match="raised nothing|raised (ValueError|IndexError|RuntimeError)"):
        testing.check_tampered("numpy", "oscar")


# ------------------------------------------------------------------------------------------------
# validation details
# ------------------------------------------------------------------------------------------------
class _CountingArrays:
    """The NumPy adapter, recording which arrays ``all_finite`` was asked about."""

    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_finite(self, x) -> bool:
        self.seen.append(id(x))
        return self.inner.all_finite(x)


@pytest.mark.parametrize("backend", ["numpy", pytest.param("numba", marks=pytest.mark.skipif(
    not HAS_NUMBA, reason="numba is not installed"))])
def test_a_block_is_checked_once_by_identity(backend: str) -> None:
    """A quantizer's own blocks are never re-scanned; a block from elsewhere is scanned on first
    use only; replacing a field makes it a new block that is scanned again."""
    q = kvq_core.get_quantizer("oscar", backend=backend, head_dim=64)
    q.arrays = counting = _CountingArrays(q.arrays)
    x = _x((1, 2, 40, 64))
    pk, pv = q.encode_keys(x), q.encode_values(x)
    fields = {id(a) for p in (pk, pv) for a in p.fields.values()}
    counting.seen.clear()
    for _ in range(3):
        q.attend(_x((1, 4, 1, 64), 1), pk, pv)
        q.decode_keys(pk)
    assert not fields & set(counting.seen)  # made here: checked when encoded, never again
    far = PackedKV.from_dict(pk.to_dict())  # validated by from_dict (host check), not by this quantizer
    counting.seen.clear()
    q.decode_keys(far)
    assert not {id(a) for a in far.fields.values()} & set(counting.seen)
    copy = dataclasses.replace(far)  # a new object: checked on first use, once
    counting.seen.clear()
    q.decode_keys(copy)
    q.decode_keys(copy)
    floats = [id(copy.fields[n]) for n, f in copy.layout.items() if f.dtype != "uint8"]
    assert sorted(counting.seen) == sorted(floats)
    bad = copy.fields["norm"].copy()
    bad[0, 3] = np.nan
    copy.fields["norm"] = bad  # a swapped field is seen
    with pytest.raises(InputError, match="'norm' holds NaN or Inf"):
        q.decode_keys(copy)


def test_kernel_contexts_are_reused_bounded_and_not_pickled() -> None:
    """A host quantizer makes one kernel context per block shape and layer and reuses it (the same
    results as a fresh quantizer's), keeps at most CONTEXTS_KEPT of them, and pickles none."""
    import pickle

    from kvq_core.api import CONTEXTS_KEPT

    q = kvq_core.get_quantizer("octopus", backend="numpy", head_dim=64)
    x = _x((1, 2, 9, 64))
    pk, pv = q.encode_keys(x), q.encode_values(x)
    query = _x((1, 4, 1, 64), 1)
    first = q.attend(query, pk, pv)
    ctx = q._bound.contexts[(pk.shape, 0)]
    np.testing.assert_array_equal(q.attend(query, pk, pv), first)
    assert q._bound.contexts[(pk.shape, 0)] is ctx
    np.testing.assert_array_equal(kvq_core.get_quantizer("octopus", backend="numpy", head_dim=64).attend(query, pk, pv),
                                  first)
    for t in range(1, CONTEXTS_KEPT + 5):
        q.decode_keys(q.encode_keys(_x((1, 2, t, 64))))
        assert len(q._bound.contexts) <= CONTEXTS_KEPT
    assert pickle.loads(pickle.dumps(q))._bound.contexts == {}
    assert kvq_core.get_quantizer("oscar", backend="torch", head_dim=64)._bound.contexts is None  # symbolic shapes


def test_block_dims_dtype_and_layer_are_checked() -> None:
    q = kvq_core.get_quantizer("octopus", backend="numpy", head_dim=64)
    pk = q.encode_keys(_x((1, 2, 5, 64)))
    for shape, err in (((1, 2, 0, 64), InputError), ((0, 2, 5, 64), InputError), ((1, 2, 5, 128), LayoutError),
                       ((1, 2, 5), LayoutError), ((1, 2, 5.0, 64), LayoutError)):
        with pytest.raises(err):
            q.decode_keys(dataclasses.replace(pk, shape=shape))
    for dtype in ("int8", "bool", "complex64", "float8_e4m3"):
        with pytest.raises(LayoutError, match="dtype="):
            q.decode_keys(dataclasses.replace(pk, dtype=dtype))
    with pytest.raises(LayoutError, match="layer=-3"):
        q.decode_keys(dataclasses.replace(pk, layer=-3))


def test_a_block_of_another_layer_needs_that_layer() -> None:
    """OCTOPUS signs are per layer: a layer-3 block decoded with layer-0 signs was silently wrong
    (relative error 1.47); now it raises unless the call names layer 3, which decodes as layer 3's
    quantizer does."""
    x = _x((1, 2, 9, 64))
    q0, q3 = (kvq_core.get_quantizer("octopus", backend="numpy", head_dim=64, layer=layer) for layer in (0, 3))
    p3 = q3.encode_keys(x)
    with pytest.raises(LayoutError, match="record layer 3"):
        q0.decode_keys(p3)
    np.testing.assert_array_equal(q0.decode_keys(p3, layer=3), q3.decode_keys(p3))
    assert q0.encode_keys(x, layer=3).layer == 3
    err = np.linalg.norm(q0.decode_keys(p3, layer=3) - x) / np.linalg.norm(x)
    assert err < 0.5
    with pytest.raises(InputError, match="layer=True"):
        q0.decode_keys(p3, layer=True)


@pytest.mark.parametrize("scale", [1e300, float("nan"), 0.0, 1e-300, "0.1"])
def test_attend_scale_outside_float32_is_rejected(scale) -> None:
    q = kvq_core.get_quantizer("oscar", backend="numpy", head_dim=64)
    x = _x((1, 2, 40, 64))
    pk, pv = q.encode_keys(x), q.encode_values(x)
    with pytest.raises(InputError, match="scale="):
        q.attend(_x((1, 2, 1, 64)), pk, pv, scale=scale)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_attend_scale_that_overflows_the_logits_raises(backend: str) -> None:
    q = kvq_core.get_quantizer("oscar", backend=backend, head_dim=64)
    x = _x((1, 2, 40, 64))
    pk, pv = q.encode_keys(x), q.encode_values(x)
    qry = 1e3 * _x((1, 2, 1, 64), 1)
    out = q.attend(qry, pk, pv, scale=1e30)  # logits ~1e34: finite in float32
    assert np.isfinite(np.asarray(q.arrays.to_numpy(out))).all()
    with np.errstate(over="ignore"), pytest.raises(InputError, match="overflows float32"):
        q.attend(qry, pk, pv, scale=1e36)


def test_from_dict_rejects_malformed_input_with_typed_errors() -> None:
    q = kvq_core.get_quantizer("kivi", backend="numpy", head_dim=64)
    plain = q.encode_keys(_x((1, 2, 8, 64))).to_dict()
    assert PackedKV.from_dict(plain).shape == (1, 2, 8, 64)
    for bad in ([1], {**plain, "fields": None}, {**plain, "shape": None}, {**plain, "shape": [1, 2, "8", 64]},
                {**plain, "layer": 2.5}, {**plain, "spec": "kivi"}, {**plain, "spec": {"method": "kivi", "bits": []}},
                {**plain, "fields": {**plain["fields"], "codes": [[1], [2, 3]]}},
                {**plain, "shape": [1, 0, 8, 64]}, {**plain, "fields": {**plain["fields"], 3: np.zeros(1)}}):
        with pytest.raises(KVQError):
            PackedKV.from_dict(bad)
    nan = dict(plain["fields"], scale=np.full_like(plain["fields"]["scale"], np.nan))
    with pytest.raises(InputError, match="'scale' holds NaN"):
        PackedKV.from_dict({**plain, "fields": nan})


# ------------------------------------------------------------------------------------------------
# size bounds
# ------------------------------------------------------------------------------------------------
def test_size_setting_parameters_are_bounded() -> None:
    """A 2 KB TurboQuant ``rotation="haar"`` block at head_dim 8192 cost 250 s of QR; dense per-head
    matrices are now bounded (QR-drawn ones to 1024 square, any to 2^20 entries)."""
    assert (MAX_HEAD_DIM, MAX_DENSE_DIM, MAX_DENSE_ENTRIES) == (1 << 16, 1 << 10, 1 << 20)
    for method, params in (("turboquant", dict(rotation="haar")), ("turboquant_prod", dict()),
                           ("turboquant_prod", dict(sketch="orthogonal")), ("qjl", dict(sketch="orthogonal"))):
        registry.make_spec(method, head_dim=MAX_DENSE_DIM, **params)
        with pytest.raises(SpecError, match="dense matrix stays bounded"):
            registry.make_spec(method, head_dim=2 * MAX_DENSE_DIM, **params)
    registry.make_spec("qjl", head_dim=64, sketch_dim=1 << 14)
    with pytest.raises(SpecError, match="sketch_dim"):
        registry.make_spec("qjl", head_dim=128, sketch_dim=1 << 14)
    with pytest.raises(SpecError, match="head_dim"):
        registry.make_spec("oscar", head_dim=2 * MAX_HEAD_DIM)
    registry.make_spec("turboquant", head_dim=8192)  # the Hadamard rotation is O(d log d): no bound below MAX_HEAD_DIM


@pytest.mark.parametrize("method", ["oscar", "quarot"])
def test_hadamard_constants_never_d_by_d(method: str) -> None:
    """The report's 32 KB one-token block at head_dim 65536 made torch OScaR/QuaRot allocate a
    32 GiB Hadamard matrix; the constants are now a <= 128-wide factor and the torch kernels apply
    the rest by butterfly stages."""
    torch = pytest.importorskip("torch")
    from kvq_core.constants import constants

    assert constants(registry.make_spec(method, head_dim=MAX_HEAD_DIM), 1, 0)["hadamard"].shape == (128, 128)
    for d in (1024, 4096):
        ref = kvq_core.get_quantizer(method, backend="numpy", head_dim=d)
        tq = kvq_core.get_quantizer(method, backend="torch", head_dim=d)
        x = _x((1, 1, 2, d), d)
        got = tq.decode_keys(tq.encode_keys(torch.from_numpy(x))).numpy()
        want = ref.decode_keys(ref.encode_keys(x))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())


def test_torch_hadamard_rotate_equals_the_fast_transform() -> None:
    torch = pytest.importorskip("torch")
    from kvq_core.math.hadamard import dense_hadamard_block, sylvester_hadamard
    from kvq_torch.common import hadamard_rotate

    for d in (16, 80, 128, 192, 384, 2048):
        x = _x((2, 3, 4, d), d)
        factor = torch.from_numpy(sylvester_hadamard(dense_hadamard_block(d)).astype(np.float32))
        assert factor.shape[0] == min(d & -d, 128)
        np.testing.assert_allclose(hadamard_rotate(torch.from_numpy(x), factor).numpy(), fwht(x), rtol=0, atol=5e-6)


# ------------------------------------------------------------------------------------------------
# thread-safe first use
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_concurrent_first_calls_bind_head_dim_once(backend: str) -> None:
    """Threads that make a quantizer's first calls together (a tiny switch interval interleaves
    them) all succeed, with the same codes a single thread gets."""
    if backend == "torch":
        pytest.importorskip("torch")
    x = _x((1, 2, 40, 64))
    want = kvq_core.get_quantizer("oscar", backend=backend).encode_keys(x).fields["codes"]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            q = kvq_core.get_quantizer("oscar", backend=backend)  # head_dim unbound (default 128)
            errors, codes = [], []
            barrier = threading.Barrier(8)

            def first(q=q, errors=errors, codes=codes, barrier=barrier):
                barrier.wait()
                try:
                    pk = q.encode_keys(x)
                    q.decode_keys(pk)
                    codes.append(np.asarray(q.arrays.to_numpy(pk.fields["codes"])))
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)

            threads = [threading.Thread(target=first) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == [] and len(codes) == 8
            assert q.spec.head_dim == 64
            for c in codes:
                np.testing.assert_array_equal(c, np.asarray(want))
    finally:
        sys.setswitchinterval(old)


def test_a_rejected_first_block_does_not_bind() -> None:
    q = kvq_core.get_quantizer("oscar", backend="numpy")
    bad = _x((1, 2, 8, 64))
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(InputError, match="NaN"):
        q.encode_keys(bad)
    q.encode_keys(_x((1, 2, 8, 96)))  # the first accepted block binds
    assert q.spec.head_dim == 96
    with pytest.raises(InputError, match="head_dim"):
        q.encode_keys(_x((1, 2, 8, 64)))


# ------------------------------------------------------------------------------------------------
# KVQCache: a step is all or nothing
# ------------------------------------------------------------------------------------------------
def _cache(attention: str, backend: str = "numpy"):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from tiny_models import configs

    from kvq_core.integrations.hf import KVQCache

    config = configs()["llama"]  # 2 layers, 2 KV heads, head_dim 16
    return KVQCache(config, "kivi", backend=backend, bits=2, group=4, residual=4, attention=attention)


def _step_inputs(n_steps: int, tokens: int = 3):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    return [[(torch.randn(1, 2, tokens, 16, generator=g), torch.randn(1, 2, tokens, 16, generator=g),
              torch.randn(1, 4, tokens, 16, generator=g)) for _layer in range(2)] for _ in range(n_steps)]


def _run_step(cache, step, attention: str):
    """One forward's layer updates (and, in codes mode, the "kvq" attention function on each)."""
    torch = pytest.importorskip("torch")
    from kvq_core.integrations.hf.attention import kvq_attention

    outs = []
    for i, (k, v, q) in enumerate(step):
        keys, values = cache.update(k, v, i)
        if attention == "codes":
            outs.append(kvq_attention(torch.nn.Module(), q, keys, values, None, scaling=0.25)[0])
        else:
            outs.append(torch.cat([keys, values], dim=-1))
    return outs


def _state(cache):
    return [(layer.get_seq_length(), layer.packed_length, layer.window_length, list(layer.block_tokens),
             layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _same_state(a, b) -> bool:
    return all(x[:4] == y[:4] and bool((x[4] == y[4]).all()) and bool((x[5] == y[5]).all()) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("attention", ["dequant", "codes"])
@pytest.mark.parametrize("poison", ["keys", "values", "query"])
def test_a_failed_step_changes_nothing_and_a_retry_equals_a_fault_free_run(attention: str, poison: str, backend: str) -> None:
    """NaN keys in a step that does not flush went into the exact window unchecked; a NaN query in
    codes mode raised after the cache was updated (layer lengths 27 and 26). Now the step raises
    InputError with every layer as before it, and retrying it gives the fault-free run's outputs.
    On numba the step's K/V and query are tested by its compiled finiteness pass (the layer's quantizer)."""
    torch = pytest.importorskip("torch")
    if backend == "numba":
        pytest.importorskip("numba")
    if poison == "query" and attention == "dequant":
        pytest.skip("dequant mode hands K/V to the model's own attention; queries never reach kvq")
    steps = _step_inputs(6)
    ref, cache = _cache(attention, backend), _cache(attention, backend)
    want = [_run_step(ref, step, attention) for step in steps]
    for s, step in enumerate(steps):
        if s in (1, 4):  # step 1 flushes a block in each layer, step 4 only adds to the exact window
            for layer in (0, 1):
                bad = [list(x) for x in step]
                which = {"keys": 0, "values": 1, "query": 2}[poison]
                bad[layer][which] = bad[layer][which].clone()
                bad[layer][which][0, 0, -1, 3] = float("nan")
                before = _state(cache)
                with pytest.raises(InputError, match="NaN or Inf"):
                    _run_step(cache, [tuple(x) for x in bad], attention)
                assert _same_state(_state(cache), before), (s, layer)
        got = _run_step(cache, step, attention)
        for g, w in zip(got, want[s]):
            assert torch.equal(g, w), s
    assert [layer.get_seq_length() for layer in cache.layers] == [18, 18]
    assert sum(len(layer.blocks) for layer in cache.layers) > 0


def test_step_inputs_of_the_wrong_batch_or_heads_are_rejected_before_storing() -> None:
    torch = pytest.importorskip("torch")
    cache = _cache("dequant")
    _run_step(cache, _step_inputs(1)[0], "dequant")
    before = _state(cache)
    for k, v in ((torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)), (torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16)),
                 (torch.randn(1, 2, 1, 16), torch.randn(1, 2, 2, 16)), (torch.ones(1, 2, 1, 16, dtype=torch.int64),) * 2):
        with pytest.raises(InputError):
            cache.update(k, v, 0)
        assert _same_state(_state(cache), before)
