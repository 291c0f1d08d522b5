"""Cache configurations for the evaluations: parse ``METHOD[:k=v,...]`` and build the cache.

Kinds:

- ``fp``: transformers ``DynamicCache`` (the full-precision baseline);
- ``quanto`` / ``hqq``: transformers' own ``QuantizedCache`` with that backend
  (``nbits``, ``q_group_size``, ``residual_length``, ``axis_key``, ``axis_value``);
- ``pypi-turboquant``: the PyPI ``turboquant`` package's ``TurboQuantCache`` (``bits``; its
  window is 128 exact tokens), a third-party TurboQuant to compare kvq's against
  (``pip install turboquant``; it dequantizes its whole history every step);
- any kvq method name: :class:`kvq_core.integrations.hf.KVQCache` with the method's parameters plus the
  cache options ``residual``, ``flush``, ``stride``, ``fp_layers``, ``fp_key_layers`` (``;``-separated layer lists),
  ``value_method`` and ``v.<param>`` (value codec parameters, e.g. ``v.bits=2``); a parameter
  that is a sequence is written ``;``-separated (``polarquant:level_bits=3;3;3;3;3;3``);
- ``plan``: the cache of a ``kvq tune`` plan file, ``plan:path=FILE`` (:meth:`KVQCache.from_plan`).

Every kind takes ``label=`` to name the row. Examples::

    fp   quanto:nbits=2   oscar:bits=2   oscar:bits=2,token_scaling=false
    octopus:bits=3   turboquant:bits=3,residual=32   oscar:bits=3,v.bits=2,label=oscar-k3v2
    plan:path=bench/results/plans/smollm2-2k-2.5.json,label=tuned-2.5
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

HF_KINDS = ("quanto", "hqq")
PYPI_TURBOQUANT = "pypi-turboquant"  # the PyPI turboquant package's cache
KVQ_KINDS = ("kvq", "plan")  # caches that are a KVQCache
CACHE_OPTIONS = ("residual", "flush", "stride", "fp_layers", "fp_key_layers", "value_method")
WINDOW_BITS = 16


def _value(text: str) -> Any:
    if ";" in text:
        return [_value(x) for x in text.split(";") if x.strip()]
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


@dataclasses.dataclass
class CacheConfig:
    """One evaluated cache: its row label, kind ("fp", "quanto", "hqq", "kvq", "plan"), method and params."""

    label: str
    kind: str
    method: str = ""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    value_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    group: str = ""  # the configuration this is one rotation seed of (``expand_seeds``), else ""

    @property
    def nominal_bits(self) -> Any:
        if self.kind == "fp":
            return 16
        if self.kind in HF_KINDS:
            return self.params.get("nbits", 4)
        if self.kind == PYPI_TURBOQUANT:
            return self.params.get("bits", 3)
        if self.method == "fp16":
            return 16
        if self.kind == "plan":
            return "plan"
        kb = self.params.get("bits")
        vb = self.value_params.get("bits", kb)
        return kb if vb == kb else f"K{kb}/V{vb}"

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "method": self.method, "params": self.params,
                "options": self.options, "value_params": self.value_params, "bits": self.nominal_bits,
                "group": self.group}


def parse_config(text: str) -> CacheConfig:
    """``METHOD[:k=v,k=v...]`` -> :class:`CacheConfig` (see module doc)."""
    head, _, rest = text.partition(":")
    head = head.strip()
    params: dict[str, Any] = {}
    options: dict[str, Any] = {}
    vparams: dict[str, Any] = {}
    label = None
    for item in filter(None, (s.strip() for s in rest.split(","))):
        if "=" not in item:
            raise ValueError(f"cache config {text!r}: {item!r} is not key=value")
        key, val = (s.strip() for s in item.split("=", 1))
        if key == "label":
            label = val
        elif key in ("fp_layers", "fp_key_layers"):
            options[key] = [int(x) for x in val.split(";") if x.strip()]
        elif key in CACHE_OPTIONS:
            options[key] = _value(val)
        elif key.startswith("v."):
            vparams[key[2:]] = _value(val)
        else:
            params[key] = _value(val)
    if head in ("fp", "dynamic"):
        kind = "fp"
    elif head in HF_KINDS or head == PYPI_TURBOQUANT:
        kind = head
    elif head == "plan":
        if set(params) != {"path"}:
            raise ValueError(f"cache config {text!r}: a plan takes path=FILE (and label=) only")
        return CacheConfig(label or f"plan[{params['path']}]", "plan", "", params)
    else:
        kind = "kvq"
    if label is None:
        label = _default_label(head, kind, params, options, vparams)
    return CacheConfig(label, kind, head if kind == "kvq" else "", params, options, vparams)


def _has_seed(method: str) -> bool:
    import kvq_core

    return "seed" in kvq_core.make_spec(method).to_dict()


def expand_seeds(configs: list[CacheConfig], seeds: list[int] | None) -> list[CacheConfig]:
    """One copy per seed (label ``LABEL@seedS``, ``group`` LABEL) of every kvq configuration
    whose codec has a rotation ``seed`` and does not fix it; others are returned unchanged.

    Rotation signs are random: one seed is one draw, and near-lossless configurations differ
    by less than the seed-to-seed spread, so comparisons there need several seeds.
    """
    if not seeds:
        return list(configs)
    out = []
    for c in configs:
        if c.kind != "kvq" or "seed" in c.params or not _has_seed(c.method):
            out.append(c)
            continue
        vmethod = c.options.get("value_method")
        for s in seeds:
            vparams = dict(c.value_params)
            if vmethod and _has_seed(vmethod) and "seed" not in vparams:  # else values inherit the key params
                vparams["seed"] = s
            out.append(dataclasses.replace(c, label=f"{c.label}@seed{s}", params={**c.params, "seed": s},
                                           value_params=vparams, group=c.label))
    return out


def _default_label(head: str, kind: str, params: dict, options: dict, vparams: dict) -> str:
    if kind == "fp":
        return "fp"
    if kind in HF_KINDS:
        return f"hf-{head}-int{params.get('nbits', 4)}"
    if kind == PYPI_TURBOQUANT:
        return f"{head}-{params.get('bits', 3)}"
    name = head + (f"-{params['bits']}" if "bits" in params else "")
    if "bits" in vparams:
        name = f"{head}-k{params.get('bits')}v{vparams['bits']}"
    extra = [f"{k}={v}" for k, v in params.items() if k != "bits"]
    extra += [f"{k}={v}" for k, v in options.items()]
    extra += [f"v.{k}={v}" for k, v in vparams.items() if k != "bits"]
    return name + (f"[{','.join(map(str, extra))}]" if extra else "")


def build_cache(cfg: CacheConfig, model_config: Any, backend: str = "auto", attention: str = "auto") -> Any:
    """A fresh cache object for ``cfg``; ``attention`` is a kvq cache's attention mode."""
    from transformers import DynamicCache, QuantizedCache

    if cfg.kind == "fp":
        return DynamicCache(config=model_config)
    if cfg.kind in HF_KINDS:
        return QuantizedCache(cfg.kind, model_config, **cfg.params)
    if cfg.kind == PYPI_TURBOQUANT:
        return _pypi_turboquant_cache(**cfg.params)
    from kvq_core.integrations.hf import KVQCache

    if cfg.kind == "plan":
        return KVQCache.from_plan(model_config, cfg.params["path"], backend=backend, attention=attention)
    return KVQCache(model_config, cfg.method, backend, value_params=cfg.value_params or None, attention=attention,
                    **cfg.options, **cfg.params)


def _pypi_turboquant_cache(**params: Any) -> Any:
    """The PyPI ``turboquant`` package's ``TurboQuantCache``, run on this stack: its ``update`` takes
    the extra keyword arguments transformers 5.2x passes (turboquant 0.2.0 accepts ``cache_kwargs``
    only), and its module sees ``np.trapezoid`` as ``np.trapz`` (removed in NumPy 2.4; it builds its
    codebook with it). Nothing else of the package is changed."""
    import types

    import numpy as np
    import turboquant.core
    from turboquant import TurboQuantCache

    if not hasattr(turboquant.core.np, "trapz"):
        turboquant.core.np = types.SimpleNamespace(**vars(np), trapz=np.trapezoid)

    class Adapted(TurboQuantCache):
        def update(self, key_states: Any, value_states: Any, layer_idx: int, cache_kwargs: Any = None,
                   **_: Any) -> Any:
            return super().update(key_states, value_states, layer_idx, cache_kwargs)

    return Adapted(**params)


def populate(cache: Any, source: Any) -> None:
    """Write a full-precision prefix (a filled ``DynamicCache``) into ``cache`` layer by layer.

    This is exactly what a prefill forward does to the cache (each layer receives the prefix
    K/V in one ``update``; prefill attention is full precision for every method here), so the
    prefix forward pass can be shared by all configurations.
    """
    for i, layer in enumerate(source.layers):
        cache.update(layer.keys, layer.values, i)
        if hasattr(cache.layers[i], "mark_attended"):
            cache.layers[i].mark_attended()


def _tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the plain tensors inside ``obj`` (quanto/HQQ tensor subclasses, tuples, dicts)."""
    seen = set() if seen is None else seen
    if obj is None or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x, seen) for x in obj.values())
    return 0


def stored(cache: Any, token_elements: int) -> dict[str, float]:
    """Stored bits (exact tokens at 16 bits), actual bytes and K/V elements of any cache here.

    ``token_elements`` is K+V elements per token per layer (2 * batch * kv_heads * head_dim).
    """
    from kvq_core.integrations.hf.cache import KVQLayer

    bits = nbytes = elements = 0.0
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(layer, KVQLayer):
            if not layer.is_initialized:
                continue
            b, h, w, d = layer.keys.shape
            bits += 8 * layer.packed_bytes + WINDOW_BITS * 2 * b * h * w * d
            nbytes += layer.packed_bytes + layer.window_bytes()
            elements += 2 * b * h * layer.cumulative_length * d
        elif hasattr(layer, "_quantized_keys"):  # transformers QuantizedLayer (quanto / hqq)
            if not getattr(layer, "is_initialized", False):
                continue
            q = _tensor_bytes(layer._quantized_keys) + _tensor_bytes(layer._quantized_values)
            res = keys.numel() + layer.values.numel() if keys is not None and keys.dim() == 4 else 0
            bits += 8 * q + WINDOW_BITS * res
            nbytes += q + (res * keys.element_size() if res else 0)
            elements += token_elements * layer.cumulative_length
        elif hasattr(layer, "_key_indices"):  # the PyPI turboquant package's layer
            if not getattr(layer, "is_initialized", False):
                continue
            q = _tensor_bytes([layer._key_indices, layer._key_norms, layer._value_indices, layer._value_norms])
            res = layer._residual_keys.numel() + layer._residual_values.numel()
            held = keys.numel() + layer.values.numel() if layer._key_indices.numel() else 0  # its decoded copy
            bits += 8 * q + WINDOW_BITS * res
            nbytes += q + (res + held) * layer._residual_keys.element_size()
            elements += token_elements * layer.get_seq_length()
        elif isinstance(keys, torch.Tensor) and keys.numel():
            e = keys.numel() + layer.values.numel()
            bits += WINDOW_BITS * e
            nbytes += e * keys.element_size()
            elements += e
    return {"bits": bits, "bytes": nbytes, "elements": elements}


def steady_bits(cache: Any, cfg: CacheConfig, tokens: int, token_elements: int) -> float:
    """Bits per K/V element of ``cache``'s format at ``tokens`` tokens with its exact window full.

    Per layer: the packed rate (stored bits per packed token, from the blocks actually held:
    codes, scales, norms, padding) for ``tokens - W`` tokens plus ``W`` exact tokens at 16
    bits, W being the layer's window (kvq ``residual``, QuantizedCache ``residual_length``),
    plus the ``stride - 1`` tokens a sliding kvq layer may hold as codes too;
    full-precision layers at 16 bits. This is the most a decode step at that length stores.
    """
    from kvq_core.integrations.hf.cache import KVQLayer

    if cfg.kind == "fp":
        return float(WINDOW_BITS)
    bits = elements = 0.0
    for layer in cache.layers:
        elements += tokens * token_elements
        if isinstance(layer, KVQLayer) and layer.packed_length:
            w = min(layer.residual, tokens)
            ahead = layer.stride - 1 if layer.flush == "sliding" else 0  # tokens also held as codes
            bits += 8 * layer.packed_bytes / layer.packed_length * (tokens - w + ahead) + WINDOW_BITS * token_elements * w
        elif hasattr(layer, "_quantized_keys") and getattr(layer, "is_initialized", False):
            keys = layer.keys
            res = keys.shape[-2] if keys is not None and keys.dim() == 4 else 0
            qtok = layer.cumulative_length - res
            q = _tensor_bytes(layer._quantized_keys) + _tensor_bytes(layer._quantized_values)
            w = min(layer.residual_length, tokens)
            bits += 8 * q / max(qtok, 1) * (tokens - w) + WINDOW_BITS * token_elements * w
        else:
            bits += WINDOW_BITS * token_elements * tokens
    return bits / elements if elements else math.nan


