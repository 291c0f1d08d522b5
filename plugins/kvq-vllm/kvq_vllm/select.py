"""What vLLM's ``CPU_ATTN`` entry resolves to while the plugin is installed.

The CPU platform always picks ``CPU_ATTN`` (it ignores ``--attention-backend``), so the plugin
points that entry at ``kvq_vllm.select.CPUBackend``. This module attribute is looked up when
vLLM builds each attention layer, inside the engine's config: with a kvq codec configured it is
:class:`~kvq_vllm.backend.KVQAttentionBackend`, otherwise vLLM's own CPU backend, so an engine
without kvq settings runs exactly as stock vLLM.
"""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name != "CPUBackend":
        raise AttributeError(name)
    from kvq_vllm.config import active_codec

    if active_codec() is not None:
        from kvq_vllm.backend import KVQAttentionBackend

        return KVQAttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend
