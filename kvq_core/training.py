"""Quantization-aware training with kvq: attention over K/V as a kvq cache would hand them back.

:meth:`kvq_core.Quantizer.fake_quant` (one ``kvq::fake_quant`` op on the torch-tensor backends)
returns ``decode(encode(x))``; its gradient is *straight-through*: the identity, zeroed where
the codec clips. What clips, per method:

=================  =====================================================================  =========
method             why the gradient is what it is                                         clips
=================  =====================================================================  =========
oscar, kivi        asymmetric min-max groups: every value lies in its group's range, so   never
                   codes only round (the integer zero-point and the float16 scale move
                   the grid by under half a step)
quarot             min-max per token, but ``clip_ratio`` < 1 shrinks the range in the     ratio < 1
                   rotated domain: the gradient is ``H (m * H g)``, m = 0 for rotated
                   coordinates outside ``[rho*min(y_min, 0), rho*max(y_max, 0)]``
octopus,           exact float32 norm times a codebook point for the direction; the       never
turboquant(_prod), codebooks tile the whole unit sphere (the outer Lloyd-Max cells hold
polarquant         every coordinate up to 1), so codes only round
qjl                keys: the sign sketch's reconstruction (its derivative is 0 almost     never
                   everywhere; straight-through treats it as the key); values: KIVI
fp16               float16 or float32 storage: rounding only                              never
=================  =====================================================================  =========

Float16 side fields (scales, offsets, radii) overflow for ``|x|`` past 65504: an eager
``fake_quant`` raises ``InputError`` then (the output would not be finite), as ``encode`` does;
under ``torch.compile`` the check is skipped like every data-dependent check.

:func:`fake_quant_attention` is the attention a model trained for a kvq cache needs: each query
position reads, exactly as decoding token by token through :class:`kvq_core.integrations.hf.KVQCache` (and
``kvq eval ppl``'s ``chunks="decode"``), the recent tokens of the exact window at full precision
and every older token fake-quantized:

- ``flush="sliding"`` (OCTOPUS, TurboQuant, PolarQuant): query ``p`` reads its ``residual`` most
  recent tokens exact (itself included), positions ``p - residual + 1 .. p``;
- ``flush="block"`` (OScaR, KIVI): tokens are packed in blocks of ``residual``, so query ``p``
  reads positions ``residual * (p // residual) .. p`` exact (1 to ``residual`` tokens) and the
  whole blocks before from their codes; token-group codecs are fake-quantized block by block,
  so their groups are the cache's;
- ``residual=0``: every query reads itself exact and all earlier tokens from codes.

A real cache's *prefill* step attends its own tokens exactly; training models the decode
regime, where the codes matter. Positions count from the first key handed in (left padding
included, as the cache counts them).
"""
from __future__ import annotations

from typing import Any

import torch

from kvq_core.api import Quantizer
from kvq_core.errors import InputError
from kvq_core.tokens import token_separable

FLUSH_MODES = ("block", "sliding")  # kvq_core.integrations.hf.flush's (this module needs no transformers)


def exact_start(positions: torch.Tensor, residual: int, flush: str) -> torch.Tensor:
    """The first position each query position reads exact (the earlier ones from codes)."""
    window = max(residual, 1)
    if flush == "sliding":
        return positions - (window - 1)
    return torch.div(positions, window, rounding_mode="floor") * window


def _fake_quant_blocks(q: Quantizer, x: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """``x`` fake-quantized as a block flush packs it: whole blocks of ``block`` tokens encoded
    separately (their token groups are the cache's); the tail after the last whole block stays
    exact (no query reads it from codes)."""
    b, h, t, d = x.shape
    n = t // block
    if n == 0:
        return x
    head = x[:, :, : n * block].reshape(b, h, n, block, d).transpose(1, 2).reshape(b * n, h, block, d)
    head = q.fake_quant(head, kind).reshape(b, n, h, block, d).transpose(1, 2).reshape(b, h, n * block, d)
    return torch.cat([head, x[:, :, n * block:]], dim=2) if n * block < t else head


def fake_quant_kv(key_q: Quantizer, value_q: Quantizer, key: torch.Tensor, value: torch.Tensor, *, residual: int,
                  flush: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[batch, kv_heads, tokens, head_dim]`` as the cache decodes them (every token;
    under a block flush the tail after the last whole block is returned exact)."""
    if flush not in FLUSH_MODES:
        raise InputError(f"flush={flush!r}; expected one of {FLUSH_MODES}")
    if flush == "sliding" or (token_separable(key_q.spec, "keys") and token_separable(value_q.spec, "values")):
        return key_q.fake_quant(key, "keys"), value_q.fake_quant(value, "values")
    block = max(residual, 1)
    return _fake_quant_blocks(key_q, key, "keys", block), _fake_quant_blocks(value_q, value, "values", block)


def fake_quant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_q: Quantizer,
                         value_q: Quantizer, *, residual: int, flush: str, attention_mask: torch.Tensor | None = None,
                         scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Softmax attention ``[b, q_heads, q_len, d]`` with each query reading old tokens
    fake-quantized and its exact window at full precision (module docstring), differentiable.

    ``query`` ``[b, q_heads, q_len, d]`` are the last ``q_len`` of the ``key``/``value`` tokens
    (GQA when q_heads is a multiple of kv_heads); ``attention_mask``: None (causal) or a bool or
    additive float mask broadcastable to ``[b, q_heads, q_len, tokens]`` (e.g. transformers'
    sdpa mask, padding and sliding windows included); ``dropout``: SDPA's ``dropout_p``. One SDPA call over the exact and the
    fake-quantized K/V side by side, each key taken from one of the two per query.
    """
    lq, t = query.shape[-2], key.shape[-2]
    k_hat, v_hat = fake_quant_kv(key_q, value_q, key, value, residual=residual, flush=flush)
    qpos = torch.arange(lq, device=query.device) + (t - lq)
    kpos = torch.arange(t, device=query.device)
    exact = kpos[None, :] >= exact_start(qpos, residual, flush)[:, None]
    if attention_mask is None:
        visible = kpos[None, :] <= qpos[:, None]
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:
        visible = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    mask = torch.cat([visible & exact, visible & ~exact], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(
        query, torch.cat([key, k_hat], dim=-2), torch.cat([value, v_hat], dim=-2), attn_mask=mask, dropout_p=dropout,
        scale=scale, enable_gqa=query.shape[1] != key.shape[1])


def training_backend(spec: Any, device: str | None) -> str:
    """The backend ``backend="auto"`` gives training: the automatic pick when it has a
    differentiable ``kvq::fake_quant`` (torch, torch-compiled, triton), else ``"torch"``."""
    from kvq_core import registry

    name = registry.select_backend(spec, device)
    return name if registry.backend_info(name).torch_ops else "torch"


__all__ = ["exact_start", "fake_quant_attention", "fake_quant_kv", "training_backend"]
