"""The ``"kvq-qat"`` attention: train a transformers model with K/V fake-quantized exactly as a
:class:`~kvq_core.integrations.hf.KVQCache` with the same settings will store them, then serve it with that cache.

::

    plan = qat.prepare(model, method="oscar", bits=2)    # the KVQCache(model.config, ...) arguments
    ...train model (attn_implementation is now "kvq-qat")...
    model.set_attn_implementation("kvq")                  # serve: attend from the codes
    model.generate(ids, cache=plan.cache(), ...)

:func:`prepare` builds the cache the settings describe (``KVQCache(model.config, method,
**settings)``, which resolves every default: per-layer specs, ``residual``, ``flush``, exact
layers) and gives each attention module its layer's :class:`LayerPlan`; the attention function
reads it through the ``module`` transformers passes. Each query position then reads its exact
window at full precision and older tokens through ``Quantizer.fake_quant`` as decoding token by
token through that cache does (:mod:`kvq_core.training`: window semantics, straight-through
gradients per method); layers the cache keeps exact attend with plain sdpa. Keys are fake-quantized
after RoPE, where the cache stores them.

The fake-quant backend is a torch-tensor backend with a differentiable ``kvq::fake_quant``
(``backend="auto"``: Triton on CUDA where it serves the method, else ``"torch"``); its codes
equal the serving cache's backend's (the conformance suite), so training and serving agree
up to rounding ties. Refused: multi-head latent attention (the cache stores the latent, which the
attention never sees), logit soft-capping and attention sinks.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvq_core.api import Quantizer, get_quantizer
from kvq_core.errors import InputError, KVQError
from kvq_core.training import fake_quant_attention, training_backend

NAME = "kvq-qat"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer's fake quantization: its quantizers and the cache's window (``residual``, ``flush``)."""

    keys: Quantizer
    values: Quantizer
    residual: int
    flush: str


@dataclasses.dataclass(frozen=True)
class QATPlan:
    """What :func:`prepare` set up: the cache settings and, per layer, a :class:`LayerPlan`
    (None: the cache keeps that layer exact)."""

    method: str
    settings: dict[str, Any]
    layers: tuple[LayerPlan | None, ...]
    config: Any

    def cache(self, **overrides: Any) -> Any:
        """A fresh :class:`~kvq_core.integrations.hf.KVQCache` with the settings the model was trained for
        (``overrides``, e.g. ``backend="numba"`` or ``stride=32``, change what does not change
        the codes)."""
        from kvq_core.integrations.hf.cache import KVQCache

        return KVQCache(self.config, self.method, **{**self.settings, **overrides})


def _plans(config: Any, method: str, settings: dict[str, Any], backend: str, device: str) -> tuple[LayerPlan | None, ...]:
    from kvq_core.integrations.hf.cache import KVQCache, KVQLayer

    cache = KVQCache(config, method, **settings)
    if cache.mla:
        raise InputError(f"kvq-qat: {config.model_type} uses multi-head latent attention; the cache stores the latent, "
                         "which the attention function never sees, so its fake quantization cannot be placed there")
    out: list[LayerPlan | None] = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, KVQLayer):
            out.append(None)
            continue
        name = training_backend(layer.key_spec, device) if backend == "auto" else backend
        kq = get_quantizer(layer.key_spec, name, layer=i, device=device)
        vq = kq if layer.same_spec else get_quantizer(layer.value_spec, name, layer=i, device=device)
        out.append(LayerPlan(kq, vq, layer.residual, layer.flush))
    return tuple(out)


def prepare(model: torch.nn.Module, method: str = "oscar", *, qat_backend: str = "auto", **settings: Any) -> QATPlan:
    """Set ``model`` to train with K/V fake-quantized as ``KVQCache(model.config, method,
    **settings)`` stores them: attaches each layer's plan to its attention module (as its
    ``kvq_qat_plan``) and switches the model to ``attn_implementation="kvq-qat"``. ``qat_backend``:
    the fake-quant backend (torch, torch-compiled, triton; "auto": see the module docstring).
    Returns the plan, whose :meth:`QATPlan.cache` is the matching serving cache."""
    register()
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    device = str(next(model.parameters()).device)
    layers = _plans(config, method, dict(settings), qat_backend, device)
    attached = set()
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < len(layers) and hasattr(module, "config"):
            module.kvq_qat_plan = layers[idx]
            attached.add(idx)
    missing = sorted(set(range(len(layers))) - attached)
    if missing:
        raise InputError(f"kvq-qat: found no attention module (an nn.Module with layer_idx) for layers {missing}")
    model.set_attn_implementation(NAME)
    return QATPlan(method, dict(settings), layers, config)


def kvq_qat_attention(
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
    if not hasattr(module, "kvq_qat_plan"):
        raise KVQError("kvq-qat attention: this model was not prepared; call kvq_core.integrations.hf.qat.prepare(model, method, ...)")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise KVQError("kvq-qat attention supports plain softmax attention only (no softcap, no sinks)")
    plan: LayerPlan | None = module.kvq_qat_plan
    if plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = fake_quant_attention(query, key, value, plan.keys, plan.values, residual=plan.residual, flush=plan.flush,
                               attention_mask=attention_mask, scale=scaling, dropout=dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``"kvq-qat"`` with transformers' attention and mask interfaces; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, kvq_qat_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


__all__ = ["LayerPlan", "NAME", "QATPlan", "kvq_qat_attention", "prepare", "register"]
