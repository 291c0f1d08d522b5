"""transformers integration: :class:`KVQCache` (a ``Cache`` storing kvq packed blocks) and the
``"kvq"`` attention function that attends from codes (:func:`register`)."""
from __future__ import annotations

from kvq_core.hf.attention import kvq_attention, merge_attention, register
from kvq_core.hf.cache import KVQCache, KVQLayer, dynamic_cache_nbytes

__all__ = ["KVQCache", "KVQLayer", "dynamic_cache_nbytes", "kvq_attention", "merge_attention", "register"]
