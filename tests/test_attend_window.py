"""``Quantizer.attend_window``: packed blocks and an exact window in one kernel call (numba on the CPU;
torch: one ``kvq::attend_window`` op, the reference over the decoded blocks; triton: that op running
the fused kernel of ``kvq_triton/window.py``).

Checked against softmax attention in float64 over the NumPy reference's decoded blocks followed
by the window, causal among the queries (the last ``q_len`` window tokens), with GQA, batch 2,
several blocks of uneven lengths, and a multi-token query. The Triton case runs under Triton's CPU
interpreter in a child process (``TRITON_INTERPRET=1`` must be set before the kernels are imported:
:func:`test_triton_under_interpreter`), where it is the only backend checked, beside the kernel's own
cases in ``tests/triton_interp/interp_window.py``.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvq_core import get_quantizer
from kvq_core.errors import BackendUnavailableError, InputError

#: the child process of test_triton_under_interpreter checks the Triton backend, this one the CPU backends
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["triton"] if INTERPRETING else ["numba", "torch"]


def _int_code_widths() -> list:
    """Both SIMD widths of the int-code kernels; the one this host does not run compiles kernels of its own
    (about two minutes on 2 cores), so that case is in the slow tier."""
    try:
        import llvmlite.binding as llvm
        host_wide = bool(llvm.get_host_cpu_features().get("avx512f", False))
    except ImportError:
        host_wide = False
    return [pytest.param(wide, id=name, marks=() if wide == host_wide else pytest.mark.slow)
            for wide, name in ((False, "8-lane"), (True, "16-lane"))]


CASES = [("oscar", {"bits": 2}), ("oscar", {"bits": 4, "token_scaling": False}), ("kivi", {"bits": 2}),
         ("octopus", {"bits": 3}), ("octopus", {"bits": 2, "values": "fp16"}), ("turboquant", {"bits": 3})]


def _reference(ref, q, blocks, wk, wv, scale):
    """(out, lse) float64: exact softmax over the decoded blocks then the window, causal in the window."""
    keys = [np.asarray(ref.decode_keys(pk), np.float64) for pk, _ in blocks] + [wk.astype(np.float64)]
    vals = [np.asarray(ref.decode_values(pv), np.float64) for _, pv in blocks] + [wv.astype(np.float64)]
    k, v = np.concatenate(keys, axis=2), np.concatenate(vals, axis=2)
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    z = np.einsum("bhqd,bhtd->bhqt", q.astype(np.float64), k) * scale
    n, lq = k.shape[2], q.shape[2]
    z[..., np.arange(n)[None, :] > (np.arange(lq)[:, None] + n - lq)] = -np.inf
    top = z.max(axis=-1, keepdims=True)
    p = np.exp(z - top)
    s = p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqt,bhtd->bhqd", p / s, v), (top + np.log(s))[..., 0]


#: block lengths: numba's int-code kernels run one or two blocks in one compiled call, more through its plan
LENGTHS = [(160,), (160, 64), (160, 64, 33)]


@pytest.mark.parametrize("method,params", CASES, ids=[f"{m}-{'-'.join(map(str, p.values()))}" for m, p in CASES])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"{len(x)}blocks" for x in LENGTHS])
def test_attend_window_equals_attention_over_decoded_blocks_and_window(backend, method, params, q_len, lengths):
    if backend == "triton" and len(lengths) < 3:
        pytest.skip("the Triton kernel reads any number of blocks through one table: three cover it")
    _check_against_reference(backend, method, params, q_len, lengths)


@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"{len(x)}blocks" for x in LENGTHS])
def test_numba_attend_window_split_across_threads(monkeypatch, lengths):
    """Above the work threshold the plan splits each block's tokens over the threads (jobs in
    chunks, then the combine): the same results."""
    numba = pytest.importorskip("numba")
    from kvq_numba import threads

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here")
    monkeypatch.setattr(threads, "PARALLEL_MIN_WORK", 0)
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        for method, params in CASES[:3]:
            _check_against_reference("numba", method, params, 1, tuple(t * 8 for t in lengths))
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("method,params,lengths", [("oscar", {"bits": 2}, (160, 64)), ("octopus", {"bits": 3}, (160, 64, 33)),
                                                    ("octopus", {"bits": 2, "values": "fp16"}, (40,))],
                         ids=["oscar-2blocks", "octopus-3blocks", "octopus-fp16-1block"])
def test_numba_one_call_equals_its_plan_path(monkeypatch, method, params, lengths):
    """numba's one compiled window call (up to two int-code or three OCTOPUS blocks) computes what its plan path
    (:func:`kvq_numba.cpu.window.run`, any number of blocks, several kernel calls) does, bit for bit."""
    pytest.importorskip("numba")
    from kvq_numba.cpu import attend_octopus, attend_planes

    rng = np.random.default_rng(3)
    quant = get_quantizer(method, "numba", head_dim=64, **params)
    b, hk, g, d, w = 2, 3, 3, 64, 12
    blocks = [(quant.encode_keys(rng.standard_normal((b, hk, t, d), dtype=np.float32)),
               quant.encode_values(rng.standard_normal((b, hk, t, d), dtype=np.float32))) for t in lengths]
    wk, wv = (rng.standard_normal((b, hk, w, d), dtype=np.float32) for _ in range(2))
    for q_len in (1, 4):
        q = rng.standard_normal((b, hk * g, q_len, d), dtype=np.float32)
        one_call = quant.attend_window(q, blocks, wk, wv, scale=0.2)
        with monkeypatch.context() as m:  # no block count fits the one call: the plan path
            m.setattr(attend_planes, "WINDOW_BLOCKS", 0)
            m.setattr(attend_octopus, "WINDOW_BLOCKS", 0)
            planned = quant.attend_window(q, blocks, wk, wv, scale=0.2)
        for got, want in zip(one_call, planned):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("wide", _int_code_widths())
@pytest.mark.parametrize("method,params,lengths", [("oscar", {"bits": 2}, (160, 64)),
                                                    ("oscar", {"bits": 4, "token_scaling": False}, (160, 64, 33)),
                                                    ("kivi", {"bits": 2}, (33,))], ids=["oscar-2blocks", "oscar4-3blocks", "kivi-33"])
def test_numba_int_code_logits_at_both_widths(monkeypatch, wide, method, params, lengths):
    """numba's int-code logits in 8- and 16-lane vectors (an AVX-512 host takes 16 where a key code row is whole
    16-byte chunks, :data:`kvq_numba.cpu.attend_planes.WIDE`; the kernels are built per width, so both run on
    any host): each equals the reference, in the one call and the plan path, a 1-token key group included."""
    pytest.importorskip("numba")
    from kvq_numba.cpu import attend_planes

    monkeypatch.setattr(attend_planes, "WIDE", wide)
    for q_len in (1, 5):
        _check_against_reference("numba", method, params, q_len, lengths)


@pytest.mark.parametrize("wide", [False, True], ids=["8-lane", "16-lane"])
@pytest.mark.parametrize("method,params", [("octopus", {"bits": 3}), ("turboquant", {"bits": 3})], ids=["octopus", "turboquant"])
def test_numba_octopus_tiles_at_both_widths(monkeypatch, wide, method, params):
    """numba's OCTOPUS logits and ``P @ V`` in 8- and 16-lane tiles (an AVX-512 host takes 16,
    :data:`kvq_numba.cpu.attend_octopus.WIDE`; the plan path passes it to the kernel as an argument, so both run on
    any host): each equals the reference, a last block of one token included."""
    pytest.importorskip("numba")
    from kvq_numba.cpu import attend_octopus

    monkeypatch.setattr(attend_octopus, "WIDE", wide)
    monkeypatch.setattr(attend_octopus, "WINDOW_BLOCKS", 0)
    for q_len in (1, 5):
        _check_against_reference("numba", method, params, q_len, (160, 33))


def _check_against_reference(backend, method, params, q_len, lengths):
    pytest.importorskip(backend)
    rng = np.random.default_rng(q_len)
    fused = get_quantizer(method, backend, head_dim=64, **params)
    host = (lambda x: x) if backend == "numba" else __import__("torch").from_numpy
    ref = get_quantizer(method, "numpy", head_dim=64, **params)
    b, hk, g, d, w = 2, 3, 3, 64, 12
    blocks = []
    for t in lengths:
        k = rng.standard_normal((b, hk, t, d), dtype=np.float32)
        v = rng.standard_normal((b, hk, t, d), dtype=np.float32)
        blocks.append((fused.encode_keys(host(k)), fused.encode_values(host(v))))
    wk = rng.standard_normal((b, hk, w, d), dtype=np.float32)
    wv = rng.standard_normal((b, hk, w, d), dtype=np.float32)
    q = rng.standard_normal((b, hk * g, q_len, d), dtype=np.float32)
    assert fused.fuses_window(host(q))
    out, lse = fused.attend_window(host(q), blocks, host(wk), host(wv), scale=0.2)
    out, lse = np.asarray(out), np.asarray(lse)
    plain = [(pk.map_fields(np.asarray), pv.map_fields(np.asarray)) for pk, pv in blocks]
    want, want_lse = _reference(ref, q, plain, wk, wv, 0.2)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    np.testing.assert_allclose(out, want, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5)


def test_attend_window_checks_its_inputs():
    pytest.importorskip("numba")
    quant = get_quantizer("oscar", "numba", head_dim=64, bits=2)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 2, 40, 64), dtype=np.float32)
    blocks = [(quant.encode_keys(k), quant.encode_values(k))]
    q = rng.standard_normal((1, 4, 3, 64), dtype=np.float32)
    with pytest.raises(InputError, match="w >= q_len"):
        quant.attend_window(q, blocks, k[:, :, :2], k[:, :, :2])  # a window shorter than the queries
    with pytest.raises(InputError, match="w >= q_len"):
        quant.attend_window(q, blocks, k[:, :1, :8], k[:, :1, :8])  # other kv heads than the blocks
    numpy_quant = get_quantizer("oscar", "numpy", head_dim=64, bits=2)
    assert not numpy_quant.fuses_window(q)
    with pytest.raises(BackendUnavailableError, match="no fused window kernel"):
        numpy_quant.attend_window(q, [], k[:, :, :8], k[:, :, :8])


@pytest.mark.slow  # slow tier: a Triton-interpreter child run
@pytest.mark.skipif(INTERPRETING or importlib.util.find_spec("triton") is None,
                    reason="starts the interpreter's child process (triton installed, not already interpreting)")
def test_triton_under_interpreter() -> None:
    """The shared check above for backend="triton", and tests/triton_interp/interp_window.py, in a fresh
    process with TRITON_INTERPRET=1."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "backends"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W",
                           "ignore::RuntimeWarning", "-k", "triton and not under_interpreter",
                           "tests/test_attend_window.py", "tests/triton_interp/interp_window.py"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert f"{2 * len(CASES) + 4} passed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("method,params", [("oscar", {"bits": 2}), ("octopus", {"bits": 3})], ids=["oscar-2", "octopus-3"])
def test_a_plan_runs_as_its_blocks_and_is_checked_again_when_a_block_changes(backend, method, params):
    """``plan_window`` checks the blocks once: calls with the plan equal calls with the list, bit for bit, for
    other queries and windows (what the kernel derived from the blocks is kept in the plan); a block whose
    fields were swapped since is checked again before any kernel reads it; another quantizer re-plans."""
    if INTERPRETING:
        pytest.skip("CPU backends")
    pytest.importorskip(backend)
    from kvq_core import LayoutError

    host = (lambda x: x) if backend == "numba" else __import__("torch").from_numpy
    quant = get_quantizer(method, backend, head_dim=64, **params)
    rng = np.random.default_rng(7)
    b, hk, d = 1, 3, 64
    blocks = [(quant.encode_keys(host(rng.standard_normal((b, hk, t, d), dtype=np.float32))),
               quant.encode_values(host(rng.standard_normal((b, hk, t, d), dtype=np.float32)))) for t in (96, 32)]
    plan = quant.plan_window(blocks)
    assert plan.shape == (b, hk, 128, d) and plan.holds(blocks) and not plan.holds(blocks[:1])
    for step in range(3):
        q = host(rng.standard_normal((b, 9, 1, d), dtype=np.float32))
        wk = host(rng.standard_normal((b, hk, 4 + step, d), dtype=np.float32))
        wv = host(rng.standard_normal((b, hk, 4 + step, d), dtype=np.float32))
        with_plan = quant.attend_window(q, plan, wk, wv, 0.125)
        with_list = quant.attend_window(q, blocks, wk, wv, 0.125)
        for got, want in zip(with_plan, with_list):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert plan.current(quant, quant.layer)
    assert plan.blocks.memo, "the kernel keeps what it derives from the blocks in the plan"
    other = get_quantizer(method, backend, head_dim=64, **params)
    assert not plan.current(other, other.layer)
    np.testing.assert_array_equal(np.asarray(other.attend_window(q, plan, wk, wv, 0.125)[0]), np.asarray(with_plan[0]))
    pk = blocks[0][0]
    pk.fields = {**pk.fields, "codes": pk.fields["codes"][:, :, :1]}  # a crafted field: too few rows
    assert not plan.current(quant, quant.layer)
    with pytest.raises(LayoutError):
        quant.attend_window(q, plan, wk, wv, 0.125)
