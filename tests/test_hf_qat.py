"""The transformers seam of quantization-aware training: ``attn_implementation="kvq-qat"``
gives every position what decoding token by token through the matching ``KVQCache`` gives
(dequant mode), and :func:`kvq_core.training.fake_quant_attention` equals a per-query
reference of the exact-window rule."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers")

import tiny_models  # noqa: E402
import kvq_core  # noqa: E402
from kvq_core.errors import InputError, KVQError  # noqa: E402
from kvq_core.integrations.hf import cache_kwargs, qat  # noqa: E402
from kvq_core.training import exact_start, fake_quant_attention, fake_quant_kv  # noqa: E402


def _ids(batch: int = 2, tokens: int = 44) -> torch.Tensor:
    return torch.randint(1, 128, (batch, tokens), generator=torch.Generator().manual_seed(0))


def _decode_through_cache(model: torch.nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits of feeding ``ids`` one token per step through ``cache`` (plain sdpa attention)."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[:, t:t + 1], **cache_kwargs(model, cache), use_cache=True).logits
                          for t in range(ids.shape[1])], dim=1)


@pytest.mark.parametrize("method,settings", [
    ("oscar", {"bits": 2, "residual": 20}),     # block flush, blocks that are not whole 32-token key groups
    ("octopus", {"bits": 2, "residual": 8}),    # sliding flush
    ("kivi", {"bits": 2, "residual": 0, "fp_layers": (1,)}),  # everything from codes; an exact layer
])
def test_qat_forward_equals_decoding_through_the_matching_cache(method: str, settings: dict) -> None:
    model = tiny_models.build("llama")
    ids = _ids()
    with torch.no_grad():
        fp = model(input_ids=ids).logits
    plan = qat.prepare(model, method, qat_backend="torch", **settings)
    assert model.config._attn_implementation == "kvq-qat"
    with torch.no_grad():
        trained_view = model(input_ids=ids).logits
    served = _decode_through_cache(model, ids, plan.cache(backend="torch", attention="dequant"))
    err = float((trained_view - served).abs().max())
    assert err < 1e-4, err
    assert float((fp - served).abs().max()) > 100 * max(err, 1e-6)  # the cache really quantized
    if "fp_layers" in settings:
        assert plan.layers[1] is None and plan.layers[0] is not None


def _reference_attention(q, k, v, kh, vh, residual: int, flush: str, scale: float) -> torch.Tensor:
    """Per query: softmax over keys 0..p, each exact when at or after exact_start(p), else fake-quantized."""
    b, hq, lq, d = q.shape
    t, g = k.shape[2], hq // k.shape[1]
    out = torch.zeros(b, hq, lq, d, dtype=torch.float64)
    for i in range(lq):
        p = t - lq + i
        start = int(exact_start(torch.tensor([p]), residual, flush)[0])
        for h in range(hq):
            keys = torch.stack([(k if s >= start else kh)[:, h // g, s] for s in range(p + 1)], 1).double()
            vals = torch.stack([(v if s >= start else vh)[:, h // g, s] for s in range(p + 1)], 1).double()
            w = torch.softmax(torch.einsum("bd,bsd->bs", q[:, h, i].double(), keys) * scale, -1)
            out[:, h, i] = torch.einsum("bs,bsd->bd", w, vals)
    return out


@pytest.mark.parametrize("method,residual,flush", [("oscar", 12, "block"), ("turboquant", 5, "sliding"),
                                                   ("quarot", 0, "block")])
def test_fake_quant_attention_matches_the_window_rule(method: str, residual: int, flush: str) -> None:
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 30, 64, generator=gen), torch.randn(1, 2, 30, 64, generator=gen)
    q = torch.randn(1, 4, 7, 64, generator=gen)  # GQA 2, the last 7 positions
    kq = kvq_core.get_quantizer(method, backend="torch", head_dim=64)
    kh, vh = fake_quant_kv(kq, kq, k, v, residual=residual, flush=flush)
    scale = 1 / math.sqrt(64)
    want = _reference_attention(q, k, v, kh, vh, residual, flush, scale)
    got = fake_quant_attention(q, k, v, kq, kq, residual=residual, flush=flush)
    assert float((got.double() - want).abs().max()) < 1e-5
    causal = torch.arange(30)[None, :] <= (torch.arange(7) + 23)[:, None]
    additive = torch.zeros(1, 1, 7, 30).masked_fill(~causal, torch.finfo(torch.float32).min)
    for mask in (causal[None, None], additive):
        again = fake_quant_attention(q, k, v, kq, kq, residual=residual, flush=flush, attention_mask=mask)
        assert float((again - got).abs().max()) < 1e-6


def test_block_flush_fake_quantizes_whole_blocks_only() -> None:
    """Token-group keys: blocks of ``residual`` tokens are encoded on their own (groups never
    span two blocks) and the tail after the last whole block, which no query reads from codes,
    stays exact."""
    kq = kvq_core.get_quantizer("oscar", backend="torch", head_dim=64, bits=2)
    k = torch.randn(1, 2, 50, 64, generator=torch.Generator().manual_seed(4))
    kh, _ = fake_quant_kv(kq, kq, k, k, residual=20, flush="block")
    assert torch.equal(kh[:, :, :20], kq.fake_quant(k[:, :, :20], "keys"))
    assert torch.equal(kh[:, :, 20:40], kq.fake_quant(k[:, :, 20:40], "keys"))
    assert torch.equal(kh[:, :, 40:], k[:, :, 40:])


def test_gradients_flow_and_errors_are_typed() -> None:
    model = tiny_models.build("llama").train()
    with pytest.raises(KVQError, match="not prepared"):
        model.set_attn_implementation("kvq-qat")
        model(input_ids=_ids(1, 8))
    qat.prepare(model, "octopus", qat_backend="torch", bits=3)
    out = model(input_ids=_ids(1, 40), labels=_ids(1, 40))
    out.loss.backward()
    assert float(model.model.layers[0].self_attn.k_proj.weight.grad.abs().sum()) > 0
    with pytest.raises(InputError, match="multi-head latent attention"):
        qat.prepare(tiny_models.build("deepseek_v3"), "octopus")
