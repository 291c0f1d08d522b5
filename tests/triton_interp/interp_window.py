"""The fused ``kvq::attend_window`` kernel of backend="triton" (``kvq_triton/window.py``) under Triton's
CPU interpreter: every way of dealing the tiles to splits, against the float32 reference over the
decoded blocks and the window, and proof that the op runs the kernel (not the reference). Run in a
fresh process with ``TRITON_INTERPRET=1`` (``tests/test_attend_window.py`` launches it with the
shared check for backend="triton"); small shapes, the interpreter pays per program and per op."""
from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("TRITON_INTERPRET") != "1" or any(m.startswith("kvq_triton.") and m != "kvq_triton.plugin"
                                                     for m in sys.modules):
    pytest.skip("run me in a fresh process with TRITON_INTERPRET=1 (see tests/test_attend_window.py)",
                allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

import kvq_core  # noqa: E402
from kvq_core import registry  # noqa: E402
from kvq_core.torch_ops import run  # noqa: E402
from kvq_core.torch_ops.torch_kernels import context  # noqa: E402
from kvq_torch import common  # noqa: E402
from kvq_torch.rotation import by_kv_head, from_kv_head  # noqa: E402
from kvq_triton import attention, tiles, window  # noqa: E402

SPECS = [("oscar", dict(bits=2, key_group=32)), ("octopus", dict(bits=3, values="fp16")), ("turboquant", dict(bits=2))]


@pytest.mark.parametrize(("method", "params"), SPECS, ids=[m for m, _ in SPECS])
def test_triton_window_kernel_every_split(method: str, params: dict) -> None:
    """One split (the kernel writes out and lse), a few, and one per tile, where the last split holds
    only the window's last tile, which the first queries do not see (their partial is empty and the
    merge drops it): each equals the reference over the decoded blocks then the causal window."""
    spec = registry.make_spec(method, head_dim=32, **params)
    impl = run.kernel("triton", spec.to_json())
    gen = torch.Generator().manual_seed(3)
    b, hk, g, lq, d, lens = 1, 2, 2, 5, 32, (70, 32, 5)
    ctx = context(spec.to_json(), 0, (b, hk, sum(lens), d), torch.device("cpu"))
    stored, keys, values = [], [], []
    for t in lens:
        part = ctx._replace(shape=(b, hk, t, d))
        k, v = torch.randn((2, b, hk, t, d), generator=gen)
        sk = impl.stored_keys(impl.encode_keys(k, part), part)
        sv = impl.stored_values(impl.encode_values(v, part), part)
        stored.append((sk, sv))
        keys.append(tiles.decode(sk, part.shape))
        values.append(tiles.decode(sv, part.shape))
    q = torch.randn((b, hk * g, lq, d), generator=gen)
    q_rot = impl.to_codes(by_kv_head(q, hk), ctx)
    bn = attention.tile_sizes(stored[0][0], g * lq, d)[2]
    w = bn + 2  # the window's second tile holds its last 2 tokens: hidden from queries 0 .. lq - 3
    wk, wv = torch.randn((2, b, hk, w, d), generator=gen)
    wk, wv = impl.to_codes(wk, ctx), impl.to_values(wv, ctx)
    want, want_lse = common.window_attend(from_kv_head(q_rot, q.shape), torch.cat([*keys, wk], 2),
                                          torch.cat([*values, wv], 2), 0.3)
    n_tiles = sum(-(-t // bn) for t in lens) + 2
    for splits in (1, 2, 3, n_tiles):
        out, lse = window.attend(q_rot, lq, stored, wk, wv, 0.3, splits=splits)
        torch.testing.assert_close(from_kv_head(out, q.shape), want, atol=2e-5, rtol=0, msg=f"splits={splits}")
        torch.testing.assert_close(from_kv_head(lse, q.shape), want_lse, atol=2e-5, rtol=0, msg=f"splits={splits}")


def test_triton_attend_window_runs_the_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Quantizer.attend_window`` on backend="triton" (bfloat16 queries and window) is one call of the
    fused kernel and never the reference, and equals the reference's answer (out in the queries' dtype)."""
    quant = kvq_core.get_quantizer("oscar", "triton", head_dim=64, bits=4)
    gen = torch.Generator().manual_seed(4)
    blocks = []
    for t in (40, 9):
        k, v = torch.randn((2, 2, 2, t, 64), generator=gen)
        blocks.append((quant.encode_keys(k), quant.encode_values(v)))
    q = torch.randn((2, 6, 3, 64), generator=gen).to(torch.bfloat16)
    wk, wv = torch.randn((2, 2, 2, 7, 64), generator=gen).to(torch.bfloat16)
    keys = torch.cat([quant.decode_keys(pk) for pk, _ in blocks] + [wk.float()], 2)
    values = torch.cat([quant.decode_values(pv) for _, pv in blocks] + [wv.float()], 2)
    want, want_lse = common.window_attend(q.float(), keys, values, 64 ** -0.5)
    calls = []
    fused = window.attend
    monkeypatch.setattr(window, "attend", lambda *a, **k: calls.append(a[1]) or fused(*a, **k))
    monkeypatch.setattr(common, "window_attend", lambda *a, **k: pytest.fail("the reference ran"))
    out, lse = quant.attend_window(q, blocks, wk, wv)
    assert calls == [3]
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out, want.to(q.dtype))  # to the output's rounding
    torch.testing.assert_close(lse.float(), want_lse, atol=2e-5, rtol=0)
