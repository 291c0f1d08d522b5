"""transformers integration: :class:`KVQCache` (a ``Cache`` storing kvq packed blocks), the
``"kvq"`` attention function that attends from codes, and ``"kvq-qat"`` (:mod:`kvq_core.integrations.hf.qat`),
which trains a model with K/V fake-quantized as that cache stores them.

Importing this module registers ``"kvq"`` and ``"kvq-qat"`` with transformers (idempotent), so
``attn_implementation="kvq"`` works right after ``import kvq_core.integrations.hf``."""
from __future__ import annotations

from kvq_core.integrations.hf.attention import kvq_attention, merge_attention, register
from kvq_core.integrations.hf.cache_arg import cache_kwargs
from kvq_core.integrations.hf.cache import KVQCache, KVQLayer, KVQMemoryWarning, dynamic_cache_nbytes
from kvq_core.integrations.hf import qat

register()
qat.register()

__all__ = ["KVQCache", "KVQLayer", "KVQMemoryWarning", "cache_kwargs", "dynamic_cache_nbytes", "kvq_attention", "merge_attention", "qat",
           "register"]
