"""transformers integration: :class:`KVQCache` (a ``Cache`` storing kvq packed blocks) and the
``"kvq"`` attention function that attends from codes.

Importing this module registers ``"kvq"`` with transformers (:func:`register`, idempotent), so
``attn_implementation="kvq"`` works right after ``import kvq_core.hf``."""
from __future__ import annotations

from kvq_core.hf.attention import kvq_attention, merge_attention, register
from kvq_core.hf.cache import KVQCache, KVQLayer, KVQMemoryWarning, dynamic_cache_nbytes

register()

__all__ = ["KVQCache", "KVQLayer", "KVQMemoryWarning", "dynamic_cache_nbytes", "kvq_attention", "merge_attention", "register"]
