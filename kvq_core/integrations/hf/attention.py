"""The ``"kvq"`` attention function: attend over packed blocks from their codes, plus the window.

Registered with ``transformers.AttentionInterface.register("kvq", kvq_attention)`` (and the
sdpa mask builder under the same name) by :func:`register`; a model loaded with
``attn_implementation="kvq"`` then routes every attention call here.

- Called with K/V that a :class:`~kvq_core.integrations.hf.layer.KVQLayer` returned in codes mode (the
  key tensor carries a ``kvq_context``) and packed blocks to read: where the backend fuses the
  window (``Quantizer.fuses_window``: numba on the CPU for 2- and 4-bit OScaR/KIVI, OCTOPUS and TurboQuant,
  every torch-tensor backend through the ``kvq::attend_window`` op, whose Triton kernel is one
  fused launch on CUDA) and the mask is the plain causal one, one
  ``Quantizer.attend_window(q, blocks, window_k, window_v, scale)`` call per layer and step scores
  every block and the full-precision window in one online softmax. Otherwise the blocks are
  scored with ``Quantizer.attend(q, pk, pv, scale, return_lse=True)`` block by block, the window
  with plain softmax attention under the model's mask, and the parts are merged exactly with
  their log-sum-exps. No decoded copy of the history is made.
- Called in codes mode with no packed block yet (a prefill: the K/V handed are all exact): sdpa,
  at its speed and memory (no logits materialised).
- Called with K/V of a layer with ``flush="sliding"`` in a multi-token step: each query reads
  the window tokens ``residual`` or more positions back from this step's flushed codes, so a
  chunked forward equals token-by-token decoding (specs/octopus.md 1.11).
- Called with ordinary K/V (no cache, ``DynamicCache``, full-precision layers): plain sdpa.

Coverage: decoder models whose attention module passes ``cache.update(...)``'s K/V unchanged
to ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with softmax attention (Llama,
Mistral, Qwen2/Qwen3, Gemma 3, Phi-3, GPT-NeoX, OLMo 2, Granite, SmolLM and other llama-style
models; tests/test_hf_models.py). Masks that hide a packed token (left padding inside the
packed region, a sliding window over a multi-token step) fall back to decoding the blocks.
Multi-head latent attention (DeepseekV3) expands the cached latent before attention, so its
layers hand decoded K/V here and take the plain sdpa path. Refused: logit soft-capping
(Gemma 2), attention sinks, dropout in training.
"""
from __future__ import annotations

from typing import Any

import torch

from kvq_core.errors import InputError, KVQError
from kvq_core.integrations.hf.layer import all_finite, to_torch
from kvq_core.integrations.hf.view import CodesContext, context_of

NAME = "kvq"


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """A boolean 'may attend' mask from a bool or additive float mask."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _softmax_parts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA softmax attention in float32: ``out [b, hq, lq, d]`` and ``lse [b, hq, lq]``.

    Few torch calls on purpose: at decode each is a few microseconds of dispatch on tiny tensors,
    and this runs once per layer and step."""
    b, hq, lq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    qg = q.float().reshape(b, hk, g * lq, d)
    logits = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)  # [b, hk, g*lq, t]
    if visible is not None:
        vis = visible[:, :, None] if visible.shape[1] == 1 else visible.reshape(visible.shape[0], hk, g, lq, -1)
        logits = logits.reshape(b, hk, g, lq, -1).masked_fill(~vis, float("-inf")).reshape(b, hk, g * lq, -1)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.exp(logits - lse)
    if visible is not None:
        p = p.nan_to_num_(0.0)  # a row that sees nothing: lse -inf, weights 0
    out = torch.matmul(p, v.float()).reshape(b, hq, lq, d)
    return out, lse.reshape(b, hq, lq)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact softmax over the union of disjoint token sets from per-set (out, lse)."""
    if len(parts) == 1:
        return parts[0][0]
    total = parts[0][1]
    for _, lse in parts[1:]:
        total = torch.logaddexp(total, lse)
    out = None
    for o, lse in parts:
        term = o * torch.exp(lse - total).nan_to_num_(0.0).unsqueeze(-1)  # nan: every part empty
        out = term if out is None else out.add_(term)
    return out  # type: ignore[return-value]


def _causal_visible(lq: int, w: int, device: torch.device) -> torch.Tensor:
    """Queries are the last ``lq`` of the ``w`` window tokens (bottom-right aligned causal mask)."""
    qpos = torch.arange(lq, device=device)[:, None] + (w - lq)
    return (torch.arange(w, device=device)[None, :] <= qpos)[None, None]


def _window_parts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, vis: torch.Tensor | None,
                  ctx: CodesContext, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The window's share: exact, except (sliding flush) tokens ``residual`` or more positions
    before a query, which that query reads decoded from this step's flushed codes."""
    lq, w = query.shape[-2], key.shape[-2]
    if ctx.flushed is None:
        return [_softmax_parts(query, key, value, vis, scale)]
    qpos = torch.arange(lq, device=query.device)[:, None] + (w - lq)
    old = (qpos - torch.arange(w, device=query.device)[None, :]) >= max(ctx.layer.residual, 1)
    fk, fv = ctx.flushed
    m = fk.shape[-2]
    if bool(old[:, m:].any()):
        raise KVQError(f"kvq attention: a query reads window tokens beyond the {m} flushed ones from codes")
    vis = _causal_visible(lq, w, query.device) if vis is None else vis
    return [_softmax_parts(query, key, value, vis & ~old, scale),
            _softmax_parts(query, fk, fv, vis[..., :m] & old[:, :m], scale)]


def _plain_causal(vis_w: torch.Tensor | None, vis_p: torch.Tensor | None, lq: int) -> bool:
    """Whether the mask shows every packed token and the window causally (bottom-right aligned),
    so the fused kernel's own visibility rule is the mask's."""
    if vis_p is not None and not bool(vis_p.all()):
        return False
    if vis_w is None:
        return True
    return bool(vis_w.all()) if lq == 1 else bool((vis_w == _causal_visible(lq, vis_w.shape[-1], vis_w.device)).all())


def attend_codes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: CodesContext,
                 attention_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention of ``query`` over ``ctx``'s packed blocks and the K/V it was handed (decoded
    history, if any, then the window): one fused kernel call when the backend has one
    (:meth:`kvq_core.Quantizer.attend_window`), else per-part attention merged by log-sum-exp."""
    layer = ctx.layer
    b, hq, lq, d = query.shape
    w = key.shape[-2]
    n_packed, h = ctx.packed_length, ctx.history
    vis_w = vis_p = None
    if attention_mask is not None:
        vis = _visible(attention_mask)
        if vis.shape[-1] != n_packed + w:
            raise KVQError(f"kvq attention: mask covers {vis.shape[-1]} keys; the cache holds {n_packed} packed + {w} in K/V")
        vis = vis[..., -lq:, :] if vis.shape[-2] != lq else vis
        lead = ctx.leading  # decoded K/V tokens that come before the blocks in position (a sliding window's edge)
        vis_p = vis[..., lead:lead + n_packed]
        vis_w = vis[..., n_packed:] if not lead else torch.cat([vis[..., :lead], vis[..., lead + n_packed:]], dim=-1)
    if (ctx.blocks and ctx.flushed is None and layer.same_spec and layer.kq.fuses_window(query)
            and _plain_causal(vis_w, vis_p, lq)):
        # decoded history here is the part of a block a sliding stride encoded ahead that lies before the window
        # (codes mode): tokens after the blocks, before every query, so the fused call takes them as the window's first
        out, _ = layer.kq.attend_window(query, layer.window_plan(ctx.blocks), key, value, scale)  # checks the query
        return to_torch(out, query.device, query.dtype)
    check_query_finite(query, ctx)  # before any part is computed: some never reach the quantizer
    if attention_mask is None and lq > 1:
        vis_w = _causal_visible(lq, w, query.device)
    parts = []
    if h:  # decoded history: every query reads it whole
        parts.append(_softmax_parts(query, key[:, :, :h], value[:, :, :h], None if vis_w is None else vis_w[..., :h], scale))
    parts += _window_parts(query, key[:, :, h:], value[:, :, h:], None if vis_w is None else vis_w[..., h:], ctx, scale)
    if ctx.blocks:
        if vis_p is not None and not bool(vis_p.all()) or not layer.same_spec:
            # a mask hides packed tokens, or K and V use different codecs: decode and attend
            dec = [layer.decode_pair(pk, pv) for pk, pv in ctx.blocks]
            hk, hv = torch.cat([x[0] for x in dec], dim=-2), torch.cat([x[1] for x in dec], dim=-2)
            parts.append(_softmax_parts(query, hk, hv, vis_p, scale))
        else:
            for pk, pv in ctx.blocks:
                out, lse = layer.kq.attend(query, pk, pv, scale=scale, return_lse=True)
                parts.append((to_torch(out, query.device, torch.float32), to_torch(lse, query.device, torch.float32)))
    return merge_attention(parts).to(query.dtype)


def check_query_finite(query: torch.Tensor, ctx: CodesContext) -> None:
    """InputError for a query holding NaN or Inf (attention from codes is all or nothing: the caller rolls
    the step back)."""
    if not all_finite(query, ctx.layer.kq):
        raise InputError(f"kvq attention, layer {ctx.layer.layer_idx}: the query contains NaN or Inf")


def kvq_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function; returns ``(out [b, q_len, q_heads, d], None)``."""
    ctx = context_of(key)
    if ctx is None:
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    ctx.layer.mark_attended()
    try:
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            raise KVQError("kvq attention from codes supports plain softmax attention only (no softcap, no sinks)")
        if dropout and module.training:
            raise KVQError("kvq attention from codes is for inference; got dropout in training mode")
        if not ctx.blocks:  # with blocks, attend_codes checks it (the fused call: Quantizer.attend_window)
            check_query_finite(query, ctx)
        if not ctx.blocks and not ctx.history and ctx.flushed is None:
            return _sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)  # all exact: a prefill
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        out = attend_codes(query, key, value, ctx, attention_mask, scale)
    except Exception:
        ctx.layer.abort_step()  # the cache was updated for this step: all or nothing
        raise
    return out.transpose(1, 2).contiguous(), None


def _sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (torch's fused kernels: no logits materialised). GQA comes from
    the shapes, as everywhere in kvq: a module without ``num_key_value_groups`` gets K/V repeated here."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = query.shape[1] // key.shape[1]
    if groups > 1 and getattr(module, "num_key_value_groups", 1) != groups:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register() -> str:
    """Register ``"kvq"`` with transformers' attention and mask interfaces; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, kvq_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
