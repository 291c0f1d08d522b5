"""Byte and bit accounting of transformers caches: what :meth:`KVQCache.memory_report` reports.

Every byte the cache holds is counted: packed blocks as stored (every field, padding included),
exact windows and full-precision layers in the model's dtype, and decoded copies (the history
a dequant-mode layer keeps, a block a sliding stride encoded ahead). Bits per element count
exact tokens at 16 bits, as a float16/bfloat16 deployment stores them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvq_core.integrations.hf.layer import WINDOW_BITS, KVQLayer


class KVQMemoryWarning(UserWarning):
    """A cache holds more than its codes (a decoded copy) or stores no codes in a layer."""


def memory_report(layers: Sequence[Any], exact_layers: Mapping[int, str]) -> dict[str, Any]:
    """Byte and bit accounting of a cache's ``layers``, per kind of storage (the fields are
    described at :meth:`KVQCache.memory_report`); ``exact_layers`` is passed through."""
    packed = window = fp = dec = dyn = 0
    bits = elements = 0.0
    for layer in layers:
        if isinstance(layer, KVQLayer):
            packed += layer.packed_bytes
            window += layer.window_bytes()
            dec += layer.decoded_bytes()
            bits += layer.last_attention_bits
            elements += layer.last_attention_elements
            if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
                b, h = layer.keys.shape[:2]
                tokens = layer.cumulative_length  # a DynamicSlidingWindowLayer holds sliding_window - 1
                if layer.sliding_window is not None:
                    tokens = min(tokens, layer.sliding_window - 1)
                dyn += b * h * tokens * (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
        elif getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            nb = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            fp += nb
            dyn += nb
            e = layer.keys.numel() + layer.values.numel()
            bits += WINDOW_BITS * e
            elements += e
    stored = packed + window + fp
    return {
        "packed_bytes": packed,
        "window_bytes": window,
        "fp_layer_bytes": fp,
        "decoded_bytes": dec,
        "stored_bytes": stored,
        "total_bytes": stored + dec,
        "dynamic_cache_bytes": dyn,
        "stored_bits_per_element": bits / elements if elements else math.nan,
        "bits_per_element": (bits + 8 * dec) / elements if elements else math.nan,
        "exact_layers": dict(exact_layers),
    }


def dynamic_cache_nbytes(cache: Cache) -> int:
    """Bytes a transformers cache holds in its layers' ``keys``/``values`` tensors."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
