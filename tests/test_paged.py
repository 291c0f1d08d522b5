"""Paged KV (kvq_core.paged): the page-row layout of every codec, and ``kvq::attend_paged`` on every
backend against the gather-then-``attend`` reference on random block tables (non-contiguous and
shared prefix blocks, lengths 1, block-boundary and ragged, pages of 16 and 32 tokens, q_len 1 and
> 1, GQA, with and without exact tails)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import kvq_core
from kvq_core.errors import LayoutError, SpecError
from kvq_core.paged import PageLayout, attend_paged_reference

torch = pytest.importorskip("torch")
import kvq_core.torch_ops.ops  # noqa: E402,F401
from kvq_core.testing.paged import paged_case  # noqa: E402

D = 64
PER_TOKEN = [("octopus", {"bits": 3}), ("turboquant", {"bits": 3}), ("turboquant_prod", {"bits": 3}),
             ("quarot", {"bits": 4}), ("polarquant", {}), ("qjl", {}), ("fp16", {})]
GROUPED = [("oscar", {"bits": 2}), ("kivi", {"bits": 2})]


def _quantizer(method: str, **params):
    return kvq_core.get_quantizer(method, "torch", head_dim=D, **params)


@pytest.mark.parametrize("method,params", PER_TOKEN + GROUPED + [("oscar", {"bits": 4, "key_group": 32})])
@pytest.mark.parametrize("host", ["numpy", "torch"])
def test_rows_round_trip(method: str, params: dict, host: str) -> None:
    """pack -> unpack gives back every field bit for bit, NumPy and torch alike; each half alone too."""
    q = kvq_core.get_quantizer(method, "numpy", head_dim=D, **params)
    layout = PageLayout(q.spec, 32, 3)
    x = np.random.default_rng(1).standard_normal((2, 3, 64, D)).astype(np.float32)
    pk, pv = q.encode_keys(x), q.encode_values(x * 0.5)
    conv = (lambda a: np.asarray(a)) if host == "numpy" else (lambda a: torch.from_numpy(np.asarray(a)))
    kf = {n: conv(a) for n, a in pk.fields.items()}
    vf = {n: conv(a) for n, a in pv.fields.items()}
    rows = layout.pack(kf, vf)
    assert tuple(rows.shape) == (2, 3, 64, layout.row_bytes)
    gk, gv = layout.unpack(rows)
    for mine, theirs in ((gk, pk.fields), (gv, pv.fields)):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert np.array_equal(np.asarray(mine[name]), np.asarray(theirs[name])), name
    only_v = layout.unpack_kind("values", rows[..., layout.columns("values")])
    assert all(np.array_equal(np.asarray(only_v[n]), np.asarray(pv.fields[n])) for n in only_v)


def test_row_bytes_count_every_byte() -> None:
    """Row sizes by hand at d=64 and 3 kv heads (vLLM sizes pages by them)."""
    def row(method: str, **params) -> int:
        return PageLayout(kvq_core.make_spec(method, head_dim=D, **params), 32, 3).row_bytes

    # OCTOPUS b=3: 28 code bytes + fp32 norm, keys and values (the plugin's 5,760 B/token over 30 layers)
    assert row("octopus", bits=3) == 2 * (28 + 4)
    # OScaR-2: keys 16 code bytes + scale and offset (2 * 64 fp16 per 32-token group: 4 bytes a row each)
    # + the fp32 token norm over 3 heads (2 bytes a row, 2 of 6 padding); values 16 + 2 * 2 fp16 stats
    assert row("oscar", bits=2) == (16 + 4 + 4 + 2) + (16 + 4 + 4)
    assert row("kivi", bits=2) == (16 + 4 + 4) + (16 + 4 + 4)
    assert row("fp16") == 2 * 2 * D
    # a group whose stats do not divide evenly: OScaR-4 groups of 128 tokens, d=16: 32 bytes over 128 rows
    assert PageLayout(kvq_core.make_spec("oscar", head_dim=16, bits=4), 128, 1).row_bytes == (8 + 1 + 1 + 4) + (8 + 2 + 2)


def test_block_size_must_hold_whole_groups() -> None:
    with pytest.raises(SpecError, match=r"block_size=16.*key group \(32 tokens\)"):
        PageLayout(kvq_core.make_spec("oscar", head_dim=D, bits=2), 16, 3)
    PageLayout(kvq_core.make_spec("oscar", head_dim=D, bits=2, key_group=16), 16, 3)
    with pytest.raises(LayoutError, match="whole number"):
        layout = PageLayout(kvq_core.make_spec("kivi", head_dim=D), 32, 3)
        layout.unpack(np.zeros((1, 3, 40, layout.row_bytes), np.uint8))


def test_reference_equals_dense_causal_attention() -> None:
    """The reference itself: decoded K/V per request, causal float64 softmax with the tail appended."""
    qz = _quantizer("oscar", bits=2)
    case = paged_case(qz, block_size=32, kv_heads=2, q_heads=4, code_lens=[64, 32], q_lens=[3, 40],
                      tail_lens=[5, 8], share_prefix=1)
    out, lse = attend_paged_reference(case.spec, 0, *case.args(), 0.2, *case.tails())
    layout = PageLayout(case.spec, 32, 2)
    from kvq_core.paged import gather_rows

    qsl = case.query_start_loc.tolist()
    for r, n in enumerate(case.code_lens.tolist()):
        pk, pv = layout.blocks(gather_rows(case.pages, case.block_table[r], n))
        k = np.asarray(qz.decode_keys(pk))[0].astype(np.float64)
        v = np.asarray(qz.decode_values(pv))[0].astype(np.float64)
        t = int(case.tail_lens[r])
        slot = int(case.tail_slot[r])
        k = np.concatenate([k, case.tail_k[slot, :, :t].double().numpy()], axis=1)
        v = np.concatenate([v, case.tail_v[slot, :, :t].double().numpy()], axis=1)
        for i, tok in enumerate(range(qsl[r], qsl[r + 1])):
            pos = n + t - (qsl[r + 1] - qsl[r]) + i
            qi = case.q[tok].double().numpy().reshape(2, 2, D)
            z = np.einsum("hgd,htd->hgt", qi, k[:, : pos + 1]) * 0.2
            w = np.exp(z - z.max(-1, keepdims=True))
            want = np.einsum("hgt,htd->hgd", w / w.sum(-1, keepdims=True), v[:, : pos + 1]).reshape(4, D)
            np.testing.assert_allclose(out[tok], want, atol=2e-5)
            np.testing.assert_allclose(lse[tok], (np.log(w.sum(-1)) + z.max(-1)).reshape(4), atol=2e-5)


def _cases(method: str, params: dict) -> list[dict]:
    """Batches covering the issue's list; group codecs get whole-group code lengths."""
    grouped = method in ("oscar", "kivi")
    cases = []
    for bs in (16, 32):
        p = dict(params, key_group=16) if method == "oscar" and bs == 16 else dict(params)
        if method == "kivi" and bs == 16:
            p["group"] = 16
        g = bs if grouped else 1
        lens = [g, 3 * bs, 2 * bs + g, bs + 2 * g] if grouped else [1, bs, 2 * bs + 5, 3 * bs - 1, 7]
        # decode: q_len 1, no tail (per-token codecs) / an open group in the tail (group codecs)
        tails = [0, 1, g - 1, 5] if grouped else None
        cases.append(dict(params=p, block_size=bs, kv_heads=2, q_heads=6, code_lens=lens, q_lens=[1] * len(lens),
                          tail_lens=tails, share_prefix=1))
        # multi-token queries (chunked prefill, spec decode): causal over codes and tail
        qlens = [1, 3, bs + 1, 2 * g] if grouped else [1, bs, 4, 2 * bs, 7]
        tails = [0, 2, 3, g - 1] if grouped else [0, 0, 3, 0, 2]
        cases.append(dict(params=p, block_size=bs, kv_heads=2, q_heads=4, code_lens=lens, q_lens=qlens,
                          tail_lens=tails, share_prefix=2))
    return cases


def check_backend(backend: str, method: str, params: dict, atol: float = 2e-5) -> None:
    """``kvq::attend_paged`` on ``backend`` equals the reference on every case of :func:`_cases`."""
    for i, c in enumerate(_cases(method, params)):
        qz = _quantizer(method, **c.pop("params"))
        case = paged_case(qz, seed=i, **c)
        want = attend_paged_reference(case.spec, 3, *case.args(), 0.17, *case.tails())
        got = torch.ops.kvq.attend_paged(backend, case.spec.to_json(), 3, *case.args(), 0.17, *case.tails())
        np.testing.assert_allclose(got[0].numpy(), want[0], atol=atol, err_msg=f"{method} case {i} out")
        np.testing.assert_allclose(got[1].numpy(), want[1], atol=atol, err_msg=f"{method} case {i} lse")


@pytest.mark.parametrize("method,params", PER_TOKEN + GROUPED)
def test_torch_fallback_matches_reference(method: str, params: dict) -> None:
    check_backend("torch", method, params)


NUMBA = [("oscar", {"bits": 2}), ("kivi", {"bits": 2}), ("octopus", {"bits": 3}), ("oscar", {"bits": 4, "key_group": 32}),
         ("octopus", {"bits": 2, "values": "fp16"}), ("oscar", {"bits": 2, "rotation": False, "token_scaling": False})]


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
@pytest.mark.parametrize("dense_min", ["default", "codes only", "decoded only"])
@pytest.mark.parametrize("method,params", NUMBA, ids=lambda x: str(x))
def test_numba_matches_reference(method: str, params: dict, dense_min: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The numba CPU kernels (planes for OScaR/KIVI 2- and 4-bit, OCTOPUS) read the pages directly;
    requests with many query tokens decode their context and attend on torch's flash kernel (every
    request one way or the other, and the default threshold, which splits the multi-token cases)."""
    from kvq_numba import paged
    from kvq_numba.paged import PagedNumba

    assert PagedNumba(kvq_core.make_spec(method, head_dim=D, **params)).fast
    assert 7 < paged.DENSE_MIN_QUERY <= 16  # the cases split: q_lens 1, 3, 4, 7 stay on the codes, 16 and more are decoded
    if dense_min != "default":
        monkeypatch.setattr(paged, "DENSE_MIN_QUERY", 1 << 30 if dense_min == "codes only" else 1)
    check_backend("numba", method, params)


def test_no_tail_arguments() -> None:
    """Without tails the op attends the coded tokens alone (code lengths may end mid-block)."""
    qz = _quantizer("octopus", bits=3)
    case = paged_case(qz, block_size=16, kv_heads=1, q_heads=2, code_lens=[1, 17, 40], q_lens=[1, 2, 1],
                      token_major=False)
    want = attend_paged_reference(case.spec, 0, *case.args(), 0.125)
    got = torch.ops.kvq.attend_paged("torch", case.spec.to_json(), 0, *case.args(), 0.125, None, None, None, None)
    np.testing.assert_allclose(got[0].numpy(), want[0], atol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_no_query_tokens(backend: str) -> None:
    """A step with no query tokens (every request idle) returns empty results."""
    if backend == "numba":
        pytest.importorskip("numba")
    qz = _quantizer("oscar", bits=2)
    case = paged_case(qz, block_size=32, kv_heads=3, q_heads=9, code_lens=[32, 64], q_lens=[1, 1])
    out, lse = torch.ops.kvq.attend_paged(backend, case.spec.to_json(), 0, case.q[:0], case.pages, case.block_table,
                                          case.code_lens, torch.zeros(3, dtype=torch.int32), 0.1, None, None, None, None)
    assert tuple(out.shape) == (0, 9, D) and tuple(lse.shape) == (0, 9)


def test_fake_shapes_and_opcheck() -> None:
    qz = _quantizer("octopus", bits=3)
    case = paged_case(qz, block_size=16, kv_heads=2, q_heads=4, code_lens=[20, 5], q_lens=[2, 1], tail_lens=[1, 0],
                      token_major=False)
    args = ("torch", case.spec.to_json(), 0, *case.args(), 0.125, *case.tails())
    torch.library.opcheck(torch.ops.kvq.attend_paged.default, args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out, lse = torch.ops.kvq.attend_paged(*args)
    assert tuple(out.shape) == (3, 4, D) and tuple(lse.shape) == (3, 4) and out.dtype == torch.float32


@pytest.mark.slow  # slow tier: a Triton-interpreter child run
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_under_interpreter() -> None:
    """tests/triton_interp/interp_paged.py in a fresh process with TRITON_INTERPRET=1."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "backends"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W",
                           "ignore::RuntimeWarning", "tests/triton_interp/interp_paged.py"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "5 passed" in proc.stdout, proc.stdout[-3000:]
