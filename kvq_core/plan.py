"""Tuned cache plans (``kvq tune``): the JSON format, the model a plan was made for, and the true
bits a plan's cache stores at a context length.

A plan is a JSON object::

    {"format": "kvq-plan", "version": 1,
     "model": {"name": ..., "layers": 30, "q_heads": 9, "kv_heads": 3, "head_dim": 64, "value_dim": 64},
     "context": 2048, "budget": 2.5, "bits_per_element": 2.49, "calibration_kl": 0.04, ...,
     "cache": {KVQCache keyword arguments: method, residual, fp_layers, fp_key_layers,
               layer_params, value_layer_params (a layer's may name another method) and the
               method's parameters}}

:meth:`kvq_core.integrations.hf.KVQCache.from_plan` builds the cache from it (encoding one token per step,
``stride=1``, so that it stores exactly these bits); :func:`check_model` refuses a
plan made for a model with another layer count or head shapes, and :func:`load_plan` one of a
newer format. Bits per element count everything stored at ``context`` tokens: the packed codes
(every field of the layout, padding included) of the ``context - residual`` oldest tokens, the
``residual`` exact tokens at 16 bits, full-precision layers and keys at 16 bits, and the bytes of
the plan's calibrated side data (``extra_bytes``: e.g. a fitted rotation seed per layer).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvq_core.errors import PlanError
from kvq_core.registry import make_spec

PLAN_FORMAT = "kvq-plan"
PLAN_VERSION = 1
EXACT_BITS = 16  # exact tokens, full-precision layers and keys, as a float16 model stores them
IDENTITY = ("layers", "q_heads", "kv_heads", "head_dim", "value_dim")


def model_identity(config: Any, name: str | None = None) -> dict[str, Any]:
    """Layer count and head shapes of a transformers config (its text config), plus ``name``."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return {"name": name or getattr(cfg, "name_or_path", "") or cfg.model_type, "model_type": cfg.model_type,
            "layers": int(cfg.num_hidden_layers), "q_heads": int(cfg.num_attention_heads),
            "kv_heads": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
            "head_dim": head_dim, "value_dim": head_dim}


def load_plan(path: str | Path) -> dict[str, Any]:
    """The plan in ``path``; PlanError when it is not a kvq plan or of a newer format version."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"plan {path}: no such file (write one with `kvq tune --out {path}`)")
    try:
        plan = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan {path}: not JSON ({exc})") from exc
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise PlanError(f"plan {path}: format={plan.get('format') if isinstance(plan, dict) else None!r}; "
                        f"expected {PLAN_FORMAT!r} (a file written by kvq tune)")
    version = plan.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise PlanError(f"plan {path}: version={version!r}; expected an integer from 1 to {PLAN_VERSION}")
    if version > PLAN_VERSION:
        raise PlanError(f"plan {path}: format version {version} is newer than this kvq reads ({PLAN_VERSION}); "
                        "upgrade kvq-core to use it")
    for key in ("model", "cache"):
        if not isinstance(plan.get(key), dict):
            raise PlanError(f"plan {path}: no {key!r} object")
    return plan


def check_model(plan: Mapping[str, Any], config: Any, where: str = "plan") -> None:
    """PlanError naming each layer count or head shape where ``config`` differs from the plan's model."""
    have, want = model_identity(config), plan["model"]
    diff = [f"{k} {want.get(k)} (the model has {have[k]})" for k in IDENTITY if k in want and want[k] != have[k]]
    if diff:
        raise PlanError(f"{where} was tuned for another model ({want.get('name')!r}): {', '.join(diff)}; "
                        "run kvq tune for this model")


def write_plan(plan: Mapping[str, Any], path: str | Path) -> None:
    """Write ``plan`` as indented JSON (the directory is created)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")


def layer_codecs(method: str, method_params: Mapping[str, Any], value_method: str | None,
                 value_params: Mapping[str, Any] | None, over: Mapping[str, Any],
                 vover: Mapping[str, Any]) -> tuple[str, dict[str, Any], str, dict[str, Any]]:
    """``(key method, key params, value method, value params)`` of one layer of a ``KVQCache``
    (``head_dim`` not included), ``over``/``vover`` being its ``layer_params``/``value_layer_params``.

    Without ``"method"`` in them they update the cache-wide codec's parameters. A layer's ``over``
    naming a ``method`` gives its keys and values that codec with ``over``'s parameters only (the
    cache-wide parameters belong to another method); a ``vover`` naming one does so for its values.
    """
    over, vover = dict(over), dict(vover)
    kmethod, vmethod = over.pop("method", None), vover.pop("method", None)
    kparams = over if kmethod is not None else {**method_params, **over}
    if vmethod is not None:
        return kmethod or method, kparams, vmethod, vover
    if kmethod is not None:
        return kmethod, kparams, kmethod, {**over, **vover}
    if value_method is None:
        return method, kparams, method, {**kparams, **(value_params or {}), **vover}
    return method, kparams, value_method, {**(value_params or {}), **over, **vover}


def packed_bits(method: str, params: Mapping[str, Any], kind: str, kv_heads: int, head_dim: int, tokens: int) -> float:
    """Stored bits per element of ``tokens`` tokens packed by ``method`` as ``kind``: every field of
    its layout (codes, norms, scales, padding) over the elements."""
    spec = make_spec(method, **{**params, "head_dim": head_dim})
    if tokens <= 0:
        return 0.0
    layout = spec.key_layout(1, kv_heads, tokens) if kind == "keys" else spec.value_layout(1, kv_heads, tokens)
    return 8 * sum(f.nbytes for f in layout.values()) / (kv_heads * tokens * head_dim)


def slot_bits(method: str, params: Mapping[str, Any] | None, kind: str, model: Mapping[str, Any], context: int,
              residual: int) -> float:
    """Bits per element of one layer's keys or values at ``context`` tokens: ``params`` None is exact
    (16 bits), else the packed rate for ``context - residual`` tokens and 16 bits for the window."""
    if params is None:
        return float(EXACT_BITS)
    w = min(residual, context)
    dim = model["head_dim"] if kind == "keys" else model["value_dim"]
    rate = packed_bits(method, params, kind, model["kv_heads"], dim, context - w)
    return (rate * (context - w) + EXACT_BITS * w) / context


def cache_bits(cache: Mapping[str, Any], model: Mapping[str, Any], context: int, extra_bytes: int = 0) -> float:
    """True bits per K/V element of the cache ``KVQCache(**cache)`` builds at ``context`` tokens
    (see the module docstring), ``extra_bytes`` of calibrated side data included."""
    method, residual = cache["method"], int(cache.get("residual") or 0)
    n = model["layers"]
    base = {k: v for k, v in cache.items() if k not in CACHE_OPTIONS}
    over = {int(k) % n: v for k, v in (cache.get("layer_params") or {}).items()}
    vover = {int(k) % n: v for k, v in (cache.get("value_layer_params") or {}).items()}
    fp = {int(i) % n for i in cache.get("fp_layers", ())}
    fpk = {int(i) % n for i in cache.get("fp_key_layers", ())}
    bits = 0.0
    for i in range(n):
        km, kp, vm, vp = layer_codecs(method, base, cache.get("value_method"), cache.get("value_params"),
                                      over.get(i, {}), vover.get(i, {}))
        bits += model["head_dim"] * slot_bits(km, None if i in fp or i in fpk else kp, "keys", model, context, residual)
        bits += model["value_dim"] * slot_bits(vm, None if i in fp else vp, "values", model, context, residual)
    elements = n * (model["head_dim"] + model["value_dim"])  # per token per KV head
    return bits / elements + 8 * extra_bytes / (elements * model["kv_heads"] * context)


#: KVQCache keyword arguments of a plan's ``cache`` that are not the method's spec parameters
CACHE_OPTIONS = ("method", "residual", "flush", "fp_layers", "fp_key_layers", "layer_params", "value_layer_params",
                 "value_method", "value_params")
