"""The ``vllm.general_plugins`` entry point: register kvq's attention backend with vLLM.

``CUSTOM`` is kvq on every platform (GPU users pass ``attention_backend="CUSTOM"``); on CPU,
whose platform always chooses ``CPU_ATTN``, that entry is pointed at :mod:`kvq_vllm.select`,
which gives kvq when the engine has kvq settings and vLLM's CPU backend otherwise.
vLLM may call this several times per process; registering again is harmless.
"""
from __future__ import annotations


def register() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, "kvq_vllm.backend.KVQAttentionBackend")
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, "kvq_vllm.select.CPUBackend")
